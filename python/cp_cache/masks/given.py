"""A given mask: an explicit bool/uint8 ``[.., S, S]`` mask over the global sequence (1 = masked out;
sparse_mode 0 folds the band of pre/next_tockens in, 1 takes the mask as it is). Each step uses the
mask's block at its query rows and key columns; wholly masked blocks are skipped. The rows each rank
needs depend on the mask's values: ``columns`` reads them once per call (one host read)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..npu_ops import SparseMode
from .base import NONE, BlockTask, MaskSpec, StepMask, chunk_tasks

__all__ = ["plan_step", "columns", "pairs", "npu_arguments", "masked"]


def _task(q_chunk, kv_chunk, mask_rows: Tensor, spec: MaskSpec) -> Optional[BlockTask]:
    (q_local, q_global, lq), (k_local, k_global, lk) = q_chunk, kv_chunk
    block = mask_rows[..., q_local:q_local + lq, k_global:k_global + lk]
    masked_out = block.bool()
    if spec.window:
        i = torch.arange(lq, device=block.device).view(-1, 1) + q_global
        j = torch.arange(lk, device=block.device).view(1, -1) + k_global
        masked_out = masked_out | (j - i > spec.next_tockens) | (i - j > spec.pre_tockens)
    if bool(masked_out.all()):
        return None
    rows, cols = (q_local, lq), (k_local, lk)
    if not bool(masked_out.any()):
        return BlockTask(rows, cols, NONE)
    return BlockTask(rows, cols, StepMask("given", block=masked_out.contiguous()))


def plan_step(rank: int, index: int, world_size: int, load_balance: bool, spec: MaskSpec, q_len: int,
              kv_len: int, mask_rows: Tensor) -> tuple[str, list[BlockTask]]:
    """``mask_rows``: the mask's rows of this rank's queries, in local order, over the whole sequence."""
    tasks = chunk_tasks(functools.partial(_task, mask_rows=mask_rows, spec=spec), rank, index, world_size, q_len,
                        kv_len, load_balance)
    return ("masked" if tasks else "skip"), tasks


def columns(mask_rows: Tensor, spec: MaskSpec, q_pos: Tensor, total: int) -> Tensor:
    """bool [total] on the host: the global keys some of this rank's queries (at ``q_pos``) may see."""
    rows = mask_rows.shape[-2]
    allowed = ~mask_rows.bool().reshape(-1, rows, mask_rows.shape[-1]).all(0)
    if spec.window:
        i = q_pos.to(allowed.device).view(-1, 1)
        j = torch.arange(total, device=allowed.device).view(1, -1)
        allowed = allowed & (j - i <= spec.next_tockens) & (i - j <= spec.pre_tockens)
    return allowed.any(0).cpu()


def pairs(step: StepMask, q_len: int, kv_len: int) -> int:
    return int((~step.block.bool()).sum())


def npu_arguments(step: StepMask, device, layout: str) -> dict:
    return dict(atten_mask=step.block, sparse_mode=int(SparseMode.ALL_MASK))


def masked(step: StepMask, sq: int, sk: int, device):
    return step.block.bool()
