"""Packed documents at a fixed shape (``CallPlan.capacity``): every rank holds ``capacity`` rows,
the tokens its placement gives it first, then padding. Around the packed-documents strategy (as
``WithSink`` goes around any): the inner strategy runs on the placed rows only (so the exchange,
the step records and the bounds are those of the call without a capacity), and the padding rows
come back as a query row that sees no key does from the NPU op: output 0, LSE -inf, and zero
gradients for q, k and v. docs/documents.md."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..documents import check_capacity_rows
from ..engine.loop import BackwardResult, ForwardResult
from ..plan import CallPlan

__all__ = ["WithCapacity"]


def _placed_rows(plan: CallPlan, *tensors: Tensor) -> int:
    """This rank's placed tokens, after checking that each of ``tensors`` has the plan's capacity
    rows and that every rank's placed tokens fit in them."""
    return check_capacity_rows(plan, *(t.size(0) for t in tensors))[plan.rank]


def _placed(rows: int, *tensors: Tensor) -> tuple[Tensor, ...]:
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
        rows = _placed_rows(plan, q, k, v)
        return self.inner.check_forward(plan, *_placed(rows, q, k, v), mask)

    def check_backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, steps, mask=None):
        rows = _placed_rows(plan, dout, q, k, v, out, lse)
        return self.inner.check_backward(plan, *_placed(rows, dout, q, k, v, out, lse), steps, mask)

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, **where) -> ForwardResult:
        rows = _placed_rows(plan, q)
        result = self.inner.forward(plan, *_placed(rows, q, k, v), **where)
        return replace(result, out=_padded(result.out, plan.capacity, 0.0),
                       lse=_padded(result.lse, plan.capacity, float("-inf")))

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps, **where) -> BackwardResult:
        rows = _placed_rows(plan, q)
        result = self.inner.backward(plan, *_placed(rows, dout, q, k, v, out, lse), steps, **where)
        return replace(result, dq=_padded(result.dq, plan.capacity, 0.0), dk=_padded(result.dk, plan.capacity, 0.0),
                       dv=_padded(result.dv, plan.capacity, 0.0))
