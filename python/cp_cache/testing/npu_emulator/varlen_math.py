"""The emulated ops in ``input_layout="TND"`` (varlen, packed sequences).

q ``[T, Nq, D]``, k/v ``[Tkv, Nkv, D]``; ``actual_seq_qlen`` / ``actual_seq_kvlen`` are the
cumulative end offsets of the segments (a 1-D int64 tensor in v3, a list in v1), the same
count for both, non-decreasing, the last equal to T (resp. Tkv). Query segment i attends
only to key segment i; inside a segment the sparse mode applies as in the 4-D layouts
(0/1 without a mask: full; 2: left-up causal; 3: right-down causal; 4: band), anchored at
the segment's own first row and column. Rows of an empty key segment see no key
(out 0, LSE -inf).

The math runs on the dense ``[1, N, T, Tkv]`` problem with the block-diagonal mask the
segments give (``attention_math`` as for BNSD with B = 1), so dropout, GQA and the
statistics behave as in the other layouts; the dropout keep mask is drawn over the
whole ``[1, Nq, T, Tkv]`` matrix. Statistics are ``[T, Nq, 8]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...npu_ops import STATS_WIDTH
from . import attention_math as M

__all__ = ["LAYOUT", "TndDims", "check_tnd_call", "tnd_forward", "tnd_backward", "segment_lengths"]

LAYOUT = "TND"
_TND_MODES = (0, 1, 2, 3, 4)


class TndDims(M._Dims):
    """The dense view's dims (B = 1, Sq = T, Skv = Tkv) plus the segments' cumulative ends."""

    __slots__ = ("cu_q", "cu_kv")

    def __init__(self, Nq, Nkv, T, Tkv, D, cu_q, cu_kv):
        super().__init__(1, Nq, Nkv, T, Tkv, D)
        self.cu_q, self.cu_kv = cu_q, cu_kv


def segment_lengths(value: Any, name: str, total: int) -> list[int]:
    """The cumulative ends given as ``name`` (tensor or list), checked: 1-D integers,
    non-decreasing, non-negative, the last equal to ``total``."""
    if value is None:
        raise ValueError(f"npu_fusion_attention: input_layout='TND' needs {name} (cumulative segment ends)")
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"npu_fusion_attention: {name} must be a 1-D integer tensor, got {M.describe(value)} "
                             f"of dtype {value.dtype}")
        ends = [int(x) for x in value.tolist()]
    else:
        ends = [int(x) for x in value]
    if not ends:
        raise ValueError(f"npu_fusion_attention: {name} is empty; it needs at least one cumulative end")
    previous = 0
    for i, end in enumerate(ends):
        if end < previous:
            raise ValueError(f"npu_fusion_attention: {name}={ends} must be non-decreasing and non-negative "
                             f"(entry {i} is {end} after {previous})")
        previous = end
    if ends[-1] != total:
        raise ValueError(f"npu_fusion_attention: {name}={ends} ends at {ends[-1]}, but the tensor has "
                         f"{total} rows (T)")
    return ends


def check_tnd_call(query, key, value, head_num, pse, padding_mask, atten_mask, keep_prob, prefix,
                   actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink) -> TndDims:
    M._check_unsupported(pse, padding_mask, prefix, None, None, sink, softmax_layout)
    M._check_sparse_mode(sparse_mode)
    if sparse_mode not in _TND_MODES:
        raise NotImplementedError(f"npu emulator: sparse_mode={sparse_mode} with input_layout='TND'")
    if sparse_mode in (0, 1) and atten_mask is not None:
        raise NotImplementedError(
            f"npu emulator: input_layout='TND' with sparse_mode={sparse_mode} and an explicit atten_mask "
            f"({M.describe(atten_mask)}) is not supported; use sparse_mode 2/3/4 with the compressed mask, "
            "or no mask (full attention per segment)")
    M._check_keep_prob(keep_prob)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(f"npu_fusion_attention: {name} must be 3-D [T, N, D] for input_layout='TND', "
                             f"got shape {list(t.shape)}")
    if tuple(key.shape) != tuple(value.shape):
        raise ValueError(f"npu_fusion_attention: key and value must have the same shape, got key "
                         f"{list(key.shape)} and value {list(value.shape)}")
    T, Nq, D = query.shape
    Tkv, Nkv, Dk = key.shape
    if head_num != Nq:
        raise ValueError(f"npu_fusion_attention: head_num={head_num} does not match the query's head count "
                         f"{Nq} (input_layout='TND', query shape {list(query.shape)})")
    if D != Dk:
        raise ValueError(f"npu_fusion_attention: query head dim {D} != key/value head dim {Dk}")
    if Nkv <= 0 or Nq % Nkv:
        raise ValueError(f"npu_fusion_attention: query heads Nq={Nq} must be a multiple of key/value heads "
                         f"Nkv={Nkv} (GQA)")
    cu_q = segment_lengths(actual_seq_qlen, "actual_seq_qlen", T)
    cu_kv = segment_lengths(actual_seq_kvlen, "actual_seq_kvlen", Tkv)
    if len(cu_q) != len(cu_kv):
        raise ValueError(f"npu_fusion_attention: actual_seq_qlen={cu_q} and actual_seq_kvlen={cu_kv} give "
                         f"{len(cu_q)} and {len(cu_kv)} segments; they must give the same count")
    return TndDims(Nq, Nkv, T, Tkv, D, cu_q, cu_kv)


def _masked(d: TndDims, atten_mask, sparse_mode: int, pre_tockens: int, next_tockens: int) -> Tensor:
    """The [T, Tkv] bool mask (True = masked out): block-diagonal over the segments, each
    block with the sparse mode's pattern."""
    masked = torch.ones(d.Sq, d.Skv, dtype=torch.bool)
    q0 = k0 = 0
    for q1, k1 in zip(d.cu_q, d.cu_kv):
        sq, skv = q1 - q0, k1 - k0
        if sq and skv:
            seg = M._Dims(1, d.Nq, d.Nkv, sq, skv, d.D)
            allowed = M._allowed_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, seg)
            masked[q0:q1, k0:k1] = False if allowed is None else ~allowed.view(sq, skv)
        q0, k0 = q1, k1
    return masked


def _dense(x: Tensor) -> Tensor:
    return x.permute(1, 0, 2).unsqueeze(0)  # [T, N, D] -> [1, N, T, D] (a view)


def _tnd(x: Tensor) -> Tensor:
    return x.squeeze(0).permute(1, 0, 2).contiguous()  # [1, N, T, X] -> [T, N, X]


def tnd_forward(query, key, value, d: TndDims, atten_mask, scale, keep_prob, pre_tockens, next_tockens,
                sparse_mode, seed: int, offset: int):
    """(out [T, Nq, D], softmax_max [T, Nq, 8], softmax_sum [T, Nq, 8])."""
    masked = _masked(d, atten_mask, sparse_mode, pre_tockens, next_tockens)
    out, smax, ssum = M.forward_math(_dense(query), _dense(key), _dense(value), d, "BNSD", masked, scale,
                                     keep_prob, M.INT_MAX, M.INT_MAX, 1, seed, offset)
    return _tnd(out), _tnd(smax), _tnd(ssum)


def tnd_backward(query, key, value, dy, d: TndDims, atten_mask, softmax_max, softmax_sum, attention_in,
                 scale, keep_prob, pre_tockens, next_tockens, sparse_mode, seed: int, offset: int):
    """(dq, dk, dv) in TND."""
    masked = _masked(d, atten_mask, sparse_mode, pre_tockens, next_tockens)
    stats = [None if s is None else _dense(s) for s in (softmax_max, softmax_sum)]
    attention_in = None if attention_in is None else _dense(attention_in)
    dq, dk, dv = M.backward_math(_dense(query), _dense(key), _dense(value), _dense(dy), d, "BNSD", masked,
                                 stats[0], stats[1], attention_in, scale, keep_prob, M.INT_MAX, M.INT_MAX, 1,
                                 seed, offset)
    return _tnd(dq), _tnd(dk), _tnd(dv)


def stats_shape(d: TndDims) -> tuple[int, int, int]:
    return (d.Sq, d.Nq, STATS_WIDTH)


def dropout_numels(d: TndDims) -> int:
    """Elements of the dropout mask the segments use: sum of Nq * sq * skv."""
    q0 = k0 = total = 0
    for q1, k1 in zip(d.cu_q, d.cu_kv):
        total += d.Nq * (q1 - q0) * (k1 - k0)
        q0, k0 = q1, k1
    return total
