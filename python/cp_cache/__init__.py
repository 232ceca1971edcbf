"""cp_cache: context-parallel ring attention (Ascend NPUs, torch's kernels) with a native step-cache store.
``import cp_cache`` is light (the store and cp_cache's op; no dynamo, no DTensor): ``enable()``, the region, the
helpers, ``cp_cache.emulator`` and ``cp_cache.testing`` load on first use."""

from __future__ import annotations

import importlib

import torch  # noqa: F401  (loads libtorch before the extension)

from . import native

_C = native.load()  # refuses an extension built against another torch, naming both versions
from ._C import StepCache, StepCacheStore
from . import op  # noqa: F401  (defines torch.ops.cp_cache.fusion_attention)
from .config import CPConfig

_LAZY = {name: module for module, names in (
    ("dispatch", ("active_config", "active_mesh", "call_stats", "context_parallel", "disable", "enable", "enabled")),
    ("packing", ("document_layout", "pad_documents", "shard_documents", "unshard_documents")),
    ("sharding", ("shard_sequence", "unshard_sequence"))) for name in names}
__all__ = sorted(["CPConfig", "StepCache", "StepCacheStore", "current_graph_task_id", "reset_peak", "stats", "store",
                  *_LAZY])


def store() -> StepCacheStore:
    """The process-wide store the handlers use."""
    return _C.default_store()


def stats() -> dict:
    """Counters of the process-wide store (docs/api.md)."""
    return store().stats()


def reset_peak() -> None:
    """Restart peak_entries / peak_bytes from the current live values."""
    store().reset_peak()


def current_graph_task_id() -> int:
    """-1 outside a backward."""
    return _C.current_graph_task_id()


def __getattr__(name: str):
    # on first use: the API (it loads DTensor and dynamo) and the submodules (cp_cache.emulator, .testing, ...)
    try:
        module = importlib.import_module(f".{_LAZY.get(name, name)}", __name__)
    except ModuleNotFoundError as e:  # no such submodule; one that a submodule needs is raised as it is
        raise AttributeError(f"module 'cp_cache' has no attribute {name!r}") if e.name == f"{__name__}.{name}" else e
    globals()[name] = value = getattr(module, name) if name in _LAZY else module
    return value
