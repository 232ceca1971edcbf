"""cp_cache: context-parallel ring attention for Ascend NPUs with a native step-cache store.

The step cache of each attention call travels through autograd as a handle
tensor whose storage owns it (see DESIGN.md); this module exposes the
process-wide store and the autograd engine state the handlers rely on.
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C
from ._C import StepCache, StepCacheStore

__all__ = [
    "StepCache",
    "StepCacheStore",
    "current_graph_task_id",
    "reset_peak",
    "stats",
    "store",
]


def store() -> StepCacheStore:
    """The process-wide step-cache store the handlers use."""
    return _C.default_store()


def stats() -> dict:
    """Counters of the process-wide store: live_entries, live_bytes, peak_entries,
    peak_bytes, created, released, pushed, popped, skipped_recompute_pushes, stack_depth."""
    return _C.default_store().stats()


def reset_peak() -> None:
    """Restart peak_entries / peak_bytes from the current live values."""
    _C.default_store().reset_peak()


def current_graph_task_id() -> int:
    """The autograd engine's graph task id on this thread (-1 outside a backward), read in C++."""
    return _C.current_graph_task_id()


from . import testing  # noqa: E402
from .dispatch import context_parallel, disable, enable, enabled  # noqa: E402

__all__ += ["context_parallel", "disable", "enable", "enabled", "testing"]
