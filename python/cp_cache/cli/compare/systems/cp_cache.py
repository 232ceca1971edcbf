"""cp_cache itself: the v3 op on DTensors inside ``cp_cache.context_parallel(mesh)``, handle or stack policy."""

from __future__ import annotations

import contextlib

from ..catalogue import CP_CACHE, CP_CACHE_STACK
from .base import DTensorSystem


class CpCacheSystem(DTensorSystem):
    def __init__(self, mesh, policy: str):
        super().__init__(mesh)
        self.policy = policy
        self.name = CP_CACHE if policy == "handle" else CP_CACHE_STACK

    @contextlib.contextmanager
    def session(self):
        import cp_cache

        cp_cache.enable(policy=self.policy)
        try:
            with cp_cache.context_parallel(self.mesh):
                yield self
        finally:
            cp_cache.disable()

    def store_bytes(self) -> int:
        import cp_cache

        return int(cp_cache.stats()["live_bytes"])

    def stack_entries(self) -> int | None:
        import cp_cache

        return int(cp_cache.stats()["stack_depth"]) if self.policy == "stack" else None

    def clear_stack(self) -> None:
        import cp_cache

        cp_cache.store().clear()

    def reported_sent_bytes(self) -> dict | None:
        """The bytes cp_cache counts as sent, by direction (``cp_cache.call_stats()``); None when
        disabled."""
        import cp_cache

        if not cp_cache.enabled():
            return None
        calls = cp_cache.call_stats()
        return {d: calls[d]["bytes_sent"] for d in ("forward", "backward")}

