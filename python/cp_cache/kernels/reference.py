"""Reference step kernel: the block attention math in plain torch (float32), any device."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from .base import StepForward, StepMask, masked_positions, repeat_kv_heads, sum_kv_heads

__all__ = ["ReferenceKernel"]


class ReferenceKernel:
    """Plain-torch step kernel. No dropout (keep_prob < 1 raises NotImplementedError)."""

    name = "reference"
    takes_tnd = False

    def _prepare(self, q, k, v, layout, head_num, keep_prob):
        if keep_prob != 1.0:
            raise NotImplementedError(f"the reference step kernel does not implement dropout (keep_prob={keep_prob}); "
                                      "use the npu kernel")
        qd = L.dims(q, layout, head_num)
        nkv = L.heads_of(k, layout, qd.head_dim)
        if head_num % nkv:
            raise ValueError(f"head_num={head_num} is not a multiple of the K/V head count {nkv}")
        groups = head_num // nkv
        qb = L.to_bnsd(q, layout, head_num).float()
        kb = repeat_kv_heads(L.to_bnsd(k, layout, nkv).float(), groups)
        vb = repeat_kv_heads(L.to_bnsd(v, layout, nkv).float(), groups)
        return qb, kb, vb, groups

    @staticmethod
    def _scores(qb: Tensor, kb: Tensor, scale: float, mask: StepMask) -> Tensor:
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
        masked = masked_positions(mask, s.shape[-2], s.shape[-1], s.device)
        return s if masked is None else s.masked_fill(masked, float("-inf"))

    @staticmethod
    def _probs(s: Tensor, lse: Tensor) -> Tensor:
        # exp(s - lse) with -inf rows giving 0, never NaN
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        return torch.exp(s - safe.unsqueeze(-1))

    def forward(self, q, k, v, *, layout, head_num, scale, keep_prob, mask: StepMask,
                actual_seq_lens=None) -> StepForward:
        qb, kb, vb, _ = self._prepare(q, k, v, layout, head_num, keep_prob)
        s = self._scores(qb, kb, scale, mask)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(self._probs(s, lse), vb)
        return StepForward(out=L.from_bnsd(out.to(q.dtype), layout), lse=lse.float(), seed=None, offset=None)

    def backward(self, q, k, v, dout, out, lse, *, layout, head_num, scale, keep_prob, mask: StepMask,
                 seed: Optional[Tensor] = None, offset: Optional[Tensor] = None, actual_seq_lens=None):
        qb, kb, vb, groups = self._prepare(q, k, v, layout, head_num, keep_prob)
        dob = L.to_bnsd(dout, layout, head_num).float()
        ob = L.to_bnsd(out, layout, head_num).float()
        s = self._scores(qb, kb, scale, mask)
        p = self._probs(s, lse.float())
        dv = torch.matmul(p.transpose(-1, -2), dob)
        dp = torch.matmul(dob, vb.transpose(-1, -2))
        delta = (dob * ob).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, kb) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qb) * scale
        dk, dv = sum_kv_heads(dk, groups), sum_kv_heads(dv, groups)
        return L.from_bnsd(dq, layout), L.from_bnsd(dk, layout), L.from_bnsd(dv, layout)
