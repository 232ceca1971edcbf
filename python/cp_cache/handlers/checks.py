"""What the CP handlers accept: the mask arguments and the DTensor sharding of their inputs."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from .. import layout as L
from ..npu_ops import CAUSAL_MODES, SparseMode, is_compressed_mask
from .arguments import describe

__all__ = ["is_causal", "check_sharding", "sharded_like", "local_tensor"]

_UNSUPPORTED_WHEN_SET = ("pse", "padding_mask", "prefix", "actual_seq_qlen", "actual_seq_kvlen", "sink")
_MASK_AS_GIVEN_MODES = (SparseMode.MASK, SparseMode.ALL_MASK)


def is_causal(a: dict[str, Any]) -> bool:
    """Causal or full attention from the bound mask arguments; anything else raises
    NotImplementedError naming the argument and its value."""
    for name in _UNSUPPORTED_WHEN_SET:
        if a[name] is not None:
            raise NotImplementedError(
                f"cp_cache ring attention does not support {name}={describe(a[name])} yet"
            )
    if a["softmax_layout"]:
        raise NotImplementedError(
            f"cp_cache ring attention does not support softmax_layout={a['softmax_layout']!r} yet"
        )
    mode, mask = a["sparse_mode"], a["atten_mask"]
    if mode not in _MASK_AS_GIVEN_MODES + CAUSAL_MODES:
        raise NotImplementedError(
            f"cp_cache ring attention supports sparse_mode 0, 1 (no mask: full attention) and "
            f"2, 3 (compressed causal mask), not sparse_mode={mode}"
        )
    if mask is None:
        return False  # the op computes full attention whatever sparse_mode says
    if mode in CAUSAL_MODES:
        if not is_compressed_mask(mask):
            raise NotImplementedError(
                f"cp_cache ring attention with sparse_mode={mode} needs the compressed 2048x2048 "
                f"causal mask, got atten_mask={describe(mask)}"
            )
        return True
    raise NotImplementedError(
        f"cp_cache ring attention does not support an arbitrary atten_mask ({describe(mask)} with "
        f"sparse_mode={mode}); pass no mask for full attention or the compressed causal mask "
        "with sparse_mode=2"
    )


def check_sharding(tensors: dict[str, Any], layout: str):
    """(mesh, placements) shared by the named DTensors, sharded on the layout's sequence dim."""
    seq_dim = L.seq_dim(layout)
    mesh = placements = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            raise TypeError(
                f"cp_cache ring attention needs {name} as a DTensor sharded on the sequence "
                f"dimension {seq_dim} of layout {layout!r}, got {type(tensor).__name__}"
            )
        if tensor.device_mesh.ndim != 1:
            raise NotImplementedError(
                f"cp_cache ring attention needs a 1-D device mesh, {name} is on a "
                f"{tensor.device_mesh.ndim}-D mesh {tensor.device_mesh}"
            )
        if tuple(tensor.placements) != (Shard(seq_dim),):
            raise NotImplementedError(
                f"cp_cache ring attention needs {name} sharded as (Shard({seq_dim}),) for layout "
                f"{layout!r}, got placements={tuple(tensor.placements)}"
            )
        if mesh is None:
            mesh, placements = tensor.device_mesh, tensor.placements
        elif tensor.device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {tensor.device_mesh}, query on {mesh}")
    return mesh, placements


def sharded_like(value: Any, name: str, mesh, placements) -> DTensor:
    """``value`` as a DTensor with the query's sharding (an incoming gradient may come
    replicated, e.g. from a sum)."""
    if not isinstance(value, DTensor):
        raise TypeError(f"cp_cache: npu_fusion_attention_grad_v3 needs {name} as a DTensor, got {describe(value)}")
    if value.device_mesh != mesh:
        raise ValueError(f"{name} is on mesh {value.device_mesh}, query on {mesh}")
    if tuple(value.placements) != tuple(placements):
        value = value.redistribute(mesh, placements)
    return value


def local_tensor(value: Any, name: str) -> Tensor:
    """The local tensor of a DTensor argument (a plain tensor passes through)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, Tensor):
        return value
    raise RuntimeError(f"cp_cache: npu_fusion_attention_grad_v3 needs {name}, got {describe(value)}")
