"""Where packed documents go over W ranks (docs/documents.md): the placements, each rank's
pieces of documents, and what a placement costs (tokens, attention work and the K/V rows a
rank needs from the others).

A placement is a deterministic function of the global cumulative document ends ``cu``, W
and its name, so every rank computes every rank's pieces without communicating. A rank
holds its pieces in increasing global position (a document's pieces on a rank are then
adjacent, and causal order within the rank is causal order globally):

* ``"balanced"``: whole documents on one rank where the balance allows; a document that
  does not fit goes head-tail over as few ranks as needed (cut into 2k chunks whose sizes
  differ by at most one; the i-th of its k ranks, in rank order, holds chunks i and
  2k-1-i). Objective: tokens and causal attention work per rank each within
  ``BALANCE_TOLERANCE`` of the mean, then the fewest K/V rows needed from other ranks. A
  greedy: documents longest first, each whole on the rank where it raises the load least,
  split over the fewest ranks only when no rank can take it whole; rerun with splits
  widened when that leaves the later documents too little room (``_balanced``);
* ``"head_tail"``: every document cut into 2W equal chunks, rank r holding chunks r and
  2W-1-r of each (every length must divide by 2W);
* ``"contiguous"``: T/W consecutive tokens per rank (T must divide by W); documents may
  cross rank boundaries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["PLACEMENTS", "BALANCED", "HEAD_TAIL", "CONTIGUOUS", "BALANCE_TOLERANCE", "Piece", "check_placement",
           "check_placeable", "placement_pieces", "sequence_pieces", "causal_pairs", "PlacementCost", "placement_cost"]

BALANCED, HEAD_TAIL, CONTIGUOUS = "balanced", "head_tail", "contiguous"
PLACEMENTS = (BALANCED, HEAD_TAIL, CONTIGUOUS)
BALANCE_TOLERANCE = 1.05  # max/mean of tokens and of work per rank the balanced placement aims under


@dataclass(frozen=True)
class Piece:
    """Consecutive tokens of one document held by one rank: (document, local start, global
    start, length)."""

    document: int
    local: int
    start: int
    length: int


def check_placement(placement: str, name: str = "placement") -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"{name}={placement!r} is not a cp_cache document placement; use one of {PLACEMENTS}")
    return placement


def check_placeable(cu: Sequence[int], world: int, placement: str, name: str = "cu_seqlens") -> None:
    """ValueError unless ``placement`` can lay the documents ``cu`` out over ``world`` ranks."""
    check_placement(placement)
    if world < 1:
        raise ValueError(f"world={world}: a placement needs at least one rank")
    total = cu[-1]
    if placement == HEAD_TAIL:
        start = 0
        for doc, end in enumerate(cu):
            if (end - start) % (2 * world):
                raise ValueError(
                    f"document {doc} of {name} has length {end - start}, not divisible by 2*W = {2 * world}: "
                    f"per-document head-tail (placement 'head_tail') cuts every document into 2W equal chunks "
                    f"(cp_cache.pad_documents pads each document up to a multiple of {2 * world}; placement "
                    f"'balanced' takes any lengths)")
            start = end
    elif placement == CONTIGUOUS and total % world:
        raise ValueError(f"{name}={list(cu)}: the global sequence of T={total} tokens does not divide into "
                         f"W={world} contiguous slices")
    elif placement == BALANCED and total < world:
        raise ValueError(f"{name}={list(cu)}: T={total} tokens cannot give each of W={world} ranks a token")


def causal_pairs(offset: int, length: int) -> int:
    """Causal (query, key) pairs of ``length`` queries starting ``offset`` tokens into their document."""
    return length * offset + length * (length + 1) // 2


def placement_pieces(cu: Sequence[int], world: int, placement: str) -> tuple[tuple[Piece, ...], ...]:
    """Each rank's pieces in local order (increasing global position)."""
    cu = tuple(int(x) for x in cu)
    check_placeable(cu, world, placement)
    return _pieces(cu, world, placement)


def sequence_pieces(rank: int, world: int, local_length: int, load_balance: bool) -> tuple[Piece, ...]:
    """The one-document case: the pieces ``rank`` holds of one sequence of ``world`` x
    ``local_length`` tokens (a dense call's shards): head-tail under load balancing (chunks r and
    2W-1-r of 2W), else contiguous. Every dense position rule asks this."""
    if local_length == 0:
        return ()
    if not load_balance or world == 1:
        return (Piece(0, 0, rank * local_length, local_length),)

    # a formula, not the placement search: the length may be symbolic (torch.compile, dynamic)
    def bound(chunk: int):  # where chunk ``chunk`` of 2W starts (chunks differ by at most one)
        return chunk * local_length // 2

    tail = 2 * world - 1 - rank
    if tail == rank + 1:  # the middle rank's two chunks touch: one piece
        return (Piece(0, 0, bound(rank), bound(rank + 2) - bound(rank)),)
    head = bound(rank + 1) - bound(rank)
    pieces = (Piece(0, 0, bound(rank), head), Piece(0, head, bound(tail), bound(tail + 1) - bound(tail)))
    return tuple(p for p in pieces if not (isinstance(p.length, int) and p.length == 0))


@functools.lru_cache(maxsize=64)  # the same documents in every layer of a step
def _pieces(cu: tuple[int, ...], world: int, placement: str) -> tuple[tuple[Piece, ...], ...]:
    if placement == CONTIGUOUS:
        spans = _contiguous(cu, world)
    else:
        groups = _balanced(cu, world) if placement == BALANCED else [tuple(range(world))] * len(cu)
        spans = _split(cu, world, groups)
    out = []
    for rank, held in enumerate(spans):
        local, pieces = 0, []
        for doc, start, length in sorted(held, key=lambda s: s[1]):
            pieces.append(Piece(doc, local, start, length))
            local += length
        if not pieces:
            raise ValueError(f"placement {placement!r} of cu_seqlens={list(cu)} over W={world} ranks leaves rank "
                             f"{rank} without tokens: pack more tokens or use fewer ranks")
        out.append(tuple(pieces))
    return tuple(out)


def _contiguous(cu: tuple[int, ...], world: int) -> list[list[tuple[int, int, int]]]:
    per_rank = cu[-1] // world
    spans: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    start = 0
    for doc, end in enumerate(cu):
        for rank in range(start // per_rank, min(world, -(-end // per_rank))):
            a, b = max(start, rank * per_rank), min(end, (rank + 1) * per_rank)
            if a < b:
                spans[rank].append((doc, a, b - a))
        start = end
    return spans


def _split(cu: tuple[int, ...], world: int, groups: Sequence[tuple[int, ...]]) -> list[list[tuple[int, int, int]]]:
    """Each document head-tail over its group of ranks (a group of one: the whole document)."""
    spans: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    start = 0
    for doc, (end, group) in enumerate(zip(cu, groups)):
        length, k = end - start, len(group)
        bounds = [start + j * length // (2 * k) for j in range(2 * k + 1)]
        for i, rank in enumerate(group):
            for chunk in (i, 2 * k - 1 - i) if k > 1 else (0, 1):
                if bounds[chunk + 1] > bounds[chunk]:
                    spans[rank].append((doc, bounds[chunk], bounds[chunk + 1] - bounds[chunk]))
        start = end
    return [_merge_adjacent(s) for s in spans]


def _merge_adjacent(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for doc, start, length in sorted(spans, key=lambda s: s[1]):
        if out and out[-1][0] == doc and out[-1][1] + out[-1][2] == start:
            out[-1] = (doc, out[-1][1], out[-1][2] + length)
        else:
            out.append((doc, start, length))
    return out


class _Loads:
    """Tokens and causal work per rank while the greedy places documents, as fractions of the
    final means (a rank's level: the larger of the two)."""

    def __init__(self, lengths: Sequence[int], world: int):
        self.world = world
        self.token_unit = world / sum(lengths)
        self.work_unit = world / max(sum(causal_pairs(0, n) for n in lengths), 1)
        self.tokens = [0.0] * world
        self.work = [0.0] * world

    def level(self, rank: int) -> float:
        return max(self.tokens[rank], self.work[rank])

    def levels_after(self, length: int, k: int) -> list[float]:
        """Each rank's level after taking a 1/k share (tokens and work) of a document of ``length``."""
        tokens, work = length / k * self.token_unit, causal_pairs(0, length) / k * self.work_unit
        return [max(t + tokens, w + work) for t, w in zip(self.tokens, self.work)]

    def lowest(self, k: int, length: int) -> tuple[tuple[int, ...], float]:
        """The ``k`` ranks (in rank order) a document of ``length`` split over k raises least, and
        the highest level among them after."""
        after = self.levels_after(length, k)
        group = sorted(range(self.world), key=lambda r: (after[r], r))[:k]
        return tuple(sorted(group)), max(after[r] for r in group)

    def add(self, ranks: Sequence[int], length: int) -> None:
        k = len(ranks)
        tokens, work = length / k * self.token_unit, causal_pairs(0, length) / k * self.work_unit
        for r in ranks:
            self.tokens[r] += tokens
            self.work[r] += work


def _balanced(cu: tuple[int, ...], world: int) -> list[tuple[int, ...]]:
    """The group of ranks of every document (one rank: whole). The greedy (``_greedy``) runs
    with settings from the fewest split ranks up; the first whose tokens and work per rank are
    within ``BALANCE_TOLERANCE`` of the mean wins (none: the most even)."""
    lengths = [end - start for start, end in zip((0,) + cu[:-1], cu)]
    best, best_peak = None, None
    for widen in _WIDEN:
        groups = _greedy(lengths, world, _AIM, widen)
        peak = _balance(lengths, groups, world)
        if peak <= BALANCE_TOLERANCE:
            return groups
        if best_peak is None or peak < best_peak:
            best, best_peak = groups, peak
    return best


_AIM = 1.02  # the level the greedy accepts without splitting further: room for the documents to come
_WIDEN = (1.0, 1.5, 2.0, 4.0, float("inf"))  # a split document goes over this many times the fewest ranks


def _greedy(lengths: Sequence[int], world: int, aim: float, widen: float) -> list[tuple[int, ...]]:
    """Documents longest first, each whole on the rank it raises least if that stays within
    ``aim`` of the means, else head-tail over the fewest ranks that stay within it (times
    ``widen``; none: the group of the lowest peak)."""
    loads = _Loads(lengths, world)
    groups: list[tuple[int, ...]] = [()] * len(lengths)
    for doc in sorted(range(len(lengths)), key=lambda d: (-lengths[d], d)):
        groups[doc] = _group_for(loads, lengths[doc], aim, widen)
        loads.add(groups[doc], lengths[doc])
    return groups


def _group_for(loads: _Loads, length: int, aim: float, widen: float) -> tuple[int, ...]:
    after = loads.levels_after(length, 1)
    whole = min(range(loads.world), key=lambda r: (after[r], r))
    most = min(loads.world, max(1, length // 2))
    if after[whole] <= aim or most == 1:
        return (whole,)
    widest, peak = loads.lowest(most, length)
    if peak > aim:
        return widest  # nothing fits: over the most ranks, where the peak is lowest
    low, high = 2, most  # the fewest ranks within aim (the peak falls as k grows)
    while low < high:
        middle = (low + high) // 2
        if loads.lowest(middle, length)[1] <= aim:
            high = middle
        else:
            low = middle + 1
    return loads.lowest(most if widen > most else min(most, math.ceil(low * widen)), length)[0]


def _balance(lengths: Sequence[int], groups: Sequence[tuple[int, ...]], world: int) -> float:
    """The larger of max/mean tokens and max/mean work per rank of ``groups``."""
    loads = _Loads(lengths, world)
    for length, group in zip(lengths, groups):
        loads.add(group, length)
    return max(loads.level(r) for r in range(world))


# ---------------------------------------------------------------- what a placement costs


@dataclass(frozen=True)
class PlacementCost:
    """Per rank: tokens held, causal (query, key) pairs of its queries, and K/V rows it needs
    from other ranks (keys of its documents before one of its queries, held elsewhere)."""

    tokens: tuple[int, ...]
    work: tuple[int, ...]
    rows_needed: tuple[int, ...]

    @staticmethod
    def _ratio(values: Sequence[int]) -> float:
        return max(values) / (sum(values) / len(values))

    @property
    def token_ratio(self) -> float:
        """max / mean tokens per rank (1.0: even)."""
        return self._ratio(self.tokens)

    @property
    def work_ratio(self) -> float:
        return self._ratio(self.work)


def placement_cost(cu: Sequence[int], world: int, placement: str) -> PlacementCost:
    """Tokens, causal work and K/V rows needed per rank of ``placement`` (causal attention
    within documents)."""
    cu = tuple(int(x) for x in cu)
    starts = (0,) + cu[:-1]
    tokens, work, rows = [], [], []
    for pieces in placement_pieces(cu, world, placement):
        tokens.append(sum(p.length for p in pieces))
        work.append(sum(causal_pairs(p.start - starts[p.document], p.length) for p in pieces))
        last: dict[int, int] = {}  # document -> the last position this rank holds of it
        held: dict[int, int] = {}  # document -> tokens this rank holds of it
        for p in pieces:
            last[p.document] = p.start + p.length - 1
            held[p.document] = held.get(p.document, 0) + p.length
        rows.append(sum(last[d] - starts[d] + 1 - held[d] for d in last))
    return PlacementCost(tuple(tokens), tuple(work), tuple(rows))
