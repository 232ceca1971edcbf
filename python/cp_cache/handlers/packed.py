"""What the CP handlers accept for packed documents: ``input_layout="TND"`` with
``actual_seq_qlen`` / ``actual_seq_kvlen``.

q/k/v are DTensors ``Shard(0)`` on a 1-D mesh; the lengths are the GLOBAL cumulative
document ends, the same on every rank (a plain tensor or list). The layout of the local
shards follows torch's ``_cp_options.enable_load_balance`` (per-document head-tail when on,
contiguous when off), for causal and full attention alike: the documents decide which
local rows belong together. The documents go into the call's plan, and a backward whose
lengths differ from its forward's is refused.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor, Shard

from ..documents import cumulative_lengths
from ..npu_ops import CAUSAL_MODES, SparseMode, is_compressed_mask
from ..plan import MaskSpec
from ..arguments import describe
from .cp_mesh import CPSharding

__all__ = ["packed_mask", "packed_documents", "packed_sharding"]

_UNSUPPORTED_WHEN_SET = ("pse", "padding_mask", "prefix", "sink")
_TND_PLACEMENTS = (Shard(0),)


def packed_mask(a: dict[str, Any]) -> MaskSpec:
    """Causal per document or full; anything else unsupported raises naming it."""
    for name in _UNSUPPORTED_WHEN_SET:
        if a[name] is not None:
            raise NotImplementedError(f"cp_cache ring attention does not support {name}={describe(a[name])} yet")
    if a["softmax_layout"]:
        raise NotImplementedError(
            f"cp_cache ring attention does not support softmax_layout={a['softmax_layout']!r} yet")
    mode, mask = a["sparse_mode"], a["atten_mask"]
    if mask is None:
        return MaskSpec()  # the op computes full attention (per document) whatever sparse_mode says
    if mode in CAUSAL_MODES and is_compressed_mask(mask):
        return MaskSpec(causal=True)
    raise NotImplementedError(
        f"cp_cache ring attention with input_layout='TND' supports full attention (no atten_mask) and causal "
        f"attention per document (sparse_mode {int(SparseMode.LEFT_UP_CAUSAL)} or "
        f"{int(SparseMode.RIGHT_DOWN_CAUSAL)} with the compressed 2048x2048 mask), not sparse_mode={mode} with "
        f"atten_mask={describe(mask)}")


def packed_documents(a: dict[str, Any]) -> tuple[int, ...]:
    """The global cumulative document ends; q and kv lengths must be the same documents."""
    for name in ("actual_seq_qlen", "actual_seq_kvlen"):
        if a[name] is None:
            raise ValueError(f"input_layout='TND' needs {name}: the global cumulative document ends (last = T)")
        if isinstance(a[name], DTensor):
            raise ValueError(f"{name} must be a plain tensor or list of the global cumulative ends, the same on "
                             f"every rank, not a DTensor ({describe(a[name])})")
    cu_q = cumulative_lengths(a["actual_seq_qlen"], "actual_seq_qlen")
    cu_kv = cumulative_lengths(a["actual_seq_kvlen"], "actual_seq_kvlen")
    if cu_q != cu_kv:
        raise ValueError(f"actual_seq_qlen={list(cu_q)} and actual_seq_kvlen={list(cu_kv)} differ; packed "
                         "self-attention under CP needs the same documents for queries and keys")
    return cu_q


def packed_sharding(tensors: dict[str, Any]) -> CPSharding:
    """Every tensor a DTensor Shard(0) on the same 1-D mesh: its one CP dimension."""
    mesh = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            raise TypeError(f"cp_cache ring attention needs {name} as a DTensor sharded on dimension 0 (T) of "
                            f"layout 'TND', got {type(tensor).__name__}")
        if tensor.device_mesh.ndim != 1:
            raise NotImplementedError(f"cp_cache ring attention needs a 1-D device mesh, {name} is on a "
                                      f"{tensor.device_mesh.ndim}-D mesh {tensor.device_mesh}")
        if tuple(tensor.placements) != _TND_PLACEMENTS:
            raise NotImplementedError(f"cp_cache ring attention needs {name} sharded as (Shard(0),) for layout "
                                      f"'TND', got placements={tuple(tensor.placements)}")
        if mesh is None:
            mesh = tensor.device_mesh
        elif tensor.device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {tensor.device_mesh}, query on {mesh}")
    return CPSharding(mesh, _TND_PLACEMENTS, cp_dims=(0,), head_shards=1)
