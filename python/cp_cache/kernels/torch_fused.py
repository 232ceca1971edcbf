"""The "torch" step kernel: torch's own fused CPU attention (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward), which gives the output and the logsumexp and never builds the S x S scores.

Causal blocks (square) are the kernel's ``is_causal``; a band or a given mask is the block's
additive ``attn_mask`` (-inf where masked out: the kernel takes a mask of the query's dtype,
where the op's bool mask is True for masked out). GQA: K/V heads repeated for the call, their
gradients summed back. Rows that see no key get LSE -inf (the kernel gives 0). A V head size
other than Q/K's (MLA), which the kernel does not take, runs the reference kernel's math; dropout
is refused (the kernel has no seed to replay). CPU tensors only so far: the CUDA kernels
(``_flash_attention_forward`` and friends) are not wired yet.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from .base import StepForward, StepMask, masked_positions, repeat_kv_heads, sum_kv_heads
from .reference import ReferenceKernel

__all__ = ["TorchKernel"]

_REFERENCE = ReferenceKernel()


class TorchKernel:
    """Step kernel over torch's fused CPU attention (see the module's docstring)."""

    name = "torch"
    takes_tnd = False

    def _operands(self, q, k, v, layout: str, head_num: int, keep_prob: float, mask: StepMask):
        if keep_prob != 1.0:
            raise NotImplementedError(f"the torch step kernel does not implement dropout (keep_prob={keep_prob}): "
                                      "torch's fused CPU attention has no seed to replay in the backward; use "
                                      "keep_prob=1.0, or the npu kernel")
        if q.device.type != "cpu":
            raise NotImplementedError(f"the torch step kernel runs on CPU tensors so far, got {q.device}; use the "
                                      "npu or reference kernel there")
        qd = L.dims(q, layout, head_num)
        nkv = L.heads_of(k, layout, qd.head_dim)
        groups = head_num // nkv
        qb = L.to_bnsd(q, layout, head_num)
        kb, vb = (repeat_kv_heads(L.to_bnsd(t, layout, nkv), groups) for t in (k, v))
        sq, sk = qb.size(2), kb.size(2)
        causal = mask.kind == "causal" and sq == sk
        masked = None if causal else masked_positions(mask, sq, sk, q.device)
        bias = None if masked is None else torch.zeros(masked.shape, dtype=qb.dtype, device=q.device).masked_fill(
            masked, float("-inf"))
        return qb, kb, vb, groups, causal, masked, bias

    def forward(self, q, k, v, *, layout, head_num, scale, keep_prob, mask: StepMask,
                actual_seq_lens=None) -> StepForward:
        if _mla(q, k, v, layout, head_num):  # V at its own head size
            return _REFERENCE.forward(q, k, v, layout=layout, head_num=head_num, scale=scale, keep_prob=keep_prob,
                                      mask=mask)
        qb, kb, vb, _, causal, masked, bias = self._operands(q, k, v, layout, head_num, keep_prob, mask)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, causal, attn_mask=bias, scale=float(scale))
        if masked is not None:
            lse = lse.masked_fill(masked.all(-1), float("-inf"))
        return StepForward(out=L.from_bnsd(out, layout), lse=lse.float(), seed=None, offset=None)

    def backward(self, q, k, v, dout, out, lse, *, layout, head_num, scale, keep_prob, mask: StepMask,
                 seed: Optional[Tensor] = None, offset: Optional[Tensor] = None, actual_seq_lens=None):
        if _mla(q, k, v, layout, head_num):
            return _REFERENCE.backward(q, k, v, dout, out, lse, layout=layout, head_num=head_num, scale=scale,
                                       keep_prob=keep_prob, mask=mask)
        qb, kb, vb, groups, causal, _, bias = self._operands(q, k, v, layout, head_num, keep_prob, mask)
        dob, ob = (L.to_bnsd(t, layout, head_num).to(qb.dtype) for t in (dout, out))
        # rows that saw no key anywhere: their probabilities are 0 whatever finite LSE they get
        lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).float()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dob, qb, kb, vb, ob, lse, 0.0, causal, attn_mask=bias, scale=float(scale))
        dk, dv = sum_kv_heads(dk, groups), sum_kv_heads(dv, groups)
        return L.from_bnsd(dq, layout), L.from_bnsd(dk, layout), L.from_bnsd(dv, layout)


def _mla(q: Tensor, k: Tensor, v: Tensor, layout: str, head_num: int) -> bool:
    """Whether V's head size differs from Q/K's (which torch's fused kernel does not take)."""
    head_dim = L.dims(q, layout, head_num).head_dim
    return L.value_head_dim(v, layout, L.heads_of(k, layout, head_dim)) != head_dim
