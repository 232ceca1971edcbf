"""Packed documents (TND) under context parallelism: the cumulative lengths, the
per-document sharding layout, and the user helpers (DESIGN.md section 10).

A packed sequence of T tokens holds documents given by their cumulative end offsets
``cu_seqlens`` (``actual_seq_qlen`` of the op: strictly increasing, the last = T). Over W
ranks:

* load balancing on (per-document head-tail): each document of length L is cut into 2W
  chunks of L/(2W); rank r holds, for each document in turn, its chunk r then its chunk
  2W-1-r. Every rank then holds T/W tokens and the same share of every document's causal
  work. Every L must divide by 2W (``pad_documents`` pads them up);
* load balancing off: contiguous T/W slices; documents may cross rank boundaries.

``document_positions`` is the one rule; the ring's per-step plan (``varlen``),
``shard_documents`` and ``unshard_documents`` all follow it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "cumulative_lengths",
    "check_documents",
    "document_pieces",
    "document_positions",
    "shard_documents",
    "unshard_documents",
    "pad_documents",
]


def cumulative_lengths(value: Any, name: str = "cu_seqlens") -> tuple[int, ...]:
    """The cumulative end offsets given as ``name`` (a 1-D integer tensor, or a list of ints),
    checked to be strictly increasing and positive; ValueError naming the values otherwise."""
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor of cumulative document ends, got a tensor of "
                             f"shape {tuple(value.shape)} and dtype {value.dtype}")
        ends = tuple(int(x) for x in value.tolist())
    elif isinstance(value, (list, tuple)):
        ends = tuple(int(x) for x in value)
    else:
        raise ValueError(f"{name} must be a 1-D integer tensor or a list of cumulative document ends, "
                         f"got {type(value).__name__}")
    if not ends:
        raise ValueError(f"{name} is empty; it needs the cumulative end of every document (the last = T)")
    previous = 0
    for i, end in enumerate(ends):
        if end <= previous:
            raise ValueError(f"{name}={list(ends)} must be strictly increasing cumulative document ends: entry {i} "
                             f"is {end} after {previous} (document {i} would have length {end - previous})")
        previous = end
    return ends


def check_documents(cu: Sequence[int], total: int, world_size: int, load_balance: bool,
                    name: str = "cu_seqlens") -> None:
    """ValueError unless the documents ``cu`` fill ``total`` tokens and (load balancing) every
    document length divides by 2W."""
    if cu[-1] != total:
        raise ValueError(f"{name}={list(cu)}: the document lengths sum to {cu[-1]}, but the global sequence has "
                         f"T={total} tokens")
    if load_balance:
        start = 0
        for doc, end in enumerate(cu):
            if (end - start) % (2 * world_size):
                raise ValueError(
                    f"document {doc} of {name} has length {end - start}, not divisible by 2*W = "
                    f"{2 * world_size}: per-document load balancing cuts every document into 2W equal chunks "
                    f"(cp_cache.pad_documents pads each document up to a multiple of {2 * world_size})")
            start = end
    elif total % world_size:
        raise ValueError(f"{name}={list(cu)}: the global sequence of T={total} tokens does not divide into "
                         f"W={world_size} contiguous slices")


def document_pieces(cu: Sequence[int], rank: int, world_size: int,
                    load_balance: bool) -> list[tuple[int, int, int, int]]:
    """The pieces of documents ``rank`` holds, in local order: (document, local start,
    global start, length). Under load balancing two pieces per document (chunks r and
    2W-1-r); without, the documents' overlaps with the contiguous slice r."""
    pieces = []
    if load_balance:
        local = start = 0
        for doc, end in enumerate(cu):
            c = (end - start) // (2 * world_size)
            pieces.append((doc, local, start + rank * c, c))
            pieces.append((doc, local + c, start + (2 * world_size - 1 - rank) * c, c))
            local += 2 * c
            start = end
        return pieces
    per_rank = cu[-1] // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    start = 0
    for doc, end in enumerate(cu):
        a, b = max(start, lo), min(end, hi)
        if a < b:
            pieces.append((doc, a - lo, a, b - a))
        start = end
    return pieces


def document_positions(cu: Sequence[int], rank: int, world_size: int, load_balance: bool) -> Tensor:
    """The global token positions ``rank`` holds, in local order (int64)."""
    pieces = document_pieces(cu, rank, world_size, load_balance)
    if not pieces:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(g, g + n) for _, _, g, n in pieces])


def _mesh_coordinates(mesh) -> tuple[int, int]:
    if mesh.ndim != 1:
        raise ValueError(f"packed documents are sharded over a 1-D mesh, got a {mesh.ndim}-D mesh {mesh}")
    return mesh.get_local_rank(), mesh.size()


def _load_balance(load_balance: Optional[bool]) -> bool:
    if load_balance is not None:
        return bool(load_balance)
    from .config import load_balance_enabled

    return load_balance_enabled()


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
