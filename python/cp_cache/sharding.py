"""Laying a full sequence out the way the CP handlers expect it, and back. One CP mesh dimension: with
load balancing (default: torch's option) rank r holds chunks r and 2W-1-r of 2W, else chunk r. Two (hybrid):
contiguous, (i, j) holding chunk i*W1 + j of W0*W1. Other mesh dimensions: ``Replicate()``."""

from __future__ import annotations

from typing import Optional, Sequence

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .documents import sequence_order
from .layout import load_balance_enabled

__all__ = ["shard_sequence", "unshard_sequence"]


def _cp_dims(mesh, cp_dims: Optional[Sequence[int]]) -> tuple[int, ...]:
    dims = tuple(range(mesh.ndim)) if cp_dims is None else tuple(cp_dims)
    if not 1 <= len(dims) <= 2 or any(not 0 <= d < mesh.ndim for d in dims) or len(set(dims)) != len(dims):
        raise ValueError(f"cp_dims={cp_dims} must name one or two distinct dimensions of the {mesh.ndim}-D mesh")
    return tuple(sorted(dims))


def _order(seq: int, mesh, cp_dims: tuple, load_balance: Optional[bool]) -> Optional[Tensor]:
    """The global positions in the order the ranks hold them, or None (contiguous)."""
    if load_balance is None:
        load_balance = load_balance_enabled() and len(cp_dims) == 1
    if not load_balance:
        return None
    if len(cp_dims) > 1:
        raise NotImplementedError("load balancing (head-tail) over two CP mesh dimensions (hybrid) is not "
                                  "supported; pass load_balance=False")
    world = math.prod(mesh.size(d) for d in cp_dims)
    if seq % (2 * world):
        raise ValueError(f"load balancing needs the sequence length {seq} divisible by 2*W = {2 * world}")
    return sequence_order(world, seq // world, True)


def shard_sequence(x: Tensor, mesh, seq_dim: int, *, cp_dims: Optional[Sequence[int]] = None,
                   load_balance: Optional[bool] = None) -> DTensor:
    """The full sequence ``x`` sharded on ``seq_dim`` over ``cp_dims`` (default: all), Replicate elsewhere."""
    dims = _cp_dims(mesh, cp_dims)
    order = _order(x.size(seq_dim), mesh, dims, load_balance)
    if order is not None:
        x = x.index_select(seq_dim, order.to(x.device))
    return distribute_tensor(x, mesh, [Shard(seq_dim) if d in dims else Replicate() for d in range(mesh.ndim)])


def unshard_sequence(x: DTensor, seq_dim: int, *, load_balance: Optional[bool] = None) -> Tensor:
    """The full sequence of a DTensor laid out by ``shard_sequence`` (same ``load_balance``)."""
    dims = tuple(d for d, p in enumerate(x.placements) if p == Shard(seq_dim))
    full = x.full_tensor()
    order = _order(full.size(seq_dim), x.device_mesh, dims, load_balance) if dims else None
    if order is None:
        return full
    return full.index_select(seq_dim, torch.argsort(order).to(full.device))
