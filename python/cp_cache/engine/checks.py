"""The argument checks every strategy makes on its local tensors (before the ranks agree)."""

from __future__ import annotations

from torch import Tensor

from .. import layout as L
from ..plan import CallPlan

__all__ = ["check_qkv", "check_keep_prob", "check_backward_operands"]


def check_qkv(plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[L.Dims, int]:
    """(the query's dims, the K/V head count) of dense-layout q/k/v, after checking them
    against the plan; ValueError (NotImplementedError for TND) naming what is wrong."""
    lay = L.check_layout(plan.layout)
    qd = L.dims(q, lay, plan.head_num)
    nkv = L.heads_of(k, lay, qd.head_dim)
    kd = L.dims(k, lay, nkv)
    L.check_value(k, v, lay, nkv)  # V's head size may differ (MLA), nothing else
    if kd.batch != qd.batch or kd.head_dim != qd.head_dim:
        raise ValueError(
            f"query {tuple(q.shape)} and key {tuple(k.shape)} disagree on batch or head size "
            f"(input_layout={lay!r})"
        )
    if plan.head_num % nkv:
        raise ValueError(f"head_num={plan.head_num} is not a multiple of the K/V head count {nkv}")
    if plan.mask.positional and kd.seq != qd.seq:
        raise ValueError(
            f"causal, band and masked ring attention need equal local query and key lengths, got "
            f"{qd.seq} and {kd.seq}"
        )
    if plan.mask.positional and plan.load_balance and qd.seq % 2:
        raise ValueError(
            f"load balancing needs an even local sequence length, got {qd.seq} "
            f"(input_layout={lay!r}, world_size={plan.world_size})"
        )
    check_keep_prob(plan)
    return qd, nkv


def check_keep_prob(plan: CallPlan) -> None:
    if not 0.0 < plan.keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {plan.keep_prob}")


def check_backward_operands(plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                            lse: Tensor) -> None:
    """The backward's incoming gradient, forward output and LSE against q/k/v: dout and out have the
    output's shape (the query's with V's head size)."""
    expected_out = L.output_shape(q, k, v, plan.layout, plan.head_num)
    if tuple(dout.shape) != expected_out or tuple(out.shape) != expected_out:
        raise ValueError(
            f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have the output's shape {expected_out} "
            f"(the query's {tuple(q.shape)} with the value's head size)"
        )
    expected = L.lse_shape(q, plan.layout, plan.head_num)
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse has shape {tuple(lse.shape)}, expected {expected}")
