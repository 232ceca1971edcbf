"""What the CP handlers accept: the mask arguments and the DTensor sharding of their inputs."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import layout as L
from ..arguments import describe
from ..npu_ops import CAUSAL_MODES, INT_MAX, SparseMode, is_compressed_mask
from ..plan import MaskSpec

__all__ = ["mask_spec", "local_mask_rows", "sharded_like", "local_tensor", "local_sink", "sink_grad_like"]

_UNSUPPORTED_WHEN_SET = ("pse", "padding_mask", "prefix", "actual_seq_qlen", "actual_seq_kvlen")
_GIVEN_MASK_MODES = (SparseMode.MASK, SparseMode.ALL_MASK)
_SUPPORTED_MODES = _GIVEN_MASK_MODES + CAUSAL_MODES + (SparseMode.BAND,)


def mask_spec(a: dict[str, Any]) -> MaskSpec:
    """The attention mask the bound arguments ask for, on global positions; anything
    unsupported raises NotImplementedError naming the argument and its value."""
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
    if mode not in _SUPPORTED_MODES:
        raise NotImplementedError(
            f"cp_cache ring attention supports sparse_mode 0, 1 (a given mask, or none: full "
            f"attention), 2, 3 (compressed causal mask) and 4 (band), not sparse_mode={mode}"
        )
    if mask is None:
        return MaskSpec()  # the op computes full attention whatever sparse_mode says
    if mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"atten_mask must be bool or uint8 (1 = masked out), got {describe(mask)}")
    if mode in CAUSAL_MODES + (SparseMode.BAND,):
        if not is_compressed_mask(mask):
            raise NotImplementedError(
                f"cp_cache ring attention with sparse_mode={mode} needs the compressed 2048x2048 "
                f"mask, got atten_mask={describe(mask)}"
            )
        if mode == SparseMode.BAND:
            return MaskSpec(window=True, pre_tockens=int(a["pre_tockens"]), next_tockens=int(a["next_tockens"]))
        return MaskSpec(causal=True)
    band = mode == SparseMode.MASK and (a["pre_tockens"] < INT_MAX or a["next_tockens"] < INT_MAX)
    return MaskSpec(given=True, window=band, pre_tockens=int(a["pre_tockens"]) if band else INT_MAX,
                    next_tockens=int(a["next_tockens"]) if band else INT_MAX)


def local_mask_rows(mask: Any, query: DTensor, layout: str, positions: Tensor) -> Tensor:
    """The given mask's rows of the local queries, in local order, over the whole sequence.

    ``mask``: [S, S], [1, 1, S, S], [B, 1, S, S] or [B, N, S, S] for the global sequence,
    a plain tensor or a replicated DTensor (rows picked at ``positions``), or a DTensor
    sharded on its query dimension like the query (its local rows as they are).
    """
    seq = query.size(L.seq_dim(layout))
    if mask.dim() not in (2, 4) or mask.shape[-1] != seq:
        raise ValueError(
            f"atten_mask for sparse_mode 0/1 must be [S, S], [1, 1, S, S], [B, 1, S, S] or [B, N, S, S] "
            f"over the global sequence S={seq}, got {describe(mask)}"
        )
    if isinstance(mask, DTensor):
        placements = tuple(mask.placements)
        if all(isinstance(p, Replicate) for p in placements):
            mask = mask.to_local()
        elif placements == (Shard(mask.dim() - 2),):
            # the local row count is checked by the ring after the ranks agree on its shape
            # (it can differ between ranks, and a refusal must come on every rank)
            return mask.to_local()
        else:
            raise NotImplementedError(
                f"cp_cache ring attention takes atten_mask replicated or sharded on its query "
                f"dimension (Shard({mask.dim() - 2})), got placements={placements}"
            )
    if mask.shape[-2] != seq:
        raise ValueError(f"atten_mask must be square over the global sequence S={seq}, got {describe(mask)}")
    return mask.index_select(mask.dim() - 2, positions.to(mask.device))


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


def local_sink(sink: Any, head_num: int, mesh, head_shards: int) -> Optional[Tensor]:
    """The attention sinks of the call as this rank's tensor [head_num] (None without): a plain
    floating tensor, or a DTensor replicated on the query's mesh. ``head_num``: the op's."""
    if sink is None:
        return None
    if not isinstance(sink, Tensor) or not sink.dtype.is_floating_point or tuple(sink.shape) != (head_num,):
        raise ValueError(f"sink must be a floating tensor of shape [head_num] = [{head_num}] (one logit per query "
                         f"head), got sink={describe(sink)}")
    if head_shards > 1:
        raise NotImplementedError(f"cp_cache ring attention does not support sink={describe(sink)} with the heads "
                                  f"split over {head_shards} tensor-parallel shards yet")
    if isinstance(sink, DTensor):
        if sink.device_mesh != mesh or not all(isinstance(p, Replicate) for p in sink.placements):
            raise NotImplementedError(f"cp_cache ring attention takes sink as a plain tensor or a DTensor replicated "
                                      f"on the query's mesh, got placements={tuple(sink.placements)} on "
                                      f"{sink.device_mesh}")
        return sink.to_local()
    return sink


def sink_grad_like(sink: Any, dsink: Tensor, cp_dims: tuple[int, ...]) -> Tensor:
    """The sink's gradient as its argument came: this rank's share as it is for a plain tensor;
    for a replicated DTensor, a DTensor ``Partial`` on the CP dimensions (the ranks' shares sum to
    the gradient) and replicated on the others (their ranks computed the same rows)."""
    if not isinstance(sink, DTensor):
        return dsink
    mesh = sink.device_mesh
    placements = [Partial() if dim in cp_dims else Replicate() for dim in range(mesh.ndim)]
    return DTensor.from_local(dsink, mesh, placements, shape=sink.shape, stride=sink.stride())
