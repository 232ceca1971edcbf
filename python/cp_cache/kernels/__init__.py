"""Step kernels for ring attention."""

from __future__ import annotations

from .base import StepForward, StepKernel
from .npu import NpuKernel
from .npu import available as npu_available
from .reference import ReferenceKernel

__all__ = ["KERNEL_NAMES", "StepForward", "StepKernel", "NpuKernel", "ReferenceKernel", "get_kernel"]

_KERNELS = {"npu": NpuKernel, "reference": ReferenceKernel}
KERNEL_NAMES = tuple(_KERNELS)


def get_kernel(name: str | None = None) -> StepKernel:
    """The step kernel called ``name``; by default "npu" when its op exists (real or
    emulated), else "reference"."""
    if name is None:
        name = "npu" if npu_available() else "reference"
    try:
        return _KERNELS[name]()
    except KeyError:
        raise ValueError(f"unknown step kernel {name!r}; known: {', '.join(sorted(_KERNELS))}") from None
