"""CPU emulation of torch_npu's fused attention ops (DESIGN.md sections 4 and 6).

``install_npu_emulator()`` defines, under ``torch.ops.npu``, the operators

* ``npu_fusion_attention_v3`` / ``npu_fusion_attention_grad_v3`` (schemas of
  DESIGN.md section 4, copied verbatim), and
* ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (v1), with the schemas
  torch_npu ships today (op-plugin master): the v1 forward has the same inputs as
  v3 except that ``prefix``, ``actual_seq_qlen`` and ``actual_seq_kvlen`` are
  ``int[]?``; it returns ``(Tensor, Tensor, Tensor, Tensor, int, int, int)``
  (seed, offset, numels as ints) and its grad takes ``int seed, int offset,
  int numels``.  (DESIGN.md's description of v1 inputs, "plus Tensor?
  dropout_mask, int seed, int offset", does not match the real schema; the
  real one is used here.)

Each op has a CPU kernel in plain torch, a fake (meta) kernel and, for the
forward ops, the autograd formula of op-plugin's derivatives.yaml: the backward
calls ``torch.ops.npu.npu_fusion_attention_grad(_v3)`` with the forward's saved
outputs (attention_out as ``attention_in``, softmax_max/sum, softmax_out as
``softmax_in``, seed, offset), the very tensors saved for backward.

Emulated semantics
------------------
* layouts BNSD, BSND, BSH, SBH (BSH/SBH: ``H = N * D``; ``D = Hq / head_num``;
  the kv head count is ``Hkv / D``).  TND raises ``NotImplementedError``.
* GQA: key/value may have ``Nkv`` heads with ``Nq % Nkv == 0``; query head ``h``
  uses kv head ``h // (Nq // Nkv)``; dk/dv are summed over each group.
* ``scale`` multiplies ``Q K^T`` (op default 1.0).
* ``atten_mask``: bool/uint8, True/1 = masked out; shapes SS, 11SS, B1SS, BNSS.
* sparse_mode 0: mask as given plus the band ``j - i <= next_tockens`` and
  ``i - j <= pre_tockens`` (left-up origin); 1: mask as given, pre/next ignored;
  2: left-up causal (``j <= i``); 3: right-down causal (``j <= i + Skv - Sq``);
  4: band with the right-down origin (Ascend docs: "the part between preTokens
  and nextTokens, parameter starting point is the lower right corner"), i.e.
  with ``d = Skv - Sq``: keep ``j - i <= next_tockens + d`` and
  ``i - j <= pre_tockens - d``.  Modes 2/3/4 require the compressed 2048x2048
  mask; its values are not used, the pattern comes from the mode.  Without an
  atten_mask the op computes full attention whatever sparse_mode says.
  Modes 5..8 raise ``NotImplementedError``; others ``ValueError``.
* dtypes: fp16/bf16/fp32 computed in float32, fp64 computed in float64; outputs
  in the input dtype.  softmax_max/softmax_sum are float32 ``[B, Nq, Sq, 8]``
  (float64 for float64 inputs, so that gradcheck is exact), the 8 values
  replicated, ``LSE = max + log(sum)``.  softmax_out is an empty ``[0]`` tensor.
* dropout: ``keep_prob`` in (0, 1].  With ``keep_prob < 1`` the forward draws
  ``seed, offset = torch.randint(0, 2**62, (2,))`` from the *default* CPU
  generator (so ``torch.utils.checkpoint``'s RNG preservation replays it) and
  the keep mask is ``dropout_keep_mask(seed, offset, [B, Nq, Sq, Skv],
  keep_prob)``: a private ``torch.Generator`` seeded from (seed, offset), then
  ``torch.rand(shape) < keep_prob``.  Kept probabilities are scaled by
  ``1 / keep_prob``.  With ``keep_prob == 1`` seed = offset = ``tensor([0])``
  and the default generator is untouched.
* grad op: standard flash backward from the GIVEN statistics and
  ``attention_in``: ``P = exp(S - LSE)`` with ``LSE = softmax_max[..., 0] +
  log(softmax_sum[..., 0])``, ``D = rowsum(dy * attention_in)``,
  ``dS = P * (dP - D)``.  ``softmax_max = LSE, softmax_sum = 1`` gives the
  same result.  dpse/dsink are empty ``[0]`` tensors.

Fully masked rows (every key masked): attention_out = 0, gradients 0,
``softmax_max`` = the float32 lowest finite value (-3.4028235e38) and
``softmax_sum`` = 0, so ``LSE = max + log(sum) = -inf`` and nothing is NaN
(a merge with such a block gives it weight ``exp(lowest - m) = 0``).

Raises ``NotImplementedError`` (naming the argument and its value) for pse,
padding_mask, prefix, actual_seq_qlen/kvlen, sink, a non-empty softmax_layout,
layout TND and sparse modes 5..8; ``ValueError`` for bad inputs (rank for the
layout, head_num mismatch, ``Nq % Nkv``, key/value shape, batch, head dim,
keep_prob, unknown layout or sparse_mode, mask dtype/shape).

With ``route_sdpa=True``, ``torch.nn.functional.scaled_dot_product_attention``
is replaced by a function of the same name that sends CPU tensors (and DTensors
whose local tensors are on CPU) to ``torch.ops.npu.npu_fusion_attention_v3``
the way torch_npu does on an NPU.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from ..kernels.npu import causal_mask

__all__ = [
    "install_npu_emulator",
    "uninstall_npu_emulator",
    "emulator_installed",
    "dropout_keep_mask",
    "scaled_dot_product_attention",
]

logger = logging.getLogger("cp_cache")

INT_MAX = 2147483647
FLOAT32_LOWEST = float(torch.finfo(torch.float32).min)
_STAT_CHANNELS = 8
_COMPRESSED_MASK_SIZE = 2048
_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")

# ---------------------------------------------------------------------------
# schemas
# ---------------------------------------------------------------------------

V3_FWD_SCHEMA = (
    "npu_fusion_attention_v3(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
    "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
    "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
    "SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, "
    "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", "
    "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
V3_GRAD_SCHEMA = (
    "npu_fusion_attention_grad_v3(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
    "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
    "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
    "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
    "int next_tockens=2147483647, int inner_precise=0, Tensor? seed=None, Tensor? offset=None, "
    "SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, "
    "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", "
    "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
V1_FWD_SCHEMA = (
    "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
    "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
    "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
    "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
)
V1_GRAD_SCHEMA = (
    "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
    "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
    "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
    "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
    "int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
    "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)

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


def _read_int(t: Any) -> int:
    if t is None:
        return 0
    if isinstance(t, torch.Tensor):
        return int(t.reshape(-1)[0].item())
    return int(t)


# ---------------------------------------------------------------------------
# validation and layout helpers
# ---------------------------------------------------------------------------


def _check_unsupported(pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, sink, softmax_layout):
    for name, value in (
        ("pse", pse),
        ("padding_mask", padding_mask),
        ("prefix", prefix),
        ("actual_seq_qlen", actual_seq_qlen),
        ("actual_seq_kvlen", actual_seq_kvlen),
        ("sink", sink),
    ):
        if value is not None:
            desc = f"Tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(
                f"npu emulator: {name}={desc} is not supported (only {name}=None)"
            )
    if softmax_layout != "":
        raise NotImplementedError(
            f"npu emulator: softmax_layout={softmax_layout!r} is not supported (only softmax_layout='')"
        )


def _check_layout(input_layout: str) -> None:
    if input_layout == "TND":
        raise NotImplementedError(
            "npu emulator: input_layout='TND' (varlen) is not supported; use BNSD, BSND, BSH or SBH"
        )
    if input_layout not in _LAYOUTS:
        raise ValueError(
            f"npu_fusion_attention: unknown input_layout={input_layout!r}; expected one of "
            f"{', '.join(_LAYOUTS)} or TND"
        )


def _check_sparse_mode(sparse_mode: int) -> None:
    if sparse_mode < 0 or sparse_mode > 8:
        raise ValueError(f"npu_fusion_attention: unknown sparse_mode={sparse_mode}; expected 0..8")
    if sparse_mode >= 5:
        raise NotImplementedError(
            f"npu emulator: sparse_mode={sparse_mode} (prefix/varlen modes) is not supported; "
            "supported: 0, 1, 2, 3, 4"
        )


def _check_keep_prob(keep_prob: float) -> None:
    if not (0.0 < keep_prob <= 1.0):
        raise ValueError(f"npu_fusion_attention: keep_prob={keep_prob} must be in (0, 1]")


class _Dims:
    __slots__ = ("B", "Nq", "Nkv", "Sq", "Skv", "D")

    def __init__(self, B, Nq, Nkv, Sq, Skv, D):
        self.B, self.Nq, self.Nkv, self.Sq, self.Skv, self.D = B, Nq, Nkv, Sq, Skv, D


def _dims(query, key, value, head_num: int, input_layout: str) -> _Dims:
    """Validate shapes for the layout and return the logical dimensions."""
    _check_layout(input_layout)
    rank = 4 if input_layout in ("BNSD", "BSND") else 3
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            raise ValueError(
                f"npu_fusion_attention: {name} must be {rank}-D for input_layout={input_layout!r}, "
                f"got {t.dim()}-D shape {list(t.shape)}"
            )
    if tuple(key.shape) != tuple(value.shape):
        raise ValueError(
            f"npu_fusion_attention: key and value must have the same shape, got key {list(key.shape)} "
            f"and value {list(value.shape)}"
        )
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
    return _Dims(B, Nq, Nkv, Sq, Skv, D)


def _to_bnsd(x: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).permute(0, 2, 1, 3)
    s, b, h = x.shape  # SBH
    return x.reshape(s, b, n, h // n).permute(1, 2, 0, 3)


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()  # SBH


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _is_compressed(mask: torch.Tensor) -> bool:
    shape = list(mask.shape)
    return (
        len(shape) >= 2
        and shape[-2:] == [_COMPRESSED_MASK_SIZE, _COMPRESSED_MASK_SIZE]
        and all(s == 1 for s in shape[:-2])
    )


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
        if not _is_compressed(atten_mask):
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


def _common_checks(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, prefix,
                   actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink):
    _check_layout(input_layout)
    _check_unsupported(pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, sink, softmax_layout)
    _check_sparse_mode(sparse_mode)
    _check_keep_prob(keep_prob)
    return _dims(query, key, value, head_num, input_layout)


# ---------------------------------------------------------------------------
# the math
# ---------------------------------------------------------------------------


def _scores(q, k, scale, allowed):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _forward_math(query, key, value, d: _Dims, layout, atten_mask, scale, keep_prob, pre_tockens,
                  next_tockens, sparse_mode, seed: int, offset: int):
    cdt = _compute_dtype(query.dtype)
    q = _to_bnsd(query, layout, d.Nq).to(cdt)
    groups = d.Nq // d.Nkv
    k = _expand_kv(_to_bnsd(key, layout, d.Nkv).to(cdt), groups)
    v = _expand_kv(_to_bnsd(value, layout, d.Nkv).to(cdt), groups)
    allowed = _allowed_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, d)
    s = _scores(q, k, scale, allowed)
    row_max = s.amax(dim=-1, keepdim=True)
    dead = torch.isneginf(row_max)
    row_max = torch.where(dead, torch.full_like(row_max, FLOAT32_LOWEST), row_max)
    p = torch.exp(s - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    probs = p / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    if keep_prob < 1.0:
        keep = dropout_keep_mask(seed, offset, (d.B, d.Nq, d.Sq, d.Skv), keep_prob)
        probs = probs * keep.to(cdt) / keep_prob
    out = torch.matmul(probs, v).to(query.dtype)
    sdt = _stat_dtype(query.dtype)
    smax = row_max.to(sdt).expand(d.B, d.Nq, d.Sq, _STAT_CHANNELS).contiguous()
    ssum = row_sum.to(sdt).expand(d.B, d.Nq, d.Sq, _STAT_CHANNELS).contiguous()
    return _from_bnsd(out, layout), smax, ssum


def _draw_seed_offset(keep_prob: float):
    if keep_prob < 1.0:
        drawn = torch.randint(0, 2**62, (2,), dtype=torch.int64)  # the default CPU generator
        return drawn[0:1].clone(), drawn[1:2].clone()
    return torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)


def _backward_math(query, key, value, dy, d: _Dims, layout, atten_mask, softmax_max, softmax_sum,
                   attention_in, scale, keep_prob, pre_tockens, next_tockens, sparse_mode,
                   seed: int, offset: int):
    cdt = _compute_dtype(query.dtype)
    groups = d.Nq // d.Nkv
    if attention_in is None or softmax_max is None or softmax_sum is None:
        # Not given: recompute them as the forward would.
        out, smax, ssum = _forward_math(query, key, value, d, layout, atten_mask, scale, keep_prob,
                                        pre_tockens, next_tockens, sparse_mode, seed, offset)
        attention_in = out if attention_in is None else attention_in
        softmax_max = smax if softmax_max is None else softmax_max
        softmax_sum = ssum if softmax_sum is None else softmax_sum
    q = _to_bnsd(query, layout, d.Nq).to(cdt)
    k = _expand_kv(_to_bnsd(key, layout, d.Nkv).to(cdt), groups)
    v = _expand_kv(_to_bnsd(value, layout, d.Nkv).to(cdt), groups)
    do = _to_bnsd(dy, layout, d.Nq).to(cdt)
    o = _to_bnsd(attention_in, layout, d.Nq).to(cdt)
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
        dv = dv.view(d.B, d.Nkv, groups, d.Skv, d.D).sum(dim=2)
    return (
        _from_bnsd(dq.to(query.dtype), layout),
        _from_bnsd(dk.to(key.dtype), layout),
        _from_bnsd(dv.to(value.dtype), layout),
    )


def _empty(dtype, device):
    return torch.empty(0, dtype=dtype, device=device)


# ---------------------------------------------------------------------------
# kernels (v3)
# ---------------------------------------------------------------------------


def _fwd_v3_cpu(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    d = _common_checks(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, prefix,
                       actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    seed_t, offset_t = _draw_seed_offset(keep_prob)
    out, smax, ssum = _forward_math(query, key, value, d, input_layout, atten_mask, scale, keep_prob,
                                    pre_tockens, next_tockens, sparse_mode, int(seed_t[0]), int(offset_t[0]))
    return out, smax, ssum, _empty(query.dtype, query.device), seed_t, offset_t


def _fwd_v3_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                 scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                 prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                 gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    d = _common_checks(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, prefix,
                       actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    sdt = _stat_dtype(query.dtype)
    stat_shape = (d.B, d.Nq, d.Sq, _STAT_CHANNELS)
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        query.new_empty(stat_shape, dtype=sdt),
        query.new_empty(stat_shape, dtype=sdt),
        query.new_empty((0,)),
        torch.empty(1, dtype=torch.int64, device="cpu"),
        torch.empty(1, dtype=torch.int64, device="cpu"),
    )


def _grad_common(query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, softmax_max,
                 softmax_sum, attention_in, scale_value, keep_prob, pre_tockens, next_tockens, seed, offset,
                 prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink):
    d = _common_checks(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, prefix,
                       actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    if tuple(dy.shape) != tuple(query.shape):
        raise ValueError(f"npu_fusion_attention_grad: dy shape {list(dy.shape)} != query shape {list(query.shape)}")
    dq, dk, dv = _backward_math(query, key, value, dy, d, input_layout, atten_mask, softmax_max, softmax_sum,
                                attention_in, scale_value, keep_prob, pre_tockens, next_tockens, sparse_mode,
                                seed, offset)
    return dq, dk, dv, _empty(query.dtype, query.device), _empty(query.dtype, query.device)


def _grad_v3_cpu(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None,
                 scale_value=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                 seed=None, offset=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                 sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    seed_i = _read_int(seed) if keep_prob < 1.0 else 0
    offset_i = _read_int(offset) if keep_prob < 1.0 else 0
    return _grad_common(query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask,
                        softmax_max, softmax_sum, attention_in, scale_value, keep_prob, pre_tockens,
                        next_tockens, seed_i, offset_i, prefix, actual_seq_qlen, actual_seq_kvlen,
                        sparse_mode, softmax_layout, sink)


def _grad_fake(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
               atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None,
               scale_value=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
               seed=None, offset=None, numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
               sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    _common_checks(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, prefix,
                   actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
        torch.empty_like(value, memory_format=torch.contiguous_format),
        query.new_empty((0,)),
        query.new_empty((0,)),
    )


# ---------------------------------------------------------------------------
# kernels (v1)
# ---------------------------------------------------------------------------


def _fwd_v1_cpu(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    out, smax, ssum, sout, seed_t, offset_t = _fwd_v3_cpu(
        query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
        pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
        gen_mask_parallel, sync, softmax_layout, sink)
    d = _dims(query, key, value, head_num, input_layout)
    numels = d.B * d.Nq * d.Sq * d.Skv if keep_prob < 1.0 else 0
    return out, smax, ssum, sout, int(seed_t[0]), int(offset_t[0]), numels


def _fwd_v1_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                 scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                 prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                 gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    res = _fwd_v3_fake(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                       keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
                       actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, softmax_layout, sink)
    d = _dims(query, key, value, head_num, input_layout)
    numels = d.B * d.Nq * d.Sq * d.Skv if keep_prob < 1.0 else 0
    return res[0], res[1], res[2], res[3], 0, 0, numels


def _grad_v1_cpu(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None,
                 scale_value=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                 seed=0, offset=0, numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                 sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    return _grad_common(query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask,
                        softmax_max, softmax_sum, attention_in, scale_value, keep_prob, pre_tockens,
                        next_tockens, int(seed), int(offset), prefix, actual_seq_qlen, actual_seq_kvlen,
                        sparse_mode, softmax_layout, sink)


# ---------------------------------------------------------------------------
# autograd (derivatives.yaml)
# ---------------------------------------------------------------------------

_FWD_ARG_NAMES = (
    "query", "key", "value", "head_num", "input_layout", "pse", "padding_mask", "atten_mask", "scale",
    "keep_prob", "pre_tockens", "next_tockens", "inner_precise", "prefix", "actual_seq_qlen",
    "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout", "sink",
)


def _setup_context_common(ctx, inputs, output, tensor_seed: bool):
    args = dict(zip(_FWD_ARG_NAMES, inputs))
    ctx.args = {
        k: v for k, v in args.items()
        if k not in ("query", "key", "value", "pse", "padding_mask", "atten_mask", "sink",
                     "actual_seq_qlen", "actual_seq_kvlen")
    }
    ctx.v1_ints = None
    if tensor_seed:
        ctx.mark_non_differentiable(output[4], output[5])
        ctx.save_for_backward(
            args["query"], args["key"], args["value"], args["pse"], args["padding_mask"], args["atten_mask"],
            args["actual_seq_qlen"], args["actual_seq_kvlen"], args["sink"],
            output[0], output[1], output[2], output[3], output[4], output[5],
        )
    else:
        ctx.v1_ints = (output[4], output[5], output[6])
        ctx.save_for_backward(
            args["query"], args["key"], args["value"], args["pse"], args["padding_mask"], args["atten_mask"],
            None, None, args["sink"], output[0], output[1], output[2], output[3],
        )
        ctx.args["actual_seq_qlen_v1"] = args["actual_seq_qlen"]
        ctx.args["actual_seq_kvlen_v1"] = args["actual_seq_kvlen"]


def _setup_context_v3(ctx, inputs, output):
    _setup_context_common(ctx, inputs, output, tensor_seed=True)


def _setup_context_v1(ctx, inputs, output):
    _setup_context_common(ctx, inputs, output, tensor_seed=False)


def _grads_tuple(dq, dk, dv, dpse, dsink, pse, sink):
    n = len(_FWD_ARG_NAMES)
    grads = [None] * n
    grads[0], grads[1], grads[2] = dq, dk, dv
    grads[5] = dpse if pse is not None else None
    grads[20] = dsink if sink is not None else None
    return tuple(grads)


def _backward_v3(ctx, grad_out, *unused_grads):
    (query, key, value, pse, padding_mask, atten_mask, qlen, kvlen, sink,
     result0, result1, result2, result3, result4, result5) = ctx.saved_tensors
    a = ctx.args
    dq, dk, dv, dpse, dsink = torch.ops.npu.npu_fusion_attention_grad_v3(
        query, key, value, grad_out, a["head_num"], a["input_layout"],
        pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=result1, softmax_sum=result2, softmax_in=result3, attention_in=result0,
        scale_value=a["scale"], keep_prob=a["keep_prob"], pre_tockens=a["pre_tockens"],
        next_tockens=a["next_tockens"], inner_precise=a["inner_precise"],
        seed=result4, offset=result5, prefix=a["prefix"],
        actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, sparse_mode=a["sparse_mode"],
        gen_mask_parallel=a["gen_mask_parallel"], sync=a["sync"], softmax_layout=a["softmax_layout"],
        sink=sink,
    )
    return _grads_tuple(dq, dk, dv, dpse, dsink, pse, sink)


def _backward_v1(ctx, grad_out, *unused_grads):
    (query, key, value, pse, padding_mask, atten_mask, _q, _kv, sink,
     result0, result1, result2, result3) = ctx.saved_tensors
    a = ctx.args
    seed, offset, numels = ctx.v1_ints
    dq, dk, dv, dpse, dsink = torch.ops.npu.npu_fusion_attention_grad(
        query, key, value, grad_out, a["head_num"], a["input_layout"],
        pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=result1, softmax_sum=result2, softmax_in=result3, attention_in=result0,
        scale_value=a["scale"], keep_prob=a["keep_prob"], pre_tockens=a["pre_tockens"],
        next_tockens=a["next_tockens"], inner_precise=a["inner_precise"],
        seed=seed, offset=offset, numels=numels, prefix=a["prefix"],
        actual_seq_qlen=a["actual_seq_qlen_v1"], actual_seq_kvlen=a["actual_seq_kvlen_v1"],
        sparse_mode=a["sparse_mode"], gen_mask_parallel=a["gen_mask_parallel"], sync=a["sync"],
        softmax_layout=a["softmax_layout"], sink=sink,
    )
    return _grads_tuple(dq, dk, dv, dpse, dsink, pse, sink)


# ---------------------------------------------------------------------------
# SDPA route
# ---------------------------------------------------------------------------

_ORIGINAL_SDPA = None
def _local_device(x: Any) -> Optional[torch.device]:
    """The device a tensor's data lives on; for a DTensor, that of its local shard.

    A DTensor is a wrapper subclass created with its local tensor's device, so
    ``.device`` answers for both without touching the data (no to_local(), no
    item()).
    """
    if not isinstance(x, torch.Tensor):
        return None
    return x.device


def _npu_mask_from_bool(attn_mask: torch.Tensor, B: int, N: int, Sq: int, Skv: int) -> torch.Tensor:
    """A torch bool mask (True = attend) as an NPU mask (True = masked out) of a supported shape."""
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.size(1) != 1:
        shape = (B, N, Sq, Skv)
    elif m.size(0) != 1:
        shape = (B, 1, Sq, Skv)
    else:
        shape = (1, 1, Sq, Skv)
    return torch.logical_not(m.expand(shape)).contiguous()


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` routed to ``torch.ops.npu.npu_fusion_attention_v3`` on CPU."""
    original = _ORIGINAL_SDPA if _ORIGINAL_SDPA is not None else torch._C._nn.scaled_dot_product_attention
    call_original = lambda: original(  # noqa: E731
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )
    devices = [_local_device(t) for t in (query, key, value)]
    if any(dev is None or dev.type != "cpu" for dev in devices):
        return call_original()
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return call_original()
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        logger.debug("npu emulator SDPA route: non-boolean attn_mask (%s), using the original SDPA", attn_mask.dtype)
        return call_original()
    if attn_mask is not None and is_causal:
        return call_original()  # torch raises for this combination
    if not (0.0 <= dropout_p < 1.0):
        return call_original()
    nq, nkv = query.size(1), key.size(1)
    if nq != nkv and not enable_gqa:
        return call_original()  # torch's own error
    B, Sq, Skv, D = query.size(0), query.size(2), key.size(2), query.size(3)
    kwargs = dict(
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(D),
        keep_prob=1.0 - float(dropout_p),
    )
    if is_causal:
        kwargs.update(atten_mask=causal_mask(devices[0]), sparse_mode=2, next_tockens=0)
    elif attn_mask is not None:
        kwargs.update(atten_mask=_npu_mask_from_bool(attn_mask, B, nq, Sq, Skv), sparse_mode=0)
    out = torch.ops.npu.npu_fusion_attention_v3(query, key, value, nq, "BNSD", **kwargs)
    return out[0]


# ---------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------

_STATE_LOCK = threading.RLock()
_LIBS: list = []
_INSTALLED = False
_ROUTED = False


def emulator_installed() -> bool:
    """True while the emulator's ops are installed."""
    return _INSTALLED


def _real_op_exists() -> bool:
    try:
        getattr(torch.ops.npu, "npu_fusion_attention_v3")
    except (AttributeError, RuntimeError):
        return False
    return True


def install_npu_emulator(route_sdpa: bool = True) -> bool:
    """Define the NPU fused attention ops on CPU (idempotent).

    Returns False (and changes nothing) when ``torch.ops.npu.npu_fusion_attention_v3``
    already exists and was not defined by this module (torch_npu is present).
    With ``route_sdpa`` also routes ``F.scaled_dot_product_attention`` to the v3 op.
    """
    global _INSTALLED, _ROUTED, _ORIGINAL_SDPA
    with _STATE_LOCK:
        if _INSTALLED:
            if route_sdpa and not _ROUTED:
                _install_route()
            return True
        if _real_op_exists():
            logger.info(
                "npu emulator not installed: torch.ops.npu.npu_fusion_attention_v3 already exists "
                "(torch_npu or another library defines it)"
            )
            return False
        lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901
        try:
            for schema in (V3_FWD_SCHEMA, V3_GRAD_SCHEMA, V1_FWD_SCHEMA, V1_GRAD_SCHEMA):
                lib.define(schema)
            lib.impl("npu_fusion_attention_v3", _fwd_v3_cpu, "CPU")
            lib.impl("npu_fusion_attention_grad_v3", _grad_v3_cpu, "CPU")
            lib.impl("npu_fusion_attention", _fwd_v1_cpu, "CPU")
            lib.impl("npu_fusion_attention_grad", _grad_v1_cpu, "CPU")
            torch.library.register_fake("npu::npu_fusion_attention_v3", _fwd_v3_fake, lib=lib)
            torch.library.register_fake("npu::npu_fusion_attention_grad_v3", _grad_fake, lib=lib)
            torch.library.register_fake("npu::npu_fusion_attention", _fwd_v1_fake, lib=lib)
            torch.library.register_fake("npu::npu_fusion_attention_grad", _grad_fake, lib=lib)
            torch.library.register_autograd(
                "npu::npu_fusion_attention_v3", _backward_v3, setup_context=_setup_context_v3, lib=lib
            )
            torch.library.register_autograd(
                "npu::npu_fusion_attention", _backward_v1, setup_context=_setup_context_v1, lib=lib
            )
        except Exception:
            lib._destroy()
            raise
        _LIBS.append(lib)
        _INSTALLED = True
        if route_sdpa:
            _install_route()
        logger.info("npu emulator installed (route_sdpa=%s)", route_sdpa)
        return True


def _install_route() -> None:
    global _ROUTED, _ORIGINAL_SDPA
    current = F.scaled_dot_product_attention
    if current is scaled_dot_product_attention:
        _ROUTED = True
        return
    _ORIGINAL_SDPA = current
    F.scaled_dot_product_attention = scaled_dot_product_attention
    _ROUTED = True


def _uninstall_route() -> None:
    global _ROUTED, _ORIGINAL_SDPA
    if not _ROUTED:
        return
    if F.scaled_dot_product_attention is scaled_dot_product_attention:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
    else:
        logger.warning(
            "npu emulator: F.scaled_dot_product_attention was replaced by someone else after the emulator "
            "routed it; leaving it as it is"
        )
    _ROUTED = False


def uninstall_npu_emulator() -> None:
    """Restore SDPA and remove the emulator's op definitions (install works again afterwards)."""
    global _INSTALLED
    with _STATE_LOCK:
        _uninstall_route()
        while _LIBS:
            _LIBS.pop()._destroy()
        _INSTALLED = False
