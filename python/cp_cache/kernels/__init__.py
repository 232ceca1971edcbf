"""Step kernels for ring attention, by name: "npu" (the NPU ops, real or emulated), "torch" (torch's
fused attention, CPU and CUDA), "reference" (plain torch) and whatever ``register`` adds. A kernel is
stateless: one shared instance."""

from __future__ import annotations

import threading
from types import MappingProxyType

from .base import StepForward, StepKernel, StepMask, segments_backward, segments_forward
from .npu import NpuKernel
from .npu import available as npu_available
from .reference import ReferenceKernel
from .torch_fused import TorchKernel

__all__ = ["StepForward", "StepKernel", "StepMask", "NpuKernel", "ReferenceKernel", "TorchKernel", "register",
           "KERNELS", "segments_forward", "segments_backward", "get_kernel", "kernel_names"]

_lock = threading.Lock()
_KERNELS: dict[str, StepKernel] = {}
KERNELS = MappingProxyType(_KERNELS)  # the registered kernels by name (read-only view)


def register(kernel: StepKernel, *, replace: bool = False) -> StepKernel:
    """Make ``kernel`` (a ``StepKernel``) the step kernel named ``kernel.name`` (``enable(kernel=name)``);
    every rank of a CP group must register the same (the agreement compares the name). ``replace``:
    allow replacing another kernel of that name; TypeError / ValueError otherwise."""
    name = getattr(kernel, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: kernel={kernel!r} needs a non-empty string name")
    if not isinstance(kernel, StepKernel) or not isinstance(getattr(kernel, "takes_tnd", None), bool):
        raise TypeError(f"register: kernel {name!r} does not follow cp_cache.kernels.StepKernel (name, takes_tnd: "
                        "bool, forward, backward)")
    with _lock:
        if name in _KERNELS and _KERNELS[name] is not kernel and not replace:
            raise ValueError(f"register: a step kernel named {name!r} exists; pass replace=True to replace it")
        _KERNELS[name] = kernel
    return kernel


def kernel_names() -> tuple[str, ...]:
    """The registered kernels' names."""
    return tuple(_KERNELS)


def get_kernel(name: str | None = None) -> StepKernel:
    """The step kernel called ``name``; by default "npu" when its op exists (real or emulated), else "torch"."""
    if name is None:
        name = "npu" if npu_available() else "torch"
    found = _KERNELS.get(name)
    if found is None:
        raise ValueError(f"unknown step kernel {name!r}; registered: {', '.join(sorted(_KERNELS))}")
    return found


register(NpuKernel())
register(TorchKernel())
register(ReferenceKernel())
