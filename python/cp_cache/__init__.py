"""cp_cache: context-parallel ring attention for Ascend NPUs with a native step-cache store.

``cp_cache.emulator`` (the NPU ops on CPU) and ``cp_cache.testing`` are loaded only when asked for.
"""

from __future__ import annotations

import importlib

import torch  # noqa: F401  (loads libtorch before the extension)

from . import native

_C = native.load()  # refuses an extension built against another torch, naming both versions
from ._C import StepCache, StepCacheStore
from . import op  # noqa: F401  (defines torch.ops.cp_cache.fusion_attention)
from .config import CPConfig
from .dispatch import active_config, active_mesh, call_stats, context_parallel, disable, enable, enabled
from .packing import document_layout, pad_documents, shard_documents, unshard_documents
from .sharding import shard_sequence, unshard_sequence

__all__ = ["CPConfig", "StepCache", "StepCacheStore", "active_config", "active_mesh", "call_stats",
           "context_parallel", "current_graph_task_id", "disable", "document_layout", "enable", "enabled",
           "pad_documents", "reset_peak", "shard_documents", "shard_sequence", "stats", "store",
           "unshard_documents", "unshard_sequence"]


def store() -> StepCacheStore:
    """The process-wide store the handlers use."""
    return _C.default_store()


def stats() -> dict:
    """Counters of the process-wide store (docs/api.md)."""
    return _C.default_store().stats()


def reset_peak() -> None:
    """Restart peak_entries / peak_bytes from the current live values."""
    _C.default_store().reset_peak()


def current_graph_task_id() -> int:
    """-1 outside a backward."""
    return _C.current_graph_task_id()


def __getattr__(name: str):
    # ``cp_cache.emulator`` and ``cp_cache.testing`` after a bare ``import cp_cache``: loaded on first use
    if name in ("emulator", "testing"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cp_cache' has no attribute {name!r}")
