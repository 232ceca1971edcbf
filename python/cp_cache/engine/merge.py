"""The merge of one ring step's result into its float32 accumulators (every strategy that rotates
K/V blocks), by the log-sum-exp rule, at all rows or at the rows a step computed: in plain torch, or
(``fused``) by ``npu_ring_attention_update``, which takes SBH or TND outputs and ``[B, N, S, 8]``
statistics (the LSE encoded as max = LSE, sum = 1; rows that saw no key as max = float32 lowest,
sum = 0, which the op merges without NaN). Both agree to float32 rounding.

Attention sinks: one more logit per row of head h, ``sink[h]``, without a value row, merged ONCE
into a call's result (``LSE' = logaddexp(LSE, sink)``, out scaled by ``exp(LSE - LSE')``), never per
step; its gradient is the sink's probability times ``-rowsum(dout * out)`` over the rank's rows.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from ..npu_ops import FLOAT32_LOWEST, lse_from_stats, op_exists, stats_from_lse

__all__ = ["OP_NAME", "merge_into", "fused_merge_available", "merge_sink", "sink_grad"]

OP_NAME = "npu_ring_attention_update"


def fused_merge_available() -> bool:
    """Whether ``torch.ops.npu.npu_ring_attention_update`` exists (torch_npu's or the emulator's)."""
    return op_exists(OP_NAME)


def merge_into(acc_out: Tensor, acc_lse: Tensor, out_i: Tensor, lse_i: Tensor, layout: str, head_num: int,
               *, fused: bool, index: Optional[Tensor] = None, actual_seq_qlen: Optional[Tensor] = None) -> None:
    """In place: ``(acc_out, acc_lse) <- logsumexp-merge((acc_out, acc_lse), (out_i, lse_i))``.

    ``acc_out``: float32 in ``layout``, possibly a view (a row range); ``acc_lse``: float32
    ``[B, N, S]`` (TND: ``[T, N]``), possibly a view; ``out_i``: the step's output in
    ``layout``, any float dtype; ``lse_i``: float32, ``-inf`` for rows that saw no key.
    ``index``: the accumulators' rows (dim 0, TND) the step computed, None for all rows;
    ``actual_seq_qlen``: the step's TND segment ends (the fused op takes them). Rows that saw
    no key on either side keep ``-inf`` and a zero output.
    """
    old_out, old_lse = _take(acc_out, index), _take(acc_lse, index)
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


def _take(x: Tensor, index: Optional[Tensor]) -> Tensor:
    return x if index is None else x.index_select(0, index)


def _merge_float32(acc_out: Tensor, acc_lse: Tensor, out_i: Tensor, lse_i: Tensor, layout: str,
                   head_num: int) -> Optional[tuple[Tensor, Tensor]]:
    """Merges into ``acc_out``/``acc_lse`` in place; for TND returns the merged rows instead."""
    new_lse = torch.logaddexp(acc_lse, lse_i)
    # rows with no key seen on either side keep -inf and a zero output (never NaN)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = L.lse_view(torch.exp(acc_lse - ref), layout)
    w_new = L.lse_view(torch.exp(lse_i - ref), layout)
    if layout == L.TND:
        return acc_out * w_old + out_i.float() * w_new, new_lse
    o = L.as_4d(acc_out, layout, head_num)
    o.mul_(w_old).add_(L.as_4d(out_i, layout, head_num).float() * w_new)
    acc_lse.copy_(new_lse)
    return None


def _stats(*lses: Tensor) -> list[Tensor]:
    """The op's [B, N, S, 8] float32 (max, sum) of each LSE: (LSE, 1), or (lowest, 0) where LSE = -inf."""
    stats = [stats_from_lse(lse) for lse in lses]
    out = []
    for softmax_max, softmax_sum in stats:
        dead = torch.isneginf(softmax_max)
        out += softmax_max.masked_fill(dead, FLOAT32_LOWEST), softmax_sum.masked_fill(dead, 0.0)
    return out


def _merge_fused(acc_out: Tensor, acc_lse: Tensor, out_i: Tensor, lse_i: Tensor, layout: str,
                 head_num: int, actual_seq_qlen: Optional[Tensor]) -> Optional[tuple[Tensor, Tensor]]:
    """As ``_merge_float32``, by the fused op (SBH for the dense layouts, TND as it is)."""
    op = getattr(torch.ops.npu, OP_NAME)
    prev_max, prev_sum, cur_max, cur_sum = _stats(acc_lse, lse_i)
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


# ---------------------------------------------------------------- attention sinks


def _per_head(sink: Tensor, lse: Tensor) -> Tensor:
    """``sink`` [N] as float32 broadcasting against an LSE [B, N, S] (TND: [T, N])."""
    return sink.float().view(-1, 1) if lse.dim() == 3 else sink.float().view(1, -1)


def merge_sink(out: Tensor, lse: Tensor, sink: Tensor, layout: str, head_num: int) -> tuple[Tensor, Tensor]:
    """(out', LSE'): a call's merged ``out`` (in ``layout``) and float32 ``lse`` with the sink's
    logit added to every row's softmax: ``LSE' = logaddexp(LSE, sink[h])``, out scaled by
    ``exp(LSE - LSE')`` in float32 (rows that saw no key: LSE' = sink[h], out 0)."""
    new_lse = torch.logaddexp(lse.float(), _per_head(sink, lse))
    weight = L.lse_view(torch.exp(lse.float() - new_lse), layout)
    scaled = L.as_4d(out, layout, head_num).float() * weight
    return scaled.reshape(out.shape).to(out.dtype), new_lse


def _row_dot(a: Tensor, b: Tensor, layout: str, head_num: int) -> Tensor:
    """rowsum(a * b) in float32, in the LSE's shape ([B, N, S]; TND: [T, N])."""
    if layout == L.TND:
        return (a.float() * b.float()).sum(-1)
    return (L.to_bnsd(a, layout, head_num).float() * L.to_bnsd(b, layout, head_num).float()).sum(-1)


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor, layout: str, head_num: int) -> Tensor:
    """dsink [N] (the sink's dtype) over this rank's rows: ``-sum_i exp(sink[h] - LSE'_i) *
    rowsum(dout * out)_i``, ``out`` and ``lse`` the call's final results (the sink merged in)."""
    p_sink = torch.exp(_per_head(sink, lse) - lse.float())
    weighted = p_sink * _row_dot(dout, out, layout, head_num)
    return -weighted.transpose(0, 1).reshape(sink.numel(), -1).sum(1).to(sink.dtype)
