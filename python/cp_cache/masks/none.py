"""Full attention: every query sees every key (no ``atten_mask``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..npu_ops import SparseMode
from .base import NONE, BlockTask, MaskSpec, StepMask

__all__ = ["plan_step", "needed", "document_needed", "pairs", "npu_arguments", "masked"]


def plan_step(rank, index, world_size, load_balance, spec: MaskSpec, q_len: int, kv_len: int, mask_rows=None):
    return "full", [BlockTask((0, q_len), (0, kv_len), NONE)]


def needed(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    return torch.ones(k_pos.numel(), dtype=torch.bool)


def document_needed(spec: MaskSpec, reach: Tensor, k_pos: Tensor, **_) -> Tensor:
    """Packed documents: every key of a document some query of the rank is in (``reach`` >= 0)."""
    return reach >= 0


def pairs(step: StepMask, q_len: int, kv_len: int) -> int:
    return q_len * kv_len


def npu_arguments(step: StepMask, device, layout: str) -> dict:
    return dict(atten_mask=None, sparse_mode=int(SparseMode.MASK))


def masked(step: StepMask, sq: int, sk: int, device):
    return None
