"""Attention sinks around any strategy: the sink's logit joins every row's softmax once, on the inner strategy's merged
result; the backward gives the inner strategy that LSE' and the sink its gradient over this rank's rows."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from ..engine.loop import BackwardResult, ForwardResult
from ..engine.merge import merge_sink, sink_grad
from ..plan import CallPlan

__all__ = ["WithSink"]


class WithSink:
    """``inner`` with the attention sink ``sink`` (this rank's heads [N], float32)."""
    def __init__(self, inner, sink: Tensor):
        self.inner, self.sink = inner, sink

    def fake(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.inner.fake(plan, q, k, v)

    def check_forward(self, *inputs):
        return self.inner.check_forward(*inputs)

    def check_backward(self, *inputs):
        return self.inner.check_backward(*inputs)

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, **where) -> ForwardResult:
        result = self.inner.forward(plan, q, k, v, **where)
        out, lse = merge_sink(result.out, result.lse, self.sink, plan.layout, plan.head_num)
        return replace(result, out=out, lse=lse)

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps, **where) -> BackwardResult:
        dsink = sink_grad(dout, out, lse, self.sink, plan.layout, plan.head_num)
        result = self.inner.backward(plan, dout, q, k, v, out, lse, steps, **where)
        return replace(result, dsink=dsink)
