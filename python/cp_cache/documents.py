"""Packed documents (TND) under context parallelism: the cumulative lengths, the
per-document sharding layout, and the user helpers (docs/documents.md).

A packed sequence of T tokens holds documents given by their cumulative end offsets
``cu_seqlens`` (``actual_seq_qlen`` of the op: strictly increasing, the last = T). Over W
ranks:

* load balancing on (per-document head-tail): each document of length L is cut into 2W
  chunks of L/(2W); rank r holds, for each document in turn, its chunk r then its chunk
  2W-1-r. Every rank then holds T/W tokens and the same share of every document's causal
  work. Every L must divide by 2W (``pad_documents`` pads them up);
* load balancing off: contiguous T/W slices; documents may cross rank boundaries.

``document_positions`` is the one rule; the ring's per-step plan (``varlen``) and the
user helpers ``shard_documents`` / ``unshard_documents`` (``packing``) follow it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = [
    "cumulative_lengths",
    "check_lengths_tensor",
    "check_documents",
    "document_pieces",
    "document_positions",
]


def cumulative_lengths(value: Any, name: str = "cu_seqlens") -> tuple[int, ...]:
    """The cumulative end offsets given as ``name`` (a 1-D integer tensor, or a list of ints),
    checked to be strictly increasing and positive; ValueError naming the values otherwise."""
    if isinstance(value, Tensor):
        check_lengths_tensor(value, name)
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


def check_lengths_tensor(value: Tensor, name: str = "cu_seqlens") -> None:
    """What a tensor of cumulative document ends must be, from its shape and dtype alone (its
    values are not read: under fake tensors they are unknown): 1-D, integer, not empty."""
    if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor of cumulative document ends, got a tensor of "
                         f"shape {tuple(value.shape)} and dtype {value.dtype}")
    if value.size(0) == 0:
        raise ValueError(f"{name} is empty; it needs the cumulative end of every document (the last = T)")


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
