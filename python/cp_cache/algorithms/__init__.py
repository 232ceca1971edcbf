"""The CP attention strategies, one interface each: ``forward(plan, q, k, v, *, groups, kernel,
mask)``, ``backward(plan, dout, q, k, v, out, lse, steps, *, groups, kernel, mask)`` and
``fake(plan, q, k, v)`` (shapes only, for tracing).

* ``ring``: K/V blocks travel around the ring (every dense layout, every mask kind);
* ``ulysses``: all-to-all to head shards around one local call; hybrid is Ulysses around
  the ring it is given (``Ulysses(inner=RING)``);
* ``packed``: packed documents (TND) on the ring's loop;
* ``sinks``: attention sinks around whichever of them runs (``WithSink``), once on its result.

``groups`` are the CP process groups, outer first: a strategy takes the innermost as its
own and gives an inner strategy the rest. None imports another's private names; what they
share is the engine (``cp_cache.engine``).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..plan import CallPlan
from .packed import PACKED, PackedDocuments
from .ring import RING, Ring
from .sinks import WithSink
from .ulysses import ULYSSES, Ulysses

__all__ = ["Ring", "Ulysses", "PackedDocuments", "WithSink", "RING", "ULYSSES", "PACKED", "HYBRID",
           "strategy_for"]

HYBRID = Ulysses(inner=RING)


def strategy_for(plan: CallPlan, sink: Optional[Tensor] = None):
    """The strategy that runs ``plan``; with ``sink`` (this rank's heads), wrapped in ``WithSink``."""
    if plan.packed:
        strategy = PACKED
    elif plan.algorithm == "ulysses":
        strategy = ULYSSES
    elif plan.algorithm == "hybrid":
        strategy = HYBRID
    else:
        strategy = RING
    return strategy if sink is None else WithSink(strategy, sink)
