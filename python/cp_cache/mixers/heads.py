"""The head all-to-all of the recurrent mixers (their Ulysses): ``[B, L_local, H, ...]`` sequence shards to
``[B, S, H/W, ...]`` head shards in sequence order and back, differentiable (the backward is the other way)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..engine.transport import exchange_heads
from .sequence import ShardedSequence

__all__ = ["by_heads", "to_heads", "to_sequence"]


def by_heads(algorithm: str, heads: int, world: int, what: str, auto: bool) -> bool:
    """Whether a mixer of ``heads`` heads runs in the head form: under "ulysses" (W must divide the heads), and
    under "auto" where ``auto`` (the kind's head form measured the better one: docs/hybrid.md) and W divides them;
    "ring" and "hybrid": the state form."""
    if algorithm == "ulysses" and heads % world:
        raise ValueError(f"cp_cache: algorithm='ulysses' shards {what}'s {heads} heads over W={world} ranks, which "
                         "needs W to divide them; use algorithm='ring' or 'auto'")
    return (algorithm == "ulysses" or algorithm == "auto" and auto) and heads % world == 0


@functools.lru_cache(maxsize=64)
def _orders(seq: ShardedSequence) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """(the rank-order row of each global position, its inverse, each rank's local length)."""
    lengths = [sum(c.length for c in seq.chunks if c.rank == r) for r in range(seq.world)]
    offsets = [sum(lengths[:r]) for r in range(seq.world)]
    order = torch.cat([torch.arange(c.length) + offsets[c.rank] + c.local for c in seq.chunks])
    return order, torch.argsort(order), tuple(lengths)


def _exchange(tensors: list[Tensor], seq: ShardedSequence, heads: bool) -> list[Tensor]:
    order, inverse, lengths = _orders(seq)
    if heads:  # [B, L, H, d] -> [B, H, L, d] -> [B, H/W, S (rank order), d] -> [B, S, H/W, d] in sequence order
        moved, _ = exchange_heads([t.transpose(1, 2) for t in tensors], seq.group, seq.world, True, list(lengths))
        return [t.transpose(1, 2)[:, order.to(t.device)] for t in moved]
    moved = [t[:, inverse.to(t.device)].transpose(1, 2) for t in tensors]
    back, _ = exchange_heads(moved, seq.group, seq.world, False, list(lengths))
    return [t.transpose(1, 2).contiguous() for t in back]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, seq: ShardedSequence, heads: bool, *tensors: Tensor):
        ctx.seq, ctx.heads = seq, heads
        return tuple(_exchange(list(tensors), seq, heads))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, None, *_exchange([g.contiguous() for g in grads], ctx.seq, not ctx.heads))


def to_heads(seq: ShardedSequence, tensors: list[Tensor]) -> list[Tensor]:
    if seq.world == 1:
        return tensors
    return list(_Exchange.apply(seq, True, *tensors))


def to_sequence(seq: ShardedSequence, tensor: Tensor) -> Tensor:
    if seq.world == 1:
        return tensor
    return _Exchange.apply(seq, False, tensor)[0]
