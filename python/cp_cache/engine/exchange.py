"""Which K/V rows the direct exchange moves: at stage s rank r sends rank r+s the rows some query of r+s may see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..documents import document_positions, sequence_positions
from ..masks import given, needed_keys
from .agreement import side_group

__all__ = ["rank_positions", "StageRows", "ExchangePlan", "exchange_plan"]


def rank_positions(plan, lengths: list) -> list[tuple[Tensor, Tensor]]:
    """Every rank's (query, key) positions in local order; uneven shards lie contiguous in rank order."""
    world = plan.world_size
    if plan.packed:
        held = [document_positions(plan.documents, p, world, plan.document_placement) for p in range(world)]
        return [(pos, pos) for pos in held]
    if len({q for q, _ in lengths}) == 1 and len({kv for _, kv in lengths}) == 1:
        keys = [sequence_positions(p, world, kv, plan.load_balance) for p, (_, kv) in enumerate(lengths)]
        queries = [sequence_positions(p, world, q, plan.load_balance) for p, (q, _) in enumerate(lengths)]
    else:
        keys, queries = _contiguous([kv for _, kv in lengths]), _contiguous([q for q, _ in lengths])
    if plan.mask.causal:
        queries = keys
    return list(zip(queries, keys))


def _contiguous(lengths: list[int]) -> list[Tensor]:
    return [torch.arange(sum(lengths[:p]), sum(lengths[:p]) + n) for p, n in enumerate(lengths)]


@dataclass(frozen=True)
class StageRows:
    """One stage's rows of a block (``index`` None: all); ``start``: the first where they are consecutive."""
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


@dataclass(frozen=True)
class ExchangePlan:
    """``send[s]``: rows of this block for rank r+s; ``recv[s]``: rows it needs of rank r-s's (0 unused)."""
    send: tuple[StageRows, ...]
    recv: tuple[StageRows, ...]
    rows_sent: int = field(init=False)
    rows_received: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "rows_sent", sum([r.count for r in self.send[1:]]))
        object.__setattr__(self, "rows_received", sum([r.count for r in self.recv[1:]]))

    def on(self, device: torch.device) -> "ExchangePlan":
        return ExchangePlan(tuple(rows.on(device) for rows in self.send), tuple(rows.on(device) for rows in self.recv))


def _plan_from(need, world: int, rank: int) -> ExchangePlan:
    """``need(receiver, source) -> bool over the source's keys``, as this rank's stages."""
    send = [StageRows(None, 0)] + [StageRows.of(need((rank + s) % world, rank)) for s in range(1, world)]
    recv = [StageRows(None, 0)] + [StageRows.of(need(rank, (rank - s) % world)) for s in range(1, world)]
    return ExchangePlan(tuple(send), tuple(recv))


def exchange_plan(plan, lengths: list, *, group=None, mask_rows: Optional[Tensor] = None) -> ExchangePlan:
    """This rank's ``ExchangePlan``; ``mask_rows``: a given mask's rows of this rank (columns shared)."""
    if plan.world_size == 1:
        return ExchangePlan((StageRows(None, 0),), (StageRows(None, 0),))
    held = rank_positions(plan, lengths)
    if plan.mask.given:
        total = sum(kv for _, kv in lengths)
        columns = _share_columns(given.columns(mask_rows, plan.mask, held[plan.rank][0], total), group)
        return _plan_from(lambda r, p: columns[r][held[p][1]], plan.world_size, plan.rank)
    documents = plan.documents if plan.packed else ()
    return _plan_from(lambda r, p: needed_keys(plan.mask, held[r][0], held[p][1], documents),
                      plan.world_size, plan.rank)


def _share_columns(mine: Tensor, group) -> list[Tensor]:
    """Every rank's bool columns, packed to bits: one all_gather on the CP group's CPU side group."""
    total = mine.numel()
    bits = torch.zeros((total + 7) // 8 * 8, dtype=torch.uint8)
    bits[:total] = mine.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    packed = (bits.view(-1, 8) * weights).sum(1).to(torch.uint8)
    gathered = side_group(group).all_gather(packed)
    return [((g.view(-1, 1) & weights) != 0).flatten()[:total] for g in gathered]
