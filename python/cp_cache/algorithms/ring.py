"""Dense ring attention on any step kernel, as the mask kind plans; the backward reuses the recorded parts and seeds."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import layout as L
from ..engine.loop import (BackwardResult, ForwardResult, RingStep, backward_ring, check_backward_operands, check_qkv,
                           check_step, check_steps, empty_outputs, forward_ring)
from ..engine.merge import merge_into
from ..kernels import StepKernel
from ..masks import BlockTask, hops_needed, plan_step
from ..plan import CallPlan

__all__ = ["Ring", "RING"]

log = logging.getLogger("cp_cache")


@dataclass(frozen=True)
class _Shapes:
    """What a ring call's checked shapes give; ``steps``: each step's (part, tasks), None for a given mask."""
    dims: L.Dims
    seq_dim: int
    kv_len: int
    out: tuple
    last: int
    kernel_args: dict
    steps: Optional[tuple]


@functools.lru_cache(maxsize=256)  # a layer's calls repeat their shapes
def _shapes(plan: CallPlan, q_shape: tuple, k_shape: tuple, v_shape: tuple) -> _Shapes:
    q, k, v = (torch.empty(shape, device="meta") for shape in (q_shape, k_shape, v_shape))
    qd, _ = check_qkv(plan, q_shape, k_shape, v_shape)
    seq_dim = L.seq_dim(plan.layout)
    kv_len = k_shape[seq_dim]
    last = hops_needed(plan.world_size, plan.load_balance, plan.mask, kv_len)
    steps = None if plan.mask.given else tuple(plan_step(plan.rank, i, plan.world_size, plan.load_balance, plan.mask,
                                                         qd.seq, kv_len, None) for i in range(last + 1))
    return _Shapes(qd, seq_dim, kv_len, tuple(L.output_shape(q, k, v, plan.layout, plan.head_num)), last,
                   dict(layout=plan.layout, head_num=plan.head_num, scale=plan.scale, keep_prob=plan.keep_prob), steps)


def _step(plan: CallPlan, checked: _Shapes, index: int, kv_len: int, mask_rows: Optional[Tensor]):
    if checked.steps is not None and kv_len == checked.kv_len:
        return checked.steps[index]
    return plan_step(plan.rank, index, plan.world_size, plan.load_balance, plan.mask, checked.dims.seq, kv_len,
                     mask_rows)


def _task_operands(task: BlockTask, seq_dim: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q_start, q_rows = task.q_rows
    kv_start, kv_rows = task.kv_rows
    if q_start or q_rows != q.shape[seq_dim]:
        q = q.narrow(seq_dim, q_start, q_rows)
    if kv_start or kv_rows != k.shape[seq_dim]:
        k, v = k.narrow(seq_dim, kv_start, kv_rows), v.narrow(seq_dim, kv_start, kv_rows)
    return q, k, v


class Ring:
    def check_forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> _Shapes:
        shapes = _shapes(plan, tuple(q.shape), tuple(k.shape), tuple(v.shape))
        expected = (shapes.dims.seq, shapes.kv_len * plan.world_size)
        if plan.mask.given and (mask is None or tuple(mask.shape[-2:]) != expected):
            raise ValueError(f"a masked ring call needs the mask rows of the local queries over the whole sequence, "
                             f"[..., {expected[0]}, {expected[1]}]; got {None if mask is None else tuple(mask.shape)}")
        return shapes

    def check_backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       steps: list[RingStep], mask: Optional[Tensor] = None) -> _Shapes:
        shapes = self.check_forward(plan, q, k, v, mask)
        check_steps(steps, plan.rank, plan.world_size, shapes.last + 1)
        check_backward_operands(plan, dout, q, k, v, out, lse)
        return shapes

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups: Sequence = (),
                kernel: StepKernel, mask: Optional[Tensor] = None, checked: _Shapes, agreement) -> ForwardResult:
        """``mask``: a given mask's rows of the local queries over the whole sequence; LSE float32 [B, Nq, Sq]."""
        seq_dim, qd = checked.seq_dim, checked.dims
        lse_shape = torch.Size((qd.batch, plan.head_num, qd.seq))
        acc: list[Tensor] = []  # [out, lse] in float32, from the first result on
        def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> tuple[str, list]:
            part, tasks = _step(plan, checked, i, cur_k.shape[seq_dim], mask)
            rng = []
            for task in tasks:
                res = kernel.forward(*_task_operands(task, seq_dim, q, cur_k, cur_v), mask=task.mask,
                                     **checked.kernel_args)
                if res.seed is not None:
                    rng.append((res.seed, res.offset))
                if not acc and task.q_rows == (0, qd.seq) and res.lse.shape == lse_shape:
                    acc.extend((res.out.float(), res.lse.float()))  # the first result over every row: no merge
                else:
                    if not acc:
                        acc.extend(_empty_accumulators(checked.out, lse_shape, q.device))
                    merge_into(acc[0].narrow(seq_dim, *task.q_rows), acc[1].narrow(2, *task.q_rows), res.out, res.lse,
                               plan.layout, plan.head_num, fused=plan.fused_merge)
                del res
            return part, rng
        steps, traffic = forward_ring(plan, groups, k, v, seq_dim, checked.last, compute, agreement, mask_rows=mask)
        if log.isEnabledFor(logging.DEBUG):  # the parts' list is built only to be logged
            log.debug("ring forward rank %d/%d: parts %s, %s", plan.rank, plan.world_size, [s.part for s in steps],
                      traffic)
        acc_out, acc_lse = acc or _empty_accumulators(checked.out, lse_shape, q.device)
        return ForwardResult(out=acc_out.to(q.dtype), lse=acc_lse, steps=steps, **vars(traffic))

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps: list[RingStep], *, groups: Sequence = (), kernel: StepKernel,
                 mask: Optional[Tensor] = None, checked: _Shapes, agreement) -> BackwardResult:
        seq_dim, lse = checked.seq_dim, lse.float()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kernel_args = checked.kernel_args
        def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> list:
            """The step's kernel calls, planned again, each with the (seed, offset) its forward drew."""
            step, kv_grads = steps[i], []
            part, tasks = _step(plan, checked, step.index, cur_k.size(seq_dim), mask)
            if step.part != part or (step.rng and len(step.rng) != len(tasks)):
                check_step(step, plan.rank, part, len(tasks))  # raises, naming both
            for task, (seed, offset) in zip(tasks, step.rng or [(None, None)] * len(tasks)):
                rows = task.q_rows
                grads = kernel.backward(*_task_operands(task, seq_dim, q, cur_k, cur_v), dout.narrow(seq_dim, *rows),
                                        out.narrow(seq_dim, *rows), lse.narrow(2, *rows), mask=task.mask, seed=seed,
                                        offset=offset, **kernel_args)
                dq.narrow(seq_dim, *rows).add_(grads[0])
                kv_grads.append((task.kv_rows, grads[1], grads[2]))
                del grads
            return kv_grads
        dk, dv, traffic = backward_ring(plan, groups, k, v, seq_dim, checked.last, compute, agreement, steps,
                                        mask_rows=mask)
        log.debug("ring backward rank %d/%d: %s", plan.rank, plan.world_size, traffic)
        return BackwardResult(dq=dq.to(q.dtype), dk=dk.to(k.dtype), dv=dv.to(v.dtype), **vars(traffic))

    def fake(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return empty_outputs(plan, q, k, v)


def _empty_accumulators(out_shape: tuple, lse_shape: tuple, device) -> tuple[Tensor, Tensor]:
    return (torch.zeros(out_shape, dtype=torch.float32, device=device),
            torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=device))


RING = Ring()
