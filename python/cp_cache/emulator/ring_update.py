"""CPU emulation of ``npu_ring_attention_update``: the fused merge of two partial
attention results by the online-softmax rule.

Inputs: two partial results of the same queries, each an attention output and its
softmax statistics (``softmax_max``, ``softmax_sum``, the 8 values of the last dim
replicated, ``LSE = max + log(sum)``).  With ``m1, s1, out1`` the previous and
``m2, s2, out2`` the current result, per query row and head::

    m   = max(m1, m2)
    a_i = s_i * exp(m_i - m)            (0 where s_i == 0)
    s   = a1 + a2
    out = out1 * (a1 / s) + out2 * (a2 / s)

The op returns ``(out, m, s)``: ``out`` in the attention output's dtype, the
statistics in their own dtype, each tensor shaped (and strided) like the matching
``prev_*`` input.  A row where both sums are 0 (no key seen on either side: max =
float32 lowest, sum = 0) gives out 0, max lowest, sum 0 -- never NaN.

Layouts (``input_layout``):

* ``"SBH"``: attention outputs ``[S, B, H]`` with ``H = N * D``; statistics
  ``[B, N, S, 8]`` (N is read from the statistics).
* ``"TND"``: attention outputs ``[T, N, D]``; statistics ``[T, N, 8]``;
  ``actual_seq_qlen`` (cumulative query lengths, 1-D int64) is required, as the
  op's meta function requires it.  The merge is row-wise, so the lengths only
  have to be consistent: non-decreasing, within ``[0, T]``, the last equal to T.

Dtypes: attention outputs fp16/bf16/fp32, both the same (float64 too, an emulator
extension computed in float64 so that references can be exact); statistics float32
(float64 allowed only with float64 outputs), all four the same.  The merge is
computed in float32 (float64 for float64 outputs) and rounded once at the end.

``input_softmax_layout`` other than ``""`` raises ``NotImplementedError`` naming it;
bad layouts, ranks, shapes and dtypes raise ``ValueError`` naming them.

No autograd formula is registered: the ring calls this op inside its own forward
on plain (detached) tensors, and differentiates through its own backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from ..npu_ops import RING_UPDATE, STATS_WIDTH

__all__ = ["OP_NAME", "ring_update_math", "ring_update_fake", "define"]

OP_NAME = RING_UPDATE.split("(", 1)[0]
LAYOUTS = ("SBH", L.TND)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(x: Tensor) -> list:
    return list(x.shape)


def _check(prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor, cur_attn_out: Tensor,
           cur_softmax_max: Tensor, cur_softmax_sum: Tensor, actual_seq_qlen: Optional[Tensor],
           input_layout: str, input_softmax_layout: str) -> None:
    """Raise for anything the op (or the emulator) does not accept; reads no tensor values."""
    if input_layout not in LAYOUTS:
        raise ValueError(f"{OP_NAME}: input_layout={input_layout!r} is not supported; supported: 'SBH', 'TND'")
    if input_softmax_layout != "":
        raise NotImplementedError(
            f"{OP_NAME}: input_softmax_layout={input_softmax_layout!r} is not emulated (only '')"
        )
    outs = {"prev_attn_out": prev_attn_out, "cur_attn_out": cur_attn_out}
    stats = {"prev_softmax_max": prev_softmax_max, "prev_softmax_sum": prev_softmax_sum,
             "cur_softmax_max": cur_softmax_max, "cur_softmax_sum": cur_softmax_sum}
    _check_attention_outputs(outs, input_layout)
    _check_statistics(stats, prev_attn_out.dtype)
    devices = {t.device for t in (*outs.values(), *stats.values())}
    if len(devices) != 1:
        raise ValueError(f"{OP_NAME}: tensors on different devices {sorted(str(d) for d in devices)}")

    rows = _shape(prev_attn_out)
    stat_shape = prev_softmax_max.shape
    if input_layout == "SBH":
        _check_sbh_shapes(rows, stat_shape)
    else:
        _check_tnd_shapes(rows, stat_shape, actual_seq_qlen)
    if actual_seq_qlen is not None:
        if actual_seq_qlen.dtype != torch.int64 or actual_seq_qlen.dim() != 1:
            raise ValueError(f"{OP_NAME}: actual_seq_qlen must be a 1-D int64 tensor, got "
                             f"{actual_seq_qlen.dtype} of shape {_shape(actual_seq_qlen)}")


def _check_attention_outputs(outs: dict, input_layout: str) -> None:
    """prev/cur attention outputs: 3-D, the same shape and dtype, a supported dtype."""
    for name, t in outs.items():
        if t.dim() != 3:
            raise ValueError(f"{OP_NAME}: {name} must be 3-D ({input_layout}), got shape {_shape(t)}")
    prev_attn_out, cur_attn_out = outs["prev_attn_out"], outs["cur_attn_out"]
    if prev_attn_out.shape != cur_attn_out.shape:
        raise ValueError(f"{OP_NAME}: prev_attn_out shape {_shape(prev_attn_out)} != "
                         f"cur_attn_out shape {_shape(cur_attn_out)}")
    if prev_attn_out.dtype != cur_attn_out.dtype:
        raise ValueError(f"{OP_NAME}: prev_attn_out dtype {prev_attn_out.dtype} != "
                         f"cur_attn_out dtype {cur_attn_out.dtype}")
    if prev_attn_out.dtype not in _OUT_DTYPES:
        raise ValueError(f"{OP_NAME}: attn_out dtype {prev_attn_out.dtype} is not supported "
                         "(float16, bfloat16, float32; float64 in the emulator)")


def _check_statistics(stats: dict, out_dtype: torch.dtype) -> None:
    """The four softmax statistics: one shape, all float32 (or all float64 with float64 outputs)."""
    stat_shape = stats["prev_softmax_max"].shape
    for name, t in stats.items():
        if t.shape != stat_shape:
            raise ValueError(f"{OP_NAME}: {name} shape {_shape(t)} != prev_softmax_max shape {list(stat_shape)}")
    allowed = (torch.float32, torch.float64) if out_dtype == torch.float64 else (torch.float32,)
    stat_dtype = stats["prev_softmax_max"].dtype
    for name, t in stats.items():
        if t.dtype != stat_dtype or t.dtype not in allowed:
            raise ValueError(f"{OP_NAME}: {name} dtype {t.dtype}: the softmax statistics must all be float32 "
                             "(or all float64 with float64 attention outputs)")


def _check_sbh_shapes(rows: list, stat_shape) -> None:
    """attn_out [S, B, H] against statistics [B, N, S, 8]."""
    if len(stat_shape) != 4 or stat_shape[-1] != STATS_WIDTH:
        raise ValueError(f"{OP_NAME}: with input_layout='SBH' the softmax statistics must be "
                         f"[B, N, S, {STATS_WIDTH}], got shape {list(stat_shape)}")
    s, b, h = rows
    sb, n, ss, _ = stat_shape
    if (sb, ss) != (b, s):
        raise ValueError(f"{OP_NAME}: attn_out shape {rows} ([S, B, H]) does not match softmax shape "
                         f"{list(stat_shape)} ([B, N, S, {STATS_WIDTH}]) in B or S")
    if n <= 0 or h % n:
        raise ValueError(f"{OP_NAME}: attn_out hidden size {h} (shape {rows}) is not divisible by the "
                         f"head count {n} of softmax shape {list(stat_shape)}")


def _check_tnd_shapes(rows: list, stat_shape, actual_seq_qlen: Optional[Tensor]) -> None:
    """attn_out [T, N, D] against statistics [T, N, 8]; TND needs actual_seq_qlen."""
    if actual_seq_qlen is None:
        raise ValueError(f"{OP_NAME}: input_layout='TND' requires actual_seq_qlen")
    if len(stat_shape) != 3 or stat_shape[-1] != STATS_WIDTH:
        raise ValueError(f"{OP_NAME}: with input_layout='TND' the softmax statistics must be "
                         f"[T, N, {STATS_WIDTH}], got shape {list(stat_shape)}")
    if list(stat_shape[:2]) != rows[:2]:
        raise ValueError(f"{OP_NAME}: attn_out shape {rows} ([T, N, D]) does not match softmax shape "
                         f"{list(stat_shape)} ([T, N, {STATS_WIDTH}]) in T or N")


def _check_lengths(actual_seq_qlen: Tensor, t: int) -> None:
    """TND: the cumulative lengths are non-decreasing, within [0, T], and end at T."""
    lens = actual_seq_qlen.cpu()
    if lens.numel() == 0 or int(lens[-1]) != t or int(lens.min()) < 0 or bool((lens.diff() < 0).any()):
        raise ValueError(f"{OP_NAME}: actual_seq_qlen={lens.tolist()} must be non-decreasing cumulative "
                         f"query lengths ending at T={t}")


def ring_update_math(prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor,
                     cur_attn_out: Tensor, cur_softmax_max: Tensor, cur_softmax_sum: Tensor, *,
                     actual_seq_qlen: Optional[Tensor] = None, input_layout: str = "SBH",
                     input_softmax_layout: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """The op on CPU tensors (the CPU kernel): merged (attn_out, softmax_max, softmax_sum)."""
    _check(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
           actual_seq_qlen, input_layout, input_softmax_layout)
    if input_layout == L.TND:
        _check_lengths(actual_seq_qlen, prev_attn_out.size(0))
    cd = torch.float64 if prev_attn_out.dtype == torch.float64 else torch.float32
    m1, s1 = prev_softmax_max.to(cd), prev_softmax_sum.to(cd)
    m2, s2 = cur_softmax_max.to(cd), cur_softmax_sum.to(cd)
    m = torch.maximum(m1, m2)
    zero = torch.zeros((), dtype=cd)
    # a side with sum 0 has weight 0 whatever its max (lowest, or even -inf)
    a1 = torch.where(s1 == 0, zero, s1 * torch.exp(m1 - m))
    a2 = torch.where(s2 == 0, zero, s2 * torch.exp(m2 - m))
    s = a1 + a2
    s0 = s[..., 0]
    denom = torch.where(s0 > 0, s0, torch.ones((), dtype=cd))
    w1, w2 = a1[..., 0] / denom, a2[..., 0] / denom  # 0 and 0 in rows where both sums are 0
    if input_layout == "SBH":
        # weights [B, N, S] -> [S, B, N, 1] against the [S, B, N, D] view of the outputs
        w1, w2 = (w.permute(2, 0, 1).unsqueeze(-1) for w in (w1, w2))
        sq, b, h = prev_attn_out.shape
        four_d = (sq, b, w1.size(2), h // w1.size(2))
    else:
        w1, w2 = w1.unsqueeze(-1), w2.unsqueeze(-1)  # [T, N, 1] against [T, N, D]
        four_d = tuple(prev_attn_out.shape)
    o1 = prev_attn_out.to(cd).reshape(four_d)
    o2 = cur_attn_out.to(cd).reshape(four_d)
    out = (o1 * w1 + o2 * w2).reshape(prev_attn_out.shape)
    # shaped and strided like the meta function's empty_like(prev_*)
    return (torch.empty_like(prev_attn_out).copy_(out),
            torch.empty_like(prev_softmax_max).copy_(m),
            torch.empty_like(prev_softmax_sum).copy_(s))


def ring_update_fake(prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor,
                     cur_attn_out: Tensor, cur_softmax_max: Tensor, cur_softmax_sum: Tensor, *,
                     actual_seq_qlen: Optional[Tensor] = None, input_layout: str = "SBH",
                     input_softmax_layout: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """The fake (meta) kernel: the shapes and dtypes of torch_npu's meta function."""
    _check(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
           actual_seq_qlen, input_layout, input_softmax_layout)
    return torch.empty_like(prev_attn_out), torch.empty_like(prev_softmax_max), torch.empty_like(prev_softmax_sum)


def define(lib: torch.library.Library) -> None:
    """Define ``npu::npu_ring_attention_update`` in ``lib`` (a ``Library("npu", "FRAGMENT")``)
    with its CPU kernel and fake kernel; destroying ``lib`` undefines it."""
    lib.define(RING_UPDATE)
    lib.impl(OP_NAME, ring_update_math, "CPU")
    torch.library.register_fake(f"npu::{OP_NAME}", ring_update_fake, lib=lib)
