"""Packed documents at a fixed shape: each rank holds ``capacity`` rows, placed tokens first. The inner strategy runs on
the placed rows only; padding rows come back as the NPU op gives a row that sees no key: output 0, LSE -inf."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..documents import check_capacity_rows
from ..engine.loop import BackwardResult, ForwardResult
from ..plan import CallPlan

__all__ = ["WithCapacity"]


def _placed(plan: CallPlan, *tensors: Tensor) -> tuple[Tensor, ...]:
    """This rank's placed tokens, once ``tensors`` have the capacity rows and every rank's placed tokens fit."""
    rows = check_capacity_rows(plan, *(t.size(0) for t in tensors))[plan.rank]
    return tuple(t.narrow(0, 0, rows) for t in tensors)


def _padded(t: Tensor, capacity: int, fill: float) -> Tensor:
    if t.size(0) == capacity:
        return t
    return torch.cat([t, t.new_full((capacity - t.size(0), *t.shape[1:]), fill)])


class WithCapacity:
    """``inner`` (the packed-documents strategy) on the placed rows of ``plan.capacity``-row shards."""
    def __init__(self, inner):
        self.inner = inner

    def fake(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.inner.fake(plan, q, k, v)  # shapes of the capacity rows, as given

    def check_forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, mask=None):
        return self.inner.check_forward(plan, *_placed(plan, q, k, v), mask)

    def check_backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, steps, mask=None):
        return self.inner.check_backward(plan, *_placed(plan, dout, q, k, v, out, lse), steps, mask)

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, **where) -> ForwardResult:
        result = self.inner.forward(plan, *_placed(plan, q, k, v), **where)
        return replace(result, out=_padded(result.out, plan.capacity, 0.0),
                       lse=_padded(result.lse, plan.capacity, float("-inf")))

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps, **where) -> BackwardResult:
        result = self.inner.backward(plan, *_placed(plan, dout, q, k, v, out, lse), steps, **where)
        return replace(result, **{n: _padded(getattr(result, n), plan.capacity, 0.0) for n in ("dq", "dk", "dv")})
