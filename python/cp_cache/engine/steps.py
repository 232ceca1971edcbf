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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..kernels.base import StepMask
from ..npu_ops import INT_MAX
from ..placement import sequence_pieces
from ..plan import MaskSpec

__all__ = ["BlockTask", "step_part", "plan_step", "hops_needed", "chunks", "given_columns", "PARTS"]

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


def _band_task(q_chunk, kv_chunk, pre: int, nxt: int) -> Optional[BlockTask]:
    """The band's part of one (query chunk, key chunk) pair, or None when it misses it."""
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
    this rank's queries, in local order, with the columns of the whole sequence."""
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
                task = _band_task(q_chunk, kv_chunk, spec.pre_tockens, spec.next_tockens)
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
