"""The log-sum-exp merge of a ring step into float32 accumulators; attention sinks, merged once per call."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from ..npu_ops import FLOAT32_LOWEST, lse_from_stats, op_exists, stats_from_lse

__all__ = ["OP_NAME", "merge_into", "fused_merge_available", "merge_sink", "sink_grad"]

OP_NAME = "npu_ring_attention_update"


def fused_merge_available() -> bool:
    return op_exists(OP_NAME)


def merge_into(acc_out: Tensor, acc_lse: Tensor, out_i: Tensor, lse_i: Tensor, layout: str, head_num: int,
               *, fused: bool, index: Optional[Tensor] = None, actual_seq_qlen: Optional[Tensor] = None) -> None:
    """In place (rows that saw no key: LSE -inf, output 0); ``index``: the rows (dim 0, packed) the step computed."""
    old_out, old_lse = (acc_out, acc_lse) if index is None else (acc_out.index_select(0, index),
                                                                 acc_lse.index_select(0, index))
    if fused:
        merged = _merge_fused(old_out, old_lse, out_i, lse_i, layout, head_num, actual_seq_qlen)
    else:
        merged = _merge_float32(old_out, old_lse, out_i, lse_i, layout, head_num)
    if index is not None:  # write the gathered rows back
        acc_out.index_copy_(0, index, merged[0])
        acc_lse.index_copy_(0, index, merged[1])
    elif merged is not None:
        acc_out.copy_(merged[0])
        acc_lse.copy_(merged[1])


def _merge_float32(acc_out: Tensor, acc_lse: Tensor, out_i: Tensor, lse_i: Tensor, layout: str,
                   head_num: int) -> Optional[tuple[Tensor, Tensor]]:
    """Merges into ``acc_out``/``acc_lse`` in place; for packed documents returns the merged rows instead."""
    new_lse = torch.logaddexp(acc_lse, lse_i)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)  # no key seen: 0 output, not NaN
    w_old = L.lse_view(torch.exp(acc_lse - ref), layout)
    w_new = L.lse_view(torch.exp(lse_i - ref), layout)
    if layout == L.TND:
        return acc_out * w_old + out_i.float() * w_new, new_lse
    o = L.as_4d(acc_out, layout, head_num)
    o.mul_(w_old).add_(L.as_4d(out_i, layout, head_num).float() * w_new)
    acc_lse.copy_(new_lse)
    return None


def _merge_fused(acc_out: Tensor, acc_lse: Tensor, out_i: Tensor, lse_i: Tensor, layout: str,
                 head_num: int, actual_seq_qlen: Optional[Tensor]) -> Optional[tuple[Tensor, Tensor]]:
    """As ``_merge_float32``, by the fused op (SBH for the dense layouts, packed as it is)."""
    op = getattr(torch.ops.npu, OP_NAME)
    stats = []  # the op's [B, N, S, 8] float32 (max, sum) of each LSE: (LSE, 1), or (lowest, 0) where LSE = -inf
    for softmax_max, softmax_sum in (stats_from_lse(acc_lse), stats_from_lse(lse_i)):
        dead = torch.isneginf(softmax_max)
        stats += softmax_max.masked_fill(dead, FLOAT32_LOWEST), softmax_sum.masked_fill(dead, 0.0)
    prev_max, prev_sum, cur_max, cur_sum = stats
    if layout == L.TND:
        merged, new_max, new_sum = op(acc_out, prev_max, prev_sum, out_i.float(), cur_max, cur_sum,
                                      actual_seq_qlen=actual_seq_qlen, input_layout=L.TND)
        return merged, lse_from_stats(new_max, new_sum)
    # float32 [S, B, N*D] copies (or the tensors themselves when already so)
    prev_sbh, cur_sbh = [L.from_bnsd(L.to_bnsd(x, layout, head_num), "SBH").float() for x in (acc_out, out_i)]
    out_sbh, new_max, new_sum = op(prev_sbh, prev_max, prev_sum, cur_sbh, cur_max, cur_sum, input_layout="SBH")
    L.to_bnsd(acc_out, layout, head_num).copy_(L.to_bnsd(out_sbh, "SBH", head_num))
    acc_lse.copy_(lse_from_stats(new_max, new_sum))  # sum 0 (no key on either side): lowest + log(0) = -inf
    return None


def _per_head(sink: Tensor, lse: Tensor) -> Tensor:
    """``sink`` [N] as float32 broadcasting against an LSE [B, N, S] (packed: [T, N])."""
    return sink.float().view(-1, 1) if lse.dim() == 3 else sink.float().view(1, -1)


def merge_sink(out: Tensor, lse: Tensor, sink: Tensor, layout: str, head_num: int) -> tuple[Tensor, Tensor]:
    """(out', LSE'): ``LSE' = logaddexp(LSE, sink[h])``, ``out`` scaled by ``exp(LSE - LSE')`` in float32."""
    new_lse = torch.logaddexp(lse.float(), _per_head(sink, lse))
    weight = L.lse_view(torch.exp(lse.float() - new_lse), layout)
    scaled = L.as_4d(out, layout, head_num).float() * weight
    return scaled.reshape(out.shape).to(out.dtype), new_lse


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor, layout: str, head_num: int) -> Tensor:
    """dsink = ``-sum_i exp(sink[h] - LSE'_i) * rowsum(dout * out)_i`` over this rank's rows (LSE': with the sink)."""
    p_sink = torch.exp(_per_head(sink, lse) - lse.float())
    if layout != L.TND:
        dout, out = L.to_bnsd(dout, layout, head_num), L.to_bnsd(out, layout, head_num)
    weighted = p_sink * (dout.float() * out.float()).sum(-1)  # rowsum(dout * out) in the LSE's shape
    return -weighted.transpose(0, 1).reshape(sink.numel(), -1).sum(1).to(sink.dtype)
