"""The CP attention strategies, one interface (check, forward, backward, fake), sharing only the engine. ``groups``:
the CP groups, outer first; a strategy takes the innermost and gives an inner one the rest."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..engine.agreement import open_agreement
from ..engine.loop import BackwardResult, ForwardResult, group_info
from ..plan import CallPlan
from .capacity import WithCapacity
from .packed import PACKED, PackedDocuments
from .ring import RING, Ring
from .sinks import WithSink
from .ulysses import ULYSSES, Ulysses

__all__ = ["Ring", "Ulysses", "PackedDocuments", "WithSink", "WithCapacity", "RING", "ULYSSES", "PACKED", "HYBRID",
           "PACKED_ULYSSES", "run_forward", "run_backward"]

HYBRID = Ulysses(inner=RING)
PACKED_ULYSSES = Ulysses(inner=PACKED)  # packed documents under "ulysses" and "hybrid"


def run_forward(strategy, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups=(), kernel,
                mask: Optional[Tensor] = None) -> ForwardResult:
    """``strategy``'s forward driven directly (no custom op): checks, agreement on ``groups``, the run."""
    checked, agreement = open_agreement("forward", lambda: strategy.check_forward(plan, q, k, v, mask), plan, q, k, v,
                                        groups=_agreeing(plan, groups), kernel=getattr(kernel, "name", ""),
                                        mask_rows=mask)
    return strategy.forward(plan, q, k, v, groups=groups, kernel=kernel, mask=mask, checked=checked,
                            agreement=agreement)


def run_backward(strategy, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps, *, groups=(), kernel, mask: Optional[Tensor] = None) -> BackwardResult:
    checked, agreement = open_agreement(
        "backward", lambda: strategy.check_backward(plan, dout, q, k, v, out, lse, steps, mask), plan, q, k, v,
        groups=_agreeing(plan, groups), kernel=getattr(kernel, "name", ""), mask_rows=mask, steps=len(steps))
    return strategy.backward(plan, dout, q, k, v, out, lse, steps, groups=groups, kernel=kernel, mask=mask,
                             checked=checked, agreement=agreement)


def _agreeing(plan: CallPlan, groups) -> list:
    given = [g for g in groups if g is not None]
    if given:
        return given
    group = group_info(plan.world_size, plan.rank, None)[2]
    return [] if group is None else [group]
