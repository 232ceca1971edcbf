"""Which K/V rows each rank needs from each other rank, and what the direct exchange sends.

Rank r holds global positions P_r (queries and keys in the same local order). It needs from
rank p the rows of p's block that some query of P_r may attend to: the lower bound of any
exchange is those rows and no others. The mask decides, on global positions:

* full: every row; causal: every row up to the rank's last query (the ring's causal rules:
  blocks wholly before, on or after the diagonal, head-tail chunks included);
* band (``pre_tockens`` / ``next_tockens``): the keys within the band of some query;
* packed documents: the keys of the documents the rank's queries are in (causal: up to the
  rank's last query of that document);
* a given mask: the columns with an unmasked entry in the rank's rows (``given_columns`` in
  ``engine/steps.py`` reads them once per call, and the ranks share them over the CPU side
  group: each rank holds only its own rows).

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
from ..plan import CallPlan, MaskSpec
from .steps import given_columns
from .transport import side_group

__all__ = ["needed_keys", "rank_positions", "StageRows", "ExchangePlan", "exchange_plan"]


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
        q_sorted = q_pos.sort().values
        # some query i with k - next <= i <= k + pre
        first = torch.searchsorted(q_sorted, k_pos - spec.next_tockens)
        past = torch.searchsorted(q_sorted, k_pos + spec.pre_tockens, right=True)
        return past > first
    return torch.ones(k_pos.numel(), dtype=torch.bool)


def _document_need(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor, documents: tuple) -> Tensor:
    ends = torch.tensor(documents, dtype=torch.int64)
    q_doc = torch.searchsorted(ends, q_pos, right=True)
    k_doc = torch.searchsorted(ends, k_pos, right=True)
    # the last query position of each document on this rank (-1: none)
    last = torch.full((len(documents),), -1, dtype=torch.int64).scatter_reduce(0, q_doc, q_pos, "amax")
    reach = last[k_doc]
    return (reach >= k_pos) if spec.causal else (reach >= 0)


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
    of a block of ``count`` rows; ``count`` 0: none)."""

    index: Optional[Tensor]
    count: int

    @staticmethod
    def of(needed: Tensor) -> "StageRows":
        count = int(needed.sum())
        if count == needed.numel():
            return StageRows(None, count)
        return StageRows(needed.nonzero().flatten(), count)

    def on(self, device: torch.device) -> "StageRows":
        return self if self.index is None else StageRows(self.index.to(device), self.count)


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's stages: ``send[s]`` rows of its own block for rank r+s, ``recv[s]`` rows of
    rank r-s's block it needs (s = 1..W-1; index 0 is the rank's own block, unused)."""

    send: tuple[StageRows, ...]
    recv: tuple[StageRows, ...]
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows_sent(self) -> int:
        return sum(r.count for r in self.send[1:])

    @property
    def rows_received(self) -> int:
        return sum(r.count for r in self.recv[1:])

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


def _positional_key(plan: CallPlan) -> CallPlan:
    """The plan with only what the need sets depend on (so calls differing in anything else,
    heads, scale, kernel, share one cache entry)."""
    return CallPlan(world_size=plan.world_size, rank=plan.rank, layout=plan.layout, head_num=1, scale=1.0,
                    keep_prob=1.0, mask=plan.mask, load_balance=plan.load_balance, documents=plan.documents,
                    placement=plan.placement)
