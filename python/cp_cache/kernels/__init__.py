"""Step kernels for ring attention (stateless: one shared instance per name)."""

from __future__ import annotations

from types import MappingProxyType

from .base import StepForward, StepKernel, StepMask
from .npu import NpuKernel
from .npu import available as npu_available
from .reference import ReferenceKernel

__all__ = ["KERNEL_NAMES", "KERNEL_BY_NAME", "StepForward", "StepKernel", "StepMask", "NpuKernel", "ReferenceKernel",
           "get_kernel"]

KERNEL_BY_NAME = MappingProxyType({"npu": NpuKernel(), "reference": ReferenceKernel()})
KERNEL_NAMES = tuple(KERNEL_BY_NAME)


def get_kernel(name: str | None = None) -> StepKernel:
    """The step kernel called ``name``; by default "npu" when its op exists (real or
    emulated), else "reference"."""
    if name is None:
        name = "npu" if npu_available() else "reference"
    try:
        return KERNEL_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown step kernel {name!r}; known: {', '.join(sorted(KERNEL_BY_NAME))}") from None
