"""Measuring memory on CPU: the storages a set of tensors holds, and peaks of allocated bytes
from the torch profiler's memory events. Shared by ``compare`` and ``bench``."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["storage_key", "tensors_in", "distinct_storage_bytes", "trace_memory", "peak_bytes", "SavedStorages"]


def storage_key(t) -> tuple[int, int] | None:
    """(data_ptr, nbytes) of a tensor's untyped storage (a DTensor's local tensor); None if it has none."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (s.data_ptr(), s.nbytes())


def tensors_in(obj, found: list) -> list:
    """Every tensor reachable through tuples, lists and dicts."""
    import torch

    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            tensors_in(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors_in(x, found)
    return found


def distinct_storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages of ``tensors`` (by data pointer), leaving out the storages
    of ``exclude``."""
    skip = {k[0] for k in map(storage_key, exclude) if k}
    keys = {}
    for t in tensors:
        k = storage_key(t)
        if k and k[0] not in skip:
            keys[k[0]] = max(keys.get(k[0], 0), k[1])
    return sum(keys.values())


def trace_memory(phases: list[tuple[str, Callable[[], Any]]], net: dict | None = None) -> dict[str, int]:
    """Run ``phases`` (name, function) one after the other under the torch profiler with
    ``profile_memory=True``; for each phase, the peak of allocated CPU bytes above the
    level at the phase's start (and, into ``net`` when given, the level at its end minus
    the level at its start).

    The allocation and free events of the whole run are summed in time order (one
    profile, so a tensor allocated in one phase and freed in a later one is accounted
    in both); a phase's window is its ``record_function`` range.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    tag = "cp_cache.measure::"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, fn in phases:
            with record_function(tag + name):
                fn()
    allocs: list[tuple[int, int]] = []
    windows: dict[str, tuple[int, int]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            if str(node.extra_fields.device).startswith("cpu"):
                allocs.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
        elif node.name.startswith(tag):
            windows[node.name[len(tag):]] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    allocs.sort()
    peaks = {}
    for name, _ in phases:
        start, end = windows[name]
        level = sum(size for t, size in allocs if t < start)
        base, peak = level, level
        for t, size in allocs:
            if start <= t <= end:
                level += size
                peak = max(peak, level)
        peaks[name] = int(peak - base)
        if net is not None:
            net[name] = int(level - base)
    return peaks


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak allocated CPU bytes above the starting level while ``fn()`` runs (``trace_memory``)."""
    return trace_memory([("call", fn)])["call"]


class SavedStorages:
    """Inside the block, records the distinct storages autograd saves for backward (by data
    pointer), leaving out those of ``exclude`` (inputs, masks): ``storages`` {pointer: bytes}
    and ``nbytes``. The memory floor's measure of what a call keeps from forward to backward."""

    def __init__(self, exclude=()):
        self._skip = {k[0] for k in map(storage_key, exclude) if k}
        self.storages: dict[int, int] = {}
        self._hooks = None

    def _pack(self, tensor):
        key = storage_key(tensor)
        if key and key[0] not in self._skip:
            self.storages[key[0]] = max(self.storages.get(key[0], 0), key[1])
        return tensor

    def __enter__(self) -> "SavedStorages":
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())
