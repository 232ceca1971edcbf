"""Agreement of the ranks on each call before any payload moves: one small collective per
call and CP process group, started early and waited for late.

Every rank builds a fixed-size int64 signature of everything the exchange and the result
depend on (local q/k/v/mask shapes, dtypes, layout, heads, mask kind and tockens, load
balancing, scale and keep_prob as float64 bit patterns, kernel, algorithm, direction, recorded
ring steps, the packed documents of a TND call (count and a digest of the cumulative ends) and
their placement, and whether this rank's own checks passed). The custom op that runs the call
checks this rank's inputs and starts the agreement once (``open_agreement`` /
``start_agreement``; a failed check: ``agree_on_refusal``): the signature is all-gathered over the CPU side group of each of the
call's CP groups (``transport.side_group``: the CP groups themselves carry only payload
tensors), in the background. The strategy waits for it (``Agreement.lengths()``) where it
first exchanges payload: the ring after computing step 0 on its own block, Ulysses before its
first all-to-all. If the signatures differ, every rank raises the same ``RuntimeError`` naming
each differing field and each rank's value, before any payload moved; a rank whose own check
failed chains its local error as the cause, and the refusing ranks' messages are gathered (a
second, rare collective) so that every rank names them. A refusal in the DTensor handler,
before the op, joins the same agreement (``agree_on_refusal``).

Uneven shards: where the ring supports local lengths that differ between ranks (full
or causal attention without load balancing; packed documents, whose placement gives each
rank's length), the signature leaves the sequence dimension
out of the compared shapes and carries each rank's query and K/V lengths in fields that
are gathered but not compared; ``Agreement.lengths()`` returns them.

Why the collective is made on every call (no skipping in the steady state): whether this
rank may skip depends on the other ranks' signatures of *this* call, which it cannot know
without communicating. If ranks cached "already agreed" by their local signature, a rank
whose signature changed would enter the all_gather while an unchanged rank skipped straight
to the K/V send: the changed rank would wait for a contribution that never comes and the
other for a block that never comes, until the process group's timeout, with an error that
names neither cause. So every rank makes the same collectives in the same order; what keeps
it off the host's critical path is that nothing waits for it until the first exchange (whose
receive would wait for the slowest rank anyway), and what is cached per distinct local
configuration is the signature's construction. The cost (one all_gather of W x
``SIGNATURE_LEN`` int64) is measured by ``python -m cp_cache bench --only agreement``. A call
that repeats its group's previous one also has its first payload round travel with the
agreement (the first stages, below), at sizes every rank knew before it; on host tensors,
where those stages reach every other rank, the signatures travel at their head and no
all_gather is made (``_StageMessages``).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .. import layout as L
from ..kernels import KERNEL_NAMES
from ..placement import PLACEMENTS
from ..plan import ALGORITHMS, EXCHANGES, GRAD_PARTIALS, CallPlan
from . import transport
from .transport import GLOO_POSTER, TAG_KV, SideGroup, Transfer, message_views, side_group

__all__ = ["SIGNATURE_LEN", "FIELDS", "signature", "refusal_signature", "agree", "counters",
           "reset_counters", "describe", "lengths", "Agreement", "open_agreement", "start_agreement", "agree_on_refusal",
           "CHECK_ERRORS", "FirstStage", "forget_first_stages", "Repeat", "recorded"]

_SHAPE_DIMS = 4  # q/k/v shapes padded with -1 to this many dims (the layouts have 3 or 4)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.int8, torch.uint8, torch.bool, torch.int32, torch.int64)
_KERNELS = ("",) + KERNEL_NAMES  # "": a strategy driven without a named kernel
_DIRECTIONS = ("forward", "backward")
_CHECKS = ("passed", "ValueError", "NotImplementedError", "TypeError", "RuntimeError", "failed")
_MASK_BITS = (("causal", 1), ("window", 2), ("given", 4))
_BAND_DOCUMENT_BITS = {"first": 8, "last": 16}  # MaskSpec.band_document (sparse_mode 8 / 7)
_PLACEMENTS = ("",) + PLACEMENTS  # "": not packed documents


def _code(table: Sequence, value) -> int:
    try:
        return table.index(value)
    except ValueError:
        return -2  # not in the table: shown as "other"


def _name(table: Sequence) -> Callable[[list[int]], str]:
    def show(v: list[int]) -> str:
        return repr(table[v[0]]) if 0 <= v[0] < len(table) else f"other ({v[0]})"
    return show


_ANY = -3  # a sequence dimension left out of the comparison (uneven shards)
_UNKNOWN = -2  # a field a refusing rank could not fill


def _shape(v: list[int]) -> str:
    if v[0] == _UNKNOWN:
        return "None"
    return "(" + ", ".join("*" if x == _ANY else str(x) for x in v if x >= 0 or x == _ANY) + ")"


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(v: list[int]) -> str:
    return repr(struct.unpack("<d", struct.pack("<q", v[0]))[0])


def _int(v: list[int]) -> str:
    return str(v[0])


def _bool(v: list[int]) -> str:
    return str(bool(v[0]))


def _mask(v: list[int]) -> str:
    names = [n for n, bit in _MASK_BITS if v[0] & bit]
    names += [f"band in the {where} document only" for where, bit in _BAND_DOCUMENT_BITS.items() if v[0] & bit]
    return "+".join(names) if names else "none (full)"


def _mask_code(mask) -> int:
    return sum(bit for name, bit in _MASK_BITS if getattr(mask, name)) + _BAND_DOCUMENT_BITS.get(mask.band_document, 0)


def _steps(v: list[int]) -> str:
    return "-" if v[0] < 0 else str(v[0])


def _documents(v: list[int]) -> str:
    return "none" if v[0] < 0 else f"{v[0]} documents (digest {v[1]:#x})"


def _exchange(v: list[int]) -> str:
    if v[0] < 0:
        return "other"
    return (f"{EXCHANGES[v[0] & 1]}, keep_kv={bool(v[0] & 2)}, "
            f"grad_partials={GRAD_PARTIALS[1 if v[0] & 4 else 0]!r}")


def _exchange_code(plan: CallPlan) -> int:
    """The ring's exchange options as bits: ring (1), keep_kv (2), partials in the input dtype (4)."""
    return (_code(EXCHANGES, plan.exchange) | 2 * bool(plan.keep_kv)
            | 4 * (plan.grad_partials == GRAD_PARTIALS[1]))


def _documents_code(documents: tuple[int, ...]) -> tuple[int, int]:
    """(count, 62-bit digest) of a plan's packed documents (() -> none)."""
    if not documents:
        return -1, 0
    text = ",".join(str(end) for end in documents)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2
    return len(documents), digest


# (field name as in the message, width in int64 slots, formatter)
FIELDS: tuple[tuple[str, int, Callable[[list[int]], str]], ...] = (
    ("described", 1, _bool),  # 0: a refusal signature, whose other fields are unknown
    ("direction", 1, _name(_DIRECTIONS)),
    ("kernel", 1, _name(_KERNELS)),
    ("algorithm", 1, _name(ALGORITHMS)),
    ("layout", 1, _name(L.ALL_LAYOUTS)),
    ("local query shape", _SHAPE_DIMS, _shape),
    ("local key shape", _SHAPE_DIMS, _shape),
    ("local value shape", _SHAPE_DIMS, _shape),
    ("query dtype", 1, _name(_DTYPES)),
    ("key dtype", 1, _name(_DTYPES)),
    ("value dtype", 1, _name(_DTYPES)),
    ("head count", 1, _int),
    ("K/V head count", 1, _int),
    ("mask kind", 1, _mask),
    ("pre_tockens", 1, _int),
    ("next_tockens", 1, _int),
    ("load balancing", 1, _bool),
    ("scale", 1, _float),
    ("keep_prob", 1, _float),
    ("local mask rows shape", _SHAPE_DIMS, _shape),
    ("ring steps recorded", 1, _steps),
    ("packed documents", 2, _documents),
    ("document placement", 1, _name(_PLACEMENTS)),
    ("exchange", 1, _exchange),
    ("argument checks", 1, _name(_CHECKS)),
    ("local query length", 1, _int),
    ("local K/V length", 1, _int),
    ("first stages sent", 1, _bool),  # the group's previous call's first stages, sent with this rank's rows
)
SIGNATURE_LEN = sum(w for _, w, _ in FIELDS)
_LENGTH_FIELDS = ("local query length", "local K/V length")  # gathered, not compared
_SENT = "first stages sent"
_NOT_COMPARED = frozenset(_LENGTH_FIELDS + (_SENT,))
_NOT_DESCRIBED = frozenset(("described", _SENT) + _LENGTH_FIELDS)


def _offsets() -> dict[str, tuple[int, int]]:
    out, start = {}, 0
    for name, width, _ in FIELDS:
        out[name] = (start, width)
        start += width
    return out


_OFFSET = _offsets()
_LENGTHS_AT = tuple(_OFFSET[name][0] for name in _LENGTH_FIELDS)


def _pad(shape: Optional[Sequence[int]], any_dim: Optional[int] = None) -> list[int]:
    if shape is None:
        return [_UNKNOWN] + [-1] * (_SHAPE_DIMS - 1)
    dims = [int(s) for s in shape][:_SHAPE_DIMS]
    if any_dim is not None:
        dims[any_dim] = _ANY
    return dims + [-1] * (_SHAPE_DIMS - len(dims))


def _check_code(error: Optional[BaseException]) -> int:
    if error is None:
        return 0
    for i, name in enumerate(_CHECKS[1:-1], start=1):
        if type(error).__name__ == name:
            return i
    return len(_CHECKS) - 1


_lock = threading.Lock()
_built: dict[tuple, Tensor] = {}  # local configuration -> its signature tensor (construction only)
_BUILT_MAX = 256
_counters = {"exchanges": 0, "disagreements": 0, "signatures_built": 0, "refusals": 0, "first_stages_taken": 0,
             "first_stages_dropped": 0, "signatures_with_stages": 0}


def counters() -> dict:
    """{"exchanges": agreements made, "disagreements": of them, "signatures_built": cache misses,
    "refusals": agreements in which some rank's argument checks failed, "first_stages_taken" /
    "first_stages_dropped": calls whose exchange took / did not take the first stages sent with
    their agreement, "signatures_with_stages": agreements whose signatures came in those stages'
    messages instead of an all_gather}."""
    with _lock:
        return dict(_counters)


def reset_counters() -> None:
    with _lock:
        for k in _counters:
            _counters[k] = 0
        _built.clear()
        _SENT_VARIANTS.clear()


def signature(*, direction: str, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, kv_heads: Optional[int] = None,
              kernel: str = "", mask_rows: Optional[Tensor] = None, steps: int = -1,
              error: Optional[BaseException] = None) -> Tensor:
    """The int64 [SIGNATURE_LEN] signature of one call on this rank (``kv_heads``: the K/V head
    count, None: read from the shapes), built once per distinct call (its plan, shapes, dtypes,
    mask rows, steps, check outcome). Where the plan allows uneven shards (``plan.uneven_allowed``)
    the sequence dimension is left out of the compared shapes."""
    call = (direction, kernel, plan, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype,
            kv_heads, None if mask_rows is None else tuple(mask_rows.shape), steps, _check_code(error))
    sig = _built.get(call)  # a dict read is atomic: the lock guards the writes
    if sig is not None:
        return sig
    kv_heads = _kv_heads(q, k, plan) if kv_heads is None else kv_heads
    mask = _mask_code(plan.mask)
    seq_dim = L.seq_dim(plan.layout) if plan.uneven_allowed else None
    key = (direction, kernel, plan.algorithm, plan.layout, tuple(q.shape), tuple(k.shape), tuple(v.shape),
           q.dtype, k.dtype, v.dtype, int(plan.head_num), int(kv_heads), mask, int(plan.mask.pre_tockens),
           int(plan.mask.next_tockens), bool(plan.load_balance), _float_bits(plan.scale),
           _float_bits(plan.keep_prob), None if mask_rows is None else tuple(mask_rows.shape), int(steps),
           _check_code(error), seq_dim, plan.documents, plan.document_placement if plan.packed else "",
           _exchange_code(plan))
    values = [1, _code(_DIRECTIONS, key[0]), _code(_KERNELS, key[1]), _code(ALGORITHMS, key[2]),
              _code(L.ALL_LAYOUTS, key[3]),
              *_pad(key[4], seq_dim), *_pad(key[5], seq_dim), *_pad(key[6], seq_dim),
              _code(_DTYPES, key[7]), _code(_DTYPES, key[8]), _code(_DTYPES, key[9]),
              *key[10:18], *_pad(key[18]), key[19], *_documents_code(key[22]), _code(_PLACEMENTS, key[23]), key[24],
              key[20],
              _length(q, plan.layout), _length(k, plan.layout), 0]
    sig = torch.tensor(values, dtype=torch.int64)
    assert sig.numel() == SIGNATURE_LEN
    with _lock:
        if len(_built) >= _BUILT_MAX:
            _built.clear()
        _built[call] = sig
        _counters["signatures_built"] += 1
    return sig


def refusal_signature(direction: str, error: BaseException) -> Tensor:
    """The signature of a call this rank refused before it could describe it (its arguments
    failed the handler's checks): the direction and the error's kind; the rest unknown, left
    out of the comparison."""
    values = [_UNKNOWN] * SIGNATURE_LEN
    values[_OFFSET["described"][0]] = 0
    values[_OFFSET["direction"][0]] = _code(_DIRECTIONS, direction)
    values[_OFFSET["argument checks"][0]] = _check_code(error)
    return torch.tensor(values, dtype=torch.int64)


CHECK_ERRORS = (ValueError, NotImplementedError, TypeError, RuntimeError)
_NO_SIGNATURE = torch.empty(0, dtype=torch.int64)  # an agreement over no group gathers nothing


class Agreement:
    """The ranks' agreement on one call: this rank's signature all-gathered on the side group of
    each of the call's CP process groups, started at once without waiting; ``lengths()`` waits
    for them (where the strategy first exchanges payload) and compares them. Every rank makes
    the same collectives in the same order whatever its signature says, so a rank never waits
    for a contribution that will not come: ranks that disagree raise the same error, before
    any payload sized by this call moves. With the signatures go the messages of the group's
    previous call's first stages (below: from this rank's K/V block ``k``, ``v`` where it has the
    recorded shapes), which the exchange adopts where the ranks agree on that call again."""

    def __init__(self, sig: Tensor, groups: Sequence, alone: Callable[[], list[tuple[int, int]]] = list,
                 k: Optional[Tensor] = None, v: Optional[Tensor] = None):
        self.signature = sig  # this rank's, as built (without "first stages sent")
        ahead, pending = _post_agreement(groups, k, v, sig, mark_rows_sent=True)
        # with no other rank: this rank's own lengths, nothing to wait for
        self._started(ahead, pending, None if pending else alone())

    @classmethod
    def posted(cls, sig: Tensor, ahead: "_Ahead", side: "SideGroup", wait: Callable[[], list[Tensor]]) -> "Agreement":
        """The agreement of a call on one CP group whose messages are already posted (``Repeat``):
        the group's record's (``ahead``) and the signature's all_gather on ``side`` (``wait``)."""
        agreement = cls.__new__(cls)
        agreement.signature = sig
        agreement._started([ahead], [(side, wait)], None)
        return agreement

    def _started(self, ahead: list, pending: list, lengths: Optional[list]) -> None:
        self._ahead, self._pending, self._lengths = ahead, pending, lengths
        self._signatures: Optional[list[list[int]]] = None
        # after lengths(): the transfers of the call's first stages that came with the agreement,
        # by stage ({} where none did), for the exchange to take
        self.first: dict[int, Transfer] = {}
        self.dropped_bytes = 0  # sent with the agreement, then dropped: the call did not repeat the record's
        self._repeated = False  # the call is its group's previous one again: its record stands

    @classmethod
    def reached(cls, lengths: list[tuple[int, int]]) -> "Agreement":
        """An agreement already reached (by the call that drives this strategy), with these lengths:
        one over no group."""
        return cls(_NO_SIGNATURE, (), alone=lambda: lengths)

    def lengths(self) -> list[tuple[int, int]]:
        """Every rank's (query length, K/V length) on the innermost group, once all agree (the
        same RuntimeError on every rank otherwise)."""
        if self._lengths is None:
            try:
                gathered = [_checked(side, wait(), None) for side, wait in self._pending]
                found = lengths(gathered[-1]) if gathered else []
                if any([q < 1 or kv < 1 for q, kv in found]):
                    raise ValueError(f"every rank needs at least one query and one key; local (query, K/V) "
                                     f"lengths by rank: {found}")  # the same on every rank: they all see them
            except BaseException:
                _drain(self._ahead)
                raise
            if len(gathered) == 1:  # a call on one CP group: its first stages may have come with it
                self._signatures = gathered[0]
                if self._ahead:
                    self._repeated = _same_call(gathered[0], self._ahead[0].record.signatures)
                    self.first = self._ahead[0].take(self._repeated)
            if not self._repeated:
                self.dropped_bytes = _drain(self._ahead)
            self._ahead, self._lengths = [], found
        return self._lengths

    @property
    def repeated(self) -> bool:
        """After ``lengths()``: whether the ranks agree that the call repeats its group's recorded
        one (its first stages came with the agreement, in ``first``)."""
        return self._repeated

    def remember_first_stages(self, stages: list["FirstStage"], group, *, rank: int, size: int, seq_dim: int,
                              k: Tensor, v: Tensor) -> None:
        """The stages this call's direct exchange posted first on its CP ``group`` (from its own
        K/V block ``k``, ``v``), for the next call on the group to send with its agreement: every
        rank of the group records its own, or none does (an agreement over several groups)."""
        if self._signatures is None or self._repeated or not stages:
            return
        own = (tuple(k.shape), tuple(v.shape), k.dtype, v.dtype, k.device)
        with _lock:
            _records[group.group_name] = _new_record(self._signatures, group, rank, size, seq_dim, own,
                                                     tuple(stages))


_SENT_VARIANTS: dict[int, tuple[Tensor, Tensor]] = {}  # id(signature) -> (it, it with "first stages sent")


def _with_rows_sent(sig: Tensor) -> Tensor:
    """``sig`` (a cached signature, never written) saying that this rank sent its rows of the first
    stages: a copy, made once per signature."""
    found = _SENT_VARIANTS.get(id(sig))
    if found is None or found[0] is not sig:
        sent = sig.clone()
        sent[_OFFSET[_SENT][0]] = 1
        with _lock:
            if len(_SENT_VARIANTS) >= _BUILT_MAX:
                _SENT_VARIANTS.clear()
            found = _SENT_VARIANTS[id(sig)] = (sig, sent)
    return found[1]


def _same_call(gathered: list[list[int]], recorded: list[list[int]]) -> bool:
    """Whether the gathered signatures are the recorded call's, in either direction (a backward
    receives again the K/V rows its forward received first), every rank having sent that call's
    first stages with its rows: alike on every rank, which all see the same signatures."""
    if len(gathered) != len(recorded):
        return False
    sent = _OFFSET[_SENT][0]
    for g, r in zip(gathered, recorded):  # loops, not generators: this runs on every call
        if g[sent] != 1:
            return False
        for a, b in _THE_CALL:
            if g[a:b] != r[a:b]:
                return False
    return True


def _between(skipped: list[int]) -> tuple[tuple[int, int], ...]:
    """The slices of a signature around the ``skipped`` positions."""
    bounds = [-1] + sorted(skipped) + [SIGNATURE_LEN]
    return tuple((a + 1, b) for a, b in zip(bounds, bounds[1:]) if b > a + 1)


# what a call is, in either direction: its signature less these fields
_THE_CALL = _between([_OFFSET[name][0] for name in ("direction", "ring steps recorded", _SENT)])


# ---------------------------------------------------------------- the first stages, sent with the agreement
#
# A call's payload may not move before its ranks agree: a message larger than the receive it
# meets aborts a gloo process, and NCCL and HCCL do not check sizes (docs/limits.md). What may
# travel with the agreement are messages whose sizes every rank knows alike before it: those
# of the stages the previous agreed call on the same CP group posted first (its ``_Record``,
# which every rank of the group left after that call, or none did). Each rank posts its part
# of them when the next call on the group starts its agreement: the rows of its own K/V block
# at the recorded indices where its block has the recorded shapes and dtypes ("first stages
# sent" in its signature), zeros of the recorded sizes otherwise (a refusing rank too). Every
# rank then decides alike from the same gathered signatures: where they are the recorded
# call's and every rank sent its rows, the call's exchange adopts the messages as its first
# stages (they are exactly the ones it would post); otherwise they are waited for and dropped.
# Either way every message posted is matched, so ranks that disagree still raise the
# agreement's error with nothing left in flight. Every agreed call on a group takes the
# group's record, so the ranks' records stay alike.


@dataclass(frozen=True)
class FirstStage:
    """A stage a call's direct exchange posted first: to rank r+s the rows ``send`` of its block
    (``engine/steps.StageRows``; ``send_shapes``: of K and V, () for none), from rank r-s into
    ``recv_shapes``."""

    stage: int
    send: Any
    send_shapes: tuple
    recv_shapes: tuple

    @functools.cached_property  # read by every call that sends the stage with its agreement
    def recv_sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.recv_shapes]


@dataclass(frozen=True)
class _Record:
    signatures: list[list[int]]
    group: Any
    rank: int
    size: int
    seq_dim: int
    own: tuple  # this rank's K and V block then: shapes, dtypes, device
    stages: tuple[FirstStage, ...]
    # a signed record's stage messages, planned once, the signatures in them (``_StageMessages``);
    # None: an unsigned record, whose messages are built per call
    messages: Optional[tuple["_StageMessages", ...]] = None

    @property
    def signed(self) -> bool:
        return self.messages is not None


def _new_record(signatures: list[list[int]], group, rank: int, size: int, seq_dim: int, own: tuple,
                stages: tuple[FirstStage, ...]) -> _Record:
    """A group's record, signed (its stages' messages planned, carrying the signatures) where it
    holds host tensors, its stages reach every other rank and they are posted on the group's gloo
    backend directly; alike on every rank: the stages are the exchange's, the device kind the
    agreed call's. A device's messages stay unsigned (no host read of what they carry), and so
    do those a counter of torch.distributed's messages sees (``transport.POST_ON_GLOO`` off:
    their payload alone)."""
    if (own[4].type != "cpu" or not transport.POST_ON_GLOO
            or sorted([first.stage for first in stages]) != list(range(1, size))):
        return _Record(signatures, group, rank, size, seq_dim, own, stages)
    messages = tuple([_StageMessages(first, group, rank, size, seq_dim, own) for first in stages])
    return _Record(signatures, group, rank, size, seq_dim, own, stages, messages)


_records: dict[str, _Record] = {}  # by CP group name


class _Layout:
    """Where the parts of a signed first stage's message lie in it: the call's signature, then
    the K rows, then the V rows (none where the stage moves no rows that way); in elements of
    the message's dtype (K's where K and V share a dtype: the signature's bytes read as it;
    else bytes, each part at a multiple of its element size)."""

    def __init__(self, shapes: Sequence, dtypes: Sequence, unit: torch.dtype):
        self.unit = unit
        self.parts: list[tuple[int, int, torch.dtype, tuple]] = []  # (start, count, dtype, shape)
        end = 0  # in bytes
        for shape, dtype in [((SIGNATURE_LEN,), torch.int64)] + list(zip(shapes, dtypes)):
            start = -(-end // dtype.itemsize) * dtype.itemsize
            end = start + math.prod(shape) * dtype.itemsize
            self.parts.append((start // unit.itemsize, (end - start) // unit.itemsize, dtype, tuple(shape)))
        self.length = end // unit.itemsize
        self.payload_bytes = sum([count for _, count, _, _ in self.parts[1:]]) * unit.itemsize

    def views(self, message: Tensor) -> list[Tensor]:
        """The parts of ``message`` (a tensor of ``length`` elements of ``unit``)."""
        views = []
        for start, count, dtype, shape in self.parts:
            part = message.narrow(0, start, count)
            views.append((part if dtype == self.unit else part.view(dtype)).view(shape))
        return views


class _StageMessages:
    """One first stage of a signed record, planned once: one message each way, the call's
    signature, then this rank's K rows and V rows (the signatures travel with the stages instead
    of an all_gather of their own). Each post makes its messages afresh (gloo holds them until
    its works complete)."""

    def __init__(self, first: FirstStage, group, rank: int, size: int, seq_dim: int, own: tuple):
        _, _, k_dtype, v_dtype, self._device = own
        self.stage = first.stage
        self._rows, self._seq_dim, self._group = first.send, seq_dim, group
        self._to, self._source = (rank + first.stage) % size, (rank - first.stage) % size
        unit = k_dtype if k_dtype == v_dtype else torch.uint8
        self._sent = _Layout(first.send_shapes, (k_dtype, v_dtype), unit)
        self._received = _Layout(first.recv_shapes, (k_dtype, v_dtype), unit)

    def post(self, k: Optional[Tensor], v: Optional[Tensor], sig: Tensor, rows: bool) -> tuple[Transfer, Tensor]:
        """Post the stage: ``sig`` and this rank's rows of ``k`` and ``v`` (``rows``: they have the
        recorded shapes; else zeros); (the transfer, where the peer's signature arrives)."""
        received = torch.empty(self._received.length, dtype=self._received.unit, device=self._device)
        signature, *views = self._received.views(received)
        transfer = Transfer.messages(self._message(k, v, sig, rows), self._to, received, self._source, self._group,
                                     TAG_KV, views, self._sent.payload_bytes, self._received.payload_bytes)
        return transfer, signature

    def _message(self, k: Optional[Tensor], v: Optional[Tensor], sig: Tensor, rows: bool) -> Tensor:
        layout, parts = self._sent, [sig]
        if len(layout.parts) > 1:
            if rows:
                parts += [self._rows.taken(k, self._seq_dim), self._rows.taken(v, self._seq_dim)]
            else:
                parts += [torch.zeros(shape, dtype=dtype, device=self._device) for _, _, dtype, shape in
                          layout.parts[1:]]
        if layout.unit != torch.uint8:  # one dtype: the parts as one concatenation
            return torch.cat([(p if p.dtype == layout.unit else p.view(layout.unit)).reshape(-1) for p in parts])
        message = torch.empty(layout.length, dtype=layout.unit, device=self._device)
        for view, part in zip(layout.views(message), parts):
            view.copy_(part)
        return message


class _Ahead:
    """The messages one call posts with its agreement on one group, from the group's record
    (``post``); where the record is signed, the call's signatures come in them (``signatures``)."""

    def __init__(self, record: _Record, k: Optional[Tensor], v: Optional[Tensor]):
        self.record = record
        k_shape, v_shape, k_dtype, v_dtype, device = record.own
        self.sent_rows = (k is not None and v is not None and k.shape == k_shape and v.shape == v_shape
                          and k.dtype == k_dtype and v.dtype == v_dtype and k.device == device)
        self._transfers: dict[int, Transfer] = {}
        self._signature: Optional[Tensor] = None
        self._signatures: dict[int, Tensor] = {}  # by stage, of a signed record: where the peer's signature arrives
        self._gathered: Optional[list[Tensor]] = None

    def post(self, k: Optional[Tensor], v: Optional[Tensor], sig: Tensor) -> None:
        """Post this rank's part of the record's stages: the rows of ``k``, ``v`` where they have
        the recorded shapes (``sent_rows``), zeros otherwise; ``sig``: this rank's signature."""
        record = self.record
        self._signature = sig
        if record.messages is not None:
            for messages in record.messages:
                self._transfers[messages.stage], self._signatures[messages.stage] = messages.post(
                    k, v, sig, self.sent_rows)
            return
        _, _, k_dtype, v_dtype, device = record.own
        dtypes = (k_dtype, v_dtype)
        for first in record.stages:
            if not first.send_shapes:
                sending = []
            elif self.sent_rows:
                sending = [first.send.taken(t, record.seq_dim) for t in (k, v)]
            else:
                sending = [torch.zeros(shape, dtype=dtype, device=device)
                           for shape, dtype in zip(first.send_shapes, dtypes)]
            message = None
            if len(first.recv_shapes) == 2 and dtypes[0] == dtypes[1]:  # K and V as one message, received as it is
                message, receiving = message_views(first.recv_shapes, dtypes[0], device, first.recv_sizes)
            else:
                receiving = [torch.empty(shape, dtype=dtype, device=device)
                             for shape, dtype in zip(first.recv_shapes, dtypes)]
            self._transfers[first.stage] = Transfer.shifted(sending, receiving, first.stage, record.rank, record.size,
                                                             record.group, TAG_KV, message)

    def signatures(self) -> list[Tensor]:
        """Every rank's signature, from a signed record's stages (each waited for): the gathered
        signatures of the call on the record's group."""
        if self._gathered is None:
            record = self.record
            gathered = [self._signature] * record.size
            for stage, transfer in self._transfers.items():
                transfer.arrived()
                gathered[(record.rank - stage) % record.size] = self._signatures[stage]
            self._gathered = gathered
            with _lock:
                _counters["signatures_with_stages"] += 1
        return self._gathered

    def take(self, repeated: bool) -> dict[int, Transfer]:
        """The transfers by stage where the call repeats the recorded one (its record then stands
        for the next call), else {} (``drain`` drops them)."""
        if not repeated:
            return {}
        with _lock:
            _records[self.record.group.group_name] = self.record
            _counters["first_stages_taken"] += 1
        transfers, self._transfers = self._transfers, {}
        return transfers

    def drain(self) -> int:
        """Wait for every message (each rank posted its part of the same record), dropping them;
        the bytes this rank sent."""
        transfers, self._transfers = self._transfers, {}
        if transfers:
            with _lock:
                _counters["first_stages_dropped"] += 1
        for transfer in transfers.values():
            transfer.drain()
        return sum(t.nbytes for t in transfers.values())


class Repeat:
    """The agreement of calls that repeat one recorded call on its CP group (this rank's
    signature ``sig`` of it, the group's ``record``), made without an ``Agreement`` where the
    ranks send what the record says: ``post`` sends the first stages and the signature as any
    agreement would (one handoff to the poster thread), ``settle`` takes the stages where the
    gathered signatures are exactly the record's repeated by every rank; any other outcome (or an
    error in between) goes on as an ``Agreement`` of the same messages (``agreement``), which
    decides as on any call: the same error on every rank, or the stages dropped."""

    def __init__(self, record: _Record, sig: Tensor):
        self.record = record
        self.sig = sig
        self._sent = _with_rows_sent(sig)
        self._side = side_group(record.group)
        self._name = record.group.group_name
        sent = _OFFSET[_SENT][0]
        self._expected = [s[:sent] + [1] + s[sent + 1:] for s in record.signatures]

    @classmethod
    def of(cls, record: _Record, sig: Tensor) -> Optional["Repeat"]:
        """A ``Repeat`` of ``record`` for calls of this rank's signature ``sig``, where that is
        the recorded call's on this rank (else None)."""
        repeat = cls(record, sig)
        return repeat if repeat._expected[record.rank] == repeat._sent.tolist() else None

    def post(self, k: Tensor, v: Tensor) -> Optional[tuple]:
        """Post the call's first stages (from ``k``, ``v``) and its signature where the group's
        record is still this one (its posted messages), else None: nothing posted, the record left
        for the call's ``Agreement``."""
        with _lock:
            record = _records.pop(self._name, None)
            if record is not self.record:
                if record is not None:
                    _records[self._name] = record
                return None
        ahead = _Ahead(record, k, v)
        sig = self._sent if ahead.sent_rows else self.sig
        with GLOO_POSTER.together():
            ahead.post(k, v, sig)
            return ahead, ahead.signatures if record.signed else self._side.all_gather_async(sig)

    def settle(self, posted: tuple) -> Optional[dict[int, Transfer]]:
        """The first stages by stage where every rank sent the recorded call's signature with its
        rows (the record then stands for the next call); else None (``agreement`` decides)."""
        ahead, wait = posted
        try:
            gathered = wait()
        except BaseException:  # as an Agreement's: nothing left in flight
            ahead.drain()
            raise
        if [g.tolist() for g in gathered] != self._expected:
            return None
        with _lock:
            _counters["exchanges"] += 1
        return ahead.take(True)

    def agreement(self, posted: tuple) -> Agreement:
        """The posted messages as an ``Agreement`` (its ``lengths()`` compares and decides)."""
        ahead, wait = posted
        return Agreement.posted(self.sig, ahead, self._side, wait)


def forget_first_stages() -> None:
    """Drop every group's record: the next call on each sends nothing with its agreement. Every
    rank of a group must call it at the same point of its calls, or none."""
    with _lock:
        _records.clear()


def recorded(group) -> Optional[_Record]:
    """The record the CP ``group``'s last agreed call left (None: none)."""
    return _records.get(group.group_name)


def _post_agreement(groups: Sequence, k: Optional[Tensor], v: Optional[Tensor], sig: Tensor, *,
                    mark_rows_sent: bool) -> tuple[list[_Ahead], list[tuple[SideGroup, Callable[[], list[Tensor]]]]]:
    """Take each group's record, if any, and post in one handoff its messages (every agreed call
    on a group does, whatever its strategy or outcome) and this rank's signature ``sig`` (with
    "first stages sent" where ``mark_rows_sent`` and its one record's stages carry its rows):
    (the records' posts, each group of several ranks' side group and the wait for its gathered
    signatures, which come in a signed record's messages, else by an all_gather of their own)."""
    with _lock:
        records = [_records.pop(g.group_name, None) for g in groups]
    ahead = [None if record is None else _Ahead(record, k, v) for record in records]
    posted = [a for a in ahead if a is not None]
    if mark_rows_sent and len(posted) == 1 and posted[0].sent_rows:
        sig = _with_rows_sent(sig)
    pending = []
    with GLOO_POSTER.together():
        for group, a in zip(groups, ahead):
            if a is not None:
                a.post(k, v, sig)
            side = side_group(group)
            if side.size > 1:
                pending.append((side, a.signatures if a is not None and a.record.signed
                                else side.all_gather_async(sig)))
    return posted, pending


def _drain(posted: list[_Ahead]) -> int:
    return sum(a.drain() for a in posted)


def agree_on_refusal(direction: str, groups: Sequence, error: BaseException, plan: Optional[CallPlan] = None,
                     q: Optional[Tensor] = None, k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                     **fields) -> None:
    """This rank's failed check ``error`` joins the call's agreement on ``groups`` as its refusal
    (described by ``plan`` and q/k/v with the signature's other ``fields`` when known, else by its
    kind alone), so the other ranks, already in that agreement, raise too instead of waiting for
    a call this rank will not make. Raises the ranks' RuntimeError (this error chained) where
    they differ; returns where every rank refused the same way, and the caller re-raises its own
    error (from its except clause: no frame keeps the error, nor what its traceback holds)."""
    if plan is None:
        sig = refusal_signature(direction, error)
    else:
        sig = signature(direction=direction, plan=plan, q=q, k=k, v=v, error=error, **fields)
    # its part of the first stages the other ranks post
    posted, pending = _post_agreement(groups, k, v, sig, mark_rows_sent=False)
    try:
        for side, wait in pending:
            _checked(side, wait(), error)
    finally:
        _drain(posted)


def _length(t: Tensor, layout: str) -> int:
    dim = L.seq_dim(layout)
    return int(t.shape[dim]) if t.dim() > dim else -1


def describe(signatures: list[list[int]]) -> list[str]:
    """'<field>: rank 0 <value>, rank 1 <value>, ...' for each compared field where the ranks
    differ; ranks that refused the call before describing it are left out of all but the
    argument checks."""
    described_at = _OFFSET["described"][0]
    out = []
    for name, width, show in FIELDS:
        if name in _NOT_DESCRIBED:
            continue
        start, _ = _OFFSET[name]
        parts = {r: s[start:start + width] for r, s in enumerate(signatures)
                 if s[described_at] or name == "argument checks"}
        values = list(parts.values())
        if any(p != values[0] for p in values[1:]):
            out.append(f"{name}: " + ", ".join(f"rank {r} {show(p)}" for r, p in parts.items()))
    return out


def lengths(signatures: list[list[int]]) -> list[tuple[int, int]]:
    """Each rank's (local query length, local K/V length), from the gathered signatures."""
    q_at, kv_at = _LENGTHS_AT
    return [(s[q_at], s[kv_at]) for s in signatures]


_UNEVEN_RULE = ("ranks may hold shards of different lengths only for full or causal attention without "
                "load balancing, and for packed documents as their placement gives them")


def agree(sig: Tensor, group, world_size: int, error: Optional[BaseException] = None) -> list[list[int]]:
    """All-gather ``sig`` on ``group``'s side group and wait; raise the same RuntimeError on every
    rank if the ranks differ (chaining this rank's own ``error``, if any). Returns the gathered
    signatures."""
    side = side_group(group)
    if side.size != world_size:
        raise ValueError(f"world_size={world_size} but the group has {side.size} ranks")
    return _checked(side, side.all_gather_async(sig)(), error)


def _checked(side, gathered: list[Tensor], error: Optional[BaseException]) -> list[list[int]]:
    """The gathered signatures, once compared: the same RuntimeError on every rank if they differ."""
    with _lock:
        _counters["exchanges"] += 1
    signatures = [g.tolist() for g in gathered]
    if signatures.count(signatures[0]) == len(signatures):  # the usual case: even the lengths are equal
        return signatures
    compared = [_compared(s) for s in signatures]
    if all(c == compared[0] for c in compared[1:]):
        return signatures
    with _lock:
        _counters["disagreements"] += 1
    parts = []
    differing = describe(signatures)
    if differing:
        parts.append("the ranks disagree on " + "; ".join(differing))
        if any(d.startswith("local ") and "shape" in d for d in differing):
            parts.append(_UNEVEN_RULE)
    check_at = _OFFSET["argument checks"][0]
    refusing = [r for r, s in enumerate(signatures) if s[check_at] != 0]
    if refusing:  # every rank sees the same signatures, so every rank makes this exchange
        with _lock:
            _counters["refusals"] += 1
        messages = side.all_gather_text("" if error is None else f"{type(error).__name__}: {error}")
        parts.append("; ".join(f"rank {r} refused the call ({messages[r]})" for r in refusing))
    message = "cp_cache: " + ". ".join(parts)
    if error is not None:
        raise RuntimeError(message) from error
    raise RuntimeError(message)


def _compared(sig: list[int]) -> list[int]:
    out = []
    for name, width, _ in FIELDS:
        if name not in _NOT_COMPARED:
            start, _ = _OFFSET[name]
            out.extend(sig[start:start + width])
    return out


def _kv_heads(q: Tensor, k: Tensor, plan: CallPlan) -> int:
    """The K/V head count, or -1 when the shapes do not say (the checks will tell why)."""
    if plan.packed:
        return k.size(1) if k.dim() == 3 else -1
    try:
        return L.heads_of(k, plan.layout, L.dims(q, plan.layout, plan.head_num).head_dim)
    except Exception:  # noqa: BLE001 - reported by the checks
        return -1


def _local_lengths(q: Tensor, k: Tensor, plan: CallPlan) -> tuple[int, int]:
    seq_dim = L.seq_dim(plan.layout)
    return q.size(seq_dim), k.size(seq_dim)


def start_agreement(direction: str, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups: Sequence,
                    kernel: str = "", mask_rows: Optional[Tensor] = None, steps: int = -1) -> Agreement:
    """Start the agreement on the call's CP ``groups`` (outer first) with this rank's signature of
    it, once its checks passed (a failed one: ``agree_on_refusal``). The strategy waits for the
    rest (``Agreement.lengths()``)."""
    sig = signature(direction=direction, plan=plan, q=q, k=k, v=v, kernel=kernel, mask_rows=mask_rows, steps=steps)
    return Agreement(sig, groups, alone=lambda: [_local_lengths(q, k, plan)], k=k, v=v)


def open_agreement(direction: str, check: Callable[[], Any], plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *,
                   groups: Sequence, **fields) -> tuple[Any, Agreement]:
    """Run this rank's ``check`` of the call, then ``start_agreement`` (``fields``: its keywords):
    (the check's result, the agreement). A check that fails joins the agreement as this rank's
    refusal, and every rank raises."""
    try:
        result = check()
    except CHECK_ERRORS as error:
        agree_on_refusal(direction, groups, error, plan, q, k, v, **fields)
        raise
    return result, start_agreement(direction, plan, q, k, v, groups=groups, **fields)
