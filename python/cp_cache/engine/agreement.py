"""The ranks' agreement on each call before any payload moves: one all_gather of each rank's signature per call and CP
group on a CPU gloo side group (the CP group carries payload only), waited for where payload first moves. Ranks that
differ all raise the same RuntimeError naming each differing field and each rank's value; refusals join it too."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import layout as L
from ..plan import CallPlan

__all__ = ["SIGNATURE_LEN", "Signature", "signature", "agree", "counters", "reset_counters", "Agreement",
           "open_agreement", "start_agreement", "agree_on_refusal", "CHECK_ERRORS", "SideGroup", "side_group"]

_DESCRIBED, _DIRECTION, _CHECK, _Q_LEN, _KV_LEN, _DIGEST = range(6)
SIGNATURE_LEN = 6
_COMPARED = (_DESCRIBED, _DIRECTION, _CHECK, _DIGEST)  # the lengths are gathered, not compared
_UNKNOWN = -2
_DIRECTIONS = ("forward", "backward")
_CHECKS = ("passed", "ValueError", "NotImplementedError", "TypeError", "RuntimeError", "failed")
CHECK_ERRORS = (ValueError, NotImplementedError, TypeError, RuntimeError)


class Signature(NamedTuple):
    tensor: Tensor  # int64 [SIGNATURE_LEN]
    fields: tuple[tuple[str, str], ...]  # (name, value) of what the digest covers; () for a refusal


def _check_code(error: Optional[BaseException]) -> int:
    if error is None:
        return 0
    name = type(error).__name__
    return _CHECKS.index(name) if name in _CHECKS[1:-1] else len(_CHECKS) - 1


def _digest(text: str) -> int:
    """A 62-bit digest of ``text``, alike on every rank (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _shape(shape: Optional[Sequence[int]], any_dim: Optional[int] = None) -> str:
    if shape is None:
        return "None"
    return "(" + ", ".join("*" if i == any_dim else str(int(s)) for i, s in enumerate(shape)) + ")"


def _mask(spec) -> str:
    names = [n for n in ("causal", "window", "given") if getattr(spec, n)]
    if spec.band_document:
        names.append(f"band in the {spec.band_document} document only")
    return "+".join(names) if names else "none (full)"


def _kv_heads(q: Tensor, k: Tensor, plan: CallPlan) -> int:
    """The K/V head count, or -1 when the shapes do not say (the checks will tell why)."""
    if plan.packed:
        return k.size(1) if k.dim() == 3 else -1
    try:
        return L.heads_of(k, plan.layout, L.dims(q, plan.layout, plan.head_num).head_dim)
    except Exception:  # noqa: BLE001 - reported by the checks
        return -1


def _fields(direction: str, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, kv_heads: int, kernel: str,
            mask_rows: Optional[Tensor], steps: int) -> tuple[tuple[str, str], ...]:
    seq = L.seq_dim(plan.layout) if plan.uneven_allowed else None  # uneven shards: not compared
    documents = f"{len(plan.documents)} documents (digest {_digest(str(plan.documents)):#x})" \
        if plan.documents else "none"
    mask = plan.mask
    return (("kernel", repr(kernel)), ("algorithm", repr(plan.algorithm)), ("layout", repr(plan.layout)),
            ("local query shape", _shape(q.shape, seq)), ("local key shape", _shape(k.shape, seq)),
            ("local value shape", _shape(v.shape, seq)), ("query dtype", str(q.dtype)), ("key dtype", str(k.dtype)),
            ("value dtype", str(v.dtype)), ("head count", str(plan.head_num)), ("K/V head count", str(kv_heads)),
            ("mask kind", _mask(mask)), ("pre_tockens", str(mask.pre_tockens)),
            ("next_tockens", str(mask.next_tockens)), ("load balancing", str(plan.load_balance)),
            ("scale", repr(float(plan.scale))), ("keep_prob", repr(float(plan.keep_prob))),
            ("local mask rows shape", _shape(None if mask_rows is None else mask_rows.shape)),
            ("ring steps recorded", "-" if steps < 0 else str(steps)), ("packed documents", documents),
            ("document placement", repr(plan.document_placement if plan.packed else "")),
            ("exchange", f"{plan.exchange}, keep_kv={plan.keep_kv}, grad_partials={plan.grad_partials!r}"))


_lock = threading.Lock()
_built: dict[tuple, Signature] = {}  # a call's value -> its signature (a layer's calls repeat it)
_BUILT_MAX = 256
_counters = {"exchanges": 0, "disagreements": 0, "signatures_built": 0, "refusals": 0}


def counters() -> dict:
    """Agreements made ("exchanges"), "disagreements" and "refusals" among them, "signatures_built" (cache misses)."""
    with _lock:
        return dict(_counters)


def reset_counters() -> None:
    with _lock:
        for name in _counters:
            _counters[name] = 0
        _built.clear()


def signature(*, direction: str, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, kv_heads: Optional[int] = None,
              kernel: str = "", mask_rows: Optional[Tensor] = None, steps: int = -1,
              error: Optional[BaseException] = None) -> Signature:
    """This rank's signature of one call, built once per distinct call (``kv_heads`` None: from the shapes)."""
    call = (direction, kernel, plan, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype,
            kv_heads, None if mask_rows is None else tuple(mask_rows.shape), steps, _check_code(error))
    sig = _built.get(call)  # a dict read is atomic: the lock guards the writes
    if sig is not None:
        return sig
    fields = _fields(direction, plan, q, k, v, _kv_heads(q, k, plan) if kv_heads is None else kv_heads, kernel,
                     mask_rows, steps)
    seq = L.seq_dim(plan.layout)
    lengths = [int(t.shape[seq]) if t.dim() > seq else -1 for t in (q, k)]
    values = [1, _DIRECTIONS.index(direction), call[-1], *lengths, _digest(json.dumps(fields))]
    sig = Signature(torch.tensor(values, dtype=torch.int64), fields)
    with _lock:
        if len(_built) >= _BUILT_MAX:
            _built.clear()
        _built[call] = sig
        _counters["signatures_built"] += 1
    return sig


class Agreement:
    """This rank's signature all-gathered at once on each CP group's side group; ``lengths()`` waits and compares."""
    def __init__(self, sig: Signature, groups: Sequence, alone: Callable[[], list[tuple[int, int]]] = list):
        self.signature = sig
        self._pending = _post(groups, sig.tensor)
        self._lengths = None if self._pending else alone()  # no other rank: nothing to wait for

    @classmethod
    def reached(cls, lengths: list[tuple[int, int]]) -> "Agreement":
        """An agreement already reached (by the call that drives this strategy), with these lengths."""
        return cls(Signature(torch.empty(0, dtype=torch.int64), ()), (), alone=lambda: lengths)

    def lengths(self) -> list[tuple[int, int]]:
        """Every rank's (query, K/V) length on the innermost group, once all agree (else the same RuntimeError)."""
        if self._lengths is None:
            gathered = [_checked(side, wait(), self.signature, None) for side, wait in self._pending]
            found = [(s[_Q_LEN], s[_KV_LEN]) for s in gathered[-1]]
            if any([q < 1 or kv < 1 for q, kv in found]):
                raise ValueError(f"every rank needs at least one query and one key; local (query, K/V) "
                                 f"lengths by rank: {found}")  # the same on every rank: they all see them
            self._pending, self._lengths = [], found
        return self._lengths


def _post(groups: Sequence, sig: Tensor) -> list:
    pending = []
    for group in groups:
        side = side_group(group)
        if side.size > 1:
            pending.append((side, side.all_gather_async(sig)))
    return pending


def agree_on_refusal(direction: str, groups: Sequence, error: BaseException, plan: Optional[CallPlan] = None,
                     q: Optional[Tensor] = None, k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                     **fields) -> None:
    """``error`` joins the agreement as a refusal: the ranks' RuntimeError where they differ, else returns."""
    if plan is None:  # refused before it could describe the call: the direction and the error's kind
        values = [0, _DIRECTIONS.index(direction), _check_code(error), _UNKNOWN, _UNKNOWN, _UNKNOWN]
        sig = Signature(torch.tensor(values, dtype=torch.int64), ())
    else:
        sig = signature(direction=direction, plan=plan, q=q, k=k, v=v, error=error, **fields)
    for side, wait in _post(groups, sig.tensor):
        _checked(side, wait(), sig, error)


def agree(sig: Signature, group, world_size: int, error: Optional[BaseException] = None) -> list[list[int]]:
    """The gathered signatures, once all-gathered on ``group``'s side group (the same RuntimeError if they differ)."""
    side = side_group(group)
    if side.size != world_size:
        raise ValueError(f"world_size={world_size} but the group has {side.size} ranks")
    return _checked(side, side.all_gather_async(sig.tensor)(), sig, error)


_UNEVEN_RULE = ("ranks may hold shards of different lengths only for full or causal attention without "
                "load balancing, and for packed documents as their placement gives them")


def _checked(side: "SideGroup", gathered: list[Tensor], sig: Signature,
             error: Optional[BaseException]) -> list[list[int]]:
    with _lock:
        _counters["exchanges"] += 1
    signatures = [g.tolist() for g in gathered]  # host tensors: no device involved
    first = signatures[0]
    if all([[s[i] for i in _COMPARED] == [first[i] for i in _COMPARED] for s in signatures[1:]]):
        return signatures
    refusing = [r for r, s in enumerate(signatures) if s[_CHECK] != 0]  # all see these: all take part below
    with _lock:
        _counters["disagreements"] += 1
        _counters["refusals"] += bool(refusing)
    mine = json.dumps([list(sig.fields), "" if error is None else f"{type(error).__name__}: {error}"])
    described = [json.loads(text) for text in side.all_gather_text(mine)]
    fields = [dict(f) for f, _ in described]
    names = next((list(f) for f in fields if f), [])
    table = [("direction", {r: repr(_DIRECTIONS[s[_DIRECTION]]) for r, s in enumerate(signatures)})]
    table += [(name, {r: f[name] for r, f in enumerate(fields) if name in f}) for name in names]
    table.append(("argument checks", {r: repr(_CHECKS[s[_CHECK]]) for r, s in enumerate(signatures)}))
    differing = [f"{name}: " + ", ".join(f"rank {r} {value}" for r, value in values.items())
                 for name, values in table if len(set(values.values())) > 1]
    parts = []
    if differing:
        parts.append("the ranks disagree on " + "; ".join(differing))
        if any(d.startswith("local ") and "shape" in d for d in differing):
            parts.append(_UNEVEN_RULE)
    if refusing:
        parts.append("; ".join(f"rank {r} refused the call ({described[r][1]})" for r in refusing))
    message = "cp_cache: " + ". ".join(parts)
    if error is not None:
        raise RuntimeError(message) from error
    raise RuntimeError(message)


def start_agreement(direction: str, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups: Sequence,
                    kernel: str = "", mask_rows: Optional[Tensor] = None, steps: int = -1) -> Agreement:
    """On the call's CP ``groups`` (outer first), once this rank's checks passed (else ``agree_on_refusal``)."""
    sig = signature(direction=direction, plan=plan, q=q, k=k, v=v, kernel=kernel, mask_rows=mask_rows, steps=steps)
    return Agreement(sig, groups, alone=lambda: [(int(sig.tensor[_Q_LEN]), int(sig.tensor[_KV_LEN]))])


def open_agreement(direction: str, check: Callable[[], Any], plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *,
                   groups: Sequence, **fields) -> tuple[Any, Agreement]:
    """(``check()``'s result, the agreement started); a check that fails joins the agreement as a refusal."""
    try:
        result = check()
    except CHECK_ERRORS as error:
        agree_on_refusal(direction, groups, error, plan, q, k, v, **fields)
        raise
    return result, start_agreement(direction, plan, q, k, v, groups=groups, **fields)


class SideGroup:
    """Keyed by its ranks alone, not registered: its members make it together whatever groups each rank made."""
    def __init__(self, group):
        from torch.distributed.constants import default_pg_timeout
        from torch.distributed.distributed_c10d import _get_default_store
        ranks = dist.get_process_group_ranks(group)
        self.ranks, self.rank, self.size = tuple(ranks), dist.get_rank(group), len(ranks)
        store = dist.PrefixStore("cp_cache/side/" + "_".join(map(str, ranks)) + "/", _get_default_store())
        for device in ("cpu", "cuda", "npu"):  # wait as long as the CP group (torch's default where none says)
            try:
                timeout = group._get_backend(torch.device(device)).options._timeout
                break
            except (AttributeError, RuntimeError, ValueError):
                pass
        else:
            timeout = default_pg_timeout
        self._backend = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every member's ``tensor`` (a CPU tensor of the same shape and dtype on every rank)."""
        return self.all_gather_async(tensor)()

    def all_gather_async(self, tensor: Tensor) -> Callable[[], list[Tensor]]:
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        work = self._backend.allgather([gathered], [tensor])
        def wait() -> list[Tensor]:
            work.wait()
            return gathered
        return wait

    def all_gather_text(self, text: str) -> list[str]:
        data = torch.tensor(list(text.encode()), dtype=torch.uint8)
        lengths = [int(n) for n in self.all_gather(torch.tensor([data.numel()], dtype=torch.int64))]  # host tensors
        padded = torch.nn.functional.pad(data, (0, max(lengths) - data.numel()))
        return [bytes(t[:n].tolist()).decode() for t, n in zip(self.all_gather(padded), lengths)]


_side_lock = threading.Lock()
_side_groups: dict[tuple[int, ...], SideGroup] = {}
_side_by_name: dict[str, SideGroup] = {}  # the same, by CP group name: no rank lookup per call


def side_group(group) -> SideGroup:
    """One per set of ranks, made by its members at the first call that needs it."""
    found = _side_by_name.get(group.group_name)
    if found is not None:
        return found
    ranks = tuple(dist.get_process_group_ranks(group))
    with _side_lock:
        found = _side_groups.get(ranks)
        if found is None:
            found = _side_groups[ranks] = SideGroup(group)
        _side_by_name[group.group_name] = found
    return found
