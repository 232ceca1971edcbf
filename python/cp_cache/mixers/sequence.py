"""A sequence sharded over the CP ranks as the recurrent mixers see it (DESIGN §20): the runs of consecutive positions
each rank holds (its chunks) in sequence order, the document pieces inside each, and what crosses ranks:

- ``gather``: one small tensor per chunk from every rank (autograd: the gradient goes back to its owner);
- ``chain``: the chunks' state summaries (transition, contribution) combined in sequence order into the state
  entering each of this rank's chunks; a chunk that starts a document starts from zero;
- ``left_context``: the last tokens before each of this rank's chunks (same document only), for a causal conv.

Host data only: positions come from the region's layout, documents from the call (never read off a device)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import layout as L
from ..documents import document_positions, sequence_positions
from . import region

__all__ = ["Chunk", "ShardedSequence", "current", "sharded_sequence", "gather", "chain", "by_state", "left_context",
           "piece_starts", "document_ends", "lengths_of", "document_lengths"]


@dataclass(frozen=True)
class Chunk:
    rank: int
    index: int  # among its rank's chunks, in local order
    local: int  # its first row in its rank's local tensor
    start: int  # its first global position
    pieces: tuple[int, ...]  # lengths of its document pieces: a document starts with each piece after the first
    continues: bool  # the token before it is of the same document: its state and left context come from there

    @property
    def length(self) -> int:
        return sum(self.pieces)

    @property
    def passes(self) -> bool:
        """Its outgoing state depends on its incoming one (no document starts inside it)."""
        return self.continues and len(self.pieces) == 1


@dataclass(frozen=True)
class ShardedSequence:
    world: int
    rank: int
    chunks: tuple[Chunk, ...]  # every rank's, in sequence order
    per_rank: int  # the most chunks a rank holds
    group: Any

    @functools.cached_property
    def mine(self) -> tuple[Chunk, ...]:
        return tuple(sorted((c for c in self.chunks if c.rank == self.rank), key=lambda c: c.local))

    @functools.cached_property
    def order(self) -> dict[tuple[int, int], int]:
        """(rank, index) -> place in sequence order."""
        return {(c.rank, c.index): i for i, c in enumerate(self.chunks)}


def current(local_length: int, ends: Optional[Sequence[int]] = None) -> Optional[ShardedSequence]:
    """The active CP region's sequence of ``local_length`` local tokens, with the documents ending at ``ends``
    (global cumulative ends, as the call's ``cu_seq_lens_q``; else those the model was called with, else the
    region's own, else one document)."""
    here = region.active()
    if here is None:
        return None
    mesh = here.mesh
    if mesh.ndim != 1:
        raise NotImplementedError(f"cp_cache: sequence mixers under a {mesh.ndim}-D CP mesh ({mesh}) are not "
                                  "supported; use a 1-D CP mesh")
    placed = here.documents
    ends = ends or region.call_documents()
    return sharded_sequence(mesh.size(), mesh.get_local_rank(), local_length, L.load_balance_enabled(),
                            placed, None if ends is None else tuple(ends), mesh.get_group())


_LAST_READ: list = [None, None, None]  # the last cumulative lengths read off a tensor: (tensor, version, ends)


def document_ends(cumulative: Any) -> Optional[tuple[int, ...]]:
    """The cumulative document ends a packed batch gives (``cu_seq_lens_q``: a leading 0, a list or a CPU
    tensor), without the 0; None: none given. Every layer of a forward passes the same tensor: read once."""
    if cumulative is None:
        return None
    if isinstance(cumulative, Tensor):
        if _LAST_READ[0] is cumulative and _LAST_READ[1] == cumulative._version:
            return _LAST_READ[2]
        ends = tuple(int(e) for e in cumulative.tolist() if int(e) > 0)  # host data by contract (DESIGN §10)
        _LAST_READ[:] = [cumulative, cumulative._version, ends]
        return ends
    return tuple(int(e) for e in cumulative if int(e) > 0)


def lengths_of(ends: Sequence[int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip((0, *ends[:-1]), ends))


@functools.lru_cache(maxsize=64)
def sharded_sequence(world: int, rank: int, local_length: int, load_balance: bool,
                     placed: Optional[tuple[tuple[int, ...], str]], ends: Optional[tuple[int, ...]],
                     group: Any) -> ShardedSequence:
    if placed is not None:
        positions = [document_positions(placed[0], r, world, placed[1]) for r in range(world)]
        ends = ends or placed[0]
    else:
        positions = [sequence_positions(r, world, local_length, load_balance) for r in range(world)]
    total = sum(p.numel() for p in positions)
    ends = ends or (total,)
    if ends[-1] != total:
        raise ValueError(f"cp_cache: the documents end at {list(ends)}, but the sequence sharded over the CP ranks "
                         f"has {total} tokens")
    if positions[rank].numel() != local_length:
        raise ValueError(f"cp_cache: this rank holds {local_length} tokens, but the CP region's layout gives it "
                         f"{positions[rank].numel()}: are the mixer's inputs the region's shards?")
    chunks = sorted((c for r in range(world) for c in _chunks(r, positions[r].tolist(), ends)),
                    key=lambda c: c.start)
    per_rank = max(sum(c.rank == r for c in chunks) for r in range(world))
    return ShardedSequence(world, rank, tuple(chunks), max(per_rank, 1), group)


def _chunks(rank: int, held: list[int], ends: tuple[int, ...]) -> list[Chunk]:
    starts = set((0,) + tuple(ends[:-1]))
    chunks, first = [], 0
    for i in range(1, len(held) + 1):
        if i < len(held) and held[i] == held[i - 1] + 1:
            continue
        span = held[first:i]
        cuts = [j for j, p in enumerate(span) if p in starts and j > 0] + [len(span)]
        pieces = tuple(b - a for a, b in zip([0] + cuts[:-1], cuts))
        chunks.append(Chunk(rank, len(chunks), first, span[0], pieces, span[0] not in starts))
        first = i
    return chunks


def document_lengths(seq: ShardedSequence) -> list[int]:
    """The lengths of the documents of the whole sequence, in order."""
    lengths = []
    for chunk in seq.chunks:
        pieces = list(chunk.pieces)
        if chunk.continues and lengths:
            lengths[-1] += pieces.pop(0)
        lengths += pieces
    return lengths


def piece_starts(lengths: Sequence[int]) -> tuple[int, ...]:
    """Where each run after the first starts, runs of ``lengths`` laid end to end (a chunk's document pieces)."""
    return tuple(itertools.accumulate(lengths[:-1]))


class _Gather(torch.autograd.Function):
    """[per_rank, ...] on every rank -> [world, per_rank, ...]; backward: each rank's part of the summed gradient."""

    @staticmethod
    def forward(ctx, local: Tensor, group: Any, world: int, rank: int) -> Tensor:
        out = local.new_empty((world * local.size(0), *local.shape[1:]))
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        ctx.group, ctx.rank = group, rank
        return out.view(world, *local.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def gather(seq: ShardedSequence, per_chunk: list[Tensor]) -> tuple[list[Tensor], Tensor]:
    """(every chunk's tensor in sequence order, from this rank's in local order, all of one shape; a zero that
    depends on them all). Add the zero to the result: then every rank's backward runs the gather's backward,
    whose collective needs them all, also where this rank uses nothing gathered."""
    local = torch.stack(per_chunk + [torch.zeros_like(per_chunk[0])] * (seq.per_rank - len(per_chunk)))
    if seq.world == 1:
        gathered = local[None]
    else:
        gathered = _Gather.apply(local, seq.group, seq.world, seq.rank)
    return [gathered[c.rank, c.index] for c in seq.chunks], gathered.sum() * 0


def chain(seq: ShardedSequence, transitions: list[Optional[Tensor]], contributions: list[Tensor],
          apply: Callable[[Tensor, Tensor], Tensor]) -> list[Optional[Tensor]]:
    """The state entering each of this rank's chunks (None: zero), from every chunk's summary in sequence order:
    out = apply(transition, incoming) + contribution; ``transitions[i]`` may be None where the chunk ``passes``
    nothing on."""
    wanted = {seq.order[(c.rank, c.index)]: c for c in seq.mine if c.continues}
    last = max(wanted, default=-1)
    entering, state = {}, None
    for i, c in enumerate(seq.chunks[:last + 1]):
        state = state if c.continues else None
        if i in wanted:
            entering[i] = state
        passed = apply(transitions[i], state) if c.passes and state is not None else None
        state = contributions[i] if passed is None else passed + contributions[i]
    return [entering.get(seq.order[(c.rank, c.index)]) for c in seq.mine]


def by_state(seq: ShardedSequence, run: Callable, apply: Callable[[Tensor, Tensor], Tensor], dim: int) -> Tensor:
    """The state form of every recurrent mixer. ``run(chunk, rows)`` runs one of this rank's chunks from a zero
    state: (its output, its transition, its final state, ``read(state)``: what its tokens add given the state
    entering it; transitions and final states of one shape each, batch first). Every rank's (transition, final
    state) are gathered, one tensor per chunk, and chained in sequence order by ``apply(transition, state)``; each
    chunk adds its read of the state that enters it. The outputs, laid end to end along ``dim``."""
    runs = [run(c, slice(c.local, c.local + c.length)) for c in seq.mine]
    transition, final = runs[0][1].shape, runs[0][2].shape
    summaries, zero = gather(seq, [torch.cat([t.flatten(1), f.flatten(1)], dim=1) for _, t, f, _ in runs])
    split = transition[1:].numel()
    entering = chain(seq, [s[:, :split].reshape(transition) for s in summaries],
                     [s[:, split:].reshape(final) for s in summaries], apply)
    outs = [out if state is None else out + read(state) for (out, _, _, read), state in zip(runs, entering)]
    return torch.cat(outs, dim=dim) + zero


def left_context(seq: ShardedSequence, x: Tensor, width: int) -> list[Tensor]:
    """For each of this rank's chunks, the ``width`` tokens before it (zeros where the document starts later):
    ``x`` [B, C, L_local] -> [B, C, width] each."""
    tails = []
    for c in seq.mine:
        tail = x[..., c.local + max(c.length - width, 0):c.local + c.length]
        tails.append(torch.nn.functional.pad(tail, (width - tail.size(-1), 0)))
    gathered, zero = gather(seq, tails)
    contexts = []
    for c in seq.mine:
        i, parts, have = seq.order[(c.rank, c.index)], [], 0
        while have < width and seq.chunks[i].continues:
            before = seq.chunks[i - 1]
            take = min(width - have, before.pieces[-1])
            parts.insert(0, gathered[i - 1][..., width - take:])
            have += take
            if not before.passes:
                break
            i -= 1
        context = torch.cat(parts, dim=-1) if parts else x.new_zeros(*x.shape[:-1], 0)
        contexts.append(torch.nn.functional.pad(context, (width - have, 0)) + zero)
    return contexts
