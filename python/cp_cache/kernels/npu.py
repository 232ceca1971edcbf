"""NPU step kernel: torch.ops.npu.npu_fusion_attention_v3 and its grad (real ops or the emulator)."""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from .base import StepForward

__all__ = ["NpuKernel", "causal_mask", "available", "stats_from_lse", "lse_from_stats"]

log = logging.getLogger("cp_cache")

# compressed left-up causal mask for sparse_mode 2 (True = masked out), one per device
_CAUSAL_MASKS: dict[torch.device, Tensor] = {}
_CAUSAL_MASKS_LOCK = threading.Lock()
_MASK_SIZE = 2048
_SPARSE_CAUSAL = 2  # left-up causal
_SPARSE_NONE = 0
_STATS_WIDTH = 8  # softmax_max / softmax_sum are [B, N, S, 8], the value replicated


def causal_mask(device: torch.device) -> Tensor:
    """The cached bool ``triu(ones(2048, 2048), 1)`` mask for ``device``."""
    device = torch.device(device)
    mask = _CAUSAL_MASKS.get(device)
    if mask is None:
        with _CAUSAL_MASKS_LOCK:
            mask = _CAUSAL_MASKS.get(device)
            if mask is None:
                mask = torch.triu(torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=device), 1)
                _CAUSAL_MASKS[device] = mask
                log.debug("built the compressed causal mask for %s", device)
    return mask


def stats_from_lse(lse: Tensor) -> tuple[Tensor, Tensor]:
    """(softmax_max, softmax_sum) in the ops' [B, N, S, 8] float32 form encoding ``lse``
    as max = LSE, sum = 1, which the grad kernel treats like the forward's own pair."""
    softmax_max = lse.float().unsqueeze(-1).expand(*lse.shape, _STATS_WIDTH).contiguous()
    return softmax_max, torch.ones_like(softmax_max)


def lse_from_stats(softmax_max: Tensor, softmax_sum: Tensor) -> Tensor:
    """The float32 LSE [B, N, S] of the ops' statistics: max + log(sum)."""
    return softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())


def available() -> bool:
    """Whether ``torch.ops.npu.npu_fusion_attention_v3`` exists (real or emulated)."""
    try:
        return hasattr(torch.ops.npu, "npu_fusion_attention_v3")
    except (AttributeError, RuntimeError):
        return False


def _mask_args(causal: bool, device: torch.device) -> dict:
    if causal:
        return dict(atten_mask=causal_mask(device), sparse_mode=_SPARSE_CAUSAL, next_tockens=0)
    return dict(atten_mask=None, sparse_mode=_SPARSE_NONE)


class NpuKernel:
    """Step kernel over the fused NPU attention ops."""

    name = "npu"

    def forward(self, q, k, v, *, layout, head_num, scale, keep_prob, causal) -> StepForward:
        L.check_layout(layout)
        res = torch.ops.npu.npu_fusion_attention_v3(
            q, k, v, head_num, layout,
            scale=float(scale), keep_prob=float(keep_prob),
            **_mask_args(causal, q.device),
        )
        out, smax, ssum = res[0], res[1], res[2]
        return StepForward(out=out, lse=lse_from_stats(smax, ssum), seed=res[4], offset=res[5])

    def backward(
        self, q, k, v, dout, out, lse, *, layout, head_num, scale, keep_prob, causal,
        seed: Optional[Tensor], offset: Optional[Tensor],
    ):
        L.check_layout(layout)
        smax, ssum = stats_from_lse(lse)
        res = torch.ops.npu.npu_fusion_attention_grad_v3(
            q, k, v, dout, head_num, layout,
            softmax_max=smax, softmax_sum=ssum, attention_in=out,
            scale_value=float(scale), keep_prob=float(keep_prob),
            seed=seed, offset=offset,
            **_mask_args(causal, q.device),
        )
        return res[0], res[1], res[2]
