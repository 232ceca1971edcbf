"""The user helpers for packed documents under CP (docs/documents.md). Unless given, the placement is
the one the packed handlers use (``config.document_placement`` under torch's load balancing, contiguous
without) and the capacity is the configured one; a 2-D mesh (hybrid) takes no capacity yet."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .config import document_capacity_from_env, document_placement, documents_from_env
from .dispatch import active_config
from .layout import load_balance_enabled
from .documents import (capacity_positions, check_capacity, check_capacity_fits, check_documents, cumulative_lengths,
                        document_positions, local_lengths, mesh_sizes, placement_order, placement_positions)
from .placement import check_placement

__all__ = ["document_layout", "shard_documents", "unshard_documents", "pad_documents"]


def _mesh_coordinates(mesh) -> tuple[int, tuple[int, ...]]:
    if mesh.ndim not in (1, 2):
        raise ValueError(f"packed documents are sharded over a 1-D mesh, or a 2-D one whose dimensions both carry "
                         f"the sequence (hybrid), got a {mesh.ndim}-D mesh {mesh}")
    if mesh.ndim == 1:
        return mesh.get_local_rank(), (mesh.size(),)
    sizes = (mesh.size(0), mesh.size(1))
    return mesh.get_local_rank(0) * sizes[1] + mesh.get_local_rank(1), sizes


def configured_placement(placement: Optional[str], load_balance: Optional[bool]) -> str:
    """``placement``, else the configured one under load balancing (None: torch's option), else contiguous."""
    if placement is not None:
        return check_placement(placement)
    config = active_config()
    return document_placement(config.documents if config is not None else documents_from_env(),
                              load_balance_enabled() if load_balance is None else load_balance)


def _capacity(capacity: Optional[int], sizes: tuple[int, ...] = (1,)) -> Optional[int]:
    """``capacity`` when given, else the configured one; ValueError for one on a 2-D mesh (``sizes``)."""
    if capacity is None:
        config = active_config()
        capacity = config.document_capacity if config is not None else document_capacity_from_env()
    capacity = check_capacity(capacity)
    if capacity is not None and len(sizes) == 2:
        raise ValueError(f"document capacity={capacity} lays packed documents out over a 1-D mesh; the 2-D (hybrid) "
                         f"layout over {sizes[0]}x{sizes[1]} ranks takes none yet (enable(document_capacity=None))")
    return capacity


def document_layout(cu_seqlens: Any, world, *, placement: Optional[str] = None,
                    load_balance: Optional[bool] = None, capacity: Optional[int] = None) -> list[Tensor]:
    """Each rank's int64 global positions, in local order, of the documents ending at ``cu_seqlens``. ``world``:
    W, or (W0, W1) for a 2-D CP mesh (rank i*W1 + j). ``placement``: "balanced", "head_tail" or "contiguous";
    None: as the handlers place them. ``capacity``: rows per rank (1-D only), the placed positions, then the
    padding's (T.. of a W x capacity sequence, rank 0's first). The same on every rank."""
    cu = cumulative_lengths(cu_seqlens)
    sizes = mesh_sizes(world)
    chosen, rows = configured_placement(placement, load_balance), _capacity(capacity, sizes)
    check_documents(cu, cu[-1], sizes, chosen)
    if rows is not None:
        return capacity_positions(cu, sizes[0], chosen, rows)
    return placement_positions(cu, sizes, chosen)


def shard_documents(tensor: Tensor, cu_seqlens: Any, mesh, dim: int = 0, *, load_balance: Optional[bool] = None,
                    placement: Optional[str] = None, capacity: Optional[int] = None) -> Tensor:
    """This rank's shard (a plain tensor) of a packed full-sequence ``tensor`` (documents along ``dim``) by
    ``document_layout``. Lengths may differ between ranks: ``DTensor.from_local(shard, mesh, [Shard(dim)] *
    mesh.ndim, shape=tensor.shape, stride=tensor.stride())`` makes the op's input. With a capacity every shard
    has ``capacity`` rows; ``tensor`` holds T tokens (zero padding) or W x capacity rows (rows T.. the padding)."""
    cu = cumulative_lengths(cu_seqlens)
    rank, sizes = _mesh_coordinates(mesh)
    chosen, rows = configured_placement(placement, load_balance), _capacity(capacity, sizes)
    if rows is None:
        check_documents(cu, tensor.size(dim), sizes, chosen)
        return tensor.index_select(dim, document_positions(cu, rank, sizes, chosen).to(tensor.device))
    world = sizes[0]
    check_documents(cu, cu[-1], world, chosen)
    if tensor.size(dim) not in (cu[-1], world * rows):
        raise ValueError(f"shard_documents: capacity={rows} over W={world} ranks takes a tensor of T={cu[-1]} "
                         f"tokens (cu_seqlens={list(cu)}) or W x capacity = {world * rows} rows along dim {dim}, "
                         f"got {tensor.size(dim)}")
    positions = capacity_positions(cu, world, chosen, rows)[rank].to(tensor.device)
    if tensor.size(dim) == cu[-1]:
        padding = [0] * (2 * (tensor.dim() - 1 - dim)) + [0, world * rows - cu[-1]]
        tensor = torch.nn.functional.pad(tensor, padding)
    return tensor.index_select(dim, positions)


def unshard_documents(local: Tensor, cu_seqlens: Any, mesh, dim: int = 0, *, load_balance: Optional[bool] = None,
                      placement: Optional[str] = None, capacity: Optional[int] = None) -> Tensor:
    """Every rank's shard (or DTensor) of ``shard_documents`` all-gathered into the T tokens, padding dropped."""
    from torch.distributed.tensor import DTensor
    if isinstance(local, DTensor):
        local = local.to_local()
    cu = cumulative_lengths(cu_seqlens)
    rank, world = _mesh_coordinates(mesh)
    chosen, rows = configured_placement(placement, load_balance), _capacity(capacity, world)
    check_documents(cu, cu[-1], world, chosen)
    held = local_lengths(cu, world, chosen) if rows is None else check_capacity_fits(cu, world[0], chosen, rows)
    expected = held[rank] if rows is None else rows
    if local.size(dim) != expected:
        given = f"placement {chosen!r}" if rows is None else f"capacity={rows} with placement {chosen!r}"
        raise ValueError(f"unshard_documents: the local shard has {local.size(dim)} tokens along dim {dim}, but "
                         f"{given} of cu_seqlens={list(cu)} gives rank {rank} {expected} rows")
    if rows is not None:
        local = local.narrow(dim, 0, held[rank])
    order = placement_order(cu, world, chosen).argsort().to(local.device)  # the gathered row of each position
    return torch.cat(_all_gather_uneven(local, dim, held, mesh), dim).index_select(dim, order)


def _all_gather_uneven(local: Tensor, dim: int, held: list[int], mesh) -> list[Tensor]:
    """All-gathers of the shards padded to the longest, the inner mesh dimension first (rank i*W1 + j)."""
    import torch.distributed as dist
    if len(held) == 1:
        return [local]
    longest = max(held)
    padded = local.new_zeros(list(local.shape[:dim]) + [longest] + list(local.shape[dim + 1:]))
    padded.narrow(dim, 0, local.size(dim)).copy_(local)
    shape = padded.shape
    for mesh_dim in reversed(range(mesh.ndim)):
        parts = [torch.empty_like(padded) for _ in range(mesh.size(mesh_dim))]
        dist.all_gather(parts, padded, group=mesh.get_group(mesh_dim))
        padded = torch.stack(parts)
    return [g.narrow(dim, 0, n) for g, n in zip(padded.reshape(len(held), *shape), held)]


def pad_documents(tensor: Tensor, cu_seqlens: Any, multiple: int, dim: int = 0,
                  value: float = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Pad every document at its end up to a multiple of ``multiple`` (2W for "head_tail"). Returns ``(padded,
    cu_padded, real)``: int64 cumulative ends and a bool mask, True = an original token (to drop the padding from
    a loss). Causal attention never lets an original token see the padding; full attention does."""
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
