"""The "torch" step kernel: torch's own fused attention, the default where the NPU op does not exist.
CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (GQA natively, causal left-up); a band in row tiles,
each against its rows' key span with a small additive mask (never S x S); dropout refused (no seed to
replay); MLA by the reference math. CUDA: ``_flash_attention_forward`` in half precision (causal,
windows, packed segments, dropout replayed from its ``rng_state``), else memory-efficient attention
with an additive mask. Rows that see no key get LSE -inf."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import layout as L
from ..masks import StepMask, masked_positions
from ..npu_ops import INT_MAX
from .base import StepForward, repeat_kv_heads, segments_backward, segments_forward, sum_kv_heads
from .reference import ReferenceKernel

__all__ = ["TorchKernel"]

_REFERENCE = ReferenceKernel()
_INF = float("inf")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_TILE_MIN, _TILE_MAX = 64, 512  # query rows per band tile


class TorchKernel:
    """Step kernel over torch's fused attention (see the module's docstring)."""

    name = "torch"
    takes_tnd = True

    def forward(self, q, k, v, *, layout, head_num, scale, keep_prob, mask: StepMask,
                actual_seq_lens=None) -> StepForward:
        if layout == L.TND:
            if _gpu(q) and _flash_takes(q, v, mask):
                return _flash_varlen_forward(q, k, v, actual_seq_lens, scale, keep_prob, mask)
            return segments_forward(self, q, k, v, actual_seq_lens=actual_seq_lens, mask=mask, head_num=head_num,
                                    scale=scale, keep_prob=keep_prob)
        _check_dropout(q, keep_prob)
        if not _gpu(q) and _mla(q, k, v, layout, head_num):
            return _REFERENCE.forward(q, k, v, layout=layout, head_num=head_num, scale=scale, keep_prob=keep_prob,
                                      mask=mask)
        qb, kb, vb = _bnsd(q, k, v, layout, head_num)
        if not _gpu(q):
            out, lse = _cpu_forward(qb, kb, vb, mask, scale)
            return StepForward(out=L.from_bnsd(out, layout), lse=lse, seed=None, offset=None)
        if _flash_takes(q, v, mask):
            out, lse, rng = _flash_forward(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), None, None,
                                           scale, keep_prob, mask)
            return StepForward(out=L.from_bnsd(out.transpose(1, 2), layout), lse=lse, seed=rng[0], offset=rng[1])
        out, lse, seed, offset = _efficient_forward(qb, kb, vb, mask, scale, keep_prob)
        return StepForward(out=L.from_bnsd(out, layout), lse=lse, seed=seed, offset=offset)

    def backward(self, q, k, v, dout, out, lse, *, layout, head_num, scale, keep_prob, mask: StepMask,
                 seed: Optional[Tensor] = None, offset: Optional[Tensor] = None, actual_seq_lens=None):
        if keep_prob < 1.0 and seed is None and _gpu(q):  # else a silent wrong gradient
            raise ValueError(f"torch step kernel backward: keep_prob={keep_prob} needs its forward's seed, got None")
        if layout == L.TND:
            if _gpu(q) and _flash_takes(q, v, mask):
                return _flash_varlen_backward(q, k, v, dout, out, lse, actual_seq_lens, scale, keep_prob, mask,
                                              seed, offset)
            return segments_backward(self, q, k, v, dout, out, lse, actual_seq_lens=actual_seq_lens, mask=mask,
                                     head_num=head_num, scale=scale, keep_prob=keep_prob, seed=seed, offset=offset)
        _check_dropout(q, keep_prob)
        if not _gpu(q) and _mla(q, k, v, layout, head_num):
            return _REFERENCE.backward(q, k, v, dout, out, lse, layout=layout, head_num=head_num, scale=scale,
                                       keep_prob=keep_prob, mask=mask)
        qb, kb, vb = _bnsd(q, k, v, layout, head_num)
        dob, ob = (L.to_bnsd(t, layout, head_num) for t in (dout, out))
        if not _gpu(q):
            grads = _cpu_backward(qb, kb, vb, dob.to(qb.dtype), ob.to(qb.dtype), lse.float(), mask, scale)
        elif _flash_takes(q, v, mask):
            grads = _flash_backward(*(t.transpose(1, 2) for t in (qb, kb, vb, dob, ob)), lse, None, None, scale,
                                    keep_prob, mask, (seed, offset))
            grads = tuple(g.transpose(1, 2) for g in grads)
        else:
            grads = _efficient_backward(qb, kb, vb, dob, ob, lse, mask, scale, keep_prob, seed, offset)
        return tuple(L.from_bnsd(g, layout) for g in grads)


def _gpu(q: Tensor) -> bool:
    """Whether the GPU kernels serve ``q``: any device but the CPU (meta tensors check their shapes)."""
    return q.device.type != "cpu"


def _check_dropout(q: Tensor, keep_prob: float) -> None:
    if keep_prob != 1.0 and not _gpu(q):
        raise NotImplementedError(f"dropout on CPU (SDPA's dropout_p={1 - keep_prob:.4g}, the op's keep_prob="
                                  f"{keep_prob:.4g}): the \"torch\" kernel serving here (torch's fused CPU attention) has "
                                  "no seed to replay in the backward. Here: dropout_p=0.0 (transformers: attention_dropout"
                                  "=0.0), or cp_cache.emulator.install_npu_emulator() before the CP region (replays it on CPU)")


def _mla(q: Tensor, k: Tensor, v: Tensor, layout: str, head_num: int) -> bool:
    """Whether V's head size differs from Q/K's."""
    head_dim = L.dims(q, layout, head_num).head_dim
    return L.value_head_dim(v, layout, L.heads_of(k, layout, head_dim)) != head_dim


def _bnsd(q: Tensor, k: Tensor, v: Tensor, layout: str, head_num: int) -> tuple[Tensor, Tensor, Tensor]:
    nkv = L.heads_of(k, layout, L.dims(q, layout, head_num).head_dim)
    return L.to_bnsd(q, layout, head_num), L.to_bnsd(k, layout, nkv), L.to_bnsd(v, layout, nkv)


def _additive(masked: Optional[Tensor], dtype) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """A mask (True = masked out) as the kernel's additive mask (-inf where masked) and its rows that see
    no key; (None, None) for no mask."""
    if masked is None:
        return None, None
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill(masked, -_INF), masked.all(-1)


# ---------------------------------------------------------------- CPU


@functools.lru_cache(maxsize=16)  # a model's few band blocks; its interior tiles share one mask
def _band_tiles(pre: int, nxt: int, sq: int, sk: int, dtype) -> tuple:
    """(rows start, rows end, keys start, keys end, additive mask, rows that see no key) per tile of the
    rows that see some key under a band anchored at the bottom-right corner: a row sees keys low..high,
    both growing with the row, so a tile's keys are one span."""
    i, d = torch.arange(sq), sk - sq
    low = (i - pre + d).clamp(min=0) if pre < INT_MAX else torch.zeros_like(i)
    high = (i + nxt + d).clamp(max=sk - 1) if nxt < INT_MAX else torch.full_like(i, sk - 1)
    live = (low <= high).nonzero().flatten()
    if live.numel() == 0:
        return ()
    first, last = int(live[0]), int(live[-1])
    # rows per tile: a quarter of the band's width, within [64, 512] (measured at S = 8192: each tile
    # computes its rows' key span, so wide tiles waste work and narrow ones pay per-call costs)
    tile = min(max(int((high - low)[first:last + 1].max()) // 4, _TILE_MIN), _TILE_MAX)
    tiles, shared = [], {}
    for a in range(first, last + 1, tile):
        b = min(a + tile, last + 1)
        k0, k1 = int(low[a]), int(high[b - 1]) + 1
        lows, highs = low[a:b].view(-1, 1) - k0, high[a:b].view(-1, 1) - k0
        cols = torch.arange(k1 - k0).view(1, -1)
        masked = (cols < lows) | (cols > highs)
        key = (k1 - k0, tuple(lows.flatten().tolist()), tuple(highs.flatten().tolist()))
        additive = shared.setdefault(key, _additive(masked, dtype)) if bool(masked.any()) else (None, None)
        tiles.append((a, b, k0, k1, *additive))
    return tuple(tiles)


def _cpu_call(q, k, v, is_causal: bool, bias: Optional[Tensor], dead: Optional[Tensor], scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=bias,
                                                                          scale=float(scale))
    if dead is not None:  # rows that see no key: the kernel gives LSE 0
        lse = lse.masked_fill(dead.expand_as(lse), -_INF)
    return out, lse.float()


def _cpu_mask(mask: StepMask, q: Tensor, sk: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """A dense call's additive mask and dead rows: a given mask's, else none."""
    return _additive(masked_positions(mask, q.size(2), sk, q.device) if mask.kind == "given" else None, q.dtype)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, mask: StepMask, scale: float) -> tuple[Tensor, Tensor]:
    if mask.kind != "band":
        return _cpu_call(q, k, v, mask.kind == "causal", *_cpu_mask(mask, q, k.size(2)), scale)
    out = q.new_zeros(*q.shape[:3], v.size(-1))
    lse = torch.full(q.shape[:3], -_INF, dtype=torch.float32, device=q.device)
    for a, b, k0, k1, bias, dead in _band_tiles(mask.pre_tockens, mask.next_tockens, q.size(2), k.size(2), q.dtype):
        out[:, :, a:b], lse[:, :, a:b] = _cpu_call(q[:, :, a:b], k[:, :, k0:k1], v[:, :, k0:k1], False, bias, dead,
                                                   scale)
    return out, lse


def _cpu_grad(dout, q, k, v, out, lse, is_causal: bool, bias: Optional[Tensor], scale: float):
    # rows that saw no key: their probabilities are 0 whatever finite LSE they get
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=float(scale))


def _cpu_backward(q, k, v, dout, out, lse, mask: StepMask, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    if mask.kind != "band":
        return _cpu_grad(dout, q, k, v, out, lse, mask.kind == "causal", _cpu_mask(mask, q, k.size(2))[0], scale)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    for a, b, k0, k1, bias, _ in _band_tiles(mask.pre_tockens, mask.next_tockens, q.size(2), k.size(2), q.dtype):
        grads = _cpu_grad(dout[:, :, a:b], q[:, :, a:b], k[:, :, k0:k1], v[:, :, k0:k1], out[:, :, a:b],
                          lse[:, :, a:b], False, bias, scale)
        dq[:, :, a:b] += grads[0]
        dk[:, :, k0:k1] += grads[1]
        dv[:, :, k0:k1] += grads[2]
    return dq, dk, dv


# ---------------------------------------------------------------- CUDA


def _window(mask: StepMask) -> tuple[Optional[int], Optional[int]]:
    """The flash kernel's window (left, right) of a band; (None, None) for no band."""
    if mask.kind != "band":
        return None, None
    return (-1 if mask.pre_tockens >= INT_MAX else mask.pre_tockens,
            -1 if mask.next_tockens >= INT_MAX else mask.next_tockens)


def _flash_takes(q: Tensor, v: Tensor, mask: StepMask) -> bool:
    """Whether the flash kernel serves this call: half precision, V's head size Q/K's, a head size
    it takes, and a mask it expresses (none, causal, a band that holds its diagonal: its window -1 means
    unlimited, so a band of pre or next -1 is not one)."""
    return (q.dtype in _FLASH_DTYPES and q.size(-1) == v.size(-1) and q.size(-1) % 8 == 0 and q.size(-1) <= 256
            and mask.kind != "given" and (mask.kind != "band" or min(mask.pre_tockens, mask.next_tockens) >= 0))


def _flash_forward(q, k, v, cum, max_len, scale, keep_prob, mask: StepMask):
    """``q``/``k``/``v`` [B, S, N, D] (or [T, N, D] with ``cum`` segment ends): (out, LSE, (rng, unused))."""
    left, right = _window(mask)
    cum_q, cum_k = cum if cum is not None else (None, None)
    max_q, max_k = max_len if max_len is not None else (q.size(1), k.size(1))
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cum_q, cum_k, max_q, max_k, 1.0 - keep_prob, mask.kind == "causal", False, scale=float(scale),
        window_size_left=left, window_size_right=right)
    lse = lse.float().masked_fill(torch.isposinf(lse), -_INF)  # rows that see no key: +inf from the kernel
    return out, lse, (rng, unused) if keep_prob < 1.0 else (None, None)


def _flash_backward(q, k, v, dout, out, lse, cum, max_len, scale, keep_prob, mask: StepMask, rng):
    left, right = _window(mask)
    cum_q, cum_k = cum if cum is not None else (None, None)
    max_q, max_k = max_len if max_len is not None else (q.size(1), k.size(1))
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    lse = lse.float().masked_fill(torch.isneginf(lse), _INF).contiguous()  # the kernel's "no key": +inf
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse, cum_q, cum_k, max_q, max_k, 1.0 - keep_prob,
        mask.kind == "causal", empty if rng[0] is None else rng[0], empty if rng[1] is None else rng[1],
        scale=float(scale), window_size_left=left, window_size_right=right)


def _varlen(actual_seq_lens, device) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
    """The segments' cumulative ends as the flash kernel takes them (int32, leading 0, on the device), and
    the longest segments, read from the host tensors the op's contract gives (no device read)."""
    ends = [torch.cat([t.new_zeros(1), t]) for t in actual_seq_lens]
    longest = [int(torch.diff(t).max()) if t.numel() > 1 else 0 for t in ends]
    return tuple(t.to(device=device, dtype=torch.int32) for t in ends), (longest[0], longest[1])


def _flash_varlen_forward(q, k, v, actual_seq_lens, scale, keep_prob, mask: StepMask) -> StepForward:
    cum, max_len = _varlen(actual_seq_lens, q.device)
    out, lse, rng = _flash_forward(q, k, v, cum, max_len, scale, keep_prob, mask)
    return StepForward(out=out, lse=lse.transpose(0, 1), seed=rng[0], offset=rng[1])  # LSE [N, T] -> [T, N]


def _flash_varlen_backward(q, k, v, dout, out, lse, actual_seq_lens, scale, keep_prob, mask, seed, offset):
    cum, max_len = _varlen(actual_seq_lens, q.device)
    return _flash_backward(q, k, v, dout, out, lse.transpose(0, 1), cum, max_len, scale, keep_prob, mask,
                           (seed, offset))


def _efficient_bias(mask: StepMask, q: Tensor, k: Tensor) -> Optional[Tensor]:
    """The block's additive mask for the memory-efficient kernel: its rows padded to a multiple of 16
    (the kernel's alignment), then narrowed back."""
    if mask.kind in ("none", "causal"):
        return None
    masked = masked_positions(mask, q.size(2), k.size(2), q.device)
    sk = masked.size(-1)
    bias = q.new_zeros(*masked.shape[:-1], math.ceil(sk / 16) * 16)[..., :sk]
    return bias.masked_fill_(masked, -_INF)


def _efficient_forward(q, k, v, mask: StepMask, scale, keep_prob):
    groups = q.size(1) // k.size(1)
    k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
    bias = _efficient_bias(mask, q, k)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 1.0 - keep_prob, mask.kind == "causal", scale=float(scale))
    lse = lse[..., :q.size(2)].float()
    if bias is not None:  # rows that see no key
        dead = torch.isinf(lse) | torch.isnan(lse)
        lse, out = lse.masked_fill(dead, -_INF), out.masked_fill(dead.unsqueeze(-1), 0.0)
    return out, lse, (seed if keep_prob < 1.0 else None), (offset if keep_prob < 1.0 else None)


def _efficient_backward(q, k, v, dout, out, lse, mask: StepMask, scale, keep_prob, seed, offset):
    groups = q.size(1) // k.size(1)
    k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
    bias = _efficient_bias(mask, q, k)
    padded = math.ceil(q.size(2) / 32) * 32  # the kernel's LSE rows
    lse = F.pad(lse.float().masked_fill(torch.isneginf(lse), _INF), (0, padded - q.size(2)))
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype), q, k, v, bias, out.to(q.dtype), lse, empty if seed is None else seed,
        empty if offset is None else offset, 1.0 - keep_prob, [True, True, True, False], mask.kind == "causal",
        scale=float(scale))
    return dq, sum_kv_heads(dk, groups), sum_kv_heads(dv, groups)
