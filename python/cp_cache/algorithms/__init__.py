"""The CP attention strategies, one interface each: their checks of this rank's inputs
(``check_forward(plan, q, k, v, mask)``, ``check_backward(plan, dout, q, k, v, out, lse, steps,
mask)``), their runs (``forward(plan, q, k, v, *, groups, kernel, mask, checked, agreement)``,
``backward(..., steps, *, groups, kernel, mask, checked, agreement)``: ``checked`` is what the
check returned, ``agreement`` the ranks' agreement on the call, which the run waits for before
its first exchange) and ``fake(plan, q, k, v)`` (shapes only, for tracing). A strategy never
calls the agreement: its driver does (the custom ops, ``handlers/ops.py``; ``run_forward`` /
``run_backward`` for a strategy driven directly).

* ``ring``: K/V blocks travel around the ring (every dense layout, every mask kind);
* ``ulysses``: all-to-all to head shards around one local call; hybrid is Ulysses around
  the ring it is given (``Ulysses(inner=RING)``);
* ``packed``: packed documents (TND) on the ring's loop; Ulysses and hybrid over them are
  Ulysses around it (``Ulysses(inner=PACKED)``: on one CP dimension a packed ring of one rank);
* ``sinks``: attention sinks around whichever of them runs (``WithSink``), once on its result;
* ``capacity``: packed documents at a fixed shape (``WithCapacity`` around ``packed``: the
  placed rows computed, the padding rows given zeros).

``groups`` are the CP process groups, outer first: a strategy takes the innermost as its
own and gives an inner strategy the rest. None imports another's private names; what they
share is the engine (``cp_cache.engine``).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .. import layout as L
from ..engine.agreement import open_agreement
from ..engine.loop import BackwardResult, ForwardResult
from ..engine.transport import group_info
from ..plan import CallPlan
from .capacity import WithCapacity
from .packed import PACKED, PackedDocuments
from .ring import RING, Ring
from .sinks import WithSink
from .ulysses import ULYSSES, Ulysses

__all__ = ["Ring", "Ulysses", "PackedDocuments", "WithSink", "WithCapacity", "RING", "ULYSSES", "PACKED", "HYBRID",
           "PACKED_ULYSSES", "strategy_for", "run_forward", "run_backward"]

HYBRID = Ulysses(inner=RING)
PACKED_ULYSSES = Ulysses(inner=PACKED)  # packed documents under "ulysses" and "hybrid"


def strategy_for(plan: CallPlan, sink: Optional[Tensor] = None):
    """The strategy that runs ``plan``; with ``sink`` (this rank's heads), wrapped in ``WithSink``."""
    if plan.layout == L.TND:  # packed documents
        if plan.algorithm in ("ulysses", "hybrid"):
            strategy = PACKED_ULYSSES
        else:
            strategy = PACKED if plan.capacity is None else WithCapacity(PACKED)
    elif plan.algorithm == "ulysses":
        strategy = ULYSSES
    elif plan.algorithm == "hybrid":
        strategy = HYBRID
    else:
        strategy = RING
    return strategy if sink is None else WithSink(strategy, sink)


def run_forward(strategy, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups=(), kernel,
                mask: Optional[Tensor] = None) -> ForwardResult:
    """``strategy``'s forward of the local shards driven directly (no custom op): this rank's
    checks, the ranks' agreement on ``groups`` (outer first), the run."""
    checked, agreement = open_agreement("forward", lambda: strategy.check_forward(plan, q, k, v, mask), plan, q, k,
                                        v, groups=_agreeing(plan, groups), kernel=getattr(kernel, "name", ""),
                                        mask_rows=mask)
    return strategy.forward(plan, q, k, v, groups=groups, kernel=kernel, mask=mask, checked=checked,
                            agreement=agreement)


def run_backward(strategy, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps, *, groups=(), kernel, mask: Optional[Tensor] = None) -> BackwardResult:
    """``strategy``'s backward driven directly, as ``run_forward``."""
    checked, agreement = open_agreement(
        "backward", lambda: strategy.check_backward(plan, dout, q, k, v, out, lse, steps, mask), plan, q, k, v,
        groups=_agreeing(plan, groups), kernel=getattr(kernel, "name", ""), mask_rows=mask, steps=len(steps))
    return strategy.backward(plan, dout, q, k, v, out, lse, steps, groups=groups, kernel=kernel, mask=mask,
                             checked=checked, agreement=agreement)


def _agreeing(plan: CallPlan, groups) -> list:
    """The groups the ranks agree on: ``groups``, or the default group where none is given for W > 1."""
    given = [g for g in groups if g is not None]
    if given:
        return given
    group = group_info(plan.world_size, plan.rank, None)[2]
    return [] if group is None else [group]
