"""Where the selftest's ranks run: the device, the ops (real or emulated), the step kernel, the mesh."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .cases import Case, hybrid_sizes


@dataclass
class Env:
    """One rank's device and how it calls the ops."""

    rank: int
    world: int
    device: object  # torch.device
    ops: str  # torch_npu | emulator | cp_cache (cp_cache's own op: the path without NPU ops)
    kernel: str | None = None  # the step kernel cp_cache.enable() gets (CUDA: "reference")
    fused_merge: bool | None = None
    one_device: str = "op"  # the float32 reference: "op" (the op on plain tensors) or "dense" (torch)
    inject: bool = False
    repeats: int = 3
    meshes: dict = field(default_factory=dict)
    cpu_group: object = None  # the group that sums float64 values on the CPU (gloo); None: the default

    def mesh(self, case: Case):
        from torch.distributed.device_mesh import init_device_mesh

        sizes = hybrid_sizes(self.world) if case.algorithm == "hybrid" else (self.world,)
        if sizes not in self.meshes:
            names = ("ring", "ulysses") if len(sizes) == 2 else ("cp",)
            self.meshes[sizes] = init_device_mesh(self.device.type, sizes, mesh_dim_names=names)
        return self.meshes[sizes]


def pick_device(launched: bool) -> str:
    """npu (torch_npu sees an NPU), cuda, or cpu under torchrun; always cpu when spawned (where run() checks two
    paths: kind "torch", cp_cache's op on torch's kernels, and "cpu", the emulated NPU op)."""
    import torch

    from .._common import npu_present

    if not launched:
        return "cpu"
    if npu_present():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_env(rank: int, world: int, kind: str, opts: dict) -> Env:
    """Set this rank's device up (ops, emulator) and describe it."""
    import torch
    import torch.distributed as dist

    from ...emulator import install_npu_emulator

    local = int(os.environ.get("LOCAL_RANK", rank))
    cpu_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    common = dict(inject=opts["inject"], repeats=opts["repeats"], cpu_group=cpu_group)
    if kind == "npu":
        return Env(rank, world, torch.device("npu", local), "torch_npu", **common)
    if kind == "torch":  # CPU ranks without the NPU ops: cp_cache's own op on torch's fused kernels
        return Env(rank, world, torch.device("cpu"), "cp_cache", kernel="torch", fused_merge=False, **common)
    install_npu_emulator(route_sdpa=False)
    if kind == "cuda":
        # the NPU op's entry emulated; every step on torch's own fused kernels (flash / memory-efficient)
        return Env(rank, world, torch.device("cuda", local), "emulator", kernel="torch", fused_merge=False,
                   one_device="dense", **common)
    return Env(rank, world, torch.device("cpu"), "emulator", **common)
