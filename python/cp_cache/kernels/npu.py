"""NPU step kernel: torch.ops.npu.npu_fusion_attention_v3 and its grad (real ops or the emulator)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from ..npu_ops import SparseMode, causal_mask, lse_from_stats, op_exists, stats_from_lse
from .base import StepForward, StepMask

__all__ = ["NpuKernel", "available"]


def available() -> bool:
    """Whether ``torch.ops.npu.npu_fusion_attention_v3`` exists (real or emulated)."""
    return op_exists("npu_fusion_attention_v3")


def _mask_args(mask: StepMask, device: torch.device) -> dict:
    if mask.kind == "none":
        return dict(atten_mask=None, sparse_mode=int(SparseMode.MASK))
    if mask.kind == "causal":
        return dict(atten_mask=causal_mask(device), sparse_mode=int(SparseMode.LEFT_UP_CAUSAL), next_tockens=0)
    if mask.kind == "band":
        return dict(atten_mask=causal_mask(device), sparse_mode=int(SparseMode.BAND),
                    pre_tockens=mask.pre_tockens, next_tockens=mask.next_tockens)
    if mask.kind == "given":
        return dict(atten_mask=mask.block, sparse_mode=int(SparseMode.ALL_MASK))
    raise ValueError(f"unknown step mask kind {mask.kind!r}")


class NpuKernel:
    """Step kernel over the fused NPU attention ops."""

    name = "npu"

    def forward(self, q, k, v, *, layout, head_num, scale, keep_prob, mask: StepMask) -> StepForward:
        L.check_layout(layout)
        res = torch.ops.npu.npu_fusion_attention_v3(
            q, k, v, head_num, layout,
            scale=float(scale), keep_prob=float(keep_prob),
            **_mask_args(mask, q.device),
        )
        out, smax, ssum = res[0], res[1], res[2]
        return StepForward(out=out, lse=lse_from_stats(smax, ssum), seed=res[4], offset=res[5])

    def backward(
        self, q, k, v, dout, out, lse, *, layout, head_num, scale, keep_prob, mask: StepMask,
        seed: Optional[Tensor], offset: Optional[Tensor],
    ):
        L.check_layout(layout)
        smax, ssum = stats_from_lse(lse)
        res = torch.ops.npu.npu_fusion_attention_grad_v3(
            q, k, v, dout, head_num, layout,
            softmax_max=smax, softmax_sum=ssum, attention_in=out,
            scale_value=float(scale), keep_prob=float(keep_prob),
            seed=seed, offset=offset,
            **_mask_args(mask, q.device),
        )
        return res[0], res[1], res[2]
