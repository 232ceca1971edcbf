"""The user helpers for packed documents under CP (docs/documents.md):
``shard_documents`` / ``unshard_documents`` lay out and gather back the per-document
head-tail (or contiguous) layout of ``documents.document_positions``; ``pad_documents``
pads every document up to a multiple of 2W. Exported as ``cp_cache.shard_documents`` etc.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .config import load_balance_enabled
from .documents import check_documents, cumulative_lengths, document_positions

__all__ = ["shard_documents", "unshard_documents", "pad_documents"]


def _mesh_coordinates(mesh) -> tuple[int, int]:
    if mesh.ndim != 1:
        raise ValueError(f"packed documents are sharded over a 1-D mesh, got a {mesh.ndim}-D mesh {mesh}")
    return mesh.get_local_rank(), mesh.size()


def _load_balance(load_balance: Optional[bool]) -> bool:
    return load_balance_enabled() if load_balance is None else bool(load_balance)


def shard_documents(tensor: Tensor, cu_seqlens: Any, mesh, dim: int = 0, *,
                    load_balance: Optional[bool] = None) -> Tensor:
    """This rank's shard of a packed full-sequence ``tensor`` (documents along ``dim``), in
    the layout the CP handlers expect: per-document head-tail under load balancing, else
    contiguous. ``load_balance`` defaults to torch's ``_cp_options.enable_load_balance``.
    Returns a plain tensor; ``DTensor.from_local(shard, mesh, [Shard(dim)])`` makes the
    op's input."""
    cu = cumulative_lengths(cu_seqlens)
    rank, world = _mesh_coordinates(mesh)
    lb = _load_balance(load_balance)
    check_documents(cu, tensor.size(dim), world, lb)
    return tensor.index_select(dim, document_positions(cu, rank, world, lb).to(tensor.device))


def unshard_documents(local: Tensor, cu_seqlens: Any, mesh, dim: int = 0, *,
                      load_balance: Optional[bool] = None) -> Tensor:
    """The full packed sequence from every rank's shard (``shard_documents``'s layout): an
    all-gather on the mesh's group, then each rank's tokens put back at their positions.
    A DTensor ``local`` is taken by its local tensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if isinstance(local, DTensor):
        local = local.to_local()
    cu = cumulative_lengths(cu_seqlens)
    rank, world = _mesh_coordinates(mesh)
    lb = _load_balance(load_balance)
    check_documents(cu, cu[-1], world, lb)
    if local.size(dim) * world != cu[-1]:
        raise ValueError(f"unshard_documents: the local shard has {local.size(dim)} tokens along dim {dim}; "
                         f"W={world} shards of it make {local.size(dim) * world}, but cu_seqlens ends at {cu[-1]}")
    if world == 1:
        shards = [local]
    else:
        shards = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(shards, local.contiguous(), group=mesh.get_group())
    shape = list(local.shape)
    shape[dim] = cu[-1]
    full = local.new_empty(shape)
    for r, shard in enumerate(shards):
        full.index_copy_(dim, document_positions(cu, r, world, lb).to(local.device), shard)
    return full


def pad_documents(tensor: Tensor, cu_seqlens: Any, multiple: int, dim: int = 0,
                  value: float = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Pad every document of a packed ``tensor`` at its end up to a multiple of ``multiple``
    (2W for per-document load balancing over W ranks). Returns ``(padded, cu_padded, real)``:
    the padded tensor, its cumulative ends (int64), and a bool mask over the padded tokens
    (True = an original token) to drop the padding from a loss.

    The padding sits at each document's end, so under causal attention no original token
    sees it; under full (non-causal) attention it would, so pad there only if that is
    intended (or mask the padded keys another way)."""
    if int(multiple) < 1:
        raise ValueError(f"pad_documents: multiple={multiple} must be a positive integer")
    cu = cumulative_lengths(cu_seqlens)
    if cu[-1] != tensor.size(dim):
        raise ValueError(f"pad_documents: cu_seqlens={list(cu)} ends at {cu[-1]}, but the tensor has "
                         f"{tensor.size(dim)} tokens along dim {dim}")
    parts, real, ends = [], [], []
    start = total = 0
    for end in cu:
        length = end - start
        padded = -(-length // multiple) * multiple
        parts.append(tensor.narrow(dim, start, length))
        if padded > length:
            shape = list(tensor.shape)
            shape[dim] = padded - length
            parts.append(tensor.new_full(shape, value))
        real += [True] * length + [False] * (padded - length)
        total += padded
        ends.append(total)
        start = end
    return (torch.cat(parts, dim), torch.tensor(ends, dtype=torch.int64),
            torch.tensor(real, dtype=torch.bool, device=tensor.device))
