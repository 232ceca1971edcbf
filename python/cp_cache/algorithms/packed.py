"""Ring attention over packed documents ``[T_r, N, D]``: a step is one packed kernel call on the rows it needs."""

from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import layout as L
from ..documents import check_documents, check_local_length, cumulative_lengths, local_lengths
from ..engine.loop import (BackwardResult, ForwardResult, RingStep, backward_ring, check_backward_operands,
                           check_keep_prob, check_step, check_steps, empty_outputs, forward_ring)
from ..engine.merge import merge_into
from ..kernels import StepKernel, segments_backward, segments_forward
from ..masks import VarlenCall, VarlenStep, document_step
from ..plan import CallPlan

__all__ = ["PackedDocuments", "PACKED"]

log = logging.getLogger("cp_cache")


def _documents(plan: CallPlan) -> tuple[int, ...]:
    if not plan.documents:
        raise ValueError("a packed-documents call needs plan.documents (the global cumulative document ends)")
    return cumulative_lengths(list(plan.documents), "plan.documents")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, plan: CallPlan, cu: Sequence[int]) -> None:
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


def _rows_index(spans: list[tuple[int, int]], total: int, device) -> Optional[Tensor]:
    """Index of the rows of ``spans`` (start, length) in order, or None when they are all rows."""
    if len(spans) and spans[0][0] == 0 and sum(n for _, n in spans) == total and all(
            a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return None
    return torch.cat([torch.arange(s, s + n) for s, n in spans]).to(device)


def _take(x: Tensor, index: Optional[Tensor]) -> Tensor:
    return x if index is None else x.index_select(0, index)


def _operands(call: VarlenCall, q_rows: int, kv_rows: int, device) -> tuple:
    """A kernel call's rows of ``q_rows`` queries and of a ``kv_rows`` K/V block, and its segments' ends."""
    segs = call.segments
    return (_rows_index([(s.q_start, s.q_len) for s in segs], q_rows, device),
            _rows_index([(s.kv_start, s.kv_len) for s in segs], kv_rows, device),
            tuple(torch.tensor(n, dtype=torch.int64).cumsum(0) for n in ([s.q_len for s in segs],
                                                                          [s.kv_len for s in segs])))


def _plan_step(plan: CallPlan, cu, index: int) -> VarlenStep:
    return document_step(cu, plan.rank, index, plan.world_size, plan.document_placement, plan.mask)


def _ring_lengths(plan: CallPlan, cu) -> list[tuple[int, int]]:
    return [(n, n) for n in local_lengths(cu, plan.world_size, plan.document_placement)]


class PackedDocuments:
    """The packed ring on the innermost group; its checks take any packed plan (Ulysses checks with them)."""
    def fake(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return empty_outputs(plan, q, k, v)

    def check_forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> None:
        _check_inputs(q, k, v, plan, _documents(plan))

    def check_backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       steps: list[RingStep], mask: Optional[Tensor] = None) -> list[VarlenStep]:
        cu = _documents(plan)
        _check_inputs(q, k, v, plan, cu)
        check_backward_operands(plan, dout, q, k, v, out, lse)
        check_steps(steps, plan.rank, plan.world_size, plan.world_size)
        planned = [_plan_step(plan, cu, i) for i in range(len(steps))]
        for st, step in zip(steps, planned):
            check_step(st, plan.rank, step.part, len(step.calls))
        return planned

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups: Sequence = (),
                kernel: StepKernel, mask: Optional[Tensor] = None, checked=None, agreement) -> ForwardResult:
        """``mask`` unused; LSE float32 ``[T_r, Nq]``."""
        cu = _documents(plan)
        rows = q.size(0)
        acc_out = torch.zeros(L.output_shape(q, k, v, L.TND, plan.head_num), dtype=torch.float32, device=q.device)
        acc_lse = torch.full((rows, plan.head_num), float("-inf"), dtype=torch.float32, device=q.device)
        run = kernel.forward if kernel.takes_tnd else functools.partial(segments_forward, kernel)
        kw = dict(head_num=plan.head_num, scale=plan.scale, keep_prob=plan.keep_prob, layout=L.TND)
        def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> tuple[str, list]:
            step = _plan_step(plan, cu, i)
            rng = []
            for call in step.calls:
                qi, kvi, lens = _operands(call, rows, cur_k.size(0), q.device)
                res = run(_take(q, qi), _take(cur_k, kvi), _take(cur_v, kvi), mask=call.mask, actual_seq_lens=lens,
                          **kw)
                if res.seed is not None:
                    rng.append((res.seed, res.offset))
                merge_into(acc_out, acc_lse, res.out, res.lse, L.TND, plan.head_num, fused=plan.fused_merge,
                           index=qi, actual_seq_qlen=lens[0])
                del res
            return step.part, rng
        steps, traffic = forward_ring(plan, groups, k, v, 0, plan.world_size - 1, compute, agreement,
                                      lengths=_ring_lengths(plan, cu))
        if log.isEnabledFor(logging.DEBUG):  # the parts' list is built only to be logged
            log.debug("packed documents forward rank %d/%d: parts %s, %s", plan.rank, plan.world_size,
                      [s.part for s in steps], traffic)
        return ForwardResult(out=acc_out.to(q.dtype), lse=acc_lse, steps=steps, **vars(traffic))

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps: list[RingStep], *, groups: Sequence = (), kernel: StepKernel,
                 mask: Optional[Tensor] = None, checked: list[VarlenStep], agreement) -> BackwardResult:
        """``checked``: the steps ``check_backward`` planned."""
        cu, planned = _documents(plan), checked
        rows, lse = q.size(0), lse.float()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        run = kernel.backward if kernel.takes_tnd else functools.partial(segments_backward, kernel)
        kw = dict(head_num=plan.head_num, scale=plan.scale, keep_prob=plan.keep_prob, layout=L.TND)
        def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> list:
            partials = []
            for c, call in enumerate(planned[i].calls):
                qi, kvi, lens = _operands(call, rows, cur_k.size(0), q.device)
                seed, offset = steps[i].rng[c] if steps[i].rng else (None, None)
                grads = run(_take(q, qi), _take(cur_k, kvi), _take(cur_v, kvi), _take(dout, qi), _take(out, qi),
                            _take(lse, qi), mask=call.mask, seed=seed, offset=offset, actual_seq_lens=lens, **kw)
                if qi is None:
                    dq.add_(grads[0])
                else:
                    dq.index_add_(0, qi, grads[0].to(dq.dtype))
                partials.append((kvi, grads[1], grads[2]))
            return partials
        dk, dv, traffic = backward_ring(plan, groups, k, v, 0, plan.world_size - 1, compute, agreement, steps,
                                        lengths=_ring_lengths(plan, cu))
        return BackwardResult(dq=dq.to(q.dtype), dk=dk.to(k.dtype), dv=dv.to(v.dtype), **vars(traffic))


PACKED = PackedDocuments()
