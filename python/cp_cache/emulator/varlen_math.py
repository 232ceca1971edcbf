"""The emulated ops in ``input_layout="TND"`` (varlen, packed sequences).

q ``[T, Nq, D]``, k ``[Tkv, Nkv, D]``, v ``[Tkv, Nkv, Dv]`` (Dv may differ from D: MLA; the
output is ``[T, Nq, Dv]``); ``actual_seq_qlen`` / ``actual_seq_kvlen`` are the
cumulative end offsets of the segments (a 1-D int64 tensor in v3, a list in v1), the same
count for both, non-decreasing, the last equal to T (resp. Tkv). Query segment i attends
only to key segment i; inside a segment the sparse mode applies as in the 4-D layouts, in
the segment's own rows and columns (0/1 without a mask: full; 2: left-up causal; 3:
right-down causal; 4: band, anchored at the segment's bottom-right corner; 7 / 8, the op's
"varlen external split" modes: the last / first segment with queries takes the band, the
others right-down / left-up causal). Rows of an empty key segment see no key (out 0, LSE
-inf).

The math runs segment by segment (``attention_math`` as for BNSD with B = 1 on each
segment's rows), so the work is the segments' own blocks, as on the NPU, and dropout, GQA
and the statistics behave as in the other layouts. Segment i draws its dropout keep mask
from ``(seed, offset + i)`` over its ``[1, Nq, sq_i, skv_i]`` block. Statistics are
``[T, Nq, 8]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import layout as L
from ..npu_ops import STATS_WIDTH
from . import attention_math as M

__all__ = ["LAYOUT", "TndDims", "check_tnd_call", "tnd_forward", "tnd_backward", "segment_lengths"]

LAYOUT = L.TND
_TND_MODES = (0, 1, 2, 3, 4, 7, 8)
# sparse_mode 7 / 8 (the op's "varlen external split" modes): one segment takes the band of
# pre/next_tockens (mode 4), the others causal: (the band's segment, the others' mode)
_SPLIT_MODES = {7: ("last", 3), 8: ("first", 2)}


class TndDims(M._Dims):
    """The dense view's dims (B = 1, Sq = T, Skv = Tkv) plus the segments' cumulative ends
    (None where a fake kernel did not read them)."""

    __slots__ = ("cu_q", "cu_kv")

    def __init__(self, Nq, Nkv, T, Tkv, D, cu_q, cu_kv, Dv=None):
        super().__init__(1, Nq, Nkv, T, Tkv, D, Dv)
        self.cu_q, self.cu_kv = cu_q, cu_kv


def _length_count(value: Any, name: str) -> int:
    """How many cumulative ends ``name`` gives, from its shape alone (a tensor's values are not
    read: under fake tensors they are unknown): present, a 1-D integer tensor or a list, not empty."""
    if value is None:
        raise ValueError(f"npu_fusion_attention: input_layout='TND' needs {name} (cumulative segment ends)")
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"npu_fusion_attention: {name} must be a 1-D integer tensor, got {M.describe(value)} "
                             f"of dtype {value.dtype}")
        count = value.size(0)
    else:
        count = len(value)
    if count == 0:
        raise ValueError(f"npu_fusion_attention: {name} is empty; it needs at least one cumulative end")
    return count


def segment_lengths(value: Any, name: str, total: int) -> list[int]:
    """The cumulative ends given as ``name`` (tensor or list), checked: 1-D integers,
    non-decreasing, non-negative, the last equal to ``total``. Reads a tensor's values."""
    _length_count(value, name)
    ends = [int(x) for x in (value.tolist() if isinstance(value, Tensor) else value)]
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


def _check_tnd_shapes(query, key, value, head_num) -> tuple[int, int, int, int, int]:
    """(T, Nq, Tkv, Nkv, D) of q ``[T, Nq, D]``, k ``[Tkv, Nkv, D]`` and v ``[Tkv, Nkv, Dv]``, checked."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(f"npu_fusion_attention: {name} must be 3-D [T, N, D] for input_layout='TND', "
                             f"got shape {list(t.shape)}")
    M.check_value_shape(key, value)
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
    return T, Nq, Tkv, Nkv, D


def _check_tnd_mask(atten_mask, sparse_mode) -> None:
    M._check_sparse_mode(sparse_mode, _TND_MODES)
    if sparse_mode in (0, 1) and atten_mask is not None:
        raise NotImplementedError(
            f"npu emulator: input_layout='TND' with sparse_mode={sparse_mode} and an explicit atten_mask "
            f"({M.describe(atten_mask)}) is not supported; use sparse_mode 2/3/4 with the compressed mask, "
            "or no mask (full attention per segment)")


def _segment_ends(actual_seq_qlen, actual_seq_kvlen, T: int, Tkv: int, read_values: bool):
    """(cu_q, cu_kv): the checked cumulative ends, or (None, None) when they are tensors and
    ``read_values`` is false (a fake kernel: shapes only; lists are host values and always read)."""
    given = ((actual_seq_qlen, "actual_seq_qlen", T), (actual_seq_kvlen, "actual_seq_kvlen", Tkv))
    if read_values or not any(isinstance(v, Tensor) for v, _, _ in given):
        cu_q, cu_kv = (segment_lengths(v, name, total) for v, name, total in given)
        counts, shown = (len(cu_q), len(cu_kv)), f"actual_seq_qlen={cu_q} and actual_seq_kvlen={cu_kv}"
    else:
        cu_q = cu_kv = None
        counts = tuple(_length_count(v, name) for v, name, _ in given)
        shown = f"actual_seq_qlen ({M.describe(actual_seq_qlen)}) and actual_seq_kvlen ({M.describe(actual_seq_kvlen)})"
    if counts[0] != counts[1]:
        raise ValueError(f"npu_fusion_attention: {shown} give {counts[0]} and {counts[1]} segments; they must give "
                         "the same count")
    return cu_q, cu_kv


def check_tnd_call(query, key, value, head_num, pse, padding_mask, atten_mask, keep_prob, prefix,
                   actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink, *,
                   read_values: bool = True) -> TndDims:
    """The call's dims, checked. ``read_values=False`` (the fake kernels): from shapes only, as
    torch_npu's meta functions; the lengths' values are then not read (``cu_q``/``cu_kv`` None)
    unless given as lists."""
    M._check_unsupported(pse, padding_mask, prefix, None, None, softmax_layout)
    _check_tnd_mask(atten_mask, sparse_mode)
    M._check_keep_prob(keep_prob)
    T, Nq, Tkv, Nkv, D = _check_tnd_shapes(query, key, value, head_num)
    M.check_sink(sink, head_num)
    cu_q, cu_kv = _segment_ends(actual_seq_qlen, actual_seq_kvlen, T, Tkv, read_values)
    return TndDims(Nq, Nkv, T, Tkv, D, cu_q, cu_kv, value.size(2))


def _segments(d: TndDims):
    """(index, q rows slice, kv rows slice, the segment's dims) of every segment with queries."""
    q0 = k0 = 0
    for i, (q1, k1) in enumerate(zip(d.cu_q, d.cu_kv)):
        if q1 > q0:
            yield i, slice(q0, q1), slice(k0, k1), M._Dims(1, d.Nq, d.Nkv, q1 - q0, k1 - k0, d.D, d.Dv)
        q0, k0 = q1, k1


def _segment_modes(d: TndDims, atten_mask, sparse_mode: int) -> dict[int, tuple]:
    """{segment index: (its mask, its sparse mode)} for the segments with queries. Modes 0/1 come
    without a mask here (check_tnd_call): full attention in the segment. Modes 7 and 8: the last
    (7) or first (8) segment with queries takes the band (sparse_mode 4), the others right-down
    (7) or left-up (8) causal."""
    with_queries = [i for i, _, _, _ in _segments(d)]
    if sparse_mode not in _SPLIT_MODES:
        mode = (atten_mask, sparse_mode) if sparse_mode in (2, 3, 4) else (None, 1)
        return dict.fromkeys(with_queries, mode)
    which, others = _SPLIT_MODES[sparse_mode]
    band = with_queries[-1 if which == "last" else 0] if with_queries else None
    return {i: (atten_mask, 4 if i == band else others) for i in with_queries}


def _bnsd(x: Tensor) -> Tensor:
    return x.permute(1, 0, 2).unsqueeze(0)  # [t, N, X] -> [1, N, t, X] (a view)


def _tnd(x: Tensor) -> Tensor:
    return x.squeeze(0).permute(1, 0, 2)  # [1, N, t, X] -> [t, N, X] (a view)


def tnd_forward(query, key, value, d: TndDims, atten_mask, scale, keep_prob, pre_tockens, next_tockens,
                sparse_mode, seed: int, offset: int, sink=None):
    """(out [T, Nq, Dv], softmax_max [T, Nq, 8], softmax_sum [T, Nq, 8]), segment by segment:
    the work is the segments' own (q x kv) blocks. Segment i's dropout keep mask is
    ``dropout_keep_mask(seed, offset + i, [1, Nq, sq_i, skv_i], keep_prob)``. Rows of an
    empty key segment: out 0, max = float32 lowest, sum 0 (LSE -inf); with a sink, max = sink,
    sum = 1 (the sink is all they see)."""
    sdt = M.stat_dtype(query.dtype)
    out = torch.zeros(d.Sq, d.Nq, d.Dv, dtype=query.dtype)
    smax = torch.full((d.Sq, d.Nq, STATS_WIDTH), M.FLOAT32_LOWEST, dtype=sdt)
    ssum = torch.zeros((d.Sq, d.Nq, STATS_WIDTH), dtype=sdt)
    if sink is not None:
        smax[:] = sink.to(sdt).view(1, -1, 1)
        ssum.fill_(1.0)
    modes = _segment_modes(d, atten_mask, sparse_mode)
    for i, qs, ks, seg in _segments(d):
        if seg.Skv == 0:
            continue
        mask, mode = modes[i]
        o, m, l = M.forward_math(_bnsd(query[qs]), _bnsd(key[ks]), _bnsd(value[ks]), seg, "BNSD", mask, scale,
                                 keep_prob, pre_tockens, next_tockens, mode, seed, offset + i, sink)
        out[qs], smax[qs], ssum[qs] = _tnd(o), _tnd(m), _tnd(l)
    return out, smax, ssum


def tnd_backward(query, key, value, dy, d: TndDims, atten_mask, softmax_max, softmax_sum, attention_in,
                 scale, keep_prob, pre_tockens, next_tockens, sparse_mode, seed: int, offset: int, sink=None):
    """(dq, dk, dv, dsink) in TND, segment by segment (as ``tnd_forward``; dsink None without a
    sink; rows of an empty key segment have out 0, so add nothing to it)."""
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (query, key, value))
    dsink = None if sink is None else torch.zeros_like(sink)
    modes = _segment_modes(d, atten_mask, sparse_mode)
    for i, qs, ks, seg in _segments(d):
        if seg.Skv == 0:
            continue
        mask, mode = modes[i]
        stats = [None if s is None else _bnsd(s[qs]) for s in (softmax_max, softmax_sum)]
        given_out = None if attention_in is None else _bnsd(attention_in[qs])
        g = M.backward_math(_bnsd(query[qs]), _bnsd(key[ks]), _bnsd(value[ks]), _bnsd(dy[qs]), seg, "BNSD", mask,
                            stats[0], stats[1], given_out, scale, keep_prob, pre_tockens, next_tockens, mode, seed,
                            offset + i, sink)
        dq[qs] = _tnd(g[0])
        dk[ks] += _tnd(g[1])
        dv[ks] += _tnd(g[2])
        if dsink is not None:
            dsink += g[3]
    return dq, dk, dv, dsink


def stats_shape(d: TndDims) -> tuple[int, int, int]:
    return (d.Sq, d.Nq, STATS_WIDTH)


def dropout_numels(d: TndDims) -> int:
    """Elements of the dropout mask the segments use: sum of Nq * sq * skv."""
    q0 = k0 = total = 0
    for q1, k1 in zip(d.cu_q, d.cu_kv):
        total += d.Nq * (q1 - q0) * (k1 - k0)
        q0, k0 = q1, k1
    return total
