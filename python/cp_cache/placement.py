"""Where packed documents go over W ranks, each rank's pieces, and what a placement costs. A placement is a
deterministic function of the ends ``cu``, W and its name: every rank computes every rank's pieces without
communicating, each in increasing global position (causal order). "balanced": whole documents where the balance
allows, a split one head-tail over as few ranks as needed, within ``BALANCE_TOLERANCE``, then the fewest K/V rows
(docs/documents.md; integer loads, bounded budgets). "head_tail": 2W chunks per document. "contiguous": T/W each."""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["PLACEMENTS", "BALANCED", "HEAD_TAIL", "CONTIGUOUS", "BALANCE_TOLERANCE", "Piece", "check_placement",
           "check_placeable", "placement_pieces", "sequence_pieces", "causal_pairs", "PlacementCost", "placement_cost"]

BALANCED, HEAD_TAIL, CONTIGUOUS = "balanced", "head_tail", "contiguous"
PLACEMENTS = (BALANCED, HEAD_TAIL, CONTIGUOUS)
_log = logging.getLogger("cp_cache")
BALANCE_TOLERANCE = 1.05  # max/mean of tokens and of work per rank the balanced placement aims under


@dataclass(frozen=True)
class Piece:
    """Consecutive tokens of one document held by one rank."""
    document: int
    local: int  # start in the rank's local order
    start: int  # global start
    length: int


def check_placement(placement: str, name: str = "placement") -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"{name}={placement!r} is not a cp_cache document placement; use one of {PLACEMENTS}")
    return placement


def check_placeable(cu: Sequence[int], world: int, placement: str, name: str = "cu_seqlens") -> None:
    check_placement(placement)
    if world < 1:
        raise ValueError(f"world={world}: a placement needs at least one rank")
    total = cu[-1]
    if placement == HEAD_TAIL:
        for doc, length in enumerate(_document_lengths(cu)):
            if length % (2 * world):
                raise ValueError(f"document {doc} of {name} has length {length}, not divisible by 2*W = {2 * world}: "
                                 f"per-document head-tail (placement 'head_tail') cuts every document into 2W equal "
                                 f"chunks (cp_cache.pad_documents pads each document up to a multiple of "
                                 f"{2 * world}; placement 'balanced' takes any lengths)")
    elif placement == CONTIGUOUS and total % world:
        raise ValueError(f"{name}={list(cu)}: the global sequence of T={total} tokens does not divide into "
                         f"W={world} contiguous slices")
    elif placement == BALANCED and total < world:
        raise ValueError(f"{name}={list(cu)}: T={total} tokens cannot give each of W={world} ranks a token")


def causal_pairs(offset: int, length: int) -> int:
    """Causal (query, key) pairs of ``length`` queries starting ``offset`` tokens into their document."""
    return length * offset + length * (length + 1) // 2


def placement_pieces(cu: Sequence[int], world: int, placement: str) -> tuple[tuple[Piece, ...], ...]:
    cu = tuple(int(x) for x in cu)
    check_placeable(cu, world, placement)
    return _pieces(cu, world, placement)


def sequence_pieces(rank: int, world: int, local_length: int, load_balance: bool) -> tuple[Piece, ...]:
    """A dense call's shards (head-tail under load balancing): a formula, ``local_length`` may be symbolic."""
    if local_length == 0:
        return ()
    if not load_balance or world == 1:
        return (Piece(0, 0, rank * local_length, local_length),)

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
    out = _as_pieces(spans)
    for rank, pieces in enumerate(out):
        if not pieces:
            raise ValueError(f"placement {placement!r} of cu_seqlens={list(cu)} over W={world} ranks leaves rank "
                             f"{rank} without tokens: pack more tokens or use fewer ranks")
    return out


Spans = list[list[tuple[int, int, int]]]  # per rank: (document, global start, length)


def _as_pieces(spans: Spans) -> tuple[tuple[Piece, ...], ...]:
    out = []
    for held in spans:
        local, pieces = 0, []
        for doc, start, length in sorted(held, key=lambda s: s[1]):
            pieces.append(Piece(doc, local, start, length))
            local += length
        out.append(tuple(pieces))
    return tuple(out)


def _contiguous(cu: tuple[int, ...], world: int) -> Spans:
    per_rank = cu[-1] // world
    spans: Spans = [[] for _ in range(world)]
    start = 0
    for doc, end in enumerate(cu):
        for rank in range(start // per_rank, min(world, -(-end // per_rank))):
            a, b = max(start, rank * per_rank), min(end, (rank + 1) * per_rank)
            if a < b:
                spans[rank].append((doc, a, b - a))
        start = end
    return spans


def _member_spans(length: int, k: int) -> list[tuple[tuple[int, int], ...]]:
    """Spans (start, length) of k members of a document in 2k chunks: i holds i and 2k-1-i, touching ones merged."""
    b = [j * length // (2 * k) for j in range(2 * k + 1)]
    return [((b[i], b[i + 1] - b[i]), (b[2 * k - 1 - i], b[2 * k - i] - b[2 * k - 1 - i])) if i < k - 1
            else ((b[i], b[i + 2] - b[i]),) for i in range(k)]


def _split(cu: tuple[int, ...], world: int, groups: Sequence[tuple[int, ...]]) -> Spans:
    spans: Spans = [[] for _ in range(world)]
    for doc, (start, end, group) in enumerate(zip((0,) + cu[:-1], cu, groups)):
        for rank, held in zip(group, _member_spans(end - start, len(group))):
            spans[rank] += [(doc, start + a, n) for a, n in held if n > 0]
    return spans


def _document_lengths(cu: Sequence[int]) -> list[int]:
    return [end - start for start, end in zip((0,) + tuple(cu[:-1]), cu)]


def _balanced(cu: tuple[int, ...], world: int) -> list[tuple[int, ...]]:
    """Every document's group of ranks: ``_Search`` over the fewest ranks, then widened (``_WIDEN``), then repaired;
    up to ``_COMPARED`` documents or off the tolerance, the better of it and the widening greedy."""
    lengths = _document_lengths(cu)
    budgets, searches, found = _Budgets(), [], None
    for widen in _WIDEN:
        search = _Search(lengths, world, widen, budgets)
        search.first_pass()
        search.descend(budgets.moves // 4 if search.forced else None)  # widened runs may follow
        if search.peak() > 1.0 and search.small:  # repaired first: it splits least
            search.repair()
        if search.peak() <= 1.0:
            found = search
            break
        searches.append(search)
        if not search.forced:  # nothing to widen
            break
    for search in searches if found is None else ():
        if not search.small:
            search.repair()
        if found is None or search.standing(search.groups) < found.standing(found.groups):
            found = search
        if found.peak() <= 1.0:
            break
    searched = found.standing(found.groups)
    if not searched[0] and len(lengths) > _COMPARED:
        return found.groups
    fallback = _widening(lengths, world)
    if found.standing(fallback) < searched:
        _log.debug("balanced placement of %d documents over W=%d: the widening greedy (%s) beats the search (%s)",
                   len(lengths), world, found.standing(fallback), searched)
        return fallback
    return found.groups


def _tolerated_load(total: int, world: int) -> int:
    """The most of ``total`` a rank may hold within ``BALANCE_TOLERANCE``, tested as ``PlacementCost`` does."""
    mean = total / world
    cap = int(BALANCE_TOLERANCE * mean) + 1
    while cap / mean > BALANCE_TOLERANCE:
        cap -= 1
    return cap


@functools.lru_cache(maxsize=4096)
def _shares(length: int, k: int) -> tuple[tuple[int, int], ...]:
    """(tokens, causal work) of each of the k members, in rank order, of a document split over them."""
    return tuple((sum(n for _, n in held), sum(causal_pairs(a, n) for a, n in held))
                 for held in _member_spans(length, k))


@functools.lru_cache(maxsize=4096)
def _rows(length: int, k: int) -> int:
    """K/V rows the members of a split document need from each other: keys before a member's last query, not held."""
    return sum(held[-1][0] + held[-1][1] - sum(n for _, n in held) for held in _member_spans(length, k))


@dataclass
class _Budgets:
    moves: int = 16_000  # moves, swaps and widenings (~1-2 us each)
    packing: int = 160_000  # ranks weighed by the depth-first packings (~0.5 us each)


_PACKED = 2_048  # documents x ranks up to which the search tries depth-first packings
_COMPARED = 128  # documents up to which the widening greedy runs beside a search within the tolerance
_PACK_PAIRED = 24  # the cheapest single splits the packings pair up
_PACK_TRIES = 150  # placements one depth-first packing tries
_WIDEN_TRIES = 3  # documents widened by one rank (each followed by the descent) weighed per step


class _Search:
    """Levels: the larger of a rank's tokens and work over the capacities. Objective: every level at most 1, then
    the fewest ``_rows``. Deterministic (ties to the lower document or rank); every step charges ``budgets``."""

    def __init__(self, lengths: Sequence[int], world: int, widen: float, budgets: _Budgets):
        self.lengths, self.world, self.widen, self.budgets = list(lengths), world, widen, budgets
        self.pairs = [causal_pairs(0, n) for n in lengths]
        self.cap_tokens = _tolerated_load(sum(lengths), world)
        self.cap_work = _tolerated_load(max(sum(self.pairs), 1), world)
        self.docs = [d for d, n in enumerate(lengths) if n > 0]
        self.tokens, self.work = [0] * world, [0] * world
        self.groups: list[tuple[int, ...]] = [() if n else (0,) for n in lengths]
        self.whole: list[set[int]] = [set() for _ in range(world)]  # documents a rank holds whole
        self.count = [0] * world  # documents a rank holds some of
        self.forced = False  # whether the first pass split a document no rank could take whole
        self.small = len(self.docs) * world <= _PACKED  # depth-first packings weighed

    def level(self, r: int, tokens: int = 0, work: int = 0) -> float:  # after taking tokens and work more
        return max((self.tokens[r] + tokens) / self.cap_tokens, (self.work[r] + work) / self.cap_work)

    def size(self, doc: int) -> float:
        return max(self.lengths[doc] / self.cap_tokens, self.pairs[doc] / self.cap_work)

    def most_ranks(self, doc: int) -> int:  # the widest group: every member holds two chunks of a token or more
        return min(self.world, max(1, self.lengths[doc] // 2))

    def peak(self) -> float:
        return max(self.level(r) for r in range(self.world)) if all(self.count) else math.inf

    def over(self, r: int, tokens: int = 0, work: int = 0) -> float:  # how far above its capacities, after taking more
        ct, cw = self.cap_tokens, self.cap_work
        return max(0, self.tokens[r] + tokens - ct) / ct + max(0, self.work[r] + work - cw) / cw

    def excess(self) -> float:
        return sum(self.over(r) for r in range(self.world))

    def standing(self, groups: Sequence[tuple[int, ...]]) -> tuple[bool, float, int]:
        """Lower is better: (above the tolerance, if so the worse max/mean ratio (inf: an empty rank), the rows)."""
        saved = list(self.groups)
        self.assign(groups)
        above = self.peak() > 1.0
        rows = sum(_rows(self.lengths[d], len(self.groups[d])) for d in self.docs)
        worst = max(max(self.tokens) * self.world / sum(self.tokens), max(self.work) * self.world / sum(self.work))
        ratio = worst if all(self.count) else math.inf
        self.assign(saved)
        return above, ratio if above else 0.0, rows

    def place(self, doc: int, group: tuple[int, ...], sign: int = 1) -> None:  # sign -1: take it away
        for r, (tokens, work) in zip(group, _shares(self.lengths[doc], len(group)) if group else ()):
            self.tokens[r] += sign * tokens
            self.work[r] += sign * work
            self.count[r] += sign
        if len(group) == 1:
            (self.whole[group[0]].add if sign > 0 else self.whole[group[0]].discard)(doc)

    def move(self, doc: int, group: tuple[int, ...]) -> None:
        if self.groups[doc]:
            self.place(doc, self.groups[doc], -1)
        self.groups[doc] = group
        self.place(doc, group)

    def assign(self, groups: Sequence[tuple[int, ...]]) -> None:
        for d in self.docs:
            if self.groups[d] != groups[d] and self.groups[d]:
                self.place(d, self.groups[d], -1)
                self.groups[d] = ()
        for d in self.docs:
            if not self.groups[d]:
                self.groups[d] = groups[d]
                self.place(d, groups[d])

    def repair(self) -> None:
        if self.peak() > 1.0 and self.small:
            self.pack_splits(paired=True)
        while self.peak() > 1.0 and self.budgets.moves > 0 and self.widen_one():
            if self.peak() > 1.0 and self.small:
                self.pack_splits(paired=False)

    def first_pass(self) -> None:
        """Largest first, each whole on the rank it raises least, split only where no rank could take it whole."""
        # heaps of (level, tokens or work; rank; the rank's version when pushed): older versions are stale
        heaps: list[list[tuple]] = [[(0, r, 0) for r in range(self.world)] for _ in range(3)]
        version = [0] * self.world
        split_tokens, split_work = [0] * self.world, [0] * self.world  # of the documents split
        rooms = {(self.cap_tokens, self.cap_work)}  # what ranks have left beside the split documents
        roomiest = 1.0  # the largest size every room takes
        sizes = {d: self.size(d) for d in self.docs}
        for doc in sorted(self.docs, key=lambda d: (-sizes[d], d)):
            n, work = self.lengths[doc], self.pairs[doc]
            if sizes[doc] > roomiest and self.most_ranks(doc) > 1 and \
                    not any(n <= t and work <= w for t, w in rooms):
                group = self.group_for(doc)
                self.forced = True
            else:
                for heap in heaps:  # stale entries off the tops
                    while heap[0][2] != version[heap[0][1]]:
                        heapq.heappop(heap)
                group = (min((self.level(heap[0][1], n, work), heap[0][1]) for heap in heaps)[1],)
            self.move(doc, group)
            if len(group) > 1:
                for r, (tokens, pairs) in zip(group, _shares(n, len(group))):
                    split_tokens[r] += tokens
                    split_work[r] += pairs
                rooms = {(self.cap_tokens - t, self.cap_work - w) for t, w in zip(split_tokens, split_work)}
                roomiest = min(min(t / self.cap_tokens, w / self.cap_work) for t, w in rooms)
            for r in group:
                version[r] += 1
                for heap, key in zip(heaps, (self.level(r), self.tokens[r], self.work[r])):
                    heapq.heappush(heap, (key, r, version[r]))

    def group_for(self, doc: int) -> tuple[int, ...]:
        """The fewest ranks within the capacities, times ``widen``; none: the better of the narrowest and widest."""
        most = self.most_ranks(doc)
        low = min(most, max(2, math.ceil(self.size(doc))))
        narrowest, widest = self.lowest(doc, low), self.lowest(doc, most)
        if narrowest[0] > 1.0 and widest[0] > 1.0:
            return min(narrowest, widest)[1]
        high = most
        while low < high and narrowest[0] > 1.0:
            middle = (low + high) // 2
            if self.lowest(doc, middle)[0] <= 1.0:
                high = middle
            else:
                low = middle + 1
        return self.lowest(doc, most if self.widen >= most else min(most, math.ceil(low * self.widen)))[1]

    def lowest(self, doc: int, k: int) -> tuple[float, tuple[int, ...]]:
        """The peak level and the k ranks (in rank order) a document split over k raises least."""
        shares = _shares(self.lengths[doc], k)
        tokens, work = max(s[0] for s in shares), max(s[1] for s in shares)
        ct, cw = self.cap_tokens, self.cap_work
        after = [max((t + tokens) / ct, (w + work) / cw) for t, w in zip(self.tokens, self.work)]
        group = sorted(range(self.world), key=lambda r: (after[r], r))[:k]
        return after[group[-1]], tuple(sorted(group))

    def descend(self, budget: int | None = None) -> None:
        """``improvement`` after ``improvement`` until none is left or ``budget`` (default: all) is spent."""
        stop = self.budgets.moves - budget if budget is not None else 0
        while self.budgets.moves > stop and self.excess() > 0:
            change = self.improvement(stop)
            if change is None:
                return
            a, p, q, b = change
            self.move(a, (q,))
            if b >= 0:
                self.move(b, (p,))

    def improvement(self, stop: int) -> tuple[int, int, int, int] | None:
        """(document, its rank p, rank q, the document swapped back or -1): the move or swap that lowers the
        excess most, or keeps it and lowers the sum of squared levels (room gathered on fewer ranks). None: none."""
        ct, cw = self.cap_tokens, self.cap_work
        t = [x / ct for x in self.tokens]
        w = [x / cw for x in self.work]

        def excess(tr: float, wr: float) -> float:
            return max(0.0, tr - 1.0) + max(0.0, wr - 1.0)

        for p in sorted(range(self.world), key=lambda r: (-max(t[r], w[r]), r)):
            for a in sorted(self.whole[p], key=lambda d: (-self.size(d), d)):
                ta, wa = self.lengths[a] / ct, self.pairs[a] / cw
                best = None  # (excess change, squares change, rank, document swapped back or -1)
                for q in range(self.world):
                    if q == p:
                        continue
                    base_excess = excess(t[p], w[p]) + excess(t[q], w[q])
                    base_squares = t[p] * t[p] + w[p] * w[p] + t[q] * t[q] + w[q] * w[q]
                    options = [(ta, wa, -1)] if self.count[p] > 1 else []
                    options += [(ta - self.lengths[b] / ct, wa - self.pairs[b] / cw, b)
                                for b in sorted(self.whole[q]) if self.lengths[b] != self.lengths[a]]
                    self.budgets.moves -= len(options)
                    for dt, dw, b in options:
                        tp, wp, tq, wq = t[p] - dt, w[p] - dw, t[q] + dt, w[q] + dw
                        d_excess = excess(tp, wp) + excess(tq, wq) - base_excess
                        d_squares = tp * tp + wp * wp + tq * tq + wq * wq - base_squares
                        if d_excess < -1e-12 or (d_excess <= 1e-12 and d_squares < -1e-12):
                            key = (round(d_excess, 12), d_squares, q, b)
                            best = key if best is None else min(best, key)
                if best is not None:
                    return a, p, best[2], best[3]
                if self.budgets.moves <= stop:
                    return None
        return None

    def pack_splits(self, paired: bool) -> None:
        """``pack`` as they are, then (``paired``) with one or two cheap splits over 2 to 4 ranks; the first wins."""
        whole = [d for d in self.docs if len(self.groups[d]) == 1]
        singles = sorted((_rows(self.lengths[d], k), ((d, k),))
                         for d in (whole if paired else ()) for k in range(2, min(self.most_ranks(d), 4) + 1))
        options = [(0, ())] + singles + [(a[0] + b[0], a[1] + b[1])
                                         for a, b in itertools.combinations(singles[:_PACK_PAIRED], 2)
                                         if a[1][0][0] != b[1][0][0]]
        for _, splits in sorted(options):
            if self.budgets.packing <= 0:
                return
            found = self.pack(whole, dict(splits))
            if found is not None:
                self.assign([found.get(d, group) for d, group in enumerate(self.groups)])
                return

    def pack(self, docs: Sequence[int], splits: dict[int, int]) -> dict[int, tuple[int, ...]] | None:
        """Groups for ``docs`` (over ``splits[d]`` ranks) within the capacities, depth first; None: none in budget."""
        ct, cw, world = self.cap_tokens, self.cap_work, self.world
        items = []
        for d in docs:
            shares = _shares(self.lengths[d], splits.get(d, 1))
            items += [(max(n for n, _ in shares), max(c for _, c in shares), d)] * len(shares)
        items.sort(key=lambda i: (-max(i[0] / ct, i[1] / cw), i[2]))
        tokens, work = list(self.tokens), list(self.work)
        for d in docs:
            for r, (n, c) in zip(self.groups[d], _shares(self.lengths[d], len(self.groups[d]))):
                tokens[r] -= n
                work[r] -= c
        self.budgets.packing -= len(items) * world  # setting up: about a node per item
        held: dict[int, set[int]] = {d: set() for d in docs}
        allowed = tries = min(self.budgets.packing // world, _PACK_TRIES)

        def search(i: int) -> bool:
            nonlocal tries
            if i == len(items):
                return True
            tries -= 1
            n, c, d = items[i]
            tried = set()
            for r in sorted(range(world), key=lambda q: (max(tokens[q] / ct, work[q] / cw), q)):
                if (tokens[r], work[r]) in tried or tokens[r] + n > ct or work[r] + c > cw or r in held[d]:
                    continue
                tried.add((tokens[r], work[r]))
                tries -= 1
                if tries < 0:
                    return False
                tokens[r] += n
                work[r] += c
                held[d].add(r)
                if search(i + 1):
                    return True
                held[d].discard(r)
                tokens[r] -= n
                work[r] -= c
            return False

        found = search(0)
        self.budgets.packing -= (allowed - max(tries, 0)) * world
        return {d: tuple(sorted(held[d])) for d in docs} if found else None

    def widen_one(self) -> bool:
        """A busiest rank's document over one more rank, then the descent, kept where the excess falls."""
        p = max(range(self.world), key=lambda r: (self.level(r), -r))
        candidates = []
        for doc in sorted(d for d in self.docs if p in self.groups[d]):
            group, n = self.groups[doc], self.lengths[doc]
            if len(group) >= self.most_ranks(doc):
                continue
            added = _rows(n, len(group) + 1) - _rows(n, len(group))
            shares = _shares(n, len(group) + 1)
            self.place(doc, group, -1)
            before = sum(self.over(r, *s) for r, s in zip(group, _shares(n, len(group))))
            self.budgets.moves -= self.world
            for q in range(self.world):
                if q not in group:
                    wider = tuple(sorted(group + (q,)))
                    change = sum(self.over(r, *s) for r, s in zip(wider, shares)) - before - self.over(q)
                    candidates.append((added, change, doc, wider))
            self.place(doc, group)
        start_excess, start_groups = self.excess(), list(self.groups)
        for _, _, doc, wider in sorted(candidates)[:_WIDEN_TRIES]:
            self.move(doc, wider)
            self.descend()
            if self.excess() < start_excess - 1e-12:
                return True
            self.assign(start_groups)
        return False


class _Loads:
    """Tokens and causal work per rank as fractions of their means (a rank's level: the larger)."""

    def __init__(self, lengths: Sequence[int], world: int):
        self.world = world
        self.token_unit = world / sum(lengths)
        self.work_unit = world / max(sum(causal_pairs(0, n) for n in lengths), 1)
        self.tokens = [0.0] * world
        self.work = [0.0] * world

    def share(self, length: int, k: int) -> tuple[float, float]:  # a 1/k share of a document's tokens and work
        return length / k * self.token_unit, causal_pairs(0, length) / k * self.work_unit

    def lowest(self, k: int, length: int) -> tuple[tuple[int, ...], float]:
        """The ``k`` ranks (in rank order) a document split over k raises least, and their peak after."""
        tokens, work = self.share(length, k)
        after = [max(t + tokens, w + work) for t, w in zip(self.tokens, self.work)]
        group = sorted(range(self.world), key=lambda r: (after[r], r))[:k]
        return tuple(sorted(group)), max(after[r] for r in group)

    def add(self, ranks: Sequence[int], length: int) -> None:
        tokens, work = self.share(length, len(ranks))
        for r in ranks:
            self.tokens[r] += tokens
            self.work[r] += work


def _widening(lengths: Sequence[int], world: int) -> list[tuple[int, ...]]:
    """``_greedy`` over the fewest split ranks, then widened: the first within the tolerance, else the most even."""
    best, best_peak = None, None
    for widen in _WIDEN:
        groups = _greedy(lengths, world, _AIM, widen)
        loads = _Loads(lengths, world)
        for length, group in zip(lengths, groups):
            loads.add(group, length)
        peak = max(max(t, w) for t, w in zip(loads.tokens, loads.work))
        if peak <= BALANCE_TOLERANCE:
            return groups
        if best_peak is None or peak < best_peak:
            best, best_peak = groups, peak
    return best


_AIM = 1.02  # the level the greedy accepts without splitting further: room for the documents to come
_WIDEN = (1.0, 1.5, 2.0, 4.0, float("inf"))  # a split document goes over this many times the fewest ranks


def _widening_cost(cu: Sequence[int], world: int) -> PlacementCost:
    """What the widening greedy alone would cost: the bench's and the tests' reference."""
    cu = tuple(int(x) for x in cu)
    return _cost(cu, _as_pieces(_split(cu, world, _widening(_document_lengths(cu), world))))


def _greedy(lengths: Sequence[int], world: int, aim: float, widen: float) -> list[tuple[int, ...]]:
    """Longest first, each whole on the rank it raises least within ``aim``, else head-tail (``_group_for``)."""
    loads = _Loads(lengths, world)
    groups: list[tuple[int, ...]] = [()] * len(lengths)
    for doc in sorted(range(len(lengths)), key=lambda d: (-lengths[d], d)):
        groups[doc] = _group_for(loads, lengths[doc], aim, widen)
        loads.add(groups[doc], lengths[doc])
    return groups


def _group_for(loads: _Loads, length: int, aim: float, widen: float) -> tuple[int, ...]:
    whole, peak = loads.lowest(1, length)
    most = min(loads.world, max(1, length // 2))
    if peak <= aim or most == 1:
        return whole
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


@dataclass(frozen=True)
class PlacementCost:
    """Per rank: tokens held, causal (query, key) pairs of its queries, and K/V rows it needs
    from other ranks (keys of its documents before one of its queries, held elsewhere)."""
    tokens: tuple[int, ...]
    work: tuple[int, ...]
    rows_needed: tuple[int, ...]

    @property
    def token_ratio(self) -> float:  # max / mean tokens per rank (1.0: even)
        return max(self.tokens) / (sum(self.tokens) / len(self.tokens))

    @property
    def work_ratio(self) -> float:
        return max(self.work) / (sum(self.work) / len(self.work))


def placement_cost(cu: Sequence[int], world: int, placement: str) -> PlacementCost:
    cu = tuple(int(x) for x in cu)
    return _cost(cu, placement_pieces(cu, world, placement))


def _cost(cu: tuple[int, ...], placed: Sequence[Sequence[Piece]]) -> PlacementCost:
    starts = (0,) + cu[:-1]
    tokens, work, rows = [], [], []
    for pieces in placed:
        tokens.append(sum(p.length for p in pieces))
        work.append(sum(causal_pairs(p.start - starts[p.document], p.length) for p in pieces))
        ends = {p.document: p.start + p.length for p in pieces}  # document -> the end of this rank's last piece
        rows.append(sum(end - starts[d] for d, end in ends.items()) - tokens[-1])  # before its queries, not held
    return PlacementCost(tuple(tokens), tuple(work), tuple(rows))
