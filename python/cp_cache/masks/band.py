"""A band (sliding window): query i sees keys i - pre_tockens <= j <= i + next_tockens (sparse_mode 4;
a causal window of w keys is (w - 1, 0)); under packed documents inside each document (7 / 8: only in
the last / first, the others causal). A chunk pair the band misses is skipped, one it covers is full,
else a band task shifted by the chunks' offsets; on contiguous shards the ring stops after the last
hop any rank needs."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..npu_ops import INT_MAX, band_arguments
from . import causal
from .base import NONE, BlockTask, MaskSpec, Segment, StepMask, VarlenCall, VarlenStep, block_positions, chunk_tasks

__all__ = ["band_task", "plan_step", "hops_needed", "needed", "some_query_within", "document_needed",
           "document_step", "pairs", "npu_arguments", "masked"]


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
        return BlockTask(rows, cols, NONE)
    d = lk - lq  # the op's band is anchored at the bottom-right corner
    return BlockTask(rows, cols, StepMask("band", pre_tockens=_shift(-low, d), next_tockens=_shift(high, -d)))


def plan_step(rank: int, index: int, world_size: int, load_balance: bool, spec: MaskSpec, q_len: int,
              kv_len: int, mask_rows=None) -> tuple[str, list[BlockTask]]:
    tasks = chunk_tasks(functools.partial(band_task, pre=spec.pre_tockens, nxt=spec.next_tockens), rank, index,
                        world_size, q_len, kv_len, load_balance)
    return ("band" if tasks else "skip"), tasks


@functools.lru_cache(maxsize=256)  # asked by every ring call: O(W^2) plans
def hops_needed(world_size: int, load_balance: bool, spec: MaskSpec, length: int) -> int:
    """The last ring step in which any rank computes something."""
    last = 0
    for rank in range(world_size):
        for index in range(last + 1, world_size):
            if plan_step(rank, index, world_size, load_balance, spec, length, length)[1]:
                last = index
    return last


def some_query_within(q_pos: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """bool per entry: whether some position of ``q_pos`` lies in [low, high]."""
    q_sorted = q_pos.sort().values
    return torch.searchsorted(q_sorted, high, right=True) > torch.searchsorted(q_sorted, low)


def needed(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    return some_query_within(q_pos, k_pos - spec.next_tockens, k_pos + spec.pre_tockens)


def document_needed(spec: MaskSpec, reach: Tensor, k_pos: Tensor, *, q_pos: Tensor, ends: Tensor,
                    k_doc: Tensor) -> Tensor:
    """Packed documents: the keys within the band of some query of their document."""
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    low = torch.maximum(k_pos - spec.next_tockens, starts[k_doc])
    high = torch.minimum(k_pos + spec.pre_tockens, ends[k_doc] - 1)
    banded = some_query_within(q_pos, low, high)
    band_document = spec.band_document_index(len(ends))
    if band_document is None:
        return banded
    return torch.where(k_doc == band_document, banded, reach >= k_pos)  # sparse_mode 7 / 8: the others causal


def _band_calls(mine: dict, theirs: dict, pre: int, nxt: int) -> tuple[VarlenCall, ...]:
    """One segment per (query piece, key piece) pair of a document the band touches; segments of
    equal masks share a call unless they share query rows (a call's outputs merge row by row)."""
    calls: list[tuple[StepMask, list[Segment], set[int]]] = []
    for doc, pieces in mine.items():
        for q_piece in pieces:
            for kv_piece in theirs.get(doc, ()):
                task = band_task(q_piece, kv_piece, pre, nxt)
                if task is None:
                    continue
                segment = Segment(doc, *task.q_rows, *task.kv_rows)
                call = next((c for c in calls if c[0] == task.mask and segment.q_start not in c[2]), None)
                if call is None:
                    call = (task.mask, [], set())
                    calls.append(call)
                call[1].append(segment)
                call[2].add(segment.q_start)
    return tuple(VarlenCall(mask, tuple(segments)) for mask, segments, _ in calls)


def document_step(mine: dict, theirs: dict, rank: int, source: int, index: int, placement: str,
                  spec: MaskSpec, documents: int) -> VarlenStep:
    """The band inside each document of ``mine`` (or only in ``spec``'s band document, the others
    causal): one kernel call per distinct shifted band."""
    band_document = spec.band_document_index(documents)
    banded = mine if band_document is None else {d: p for d, p in mine.items() if d == band_document}
    calls = _band_calls(banded, theirs, spec.pre_tockens, spec.next_tockens)
    if band_document is None:
        return VarlenStep("band" if calls else "skip", calls)
    others = causal.document_step({d: p for d, p in mine.items() if d != band_document}, theirs, rank, source,
                                  index, placement)
    return VarlenStep("band" if calls else others.part, others.calls + calls)


def pairs(step: StepMask, q_len: int, kv_len: int) -> int:
    """(query, key) pairs of a block under the op's band, anchored at its bottom-right corner."""
    d = kv_len - q_len
    i = torch.arange(q_len, dtype=torch.int64)
    first = (i - step.pre_tockens + d).clamp(min=0)
    last = (i + step.next_tockens + d).clamp(max=kv_len - 1)
    return int((last - first + 1).clamp(min=0).sum())


def npu_arguments(step: StepMask, device, layout: str) -> dict:
    return band_arguments(device, step.pre_tockens, step.next_tockens)


def masked(step: StepMask, sq: int, sk: int, device):
    i, j = block_positions(sq, sk, device)
    d = sk - sq
    return (j - i > step.next_tockens + d) | (i - j > step.pre_tockens - d)
