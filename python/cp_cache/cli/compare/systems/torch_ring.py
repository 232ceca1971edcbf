"""torch's own ring: ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` (the
ring torch_npu 2.13.0 also drives) on local BNSD tensors, with ``_cp_options.rotate_method``
ALL_GATHER or ALL_TO_ALL, and a step wrapper (here) around the emulator's v3 op."""

from __future__ import annotations

import contextlib
import math

from ..catalogue import TORCH_A2A, TORCH_AG
from ..patches import rotate_method
from .base import System, Unsupported


def _ring_step_forward(query, key, value, *, is_causal, scale):
    """One block of one ring step for torch's ``_templated_ring_attention``: the emulator's v3
    op on BNSD tensors; returns (out, LSE [B, N, S]) as torch's merger expects."""
    import torch

    from ....npu_ops import INT_MAX, causal_mask, lse_from_stats

    res = torch.ops.npu.npu_fusion_attention_v3(
        query, key, value, query.size(1), "BNSD", atten_mask=causal_mask(query.device) if is_causal else None,
        scale=scale, sparse_mode=2 if is_causal else 0, next_tockens=0 if is_causal else INT_MAX)
    return res[0], lse_from_stats(res[1], res[2])


def _ring_step_backward(*, query, key, value, out, logsumexp, is_causal, grad_out, scale):
    """One block's gradients for ``_templated_ring_attention_backward`` (the emulator's grad_v3,
    the merged LSE given as softmax_max = LSE, softmax_sum = 1)."""
    import torch

    from ....npu_ops import INT_MAX, causal_mask, stats_from_lse

    smax, ssum = stats_from_lse(logsumexp)
    g = torch.ops.npu.npu_fusion_attention_grad_v3(
        query, key, value, grad_out, query.size(1), "BNSD",
        atten_mask=causal_mask(query.device) if is_causal else None, softmax_max=smax, softmax_sum=ssum,
        attention_in=out, scale_value=scale, sparse_mode=2 if is_causal else 0,
        next_tockens=0 if is_causal else INT_MAX)
    return g[0], g[1], g[2]


def _torch_ring_function():
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    class TorchRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, group, causal, scale):
            out, lse = _templated_ring_attention(group, 2, _ring_step_forward, q, k, v, is_causal=causal,
                                                 scale=scale)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.group, ctx.causal, ctx.scale = group, causal, scale
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = _templated_ring_attention_backward(
                ctx.group, 2, _ring_step_backward, dout.contiguous(), "grad_out", q, k, v, out, lse, ctx.causal,
                scale=ctx.scale)[:3]
            return dq, dk, dv, None, None, None

    return TorchRing


class TorchRingSystem(System):
    """torch's templated ring (the one torch_npu 2.13.0 also drives) on local BNSD tensors."""

    def __init__(self, mesh, rotate: str):
        self.mesh, self.rotate = mesh, rotate
        self.name = TORCH_AG if rotate == "allgather" else TORCH_A2A
        self.fn = _torch_ring_function()

    @contextlib.contextmanager
    def session(self):
        with rotate_method(self.rotate):
            yield self

    def attention(self, q, k, v, spec: dict, mask):
        if spec["layout"] != "BNSD":
            raise Unsupported("torch's ring chunks the sequence on dim 2: BNSD only")
        if spec.get("keep_prob", 1.0) < 1.0:
            raise Unsupported("torch's ring has no per-step dropout state (SDPA dropout_p unsupported under CP)")
        if spec["mask"] == "all_false" or spec["mode"] not in (0, 2, 3):
            raise Unsupported("torch's ring takes is_causal only, no attention mask")
        return self.fn.apply(q, k, v, self.mesh.get_group(), spec["mask"] == "causal",
                             1.0 / math.sqrt(spec["head_dim"]))

