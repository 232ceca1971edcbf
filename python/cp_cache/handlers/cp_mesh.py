"""The context-parallel dimensions of a device mesh, and the algorithm that runs over them.

The CP dimensions are the mesh dimensions whose placement is
``Shard(seq)`` (one for the ring and Ulysses, two for hybrid: the outer one carries the
ring, the inner one Ulysses). Every other dimension passes through: ``Replicate``
(data parallel) or ``Shard(head)`` (tensor parallel: the local query has
head_num / (product of those dimensions' sizes) heads). Outputs and gradients keep the
input placements; the softmax statistics ``[B, N, S, 8]`` get ``Shard(2)`` where the
input has ``Shard(seq)`` and ``Shard(1)`` where it has ``Shard(head)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import layout as L
from ..plan import ALGORITHM_CP_DIMS, choose_algorithm

__all__ = ["CPSharding", "cp_sharding", "resolve_algorithm", "sequence_sharded", "whole_mask"]


@dataclass(frozen=True)
class CPSharding:
    """How q/k/v lie on their mesh: its CP dimensions (outer first) and the head split."""

    mesh: Any
    placements: tuple
    cp_dims: tuple[int, ...]
    head_shards: int  # product of the sizes of the Shard(head) dimensions (1: none)

    @property
    def cp_sizes(self) -> list[int]:
        """The sizes of the CP dimensions, outer first."""
        return [self.mesh.size(d) for d in self.cp_dims]

    @property
    def size(self) -> int:
        """Ranks over which the sequence is split."""
        return math.prod(self.cp_sizes)

    @property
    def rank(self) -> int:
        """This rank's sequence chunk: nested over the CP dimensions, outer first (DTensor's order)."""
        rank = 0
        for d in self.cp_dims:
            rank = rank * self.mesh.size(d) + self.mesh.get_local_rank(d)
        return rank

    def group(self, index: int):
        """The process group of CP dimension ``index`` (0: the outer one)."""
        return self.mesh.get_group(self.cp_dims[index])

    def local_heads(self, head_num: int) -> int:
        """The query head count on this rank (``head_num`` is the op's, over all heads)."""
        if head_num % self.head_shards:
            raise ValueError(
                f"head_num={head_num} is not divisible by the {self.head_shards} tensor-parallel head "
                f"shards of placements={self.placements}"
            )
        return head_num // self.head_shards

    def stats_placements(self, layout: str) -> tuple:
        seq, head = L.seq_dim(layout), L.head_dim_index(layout)
        stats_seq, stats_head = L.stats_dims(layout)
        out = []
        for p in self.placements:
            if p == Shard(seq):
                out.append(Shard(stats_seq))
            elif p == Shard(head):
                out.append(Shard(stats_head))
            else:
                out.append(Replicate())
        return tuple(out)


def sequence_sharded(query: Any, layout: Any) -> bool:
    """Whether ``query`` is a DTensor sharded on the sequence dimension of ``layout`` over some mesh
    dimension: a CP call. False for a plain tensor, an unknown layout, or placements without
    ``Shard(seq)`` (data or tensor parallel, replicated): calls cp_cache leaves to others."""
    if not isinstance(query, DTensor) or layout not in L.ALL_LAYOUTS:
        return False
    return Shard(L.seq_dim(layout)) in tuple(query.placements)


def cp_sharding(tensors: dict[str, Any], layout: str) -> CPSharding:
    """The CP sharding shared by the named DTensors (same mesh, same placements)."""
    seq, head = L.seq_dim(layout), L.head_dim_index(layout)
    mesh = placements = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            raise TypeError(
                f"cp_cache ring attention needs {name} as a DTensor sharded on the sequence "
                f"dimension {seq} of layout {layout!r}, got {type(tensor).__name__}"
            )
        if mesh is None:
            mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        elif tensor.device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {tensor.device_mesh}, query on {mesh}")
        elif tuple(tensor.placements) != placements:
            raise NotImplementedError(
                f"cp_cache CP attention needs q, k, v placed alike; query has {placements}, "
                f"{name} has {tuple(tensor.placements)}"
            )
    cp_dims = tuple(d for d, p in enumerate(placements) if p == Shard(seq))
    others = [p for p in placements if p != Shard(seq) and not isinstance(p, Replicate) and p != Shard(head)]
    if not cp_dims or others:
        raise NotImplementedError(
            f"cp_cache ring attention needs query sharded as (Shard({seq}),) for layout {layout!r} on "
            f"the CP mesh dimension(s), other mesh dimensions Replicate() or Shard({head}) (heads); "
            f"got placements={placements}"
        )
    head_shards = math.prod(mesh.size(d) for d, p in enumerate(placements) if p == Shard(head))
    return CPSharding(mesh, placements, cp_dims, head_shards)


def resolve_algorithm(configured: str, sharding: CPSharding, *, nq: int, nkv: int, given_mask: bool,
                      strict: bool = True, **shape: int) -> str:
    """The algorithm a call runs: the configured one, or for "auto" hybrid on two CP dimensions
    and ``plan.choose_algorithm`` on one (``shape``: batch, local_seq, head_dim, itemsize,
    v_head_dim).
    ``strict``: refuse an algorithm that cannot run on these CP dimensions (a backward does not:
    it runs what its forward ran, and reports a mesh that differs as a mismatch)."""
    count = len(sharding.cp_dims)
    if configured == "auto":
        configured = "hybrid" if count == 2 else choose_algorithm(nq=nq, nkv=nkv, world=sharding.size,
                                                                  given_mask=given_mask, **shape)
    needed = ALGORITHM_CP_DIMS[configured]
    if count != needed and strict:
        hint = "; use algorithm='hybrid' for two" if needed == 1 and count == 2 else ""
        raise NotImplementedError(
            f"cp_cache algorithm={configured!r} runs over {needed} mesh dimension(s) sharded on the "
            f"sequence; the query is sharded on the sequence over {count} (mesh dims {sharding.cp_dims}, "
            f"placements={sharding.placements}){hint}"
        )
    return configured


def whole_mask(mask: Any, query: DTensor, layout: str):
    """A given ``atten_mask`` over the whole sequence as a plain tensor, for Ulysses (which
    attends every query to every key in one call): a plain tensor or a replicated DTensor."""
    if isinstance(mask, DTensor):
        if not all(isinstance(p, Replicate) for p in mask.placements):
            raise NotImplementedError(
                f"cp_cache Ulysses attention takes atten_mask as a plain tensor or replicated, got a DTensor "
                f"with placements={tuple(mask.placements)}; use algorithm='ring' for a sharded mask"
            )
        mask = mask.to_local()
    seq = query.size(L.seq_dim(layout))
    if mask.dim() not in (2, 4) or tuple(mask.shape[-2:]) != (seq, seq):
        raise ValueError(
            f"atten_mask for sparse_mode 0/1 must be [S, S], [1, 1, S, S], [B, 1, S, S] or [B, N, S, S] "
            f"over the global sequence S={seq}, got <tensor of shape {tuple(mask.shape)}>"
        )
    return mask
