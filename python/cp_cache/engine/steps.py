"""What each ring step computes: the blocks of (local queries x one K/V block) and their masks.

A rank's local sequence is one contiguous chunk of the global sequence (rank r holds
chunk r of W) or, under head-tail load balancing, two (chunks r and 2W-1-r of 2W).
Step i on rank r sees the K/V block of rank (r - i) % W. Every mask kind is a rule on
global positions, turned here into per-block tasks for the step kernel:

* full and causal: torch's ring rules (``step_part``): one task per step;
* band (sliding window, ``sparse_mode=4``): query i sees key j iff
  i - pre <= j <= i + next; each (query chunk, key chunk) pair is skipped when the band
  misses it, full when the band covers it, else a band task whose offsets are shifted
  by the chunks' global offsets;
* given (an explicit ``[.., S, S]`` mask, ``sparse_mode`` 0 or 1): each step uses the
  block of the mask at its query rows and key columns (with the band of
  ``sparse_mode=0`` folded in); wholly masked blocks are skipped.

``hops_needed`` is the last step any rank computes something in: with contiguous
sharding a causal window of w tokens needs ceil((w-1)/S_local) hops, not W-1.

Which rows each step needs (the direct exchange, ``exchange_plan``): rank r holds global
positions P_r (queries and keys in the same local order). It needs from rank p the rows of p's
block that some query of P_r may attend to: the lower bound of any exchange is those rows and
no others. The mask decides, on global positions:

* full: every row; causal: every row up to the rank's last query (the ring's causal rules:
  blocks wholly before, on or after the diagonal, head-tail chunks included);
* band (``pre_tockens`` / ``next_tockens``): the keys within the band of some query;
* packed documents: the keys of the documents the rank's queries are in (causal: up to the
  rank's last query of that document; band: within the band of one of its queries of that
  document);
* a given mask: the columns with an unmasked entry in the rank's rows (``given_columns`` reads
  them once per call, and the ranks share them over the CPU side group: each rank holds only
  its own rows).

Positional need sets are a function of (mask, every rank's positions): every rank computes
those it sends and those it receives without communicating (cached per configuration).
Stage s = 1..W-1 of the exchange: rank r sends rank r+s the rows it needs of r's block and
receives from rank r-s the rows it needs of that block (``ExchangePlan``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..documents import document_positions, sequence_positions
from ..kernels import StepMask
from ..npu_ops import INT_MAX
from ..placement import sequence_pieces
from ..plan import CallPlan, MaskSpec
from .transport import side_group

__all__ = ["BlockTask", "band_task", "step_part", "plan_step", "hops_needed", "chunks", "given_columns", "PARTS", "needed_keys",
           "rank_positions", "StageRows", "ExchangePlan", "exchange_plan"]

PARTS = ("causal", "full", "q_tail", "kv_head", "band", "masked", "skip")


@dataclass(frozen=True)
class BlockTask:
    """One kernel call of a step: local query rows x rows of the K/V block, (start, length)."""

    q_rows: tuple[int, int]
    kv_rows: tuple[int, int]
    mask: StepMask


_NONE = StepMask("none")


def step_part(rank: int, index: int, world_size: int, causal: bool, load_balance: bool) -> str:
    """Which part of the block pair step ``index`` on ``rank`` computes (full and causal)."""
    if not causal:
        return "full"
    if index == 0:
        return "causal"
    source = (rank - index) % world_size
    if source < rank:
        return "kv_head" if load_balance else "full"
    return "q_tail" if load_balance else "skip"


def chunks(rank: int, world_size: int, length: int, load_balance: bool) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the chunks a rank holds (``placement.sequence_pieces``)."""
    return [(p.local, p.start, p.length) for p in sequence_pieces(rank, world_size, length, load_balance)]


def _causal_tasks(part: str, q_len: int, kv_len: int) -> list[BlockTask]:
    if part == "skip":
        return []
    if part == "q_tail":
        half = q_len // 2
        return [BlockTask((half, q_len - half), (0, kv_len), _NONE)]
    if part == "kv_head":
        return [BlockTask((0, q_len), (0, kv_len // 2), _NONE)]
    return [BlockTask((0, q_len), (0, kv_len), StepMask("causal") if part == "causal" else _NONE)]


def _shift(tockens: int, by: int) -> int:
    return INT_MAX if tockens >= INT_MAX else min(tockens + by, INT_MAX)


def band_task(q_chunk, kv_chunk, pre: int, nxt: int) -> Optional[BlockTask]:
    """The band's part of one (query chunk, key chunk) pair, each (local start, global start,
    length), or None when it misses it."""
    (q_local, q_global, lq), (k_local, k_global, lk) = q_chunk, kv_chunk
    delta = q_global - k_global
    # in block coordinates, query i' sees key j' iff -(pre - delta) <= j' - i' <= next + delta
    low, high = -_shift(pre, -delta), _shift(nxt, delta)
    if low > lk - 1 or high < -(lq - 1) or low > high:
        return None
    rows, cols = (q_local, lq), (k_local, lk)
    if low <= -(lq - 1) and high >= lk - 1:
        return BlockTask(rows, cols, _NONE)
    # the op's band (sparse_mode 4) is anchored at the bottom-right corner: d = lk - lq
    d = lk - lq
    return BlockTask(rows, cols, StepMask("band", pre_tockens=_shift(-low, d), next_tockens=_shift(high, -d)))


def _given_task(mask_rows: Tensor, q_chunk, kv_chunk, spec: MaskSpec) -> Optional[BlockTask]:
    (q_local, q_global, lq), (k_local, k_global, lk) = q_chunk, kv_chunk
    block = mask_rows[..., q_local:q_local + lq, k_global:k_global + lk]
    masked = block.bool()
    if spec.window:
        i = torch.arange(lq, device=block.device).view(-1, 1) + q_global
        j = torch.arange(lk, device=block.device).view(1, -1) + k_global
        masked = masked | (j - i > spec.next_tockens) | (i - j > spec.pre_tockens)
    if bool(masked.all()):
        return None
    rows, cols = (q_local, lq), (k_local, lk)
    if not bool(masked.any()):
        return BlockTask(rows, cols, _NONE)
    return BlockTask(rows, cols, StepMask("given", block=masked.contiguous()))


def given_columns(mask_rows: Tensor, spec: MaskSpec, q_pos: Tensor, total: int) -> Tensor:
    """bool [total] on the host: the global keys some of this rank's queries may attend to under a
    given mask (``mask_rows``: its rows at the global query positions ``q_pos``, True = masked
    out; the band of ``sparse_mode=0`` folded in). One host read per call: the need set of the
    direct exchange depends on the mask's values."""
    rows = mask_rows.shape[-2]
    allowed = ~mask_rows.bool().reshape(-1, rows, mask_rows.shape[-1]).all(0)
    if spec.window:
        i = q_pos.to(allowed.device).view(-1, 1)
        j = torch.arange(total, device=allowed.device).view(1, -1)
        allowed = allowed & (j - i <= spec.next_tockens) & (i - j <= spec.pre_tockens)
    return allowed.any(0).cpu()


def plan_step(rank: int, index: int, world_size: int, load_balance: bool, spec: MaskSpec,
              q_len: int, kv_len: int, mask_rows: Optional[Tensor] = None) -> tuple[str, list[BlockTask]]:
    """(part, tasks) of step ``index`` on ``rank``; ``mask_rows``: the given mask's rows of
    this rank's queries, in local order, with the columns of the whole sequence. Positional
    masks are planned once per step (the same every call of a layer); given masks every call."""
    if not spec.given:
        return _positional_step(rank, index, world_size, load_balance, spec, q_len, kv_len)
    return _planned_step(rank, index, world_size, load_balance, spec, q_len, kv_len, mask_rows)


@functools.lru_cache(maxsize=1024)
def _positional_step(rank: int, index: int, world_size: int, load_balance: bool, spec: MaskSpec, q_len: int,
                     kv_len: int) -> tuple[str, tuple[BlockTask, ...]]:
    part, tasks = _planned_step(rank, index, world_size, load_balance, spec, q_len, kv_len, None)
    return part, tuple(tasks)


def _planned_step(rank: int, index: int, world_size: int, load_balance: bool, spec: MaskSpec, q_len: int,
                  kv_len: int, mask_rows: Optional[Tensor]) -> tuple[str, list[BlockTask]]:
    if not spec.window and not spec.given:
        part = step_part(rank, index, world_size, spec.causal, load_balance)
        return part, _causal_tasks(part, q_len, kv_len)
    source = (rank - index) % world_size
    tasks = []
    for q_chunk in chunks(rank, world_size, q_len, load_balance):
        for kv_chunk in chunks(source, world_size, kv_len, load_balance):
            if spec.given:
                task = _given_task(mask_rows, q_chunk, kv_chunk, spec)
            else:
                task = band_task(q_chunk, kv_chunk, spec.pre_tockens, spec.next_tockens)
            if task is not None:
                tasks.append(task)
    if not tasks:
        return "skip", tasks
    return ("masked" if spec.given else "band"), tasks


@functools.lru_cache(maxsize=256)  # asked by every ring call, forward and backward: O(W^2) plans
def hops_needed(world_size: int, load_balance: bool, spec: MaskSpec, length: int) -> int:
    """The last ring step in which any rank computes something (band attention: on every
    rank; other kinds need every hop). Ranks agree on it without communication."""
    if not spec.window or spec.given or world_size == 1:
        return world_size - 1
    last = 0
    for rank in range(world_size):
        for index in range(1, world_size):
            if index > last and plan_step(rank, index, world_size, load_balance, spec, length, length)[1]:
                last = index
    return last


# ---------------------------------------------------------------- which rows each step needs



def needed_keys(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor, documents: tuple = ()) -> Tensor:
    """bool over ``k_pos``: whether some query at the positions ``q_pos`` may attend to that key
    (positional masks and packed documents; a given mask's columns are ``given_columns``)."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return torch.zeros(k_pos.numel(), dtype=torch.bool)
    if documents:
        return _document_need(spec, q_pos, k_pos, documents)
    if spec.causal:
        return k_pos <= q_pos.max()
    if spec.window:
        # some query i with k - next <= i <= k + pre
        return _some_query_within(q_pos, k_pos - spec.next_tockens, k_pos + spec.pre_tockens)
    return torch.ones(k_pos.numel(), dtype=torch.bool)


def _some_query_within(q_pos: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """bool per entry: whether some position of ``q_pos`` lies in [low, high]."""
    q_sorted = q_pos.sort().values
    return torch.searchsorted(q_sorted, high, right=True) > torch.searchsorted(q_sorted, low)


def _document_need(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor, documents: tuple) -> Tensor:
    ends = torch.tensor(documents, dtype=torch.int64)
    k_doc = torch.searchsorted(ends, k_pos, right=True)
    q_doc = torch.searchsorted(ends, q_pos, right=True)
    # the last query position of each document on this rank (-1: none)
    last = torch.full((len(documents),), -1, dtype=torch.int64).scatter_reduce(0, q_doc, q_pos, "amax")
    reach = last[k_doc]
    if not spec.window:
        return (reach >= k_pos) if spec.causal else (reach >= 0)
    # the band inside the key's document: its queries from k - next to k + pre
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    low = torch.maximum(k_pos - spec.next_tockens, starts[k_doc])
    high = torch.minimum(k_pos + spec.pre_tockens, ends[k_doc] - 1)
    banded = _some_query_within(q_pos, low, high)
    band_document = spec.band_document_index(len(documents))
    if band_document is None:
        return banded
    return torch.where(k_doc == band_document, banded, reach >= k_pos)  # sparse_mode 7 / 8: the others causal


def rank_positions(plan: CallPlan, lengths: list) -> list[tuple[Tensor, Tensor]]:
    """(query positions, key positions) of every rank, in local order; ``lengths``: every rank's
    (local query length, local K/V length). Uneven shards (full or causal, contiguous) lie in
    rank order. For the causal rules a rank's queries sit at its keys' positions (the blocks
    are wholly before, on or after the diagonal whatever the query lengths)."""
    world = plan.world_size
    if plan.packed:
        held = [document_positions(plan.documents, p, world, plan.document_placement) for p in range(world)]
        return [(pos, pos) for pos in held]
    if len({q for q, _ in lengths}) == 1 and len({kv for _, kv in lengths}) == 1:
        keys = [sequence_positions(p, world, kv, plan.load_balance) for p, (_, kv) in enumerate(lengths)]
        queries = [sequence_positions(p, world, q, plan.load_balance) for p, (q, _) in enumerate(lengths)]
    else:
        keys = _contiguous([kv for _, kv in lengths])
        queries = _contiguous([q for q, _ in lengths])
    if plan.mask.causal:
        queries = keys
    return list(zip(queries, keys))


def _contiguous(lengths: list[int]) -> list[Tensor]:
    starts = [sum(lengths[:p]) for p in range(len(lengths))]
    return [torch.arange(s, s + n) for s, n in zip(starts, lengths)]


@dataclass(frozen=True)
class StageRows:
    """Rows of one stage, local indices of a block in order (``index`` None: all ``count`` rows
    of a block of ``count`` rows; ``count`` 0: none); ``start``: the first of them where they are
    consecutive (known on the host: a narrow serves instead of the index)."""

    index: Optional[Tensor]
    count: int
    start: Optional[int] = None

    @staticmethod
    def of(needed: Tensor) -> "StageRows":
        count = int(needed.sum())
        if count == needed.numel():
            return StageRows(None, count)
        index = needed.nonzero().flatten()
        first = int(index[0]) if count else None
        consecutive = count and int(index[-1]) - first + 1 == count
        return StageRows(index, count, first if consecutive else None)

    def on(self, device: torch.device) -> "StageRows":
        return self if self.index is None else StageRows(self.index.to(device), self.count, self.start)

    def taken(self, t: Tensor, dim: int) -> Tensor:
        """These rows of ``t`` (a block) on ``dim``: ``t`` itself (all), a view (consecutive) or a copy."""
        if self.index is None:
            return t
        if self.start is not None:
            return t.narrow(dim, self.start, self.count)
        return t.index_select(dim, self.index)

    def placed(self, buffer: Tensor, dim: int, rows: Tensor) -> Tensor:
        """``buffer`` (a block) with ``rows`` (these rows of it) copied in place."""
        if self.start is not None:
            buffer.narrow(dim, self.start, self.count).copy_(rows)
            return buffer
        return buffer.index_copy_(dim, self.index, rows)


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's stages: ``send[s]`` rows of its own block for rank r+s, ``recv[s]`` rows of
    rank r-s's block it needs (s = 1..W-1; index 0 is the rank's own block, unused)."""

    send: tuple[StageRows, ...]
    recv: tuple[StageRows, ...]
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property  # plans are cached and read every call
    def rows_sent(self) -> int:
        return sum([r.count for r in self.send[1:]])

    @functools.cached_property
    def rows_received(self) -> int:
        return sum([r.count for r in self.recv[1:]])

    def on(self, device: torch.device) -> "ExchangePlan":
        """The same plan with its indices on ``device`` (copied once per device)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = ExchangePlan(tuple(rows.on(device) for rows in self.send),
                                                tuple(rows.on(device) for rows in self.recv))
        return self._on_device[key]


def _plan_from(need, world: int, rank: int) -> ExchangePlan:
    """``need(receiver, source) -> bool over the source's keys``, as this rank's stages."""
    send = [StageRows(None, 0)] + [StageRows.of(need((rank + s) % world, rank)) for s in range(1, world)]
    recv = [StageRows(None, 0)] + [StageRows.of(need(rank, (rank - s) % world)) for s in range(1, world)]
    return ExchangePlan(tuple(send), tuple(recv))


@functools.lru_cache(maxsize=256)  # the positional plans: one per (mask, layout, lengths) and rank
def _positional_plan(plan: CallPlan, lengths: tuple) -> ExchangePlan:
    held = rank_positions(plan, list(lengths))
    documents = plan.documents if plan.packed else ()
    return _plan_from(lambda r, p: needed_keys(plan.mask, held[r][0], held[p][1], documents),
                      plan.world_size, plan.rank)


def _given_plan(plan: CallPlan, lengths: list, mask_rows: Tensor, group) -> ExchangePlan:
    held = rank_positions(plan, lengths)
    total = sum(kv for _, kv in lengths)
    mine = given_columns(mask_rows, plan.mask, held[plan.rank][0], total)
    columns = _share_columns(mine, group, plan.world_size)
    return _plan_from(lambda r, p: columns[r][held[p][1]], plan.world_size, plan.rank)


def _share_columns(mine: Tensor, group, world: int) -> list[Tensor]:
    """Every rank's bool columns (each rank holds its own): packed to bits, one all_gather on the
    CP group's CPU side group."""
    total = mine.numel()
    bits = torch.zeros((total + 7) // 8 * 8, dtype=torch.uint8)
    bits[:total] = mine.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    packed = (bits.view(-1, 8) * weights).sum(1).to(torch.uint8)
    gathered = side_group(group).all_gather(packed)
    return [((g.view(-1, 1) & weights) != 0).flatten()[:total] for g in gathered]


def exchange_plan(plan: CallPlan, lengths: list, *, group=None, mask_rows: Optional[Tensor] = None) -> ExchangePlan:
    """This rank's ``ExchangePlan`` for a ring call of ``plan`` (``lengths``: every rank's (query,
    K/V) lengths; ``mask_rows``: a given mask's rows of this rank, whose columns the ranks share
    over ``group``'s side group)."""
    if plan.world_size == 1:
        return ExchangePlan((StageRows(None, 0),), (StageRows(None, 0),))
    if plan.mask.given:
        return _given_plan(plan, lengths, mask_rows, group)
    return _positional_plan(_positional_key(plan), tuple(map(tuple, lengths)))


@functools.lru_cache(maxsize=256)  # a layer's calls repeat their plan
def _positional_key(plan: CallPlan) -> CallPlan:
    """The plan with only what the need sets depend on (so calls differing in anything else,
    heads, scale, kernel, share one cache entry)."""
    return CallPlan(world_size=plan.world_size, rank=plan.rank, layout=plan.layout, head_num=1, scale=1.0,
                    keep_prob=1.0, mask=plan.mask, load_balance=plan.load_balance, documents=plan.documents,
                    placement=plan.placement)
