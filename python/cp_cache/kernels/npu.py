"""NPU step kernel: torch.ops.npu.npu_fusion_attention_v3 and its grad (real ops or the emulator)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from ..masks import StepMask, npu_arguments
from ..npu_ops import lse_from_stats, op_exists, stats_from_lse
from .base import StepForward

__all__ = ["NpuKernel", "available"]


def available() -> bool:
    """Whether ``torch.ops.npu.npu_fusion_attention_v3`` exists (real or emulated)."""
    return op_exists("npu_fusion_attention_v3")


def _mask_args(mask: StepMask, device: torch.device, layout: str) -> dict:
    if mask.kind == "given":  # its block: a tensor of its own each call
        return npu_arguments(mask, device, layout)
    return _positional_mask_args(mask, device, layout)


@functools.lru_cache(maxsize=64)  # a few masks serve every call
def _positional_mask_args(mask: StepMask, device: torch.device, layout: str) -> dict:
    return npu_arguments(mask, device, layout)


def _layout_args(layout: str, actual_seq_lens) -> dict:
    """TND takes the segments' cumulative ends (q, kv) as CPU int64 tensors; the other layouts none."""
    if layout == L.TND:
        if actual_seq_lens is None:
            raise ValueError("input_layout='TND' needs actual_seq_lens (cumulative q and kv segment ends)")
        return dict(actual_seq_qlen=actual_seq_lens[0], actual_seq_kvlen=actual_seq_lens[1])
    return {}  # the op checks the layout


class NpuKernel:
    """Step kernel over the fused NPU attention ops; with layout TND one call takes all the step's
    segments (``actual_seq_lens``: their cumulative q and kv ends) and the LSE is [T, N]."""

    name = "npu"
    takes_tnd = True

    def forward(self, q, k, v, *, layout, head_num, scale, keep_prob, mask: StepMask,
                actual_seq_lens=None) -> StepForward:
        res = torch.ops.npu.npu_fusion_attention_v3(q, k, v, head_num, layout, scale=float(scale),
                                                    keep_prob=float(keep_prob), **_layout_args(layout, actual_seq_lens),
                                                    **_mask_args(mask, q.device, layout))
        return StepForward(out=res[0], lse=lse_from_stats(res[1], res[2]), seed=res[4], offset=res[5])

    def backward(self, q, k, v, dout, out, lse, *, layout, head_num, scale, keep_prob, mask: StepMask,
                 seed: Optional[Tensor], offset: Optional[Tensor], actual_seq_lens=None):
        args = dict(_layout_args(layout, actual_seq_lens), **_mask_args(mask, q.device, layout))
        smax, ssum = stats_from_lse(lse)  # after the kernel's own helpers: one visit to npu_ops per call
        res = torch.ops.npu.npu_fusion_attention_grad_v3(
            q, k, v, dout, head_num, layout, softmax_max=smax, softmax_sum=ssum, attention_in=out,
            scale_value=float(scale), keep_prob=float(keep_prob), seed=seed, offset=offset, **args)
        return res[0], res[1], res[2]
