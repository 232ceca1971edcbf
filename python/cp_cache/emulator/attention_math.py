"""The emulated ops' math: argument checks, the mask each sparse mode gives, dropout, and
attention forward/backward in plain torch (float32, float64 for float64 inputs).

See ``cp_cache.emulator`` for the semantics emulated.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .. import layout as L
from ..npu_ops import FLOAT32_LOWEST, INT_MAX, STATS_WIDTH, is_compressed_mask

# ---------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, offset: int) -> int:
    """A 64-bit seed for a private generator from (seed, offset) (splitmix64-style)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(offset) + 0x632BE59BD9B4E019) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x


def dropout_keep_mask(seed: int, offset: int, shape: Sequence[int], keep_prob: float) -> torch.Tensor:
    """The emulator's dropout keep mask (True = keep) for a probability matrix of ``shape``.

    A deterministic function of (seed, offset, shape, keep_prob): a private
    ``torch.Generator`` seeded from (seed, offset) draws ``torch.rand(shape)``
    and an element is kept where that value is ``< keep_prob``.  Never touches
    the default generator.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_mix_seed(seed, offset))
    u = torch.rand(tuple(int(s) for s in shape), generator=gen, dtype=torch.float32)
    return u < float(keep_prob)


def read_int(t: Any) -> int:
    if t is None:
        return 0
    if isinstance(t, torch.Tensor):
        return int(t.reshape(-1)[0].item())
    return int(t)


# ---------------------------------------------------------------------------
# validation and layout helpers
# ---------------------------------------------------------------------------


def describe(value: Any) -> str:
    return f"Tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def _check_unsupported(pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, softmax_layout):
    for name, value in (
        ("pse", pse),
        ("padding_mask", padding_mask),
        ("prefix", prefix),
        ("actual_seq_qlen", actual_seq_qlen),
        ("actual_seq_kvlen", actual_seq_kvlen),
    ):
        if value is not None:
            raise NotImplementedError(
                f"npu emulator: {name}={describe(value)} is not supported (only {name}=None)"
            )
    if softmax_layout != "":
        raise NotImplementedError(
            f"npu emulator: softmax_layout={softmax_layout!r} is not supported (only softmax_layout='')"
        )


def _check_layout(input_layout: str) -> None:
    if input_layout == L.TND:
        raise NotImplementedError(
            "npu emulator: input_layout='TND' (varlen) is not supported; use BNSD, BSND, BSH or SBH"
        )
    if input_layout not in L.LAYOUTS:
        raise ValueError(
            f"npu_fusion_attention: unknown input_layout={input_layout!r}; expected one of "
            f"{', '.join(L.LAYOUTS)} or TND"
        )


def _check_sparse_mode(sparse_mode: int, supported: Sequence[int] = (0, 1, 2, 3, 4)) -> None:
    if sparse_mode < 0 or sparse_mode > 8:
        raise ValueError(f"npu_fusion_attention: unknown sparse_mode={sparse_mode}; expected 0..8")
    if sparse_mode not in supported:
        raise NotImplementedError(
            f"npu emulator: sparse_mode={sparse_mode} (prefix/varlen modes) is not supported; "
            f"supported: {', '.join(map(str, supported))}"
        )


def check_sink(sink: Optional[torch.Tensor], head_num: int) -> None:
    """``sink``: None, or a floating tensor [head_num] (one logit per query head; float32 on the NPU)."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor) or not sink.dtype.is_floating_point or tuple(sink.shape) != (head_num,):
        raise ValueError(
            f"npu_fusion_attention: sink={describe(sink)} must be a floating tensor of shape [head_num] = "
            f"[{head_num}] (one logit per query head)"
        )


def _check_keep_prob(keep_prob: float) -> None:
    if not (0.0 < keep_prob <= 1.0):
        raise ValueError(f"npu_fusion_attention: keep_prob={keep_prob} must be in (0, 1]")


class _Dims:
    """The call's dims; ``D`` is Q/K's head size, ``Dv`` V's (and the output's): MLA, default ``D``."""

    __slots__ = ("B", "Nq", "Nkv", "Sq", "Skv", "D", "Dv")

    def __init__(self, B, Nq, Nkv, Sq, Skv, D, Dv=None):
        self.B, self.Nq, self.Nkv, self.Sq, self.Skv, self.D = B, Nq, Nkv, Sq, Skv, D
        self.Dv = D if Dv is None else Dv


def op_dims(query, key, value, head_num: int, input_layout: str) -> _Dims:
    """Validate shapes for the layout and return the logical dimensions."""
    _check_layout(input_layout)
    rank = 4 if input_layout in ("BNSD", "BSND") else 3
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            raise ValueError(
                f"npu_fusion_attention: {name} must be {rank}-D for input_layout={input_layout!r}, "
                f"got {t.dim()}-D shape {list(t.shape)}"
            )
    check_value_shape(key, value)
    if head_num <= 0:
        raise ValueError(f"npu_fusion_attention: head_num={head_num} must be positive")
    qs, ks = list(query.shape), list(key.shape)
    if input_layout == "BNSD":
        B, Nq, Sq, D = qs
        Bk, Nkv, Skv, Dk = ks
    elif input_layout == "BSND":
        B, Sq, Nq, D = qs
        Bk, Skv, Nkv, Dk = ks
    else:
        if input_layout == "BSH":
            B, Sq, Hq = qs
            Bk, Skv, Hkv = ks
        else:
            Sq, B, Hq = qs
            Skv, Bk, Hkv = ks
        if Hq % head_num != 0:
            raise ValueError(
                f"npu_fusion_attention: head_num={head_num} does not divide the query hidden size "
                f"H={Hq} (input_layout={input_layout!r})"
            )
        Nq, D = head_num, Hq // head_num
        if Hkv % D != 0:
            raise ValueError(
                f"npu_fusion_attention: key hidden size H={Hkv} is not a multiple of the head dim "
                f"D={D} (= H_q {Hq} / head_num {head_num})"
            )
        Nkv, Dk = Hkv // D, D
        if Nkv > 0 and value.size(2) % Nkv:
            raise ValueError(
                f"npu_fusion_attention: value hidden size H={value.size(2)} is not a multiple of the key/value "
                f"head count Nkv={Nkv} (= key H {Hkv} / D {D})"
            )
    if Nq != head_num:
        raise ValueError(
            f"npu_fusion_attention: head_num={head_num} does not match the query's head count {Nq} "
            f"(input_layout={input_layout!r}, query shape {qs})"
        )
    if B != Bk:
        raise ValueError(f"npu_fusion_attention: query batch {B} != key/value batch {Bk}")
    if D != Dk:
        raise ValueError(f"npu_fusion_attention: query head dim {D} != key/value head dim {Dk}")
    if Nkv <= 0 or Nq % Nkv != 0:
        raise ValueError(
            f"npu_fusion_attention: query heads Nq={Nq} must be a multiple of key/value heads Nkv={Nkv} (GQA)"
        )
    return _Dims(B, Nq, Nkv, Sq, Skv, D, L.value_head_dim(value, input_layout, Nkv))


def check_value_shape(key, value) -> None:
    """Key and value agree on every dim but the last (V's head size, or BSH/SBH's hidden size N * Dv,
    may differ from K's: MLA)."""
    if key.dim() != value.dim() or tuple(key.shape[:-1]) != tuple(value.shape[:-1]):
        raise ValueError(
            f"npu_fusion_attention: key and value must agree on every dim but the head size, got key "
            f"{list(key.shape)} and value {list(value.shape)}"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _allowed_mask(
    atten_mask: Optional[torch.Tensor], sparse_mode: int, pre_tockens: int, next_tockens: int, d: _Dims
) -> Optional[torch.Tensor]:
    """Boolean 'may attend' mask broadcastable to [B, Nq, Sq, Skv], or None for full attention."""
    _check_sparse_mode(sparse_mode)
    if atten_mask is None:
        return None  # full attention whatever sparse_mode says
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(
            f"npu_fusion_attention: atten_mask dtype {atten_mask.dtype} is not supported; use bool or uint8 "
            "(1/True = masked out)"
        )
    Sq, Skv = d.Sq, d.Skv
    i = torch.arange(Sq).unsqueeze(1)
    j = torch.arange(Skv).unsqueeze(0)
    if sparse_mode in (2, 3, 4):
        if not is_compressed_mask(atten_mask):
            raise ValueError(
                f"npu_fusion_attention: sparse_mode={sparse_mode} needs the compressed 2048x2048 atten_mask, "
                f"got atten_mask shape {list(atten_mask.shape)}"
            )
        if sparse_mode == 2:
            allowed = j <= i
        elif sparse_mode == 3:
            allowed = j <= i + (Skv - Sq)
        else:
            delta = Skv - Sq
            allowed = ((j - i) <= next_tockens + delta) & ((i - j) <= pre_tockens - delta)
        return allowed.view(1, 1, Sq, Skv)
    shape = list(atten_mask.shape)
    ok = False
    if len(shape) == 2:
        ok = shape == [Sq, Skv]
    elif len(shape) == 4:
        ok = shape[2:] == [Sq, Skv] and (
            shape[:2] == [1, 1] or shape[:2] == [d.B, 1] or shape[:2] == [d.B, d.Nq]
        )
    if not ok:
        raise ValueError(
            f"npu_fusion_attention: atten_mask shape {shape} is not supported for sparse_mode={sparse_mode}; "
            f"expected [Sq, Skv], [1, 1, Sq, Skv], [B, 1, Sq, Skv] or [B, N, Sq, Skv] with "
            f"B={d.B}, N={d.Nq}, Sq={Sq}, Skv={Skv}"
        )
    m = atten_mask.bool()
    if m.dim() == 2:
        m = m.view(1, 1, Sq, Skv)
    allowed = ~m
    if sparse_mode == 0 and (pre_tockens < INT_MAX or next_tockens < INT_MAX):
        band = ((j - i) <= next_tockens) & ((i - j) <= pre_tockens)
        allowed = allowed & band.view(1, 1, Sq, Skv)
    return allowed


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def check_call(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, prefix,
                   actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink):
    _check_layout(input_layout)
    _check_unsupported(pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, softmax_layout)
    _check_sparse_mode(sparse_mode)
    _check_keep_prob(keep_prob)
    check_sink(sink, head_num)
    return op_dims(query, key, value, head_num, input_layout)


# ---------------------------------------------------------------------------
# the math
# ---------------------------------------------------------------------------


def _scores(q, k, scale, allowed):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _sink_logits(sink: Optional[torch.Tensor], cdt: torch.dtype) -> Optional[torch.Tensor]:
    """The sink as [1, N, 1, 1] logits in the compute dtype (None: no sink)."""
    return None if sink is None else sink.to(cdt).view(1, -1, 1, 1)


def forward_math(query, key, value, d: _Dims, layout, atten_mask, scale, keep_prob, pre_tockens,
                  next_tockens, sparse_mode, seed: int, offset: int, sink=None):
    """(out, softmax_max, softmax_sum). ``sink`` [Nq]: one more logit per row of head h, sink[h]
    itself (not scaled), in the softmax's max and sum; its column is dropped before P V."""
    cdt = _compute_dtype(query.dtype)
    q = L.to_bnsd(query, layout, d.Nq).to(cdt)
    groups = d.Nq // d.Nkv
    k = _expand_kv(L.to_bnsd(key, layout, d.Nkv).to(cdt), groups)
    v = _expand_kv(L.to_bnsd(value, layout, d.Nkv).to(cdt), groups)
    allowed = _allowed_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, d)
    s = _scores(q, k, scale, allowed)
    row_max = s.amax(dim=-1, keepdim=True)
    sink_logit = _sink_logits(sink, cdt)
    if sink_logit is not None:
        row_max = torch.maximum(row_max, sink_logit)
    dead = torch.isneginf(row_max)
    row_max = torch.where(dead, torch.full_like(row_max, FLOAT32_LOWEST), row_max)
    p = torch.exp(s - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    if sink_logit is not None:
        row_sum = row_sum + torch.exp(sink_logit - row_max)
    probs = p / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    if keep_prob < 1.0:
        keep = dropout_keep_mask(seed, offset, (d.B, d.Nq, d.Sq, d.Skv), keep_prob)
        probs = probs * keep.to(cdt) / keep_prob
    out = torch.matmul(probs, v).to(query.dtype)
    sdt = stat_dtype(query.dtype)
    smax = row_max.to(sdt).expand(d.B, d.Nq, d.Sq, STATS_WIDTH).contiguous()
    ssum = row_sum.to(sdt).expand(d.B, d.Nq, d.Sq, STATS_WIDTH).contiguous()
    return L.from_bnsd(out, layout), smax, ssum


def draw_seed_offset(keep_prob: float):
    if keep_prob < 1.0:
        drawn = torch.randint(0, 2**62, (2,), dtype=torch.int64)  # the default CPU generator
        return drawn[0:1].clone(), drawn[1:2].clone()
    return torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)


def backward_math(query, key, value, dy, d: _Dims, layout, atten_mask, softmax_max, softmax_sum,
                   attention_in, scale, keep_prob, pre_tockens, next_tockens, sparse_mode,
                   seed: int, offset: int, sink=None):
    """(dq, dk, dv, dsink); dsink [Nq] (None without a sink): the sink's probability
    exp(sink_h - LSE_i) times (0 - rowsum(dy * attention_in)), summed over the rows."""
    cdt = _compute_dtype(query.dtype)
    groups = d.Nq // d.Nkv
    if attention_in is None or softmax_max is None or softmax_sum is None:
        # Not given: recompute them as the forward would.
        out, smax, ssum = forward_math(query, key, value, d, layout, atten_mask, scale, keep_prob,
                                        pre_tockens, next_tockens, sparse_mode, seed, offset, sink)
        attention_in = out if attention_in is None else attention_in
        softmax_max = smax if softmax_max is None else softmax_max
        softmax_sum = ssum if softmax_sum is None else softmax_sum
    q = L.to_bnsd(query, layout, d.Nq).to(cdt)
    k = _expand_kv(L.to_bnsd(key, layout, d.Nkv).to(cdt), groups)
    v = _expand_kv(L.to_bnsd(value, layout, d.Nkv).to(cdt), groups)
    do = L.to_bnsd(dy, layout, d.Nq).to(cdt)
    o = L.to_bnsd(attention_in, layout, d.Nq).to(cdt)
    allowed = _allowed_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, d)
    s = _scores(q, k, scale, allowed)
    m = softmax_max[..., :1].to(cdt)
    l_sum = softmax_sum[..., :1].to(cdt)
    lse = m + torch.log(l_sum)  # -inf for fully masked rows (sum == 0)
    live = torch.isfinite(lse)
    lse_safe = torch.where(live, lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe)
    p = torch.where(live, p, torch.zeros_like(p))
    dp = torch.matmul(do, v.transpose(-1, -2))
    if keep_prob < 1.0:
        keep = dropout_keep_mask(seed, offset, (d.B, d.Nq, d.Sq, d.Skv), keep_prob).to(cdt) / keep_prob
        pd = p * keep
        dp = dp * keep
    else:
        pd = p
    dv = torch.matmul(pd.transpose(-1, -2), do)
    delta = (do * o).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    if groups > 1:
        dk = dk.view(d.B, d.Nkv, groups, d.Skv, d.D).sum(dim=2)
        dv = dv.view(d.B, d.Nkv, groups, d.Skv, d.Dv).sum(dim=2)
    dsink = None
    if sink is not None:
        p_sink = torch.where(live, torch.exp(_sink_logits(sink, cdt) - lse_safe), torch.zeros_like(lse))
        dsink = (-(p_sink * delta)).sum(dim=(0, 2, 3)).to(sink.dtype)
    return (
        L.from_bnsd(dq.to(query.dtype), layout),
        L.from_bnsd(dk.to(key.dtype), layout),
        L.from_bnsd(dv.to(value.dtype), layout),
        dsink,
    )


def empty(dtype, device):
    return torch.empty(0, dtype=dtype, device=device)
