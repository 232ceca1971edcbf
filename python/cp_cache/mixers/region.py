"""The CP regions ``cp_cache.context_parallel()`` entered and not yet left: each one's mesh, the documents its buffers
were laid out by, and what it sharded (each buffer's sequence dim, local and global length), so that an attention
call can be checked against the shapes the region gave out. Also what the recurrent mixers and the guard read:
whether any CP region is entered (cp_cache's, or torch's with cp_cache enabled), the packed documents the running
model was called with, and the count of CP attention calls served (an attention module that never reached
cp_cache is told by it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ShardedBuffer", "Region", "ACTIVE", "active", "in_cp", "set_in_cp", "refuse_without_region",
           "note_call_documents", "call_documents", "buffer_seq_dims", "sharded_buffers", "check_mask_fits",
           "check_sequence_fits",
           "count_attention_call", "attention_calls"]


@dataclass(frozen=True)
class ShardedBuffer:
    index: int  # its place in ``buffers``
    seq_dim: int
    local: int  # this rank's length
    total: int  # the global length


@dataclass(frozen=True)
class Region:
    mesh: Any
    documents: Optional[tuple[tuple[int, ...], str]] = None  # (cumulative ends, placement) the buffers follow
    buffers: tuple[ShardedBuffer, ...] = ()
    algorithm: str = "ring"  # the configured CP algorithm, which also picks the recurrent mixers' form

    def fits(self, local: int, total: int) -> bool:
        return any(b.local == local and b.total == total for b in self.buffers)

    def describe_buffers(self) -> str:
        return "; ".join(f"buffers[{b.index}]: dim {b.seq_dim}, {b.total} tokens, {b.local} on this rank"
                         for b in self.buffers)


# innermost last
ACTIVE: list[Region] = []


def active() -> Optional[Region]:
    return ACTIVE[-1] if ACTIVE else None


_IN_CP = [False]  # inside a CP region, cp_cache's or torch's own (cp_cache enabled)


def in_cp() -> bool:
    return _IN_CP[0]


def set_in_cp(inside: bool) -> None:
    _IN_CP[0] = inside
    _CALL_DOCUMENTS[0] = None


# the packed documents (cumulative ends) the model running inside the region was called with: the mixers whose
# forward is not handed them (Mamba's) read them here
_CALL_DOCUMENTS: list = [None]


def note_call_documents(ends: Optional[tuple[int, ...]]) -> None:
    _CALL_DOCUMENTS[0] = ends


def call_documents() -> Optional[tuple[int, ...]]:
    return _CALL_DOCUMENTS[0]


def refuse_without_region(what: str) -> None:
    """Inside torch's own CP region cp_cache knows neither the mesh nor the layout a mixer needs."""
    if _IN_CP[0] and active() is None:
        raise RuntimeError(f"cp_cache: {what} inside a CP region entered through torch's context_parallel() alone: "
                           "enter it with cp_cache.context_parallel(mesh, buffers=[...]) so that the layer knows "
                           "its mesh and layout")


def buffer_seq_dims(buffers, seq_dims) -> list[int]:
    """Each buffer's sequence dim (non-negative); ValueError where their counts or sequence lengths disagree."""
    seq_dims = list(seq_dims) if seq_dims is not None else [0] * len(buffers)
    if len(seq_dims) != len(buffers):
        raise ValueError(f"context_parallel: buffer_seq_dims={seq_dims} must give one dimension for each of the "
                         f"{len(buffers)} buffers")
    for index, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        if not -buffer.dim() <= dim < buffer.dim():
            raise ValueError(f"context_parallel: buffer_seq_dims[{index}]={dim} is not a dimension of buffers[{index}] "
                             f"(shape {tuple(buffer.shape)})")
    seq_dims = [dim % buffer.dim() for buffer, dim in zip(buffers, seq_dims)]
    lengths = [buffer.size(dim) for buffer, dim in zip(buffers, seq_dims)]
    if len(set(lengths)) > 1:
        described = ", ".join(f"buffers[{i}] {tuple(b.shape)} dim {d}: {n}"
                              for i, (b, d, n) in enumerate(zip(buffers, seq_dims, lengths)))
        raise ValueError(f"context_parallel: the buffers' sequence lengths differ ({described}); every buffer is "
                         "sharded along the same sequence, so each buffer_seq_dims entry must name its sequence dim")
    return seq_dims


def sharded_buffers(buffers, seq_dims, world: int, local_lengths=None) -> tuple[ShardedBuffer, ...]:
    """The record of ``buffers`` before sharding: even shards unless ``local_lengths`` are given."""
    return tuple(ShardedBuffer(i, dim, b.size(dim) // world if local_lengths is None else local_lengths[i],
                               b.size(dim)) for i, (b, dim) in enumerate(zip(buffers, seq_dims)))


def check_mask_fits(mask: Any, keys: int, what: str) -> None:
    """ValueError where a mask's last dim is not the keys' global length: a mask made for this rank's shard."""
    if mask is not None and mask.size(-1) != keys:
        raise ValueError(f"{what} under context parallelism: attn_mask of shape {tuple(mask.shape)} covers "
                         f"{mask.size(-1)} keys, but the keys are {keys} tokens across the CP ranks: a mask made for "
                         "this rank's shard (transformers' 'sdpa' attention makes one for windows, packed documents "
                         "and padding); with transformers use attn_implementation='cp_cache', which passes the "
                         "mask's rule instead of a tensor")


def check_sequence_fits(tensors: dict[str, Any], seq_dim: int, what: str) -> None:
    """ValueError where a CP call's sequence (local and global length on ``seq_dim``) is none the region's buffers
    were sharded to: q/k/v taken along another dimension, or K/V left out of the buffers."""
    region = active()
    if region is None or not region.buffers:
        return
    for name, t in tensors.items():
        local, total = t._local_tensor.size(seq_dim), t.size(seq_dim)
        if isinstance(local, torch.SymInt) or isinstance(total, torch.SymInt) or region.fits(local, total):
            continue  # symbolic sizes (a traced call) are not compared: a guard would pin them
        whole = any(b.total == local for b in region.buffers)
        hint = ("it holds the whole sequence on every rank: compute it from the region's buffers, or pass the "
                "tensor it comes from among them" if whole else
                "was it taken along another dimension than the buffers' sequence dim (buffer_seq_dims), or left "
                "out of the buffers?")
        raise ValueError(f"{what} under context parallelism: {name} has {local} tokens on this rank on its sequence "
                         f"dim {seq_dim} ({total} in all), which fits none of the CP region's buffers "
                         f"({region.describe_buffers()}): {hint}")


_attention_calls = [0]


def count_attention_call() -> None:
    _attention_calls[0] += 1


def attention_calls() -> int:
    return _attention_calls[0]
