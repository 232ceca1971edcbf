"""Ring attention over packed documents (input_layout TND).

The local q/k/v are ``[T_r, N, D]``: the tokens the call's placement
(``plan.document_placement``, ``placement.py``) gives rank r, in increasing global
position; T_r may differ between ranks, and every rank derives every rank's length from
(documents, W, placement), so the ring knows the size of each block it receives. Attention never crosses a document, so
each ring step computes, per document, what that document's pieces on the two ranks allow:

* step 0: causal over the document's local rows (its pieces on a rank are in increasing
  position, so causal in local order is causal globally);
* causal, a block from another rank: the local queries that see some of its keys against
  the keys they see: a document split head-tail over k ranks gives, for a lower rank in
  its group, all its local queries against that rank's head chunk ("kv_head"), for a
  higher rank, the tail chunk's queries against all that rank's keys ("q_tail"); with
  contiguous slices, a lower rank's keys in full and a higher rank's not at all; a
  document held whole by one rank makes no work on another rank's block;
* non-causal: full for every document both blocks hold;
* a band (sparse_mode 4: pre/next_tockens inside each document): per (query piece, key
  piece) pair of a document both blocks hold, the band shifted by the pieces' global offsets
  (``engine.steps.band_task``, as for the dense layouts), none where it covers the pair,
  nothing where it misses it; sparse_mode 7 / 8: so in the last / first document only, the
  others causal.

A step's documents become the segments of ONE kernel call in TND (its
``actual_seq_qlen/kvlen``), so the kernel does the masking; a band's segments need one
call per distinct shifted band (a call takes one pre/next_tockens), and segments sharing
query rows go to different calls (each call's result merges row by row). The rows a call
uses are gathered (``index_select``) only when they are not the whole block. Documents
with no work on a step are left out, and a step with none makes no kernel call. The softmax
statistics are ``[T, N]`` LSEs (the ops' ``[T, N, 8]``). Step results merge into float32
accumulators in plain torch or, with ``fused_merge``, by ``npu_ring_attention_update`` in
TND (the engine's merge, at the gathered rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import layout as L
from ..documents import check_documents, check_local_length, cumulative_lengths, document_pieces, local_lengths
from ..engine.loop import (BackwardResult, ForwardResult, RingStep, backward_ring, check_backward_operands,
                           check_keep_prob, check_step, check_steps, empty_outputs, forward_ring, kept_rows,
                           partials_dtype)
from ..engine.steps import band_task, exchange_plan
from ..engine.merge import merge_into
from ..engine.transport import group_info, own_group
from ..kernels import StepForward, StepKernel, StepMask
from ..placement import CONTIGUOUS
from ..plan import CallPlan

__all__ = ["Segment", "VarlenCall", "VarlenStep", "plan_varlen_step", "step_pairs", "PackedDocuments", "PACKED"]

log = logging.getLogger("cp_cache")

_CAUSAL = StepMask("causal")
_FULL = StepMask("none")


def _documents(plan: CallPlan) -> tuple[int, ...]:
    if not plan.documents:
        raise ValueError("a packed-documents call needs plan.documents (the global cumulative document ends)")
    return cumulative_lengths(list(plan.documents), "plan.documents")


@dataclass(frozen=True)
class Segment:
    """One document's part of a step: local query rows x rows of the K/V block, (start, length)."""

    document: int
    q_start: int
    q_len: int
    kv_start: int
    kv_len: int


@dataclass(frozen=True)
class VarlenCall:
    """One TND kernel call of a step: its mask (the same for every segment: the op takes one
    sparse_mode and one pre/next_tockens) and its segments, whose query rows never overlap."""

    mask: StepMask
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class VarlenStep:
    part: str  # one of engine.steps.PARTS
    calls: tuple[VarlenCall, ...]  # none when the step has no work

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(s for call in self.calls for s in call.segments)


def _doc_pieces(cu: Sequence[int], rank: int, world_size: int, placement: str) -> dict[int, list[tuple[int, int, int]]]:
    """{document: [(local start, global start, length), ...]} of the pieces ``rank`` holds, in
    increasing position (a document's pieces on one rank are adjacent locally)."""
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    for doc, local, start, length in document_pieces(cu, rank, world_size, placement):
        pieces.setdefault(doc, []).append((local, start, length))
    return pieces


def _span(pieces: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(local start, length) of adjacent pieces."""
    return pieces[0][0], sum(n for _, _, n in pieces)


def _earlier_keys(doc: int, mine: list[tuple[int, int, int]], theirs: list[tuple[int, int, int]]) -> Optional[Segment]:
    """Causal, a block from another rank: my pieces that see some of theirs (a suffix of mine)
    against their pieces that some of mine see (a prefix of theirs). Pieces of one document on
    two ranks are disjoint, so a key piece is wholly before or after a query piece; the placements
    make every chosen key piece come before every chosen query piece (one full rectangle)."""
    queries = [p for p in mine if p[1] > theirs[0][1]]
    keys = [p for p in theirs if p[1] < mine[-1][1]]
    if not queries or not keys:
        return None
    if keys[-1][1] > queries[0][1]:
        raise RuntimeError(f"document {doc}: pieces {mine} and {theirs} do not meet in one rectangle; the "
                           "placement cannot run on the ring")
    (q_start, q_len), (kv_start, kv_len) = _span(queries), _span(keys)
    return Segment(doc, q_start, q_len, kv_start, kv_len)


def _band_calls(mine: dict, theirs: dict, pre: int, nxt: int) -> tuple[VarlenCall, ...]:
    """The band inside each document both ranks hold: one segment per (query piece, key piece)
    pair the band touches, with the band shifted by the pieces' global offsets (``band_task``),
    or no mask where it covers the pair. Segments of equal masks share a call unless they share
    query rows (a call's outputs merge row by row)."""
    calls: list[tuple[StepMask, list[Segment], set[int]]] = []
    for doc, pieces in mine.items():
        for q_piece in pieces:
            for kv_piece in theirs.get(doc, ()):
                task = band_task(q_piece, kv_piece, pre, nxt)
                if task is None:
                    continue
                segment = Segment(doc, *task.q_rows, *task.kv_rows)
                call = next((c for c in calls if c[0] == task.mask and segment.q_start not in c[2]), None)
                if call is None:
                    call = (task.mask, [], set())
                    calls.append(call)
                call[1].append(segment)
                call[2].add(segment.q_start)
    return tuple(VarlenCall(mask, tuple(segments)) for mask, segments, _ in calls)


def plan_varlen_step(cu: Sequence[int], rank: int, index: int, world_size: int, causal: bool,
                     placement: str, window: Optional[tuple[int, int]] = None,
                     band_document: Optional[int] = None) -> VarlenStep:
    """What step ``index`` on ``rank`` computes for each document (see the module docstring);
    ``window``: (pre_tockens, next_tockens) of a band inside each document (``causal`` False), or
    only inside document ``band_document``, the others causal (sparse_mode 7 / 8)."""
    source = (rank - index) % world_size
    mine = _doc_pieces(cu, rank, world_size, placement)
    theirs = mine if source == rank else _doc_pieces(cu, source, world_size, placement)
    if window is None:
        return _whole_documents_step(mine, theirs, rank, source, index, causal, placement)
    banded = mine if band_document is None else {d: p for d, p in mine.items() if d == band_document}
    calls = _band_calls(banded, theirs, *window)
    if band_document is None:
        return VarlenStep("band" if calls else "skip", calls)
    others = _whole_documents_step({d: p for d, p in mine.items() if d != band_document}, theirs, rank, source,
                                   index, True, placement)
    return VarlenStep("band" if calls else others.part, others.calls + calls)


def _whole_documents_step(mine: dict, theirs: dict, rank: int, source: int, index: int, causal: bool,
                          placement: str) -> VarlenStep:
    """Causal or full attention in every document of ``mine`` (one kernel call)."""
    if not causal:
        part, mask = "full", _FULL
    elif index == 0:
        part, mask = "causal", _CAUSAL
    elif placement != CONTIGUOUS:
        part, mask = ("kv_head" if source < rank else "q_tail"), _FULL
    else:
        part, mask = ("full" if source < rank else "skip"), _FULL
    segments = []
    for doc, pieces in mine.items():
        if doc not in theirs or part == "skip":
            continue
        if part in ("full", "causal"):
            segments.append(Segment(doc, *_span(pieces), *_span(theirs[doc])))
        else:
            segment = _earlier_keys(doc, pieces, theirs[doc])
            if segment is not None:
                segments.append(segment)
    if not segments:
        return VarlenStep("skip", ())
    return VarlenStep(part, (VarlenCall(mask, tuple(segments)),))


def _band_pairs(s: Segment, mask: StepMask) -> int:
    """(query, key) pairs of a segment under the op's band, anchored at its bottom-right corner."""
    d = s.kv_len - s.q_len
    i = torch.arange(s.q_len, dtype=torch.int64)
    first = (i - mask.pre_tockens + d).clamp(min=0)
    last = (i + mask.next_tockens + d).clamp(max=s.kv_len - 1)
    return int((last - first + 1).clamp(min=0).sum())


def step_pairs(step: VarlenStep) -> int:
    """(query, key) pairs the step's kernel calls compute: its attention FLOPs are
    4 * pairs * N * D forward (QK^T and PV)."""
    pairs = 0
    for call in step.calls:
        for s in call.segments:
            if call.mask.kind == "causal":
                pairs += s.q_len * (s.q_len + 1) // 2
            elif call.mask.kind == "band":
                pairs += _band_pairs(s, call.mask)
            else:
                pairs += s.q_len * s.kv_len
    return pairs


# ---------------------------------------------------------------- checks


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, plan: CallPlan, cu: Sequence[int]) -> int:
    """The K/V head count, after checking the local TND shapes against the documents."""
    if plan.layout != L.TND:
        raise ValueError(f"varlen ring attention takes input_layout='TND', got {plan.layout!r}")
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 3:
            raise ValueError(f"input_layout='TND' needs {name} as [T, N, D], got shape {tuple(t.shape)}")
    if q.size(1) != plan.head_num:
        raise ValueError(f"head_num={plan.head_num} but the local query {tuple(q.shape)} has {q.size(1)} heads")
    if k.size(0) != q.size(0) or k.size(2) != q.size(2):
        raise ValueError(f"local query {tuple(q.shape)} and key {tuple(k.shape)} must agree on T and D "
                         "(the documents are the same for queries and keys)")
    nkv = k.size(1)
    if nkv <= 0 or plan.head_num % nkv:
        raise ValueError(f"head_num={plan.head_num} is not a multiple of the K/V head count {nkv}")
    L.check_value(k, v, L.TND, nkv)  # V's head size may differ (MLA), nothing else
    check_documents(cu, cu[-1], plan.document_mesh, plan.document_placement, name="actual_seq_qlen")
    check_local_length(cu, plan.document_mesh, plan.document_placement, plan.rank, q.size(0))
    check_keep_prob(plan)
    return nkv


# ---------------------------------------------------------------- one step's kernel call


def _rows_index(spans: list[tuple[int, int]], total: int, device) -> Optional[Tensor]:
    """Index of the rows of ``spans`` (start, length) in order, or None when they are all rows."""
    if len(spans) and spans[0][0] == 0 and sum(n for _, n in spans) == total and all(
            a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return None
    return torch.cat([torch.arange(s, s + n) for s, n in spans]).to(device)


def _take(x: Tensor, index: Optional[Tensor]) -> Tensor:
    return x if index is None else x.index_select(0, index)


def _cumulative(lengths: list[int]) -> Tensor:
    return torch.tensor(lengths, dtype=torch.int64).cumsum(0)


class _StepOperands:
    """A kernel call's gathered rows and its segments' cumulative ends (``q_rows``: the local
    queries, ``kv_rows``: the K/V block's rows, the source rank's length: under the balanced
    placement ranks hold different lengths)."""

    def __init__(self, call: VarlenCall, q_rows: int, kv_rows: int, device):
        segs = call.segments
        self.q_index = _rows_index([(s.q_start, s.q_len) for s in segs], q_rows, device)
        self.kv_index = _rows_index([(s.kv_start, s.kv_len) for s in segs], kv_rows, device)
        self.q_lens = [s.q_len for s in segs]
        self.kv_lens = [s.kv_len for s in segs]
        self.actual_seq_lens = (_cumulative(self.q_lens), _cumulative(self.kv_lens))


def _segments_forward(kernel: StepKernel, q, k, v, ops: _StepOperands, mask: StepMask, kw) -> StepForward:
    if kernel.takes_tnd:
        return kernel.forward(q, k, v, mask=mask, layout=L.TND, actual_seq_lens=ops.actual_seq_lens, **kw)
    # a kernel without TND: one call per segment, each segment a batch of one in BSND
    outs, lses = [], []
    for qs, ks, vs in zip(q.split(ops.q_lens), k.split(ops.kv_lens), v.split(ops.kv_lens)):
        res = kernel.forward(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), mask=mask, layout="BSND", **kw)
        outs.append(res.out.squeeze(0))
        lses.append(res.lse.squeeze(0).transpose(0, 1))
    return StepForward(out=torch.cat(outs), lse=torch.cat(lses), seed=None, offset=None)


def _segments_backward(kernel: StepKernel, q, k, v, dout, out, lse, ops: _StepOperands, mask: StepMask, seed,
                       offset, kw) -> tuple[Tensor, Tensor, Tensor]:
    if kernel.takes_tnd:
        return kernel.backward(q, k, v, dout, out, lse, mask=mask, layout=L.TND, seed=seed, offset=offset,
                               actual_seq_lens=ops.actual_seq_lens, **kw)
    grads = ([], [], [])
    for qs, ks, vs, ds, os_, ls in zip(q.split(ops.q_lens), k.split(ops.kv_lens), v.split(ops.kv_lens),
                                       dout.split(ops.q_lens), out.split(ops.q_lens), lse.split(ops.q_lens)):
        res = kernel.backward(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), ds.unsqueeze(0), os_.unsqueeze(0),
                              ls.transpose(0, 1).unsqueeze(0), mask=mask, layout="BSND", seed=None, offset=None, **kw)
        for acc, g in zip(grads, res):
            acc.append(g.squeeze(0))
    return tuple(torch.cat(g) for g in grads)


def _add_rows(acc: Tensor, index: Optional[Tensor], value: Tensor) -> None:
    if index is None:
        acc.add_(value)
    else:
        acc.index_add_(0, index, value.to(acc.dtype))


# ---------------------------------------------------------------- forward and backward


def _plan_step(plan: CallPlan, cu, index: int) -> VarlenStep:
    window = (plan.mask.pre_tockens, plan.mask.next_tockens) if plan.mask.window else None
    return plan_varlen_step(cu, plan.rank, index, plan.world_size, plan.causal, plan.document_placement, window,
                            plan.mask.band_document_index(len(cu)))


def _ring_lengths(plan: CallPlan, cu) -> list[tuple[int, int]]:
    """Every rank's (query, K/V) length: what its placement gives it (each rank checked its own)."""
    return [(n, n) for n in local_lengths(cu, plan.world_size, plan.document_placement)]


def _ready(plan: CallPlan, cu, agreement):
    """The loop's ``ready``: once the ranks agree, their lengths (the placement's) and the direct
    exchange's plan."""
    def ready():
        agreement.lengths()
        lengths = _ring_lengths(plan, cu)
        return lengths, exchange_plan(plan, lengths)
    return ready


def _check_records(steps: list[RingStep], plan: CallPlan, cu) -> list[VarlenStep]:
    check_steps(steps, plan.rank, plan.world_size, plan.world_size)
    planned = [_plan_step(plan, cu, i) for i in range(len(steps))]
    for st, step in zip(steps, planned):
        check_step(st, plan.rank, step.part, len(step.calls))
    return planned


def _kernel_args(plan: CallPlan) -> dict:
    return dict(head_num=plan.head_num, scale=plan.scale, keep_prob=plan.keep_prob)


class PackedDocuments:
    """The ring over packed documents (layout TND) on the innermost of the given groups. Its input
    checks take any packed plan (the layout of ``plan.document_mesh``): Ulysses around it checks
    the local shards with them."""

    def fake(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Empty (out, lse [T/W, Nq]) of the shapes ``forward`` returns: from shapes only."""
        return empty_outputs(plan, q, k, v)

    def check_forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> None:
        """This rank's inputs of a forward against the plan's documents and placement."""
        _check_inputs(q, k, v, plan, _documents(plan))

    def check_backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       steps: list[RingStep], mask: Optional[Tensor] = None) -> list[VarlenStep]:
        """This rank's inputs of a backward, and the forward's step records: the steps planned again."""
        cu = _documents(plan)
        _check_inputs(q, k, v, plan, cu)
        check_backward_operands(plan, dout, q, k, v, out, lse)
        return _check_records(steps, plan, cu)

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups: Sequence = (),
                kernel: StepKernel, mask: Optional[Tensor] = None, checked=None, agreement) -> ForwardResult:
        """Ring attention of the local packed queries ``[T/W, Nq, D]`` against every rank's K/V,
        within documents (``plan.documents``); ``mask`` is unused (None); ``checked``,
        ``agreement`` as for the ring. Returns the merged output (query dtype), the float32 LSE
        ``[T/W, Nq]``, the per-step records and the bytes sent."""
        size, rank, group = group_info(plan.world_size, plan.rank, own_group(groups))
        cu = _documents(plan)
        rows = q.size(0)
        acc_out = torch.zeros(L.output_shape(q, k, v, L.TND, plan.head_num), dtype=torch.float32, device=q.device)
        acc_lse = torch.full((rows, plan.head_num), float("-inf"), dtype=torch.float32, device=q.device)

        def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> tuple[str, list]:
            step = _plan_step(plan, cu, i)
            rng = []
            for call in step.calls:
                ops = _StepOperands(call, rows, cur_k.size(0), q.device)
                res = _segments_forward(kernel, _take(q, ops.q_index), _take(cur_k, ops.kv_index),
                                        _take(cur_v, ops.kv_index), ops, call.mask, _kernel_args(plan))
                if res.seed is not None:
                    rng.append((res.seed, res.offset))
                merge_into(acc_out, acc_lse, res.out, res.lse, L.TND, plan.head_num, fused=plan.fused_merge,
                           index=ops.q_index, actual_seq_qlen=ops.actual_seq_lens[0])
                del res
            return step.part, rng

        steps, traffic, compute_s, wait_s, _ = forward_ring(k, v, L.seq_dim(L.TND), size - 1, compute,
                                                            _ready(plan, cu, agreement), group=group, rank=rank,
                                                            size=size, direct=plan.exchange == "direct",
                                                            keep=plan.keep_kv)
        if log.isEnabledFor(logging.DEBUG):  # the parts' list is built only to be logged
            log.debug("packed documents forward rank %d/%d: parts %s, %s", rank, size, [s.part for s in steps], traffic)
        return ForwardResult(out=acc_out.to(q.dtype), lse=acc_lse, steps=steps, compute_seconds=compute_s,
                             wait_seconds=wait_s, **traffic.fields())

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps: list[RingStep], *, groups: Sequence = (), kernel: StepKernel,
                 mask: Optional[Tensor] = None, checked: list[VarlenStep], agreement) -> BackwardResult:
        """Gradients of the local packed q and of this rank's own K/V block (``lse``: [T/W, Nq]);
        ``checked``: the steps ``check_backward`` planned."""
        size, rank, group = group_info(plan.world_size, plan.rank, own_group(groups))
        cu, planned = _documents(plan), checked
        rows, lse = q.size(0), lse.float()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> list:
            partials = []
            for c, call in enumerate(planned[i].calls):
                ops = _StepOperands(call, rows, cur_k.size(0), q.device)
                seed, offset = steps[i].rng[c] if steps[i].rng else (None, None)
                qi = ops.q_index
                grads = _segments_backward(
                    kernel, _take(q, qi), _take(cur_k, ops.kv_index), _take(cur_v, ops.kv_index), _take(dout, qi),
                    _take(out, qi), _take(lse, qi), ops, call.mask, seed, offset, _kernel_args(plan))
                _add_rows(dq, qi, grads[0])
                partials.append((ops.kv_index, grads[1], grads[2]))
            return partials

        dk, dv, traffic, compute_s, wait_s, _ = backward_ring(k, v, L.seq_dim(L.TND), size - 1, compute, _add_rows,
                                                              _ready(plan, cu, agreement), group=group, rank=rank,
                                                              size=size, direct=plan.exchange == "direct",
                                                              kept=kept_rows(plan, steps),
                                                              partials=partials_dtype(plan, k))
        return BackwardResult(dq=dq.to(q.dtype), dk=dk.to(k.dtype), dv=dv.to(v.dtype), compute_seconds=compute_s,
                              wait_seconds=wait_s, **traffic.fields())


PACKED = PackedDocuments()
