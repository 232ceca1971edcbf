"""The CP attention strategies, one interface each: ``forward(plan, q, k, v, *, groups, kernel,
mask)``, ``backward(plan, dout, q, k, v, out, lse, steps, *, groups, kernel, mask)`` and
``fake(plan, q, k, v)`` (shapes only, for tracing).

* ``ring``: K/V blocks travel around the ring (every dense layout, every mask kind);
* ``ulysses``: all-to-all to head shards around one local call; hybrid is Ulysses around
  the ring it is given (``Ulysses(inner=RING)``);
* ``packed``: packed documents (TND) on the ring's loop.

``groups`` are the CP process groups, outer first: a strategy takes the innermost as its
own and gives an inner strategy the rest. None imports another's private names; what they
share is the engine (``cp_cache.engine``).
"""

from __future__ import annotations

from ..plan import CallPlan
from .packed import PACKED, PackedDocuments
from .ring import RING, Ring
from .ulysses import ULYSSES, Ulysses

__all__ = ["Ring", "Ulysses", "PackedDocuments", "RING", "ULYSSES", "PACKED", "HYBRID", "strategy_for"]

HYBRID = Ulysses(inner=RING)


def strategy_for(plan: CallPlan):
    """The strategy that runs ``plan``."""
    if plan.packed:
        return PACKED
    if plan.algorithm == "ulysses":
        return ULYSSES
    if plan.algorithm == "hybrid":
        return HYBRID
    return RING
