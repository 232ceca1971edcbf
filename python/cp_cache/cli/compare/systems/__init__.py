"""The compared systems, one adapter family per module, each run on one rank:

* ``cp_cache``: cp_cache, handle or stack policy;
* ``torch_npu``: torch_npu 2.14.0, 2.13.0 (also with its dropout guard lifted) and 2.12.0;
* ``torch_ring``: torch's templated ring, all-gather or all-to-all rotation.

Each system has a ``session()`` (a context manager that makes it the one in use), and
``attention(q, k, v, spec, mask)`` on local tensors, which raises ``Unsupported`` for an input
it has no way to express.
"""

from __future__ import annotations

from ..catalogue import CP_CACHE, CP_CACHE_STACK, NPU_213_LIFTED, TORCH_A2A, TORCH_AG, TORCH_NPU_RELEASES
from .base import System, Unsupported, op_kwargs
from .cp_cache import CpCacheSystem
from .torch_npu import TorchNpuSystem
from .torch_ring import TorchRingSystem

__all__ = ["System", "Unsupported", "op_kwargs", "make_system", "CpCacheSystem", "TorchNpuSystem",
           "TorchRingSystem"]


def make_system(name: str, mesh) -> System:
    """The system called ``name`` (one of ``catalogue.SYSTEMS``) on ``mesh``."""
    if name == CP_CACHE:
        return CpCacheSystem(mesh, "handle")
    if name == CP_CACHE_STACK:
        return CpCacheSystem(mesh, "stack")
    if name in TORCH_NPU_RELEASES:
        return TorchNpuSystem(mesh, name, lifted=name == NPU_213_LIFTED)
    if name == TORCH_AG:
        return TorchRingSystem(mesh, "allgather")
    if name == TORCH_A2A:
        return TorchRingSystem(mesh, "alltoall")
    raise ValueError(f"unknown system {name!r}")
