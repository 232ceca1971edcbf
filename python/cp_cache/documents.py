"""Packed documents under CP: which positions each rank holds, the fixed-shape capacity, and the
checks of an op's documents (docs/documents.md). On a 2-D CP mesh (hybrid: Ulysses inner, ring outer)
``world`` is (W0, W1): the documents are placed over W0 and each share is cut into W1 contiguous slices;
rank i*W1 + j holds slice j of share i, so Ulysses' all-to-all gathers share i whole, in ring order."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from .placement import BALANCED, CONTIGUOUS, PLACEMENTS, Piece, check_placeable, placement_pieces, sequence_pieces

__all__ = ["cumulative_lengths", "check_lengths_tensor", "check_documents", "document_pieces", "document_positions",
           "sequence_positions", "sequence_order", "placement_positions", "placement_order", "mesh_sizes",
           "local_lengths", "check_local_length", "check_capacity", "check_capacity_fits", "check_capacity_rows",
           "capacity_positions", "same_documents", "check_packed_tokens", "read_documents"]


def cumulative_lengths(value: Any, name: str = "cu_seqlens") -> tuple[int, ...]:
    if isinstance(value, Tensor):
        check_lengths_tensor(value, name)
        value = value.tolist()
    elif not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a 1-D integer tensor or a list of cumulative document ends, "
                         f"got {type(value).__name__}")
    ends = tuple(int(x) for x in value)
    if not ends:
        raise ValueError(f"{name} is empty; it needs the cumulative end of every document (the last = T)")
    for i, (previous, end) in enumerate(zip((0,) + ends, ends)):
        if end <= previous:
            raise ValueError(f"{name}={list(ends)} must be strictly increasing cumulative document ends: entry {i} "
                             f"is {end} after {previous} (document {i} would have length {end - previous})")
    return ends


def check_lengths_tensor(value: Tensor, name: str = "cu_seqlens") -> None:
    """1-D, integer, not empty: checked from shape and dtype alone (fake tensors have no values)."""
    if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor of cumulative document ends, got a tensor of "
                         f"shape {tuple(value.shape)} and dtype {value.dtype}")
    if value.size(0) == 0:
        raise ValueError(f"{name} is empty; it needs the cumulative end of every document (the last = T)")


World = Union[int, Sequence[int]]  # W ranks, or the sizes (W0, W1) of a two-dimensional CP mesh


def mesh_sizes(world: World) -> tuple[int, ...]:
    sizes = (int(world),) if isinstance(world, int) else tuple(int(s) for s in world)
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise ValueError(f"world={world!r}: packed documents lie over W ranks (an int >= 1) or a two-dimensional "
                         "CP mesh (W0, W1), outer first")
    return sizes


def _slices(length: int, parts: int) -> list[tuple[int, int]]:
    return [(j * length // parts, (j + 1) * length // parts) for j in range(parts)]


def check_documents(cu: Sequence[int], total: int, world_size: World, placement: str,
                    name: str = "cu_seqlens") -> None:
    """On a (W0, W1) mesh: placed over W0, each share holding at least W1 tokens."""
    if cu[-1] != total:
        raise ValueError(f"{name}={list(cu)}: the document lengths sum to {cu[-1]}, but the global sequence has "
                         f"T={total} tokens")
    sizes = mesh_sizes(world_size)
    check_placeable(cu, sizes[0], placement, name)
    if len(sizes) == 2:
        shares = local_lengths(cu, sizes[0], placement)
        if min(shares) < sizes[1]:
            raise ValueError(f"{name}={list(cu)}: placement {placement!r} over the {sizes[0]} outer positions of "
                             f"a {sizes[0]}x{sizes[1]} CP mesh gives them {shares} tokens; each is cut over "
                             f"{sizes[1]} inner ranks and needs at least {sizes[1]}")


def document_pieces(cu: Sequence[int], rank: int, world_size: int,
                    placement: str) -> list[tuple[int, int, int, int]]:
    """(document, local start, global start, length) of the pieces ``rank`` holds, in local order."""
    if not isinstance(placement, str):
        raise TypeError(f"placement={placement!r}: give a placement name, one of {PLACEMENTS}")
    return [(p.document, p.local, p.start, p.length) for p in placement_pieces(cu, world_size, placement)[rank]]


def document_positions(cu: Sequence[int], rank: int, world_size: World, placement: str) -> Tensor:
    sizes = mesh_sizes(world_size)
    inner = math.prod(sizes[1:])
    share = _positions(placement_pieces(cu, sizes[0], placement)[rank // inner])
    start, stop = _slices(share.numel(), inner)[rank % inner]
    return share[start:stop]


def sequence_positions(rank: int, world_size: int, local_length: int, load_balance: bool) -> Tensor:
    return _positions(sequence_pieces(rank, world_size, local_length, load_balance))


def sequence_order(world_size: int, local_length: int, load_balance: bool) -> Tensor:
    """The global position of each row of the ranks' shards laid end to end in rank order."""
    return torch.cat([sequence_positions(r, world_size, local_length, load_balance) for r in range(world_size)])


def _positions(pieces: Sequence[Piece]) -> Tensor:
    if not pieces:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(p.start, p.start + p.length) for p in pieces])


def placement_positions(cu: Sequence[int], world_size: World, placement: str) -> list[Tensor]:
    return [document_positions(cu, r, world_size, placement) for r in range(math.prod(mesh_sizes(world_size)))]


@functools.lru_cache(maxsize=16)  # the same documents in every layer of a step; callers only read it
def placement_order(cu: tuple[int, ...], world_size: World, placement: str) -> Tensor:
    """``sequence_order`` of packed documents."""
    return torch.cat(placement_positions(cu, world_size, placement))


def check_local_length(cu: Sequence[int], world_size: World, placement: str, rank: int, local_rows: int,
                       name: str = "actual_seq_qlen") -> None:
    held = local_lengths(cu, world_size, placement)[rank]
    if local_rows != held:
        sizes = mesh_sizes(world_size)
        where = (f"W={sizes[0]} ranks" if len(sizes) == 1
                 else f"a {sizes[0]}x{sizes[1]} CP mesh (placed over its {sizes[0]} outer positions)")
        raise ValueError(f"rank {rank} holds {local_rows} local tokens, but placement {placement!r} of "
                         f"{name}={list(cu)} over {where} gives it {held} "
                         "(cp_cache.document_layout; cp_cache.shard_documents lays a tensor out by it)")


def local_lengths(cu: Sequence[int], world_size: World, placement: str) -> list[int]:
    sizes = mesh_sizes(world_size)
    shares = [sum(p.length for p in pieces) for pieces in placement_pieces(cu, sizes[0], placement)]
    return [stop - start for share in shares for start, stop in _slices(share, math.prod(sizes[1:]))]


def check_capacity(capacity: Any, name: str = "capacity") -> Optional[int]:
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"{name}={capacity!r} must be a positive integer (the rows every rank holds) or None")
    return capacity


def check_capacity_fits(cu: Sequence[int], world_size: int, placement: str, capacity: int,
                        name: str = "cu_seqlens", what: str = "capacity") -> list[int]:
    held = local_lengths(cu, world_size, placement)
    over = [rank for rank, n in enumerate(held) if n > capacity]
    if over:
        raise ValueError(f"{what}={capacity} is smaller than rank {over[0]}'s {held[over[0]]} tokens under placement "
                         f"{placement!r} of {name}={list(cu)} over W={world_size} ranks; the least capacity for "
                         f"these documents is {max(held)}")
    return held


def check_capacity_rows(plan, *local_rows: int) -> list[int]:
    """Each rank's placed tokens, checked to fit in the plan's capacity; ``local_rows`` must equal it."""
    for rows in local_rows:
        if rows != plan.capacity:
            raise ValueError(f"rank {plan.rank} holds {rows} local tokens, but document_capacity={plan.capacity} "
                             f"gives every rank {plan.capacity} rows")
    return check_capacity_fits(plan.documents, plan.world_size, plan.document_placement, plan.capacity,
                               "actual_seq_qlen", "document_capacity")


def capacity_positions(cu: Sequence[int], world_size: int, placement: str, capacity: int) -> list[Tensor]:
    """Per rank: its placed tokens' positions, then its padding's (T.., rank 0's first)."""
    held = check_capacity_fits(cu, world_size, placement, capacity)
    positions, padding = [], cu[-1]
    for real, n in zip(placement_positions(cu, world_size, placement), held):
        positions.append(torch.cat([real, torch.arange(padding, padding + capacity - n)]))
        padding += capacity - n
    return positions


def same_documents(qlen: Any, kvlen: Any) -> tuple[int, ...]:
    """The documents of ``actual_seq_qlen`` (a host read), checked equal to ``actual_seq_kvlen``'s."""
    cu_q = cumulative_lengths(qlen, "actual_seq_qlen")
    cu_kv = cumulative_lengths(kvlen, "actual_seq_kvlen")
    if cu_q != cu_kv:
        raise ValueError(f"actual_seq_qlen={list(cu_q)} and actual_seq_kvlen={list(cu_kv)} differ; packed "
                         "self-attention under CP needs the same documents for queries and keys")
    return cu_q


def check_packed_tokens(plan, total: int) -> None:
    """Unknown documents: contiguous slices need T divisible by W0; with a capacity, T = W x capacity."""
    if plan.capacity is not None:
        if total != plan.world_size * plan.capacity:
            raise ValueError(f"document_capacity={plan.capacity} gives each of W={plan.world_size} ranks "
                             f"{plan.capacity} rows, a global sequence of {plan.world_size * plan.capacity}; the "
                             f"query has {total} (cp_cache.shard_documents(..., capacity=...) lays a tensor out)")
        if plan.documents:
            check_capacity_rows(plan)
        return
    if plan.documents:
        check_documents(plan.documents, total, plan.document_mesh, plan.document_placement, name="actual_seq_qlen")
    elif plan.document_placement == CONTIGUOUS and total % plan.document_mesh[0]:
        raise ValueError(f"input_layout='TND' without load balancing cuts the global sequence into W="
                         f"{plan.document_mesh[0]} equal slices: its T={total} tokens do not divide by W")


def read_documents(plan, qlen: Optional[Tensor], kvlen: Optional[Tensor], local_rows: int):
    """``plan`` with its documents read on the host and checked; never while tracing (a graph keeps no values)."""
    plan = replace(plan, documents=same_documents(qlen, kvlen))
    placement, mesh = plan.document_placement, plan.document_mesh
    if plan.capacity is not None:  # even shards of capacity rows, the placed tokens first
        check_capacity_rows(plan, local_rows)
        return plan
    if placement != BALANCED and len(mesh) == 1:  # even shards: T = W * local rows
        check_packed_tokens(plan, local_rows * plan.world_size)
    check_documents(plan.documents, plan.documents[-1], mesh, placement, name="actual_seq_qlen")
    check_local_length(plan.documents, mesh, placement, plan.rank, local_rows)
    return plan
