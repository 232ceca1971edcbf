"""The ranks' agreement on each call before any payload moves: one small collective per call
and CP process group, posted early and waited for where the strategy first exchanges payload.

Every rank builds a fixed-size int64 signature of everything the exchange and the result depend
on (local shapes and dtypes, layout, heads, mask, load balancing, scale, keep_prob, kernel,
algorithm, direction, recorded steps, packed documents and their placement, whether this rank's
own checks passed) and all-gathers it on the CPU side group of each CP group
(``transport.side_group``). ``Agreement.lengths()`` waits and compares: ranks that differ raise
the same ``RuntimeError`` naming each field and each rank's value, before any payload moved. A
refusal joins the same agreement (``agree_on_refusal``), so no rank is left waiting. Where
uneven shards are allowed the sequence dimension is not compared and each rank's lengths travel
in fields that are gathered, not compared. Every rank makes the collective on every call: a rank
that skipped it on a guess would leave another waiting (docs/limits.md: its cost per call).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .. import layout as L
from ..kernels import kernel_names
from ..placement import PLACEMENTS
from ..plan import ALGORITHMS, EXCHANGES, GRAD_PARTIALS, CallPlan
from .transport import side_group

__all__ = ["SIGNATURE_LEN", "FIELDS", "signature", "refusal_signature", "agree", "counters", "reset_counters",
           "describe", "lengths", "Agreement", "open_agreement", "start_agreement", "agree_on_refusal", "CHECK_ERRORS"]

_SHAPE_DIMS = 4  # q/k/v shapes padded with -1 to this many dims (the layouts have 3 or 4)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.int8, torch.uint8, torch.bool, torch.int32, torch.int64)
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


def _digest(text: str) -> int:
    """A 62-bit digest of ``text`` (alike on every rank, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _kernel_code(name: str) -> int:
    """The step kernel by a digest of its name ("": a strategy driven without a named kernel): any
    registered kernel, the same on every rank that registered it."""
    return _digest(name) if name else 0


def _kernel(v: list[int]) -> str:
    for name in ("",) + kernel_names():
        if _kernel_code(name) == v[0]:
            return repr(name)
    return f"other ({v[0]:#x})"


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
    return len(documents), _digest(",".join(str(end) for end in documents))


# (field name as in the message, width in int64 slots, formatter)
FIELDS: tuple[tuple[str, int, Callable[[list[int]], str]], ...] = (
    ("described", 1, _bool),  # 0: a refusal signature, whose other fields are unknown
    ("direction", 1, _name(_DIRECTIONS)),
    ("kernel", 1, _kernel),
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
)
SIGNATURE_LEN = sum(w for _, w, _ in FIELDS)
_LENGTH_FIELDS = ("local query length", "local K/V length")  # gathered, not compared
_NOT_COMPARED = frozenset(_LENGTH_FIELDS)
_NOT_DESCRIBED = frozenset(("described",) + _LENGTH_FIELDS)


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
_counters = {"exchanges": 0, "disagreements": 0, "signatures_built": 0, "refusals": 0}


def counters() -> dict:
    """{"exchanges": agreements made, "disagreements": of them, "signatures_built": cache misses,
    "refusals": agreements in which some rank's argument checks failed}."""
    with _lock:
        return dict(_counters)


def reset_counters() -> None:
    with _lock:
        for k in _counters:
            _counters[k] = 0
        _built.clear()


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
    values = [1, _code(_DIRECTIONS, key[0]), _kernel_code(key[1]), _code(ALGORITHMS, key[2]),
              _code(L.ALL_LAYOUTS, key[3]),
              *_pad(key[4], seq_dim), *_pad(key[5], seq_dim), *_pad(key[6], seq_dim),
              _code(_DTYPES, key[7]), _code(_DTYPES, key[8]), _code(_DTYPES, key[9]),
              *key[10:18], *_pad(key[18]), key[19], *_documents_code(key[22]), _code(_PLACEMENTS, key[23]), key[24],
              key[20],
              _length(q, plan.layout), _length(k, plan.layout)]
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
    each of the call's CP process groups, posted at once; ``lengths()`` waits for them (where the
    strategy first exchanges payload) and compares them. Every rank makes the same collectives in
    the same order whatever its signature says: ranks that disagree raise the same error, before
    any payload moves."""

    def __init__(self, sig: Tensor, groups: Sequence, alone: Callable[[], list[tuple[int, int]]] = list):
        self.signature = sig
        self._pending = _post(groups, sig)
        # with no other rank: this rank's own lengths, nothing to wait for
        self._lengths = None if self._pending else alone()

    @classmethod
    def reached(cls, lengths: list[tuple[int, int]]) -> "Agreement":
        """An agreement already reached (by the call that drives this strategy), with these lengths:
        one over no group."""
        return cls(_NO_SIGNATURE, (), alone=lambda: lengths)

    def lengths(self) -> list[tuple[int, int]]:
        """Every rank's (query length, K/V length) on the innermost group, once all agree (the
        same RuntimeError on every rank otherwise)."""
        if self._lengths is None:
            gathered = [_checked(side, wait(), None) for side, wait in self._pending]
            found = lengths(gathered[-1])
            if any([q < 1 or kv < 1 for q, kv in found]):
                raise ValueError(f"every rank needs at least one query and one key; local (query, K/V) "
                                 f"lengths by rank: {found}")  # the same on every rank: they all see them
            self._pending, self._lengths = [], found
        return self._lengths


def _post(groups: Sequence, sig: Tensor) -> list[tuple[Any, Callable[[], list[Tensor]]]]:
    """``sig`` all-gathered, without waiting, on the side group of each of ``groups`` that has
    other ranks: (the side group, the wait for the gathered signatures) each."""
    pending = []
    for group in groups:
        side = side_group(group)
        if side.size > 1:
            pending.append((side, side.all_gather_async(sig)))
    return pending


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
    for side, wait in _post(groups, sig):
        _checked(side, wait(), error)


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
    return Agreement(sig, groups, alone=lambda: [_local_lengths(q, k, plan)])


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
