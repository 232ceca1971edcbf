"""``npu_ring_attention_update`` (the fused merge) and the ring's merge (``cp_cache.engine.merge``).

* the emulated op against a float64 merge, SBH and TND, fp32/bf16/fp16, fully masked rows;
* its schema equals torch-npu 2.14.0's yaml, its fake outputs the wheel's meta function;
* ``merge_into(..., fused=True)`` equals the float32 path for the four layouts, with
  narrowed accumulators and rows that saw no key;
* ``torch.library.opcheck`` of the emulated op.
"""

from __future__ import annotations

import re

import pytest
import torch

from cp_cache import layout as L
from cp_cache.config import FUSED_MERGE_ENV, resolve_config
from cp_cache.engine.merge import fused_merge_available, merge_into
from cp_cache.npu_ops import RING_UPDATE, SCHEMAS, STATS_WIDTH
from cp_cache.testing import install_npu_emulator
from cp_cache.testing.reference import eps, error_bound
from cp_cache.testing.torch_npu_wheel import NEWEST, fetch, wheel_meta_functions

VERSION = NEWEST  # torch-npu 2.14.0
OP = "npu_ring_attention_update"
LOWEST = float(torch.finfo(torch.float32).min)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
B, N, S, D = 2, 3, 8, 4
T_LENS = (3, 8)  # TND: two sequences, T = 8
# a merge is a handful of float32 operations per element: the op may err 4x as much as the same
# merge in plain torch (both against float64) + 4 eps of the largest value
MERGE_BOUND = dict(factor=4.0, floor=4.0)


@pytest.fixture(scope="module", autouse=True)
def emulator():
    install_npu_emulator(route_sdpa=False)


def _op():
    return getattr(torch.ops.npu, OP)


# ---------------------------------------------------------------- inputs and the float64 reference


def _stats(shape, gen, dead=None):
    """float32 (max, sum) of ``shape`` [..., 8], the value replicated; ``dead`` rows: (lowest, 0)."""
    m = (torch.randn(shape[:-1], generator=gen) * 3).float()
    s = (torch.rand(shape[:-1], generator=gen) * 4 + 0.25).float()
    if dead is not None:
        m = m.masked_fill(dead, LOWEST)
        s = s.masked_fill(dead, 0.0)
    return (m.unsqueeze(-1).expand(shape).contiguous(), s.unsqueeze(-1).expand(shape).contiguous())


def _inputs(layout: str, dtype: torch.dtype, seed: int = 0):
    """(args, kwargs) of the op: SBH [S, B, N*D] / [B, N, S, 8] or TND [T, N, D] / [T, N, 8], with
    rows dead on the previous side only, the current side only, and both sides."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "SBH":
        out_shape, stat_shape = (S, B, N * D), (B, N, S, STATS_WIDTH)
    else:
        out_shape, stat_shape = (T_LENS[-1], N, D), (T_LENS[-1], N, STATS_WIDTH)
    dead_prev = torch.zeros(stat_shape[:-1], dtype=torch.bool)
    dead_cur = torch.zeros(stat_shape[:-1], dtype=torch.bool)
    flat_prev, flat_cur = dead_prev.view(-1), dead_cur.view(-1)
    flat_prev[[0, 5]] = True  # 0: both sides dead
    flat_cur[[0, 7]] = True
    o1 = torch.randn(out_shape, generator=gen).to(dtype)
    o2 = torch.randn(out_shape, generator=gen).to(dtype)
    m1, s1 = _stats(stat_shape, gen, dead_prev)
    m2, s2 = _stats(stat_shape, gen, dead_cur)
    kwargs = {"input_layout": layout}
    if layout == "TND":
        kwargs["actual_seq_qlen"] = torch.tensor(T_LENS, dtype=torch.int64)
    return (o1, m1, s1, o2, m2, s2), kwargs


def _row_weights(w: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S] -> [S, B, N, 1] (SBH) or [T, N] -> [T, N, 1] (TND)."""
    return w.permute(2, 0, 1).unsqueeze(-1) if layout == "SBH" else w.unsqueeze(-1)


def _merge(args, layout: str, dtype: torch.dtype, stats_dtype: torch.dtype = torch.float64):
    """The online-softmax merge computed in ``dtype`` (float64: the reference), its statistics in
    ``stats_dtype`` (the plain-torch float32 merge: both float32)."""
    o1, m1, s1, o2, m2, s2 = args
    m1, s1, m2, s2 = (t[..., 0].to(stats_dtype) for t in (m1, s1, m2, s2))
    m = torch.maximum(m1, m2)
    a1 = torch.where(s1 == 0, 0.0, s1 * torch.exp(m1 - m))
    a2 = torch.where(s2 == 0, 0.0, s2 * torch.exp(m2 - m))
    s = a1 + a2
    den = torch.where(s > 0, s, 1.0)
    w1, w2 = (_row_weights(a / den, layout).to(dtype) for a in (a1, a2))
    shape4 = (o1.shape[0], o1.shape[1], w1.shape[2], -1) if layout == "SBH" else tuple(o1.shape)
    out = o1.to(dtype).reshape(shape4) * w1 + o2.to(dtype).reshape(shape4) * w2
    return out.reshape(o1.shape), m, s


# ---------------------------------------------------------------- (a) the op's math


@pytest.mark.parametrize("layout", ["SBH", "TND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_matches_float64_merge(layout, dtype):
    args, kwargs = _inputs(layout, dtype)
    out, smax, ssum = _op()(*args, **kwargs)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert smax.dtype == ssum.dtype == torch.float32 and smax.shape == args[1].shape
    assert not any(t.isnan().any() for t in (out, smax, ssum))
    ref_out, ref_m, ref_s = _merge(args, layout, torch.float64)
    # statistics: the 8 values replicated, max exact, sum to float32 rounding
    assert torch.equal(smax, smax[..., :1].expand_as(smax)) and torch.equal(ssum, ssum[..., :1].expand_as(ssum))
    assert torch.equal(smax[..., 0].double(), ref_m)
    # the same merge in plain torch, float32 throughout: its error bounds the op's
    plain_out, _, plain_s = _merge(args, layout, torch.float32, stats_dtype=torch.float32)
    s_err = (ssum[..., 0].double() - ref_s).abs().max().item()
    s_bound = error_bound((plain_s.double() - ref_s).abs().max().item(), scale=ref_s.abs().max().item(),
                          **MERGE_BOUND)
    assert s_err <= s_bound, (s_err, s_bound)
    err = (out.double() - ref_out).abs().max().item()
    if dtype == torch.float32:
        bound = error_bound((plain_out.double() - ref_out).abs().max().item(), scale=ref_out.abs().max().item(),
                            **MERGE_BOUND)
        assert err <= bound, (err, bound)
    else:
        # computed in float32, rounded once: no worse than the same merge done in plain torch in dtype
        plain = (_merge(args, layout, dtype)[0].double() - ref_out).abs().max().item()
        assert 0 < plain and err <= 2 * plain, (err, plain)
        assert err <= torch.finfo(dtype).eps * ref_out.abs().max().item()


@pytest.mark.parametrize("layout", ["SBH", "TND"])
def test_fully_masked_rows(layout):
    args, kwargs = _inputs(layout, torch.float32)
    o1, m1, s1, o2, m2, s2 = args
    out, smax, ssum = _op()(*args, **kwargs)
    both = (s1[..., 0] == 0) & (s2[..., 0] == 0)
    prev_only = (s2[..., 0] == 0) & ~both  # the current side is dead: the previous result stands
    assert both.any() and prev_only.any()
    assert (smax[both] == LOWEST).all() and (ssum[both] == 0).all()
    w_both, w_prev = _row_weights(both.float(), layout), _row_weights(prev_only.float(), layout)
    shape4 = (out.shape[0], out.shape[1], N, D) if layout == "SBH" else tuple(out.shape)
    out4, o14 = out.reshape(shape4), o1.reshape(shape4)
    assert (out4 * w_both == 0).all() and not out.isnan().any()
    # the previous side's weight is s1 exp(0) / s1: 1 up to a rounding or two
    torch.testing.assert_close(out4 * w_prev, o14 * w_prev, rtol=4 * eps(), atol=0)
    torch.testing.assert_close(smax[prev_only], m1[prev_only], rtol=0, atol=0)
    torch.testing.assert_close(ssum[prev_only], s1[prev_only], rtol=4 * eps(), atol=0)
    # all rows dead on both sides
    dead = (torch.full_like(m1, LOWEST), torch.zeros_like(s1))
    out, smax, ssum = _op()(o1, *dead, o2, *dead, **kwargs)
    assert (out == 0).all() and (smax == LOWEST).all() and (ssum == 0).all()


def test_float64_outputs_are_computed_in_float64():
    args, kwargs = _inputs("SBH", torch.float64)
    args = tuple(a.double() for a in args)
    out, smax, ssum = _op()(*args, **kwargs)
    assert out.dtype == smax.dtype == torch.float64
    ref_out, _, ref_s = _merge(args, "SBH", torch.float64)
    # float64 against the same float64 formula: a few roundings (eps 2.2e-16), not float32's 1.2e-7
    tol = 64 * eps(torch.float64)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol * ref_out.abs().max().item())
    torch.testing.assert_close(ssum[..., 0], ref_s, rtol=tol, atol=0)


def test_bad_calls_are_refused_by_name():
    (o1, m1, s1, o2, m2, s2), _ = _inputs("SBH", torch.float32)
    op = _op()
    with pytest.raises(NotImplementedError, match=r"input_softmax_layout='SBH'"):
        op(o1, m1, s1, o2, m2, s2, input_softmax_layout="SBH")
    with pytest.raises(ValueError, match=r"input_layout='BNSD'"):
        op(o1, m1, s1, o2, m2, s2, input_layout="BNSD")
    with pytest.raises(ValueError, match=r"cur_attn_out shape \[7, 2, 12\]"):
        op(o1, m1, s1, o2[:7], m2, s2)
    with pytest.raises(ValueError, match=r"cur_softmax_sum shape \[2, 3, 8, 4\]"):
        op(o1, m1, s1, o2, m2, s2[..., :4])
    with pytest.raises(ValueError, match=r"cur_softmax_max dtype torch.bfloat16"):
        op(o1, m1, s1, o2, m2.bfloat16(), s2)
    with pytest.raises(ValueError, match=r"dtype torch.float16"):
        op(o1, m1, s1, o2.half(), m2, s2)
    with pytest.raises(ValueError, match=r"attn_out shape \[7, 2, 12\].*softmax shape \[2, 3, 8, 8\]"):
        op(o1[:7], m1, s1, o2[:7], m2, s2, input_layout="SBH")
    with pytest.raises(ValueError, match=r"hidden size 12.*head count 5"):
        op(o1, *(t.expand(2, 5, 8, 8) for t in (m1[:, :1], s1[:, :1])), o2,
           *(t.expand(2, 5, 8, 8) for t in (m2[:, :1], s2[:, :1])))
    (t1, n1, u1, t2, n2, u2), kw = _inputs("TND", torch.float32)
    with pytest.raises(ValueError, match=r"requires actual_seq_qlen"):
        op(t1, n1, u1, t2, n2, u2, input_layout="TND")
    with pytest.raises(ValueError, match=r"actual_seq_qlen=\[3, 5\]"):
        op(t1, n1, u1, t2, n2, u2, input_layout="TND", actual_seq_qlen=torch.tensor([3, 5]))


# ---------------------------------------------------------------- (b) schema, (c) fake vs the wheel's meta


def test_schema_equals_torch_npu_yaml():
    text = (fetch(VERSION) / "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").read_text()
    found = {m.group(1).strip() for m in re.finditer(r"^\s*-?\s*func:\s*(.+)$", text, flags=re.M)
             if m.group(1).strip().split("(", 1)[0] == OP}
    assert found == {RING_UPDATE}
    assert SCHEMAS[OP] == RING_UPDATE
    assert str(_op().default._schema).removeprefix("npu::") == RING_UPDATE


def _signature(outputs) -> list:
    return [(tuple(o.shape), o.stride(), o.dtype) for o in outputs]


@pytest.fixture(scope="module")
def wheel_meta():
    fetch(VERSION)  # fails (does not skip) when the wheel cannot be fetched
    meta_fns = wheel_meta_functions(VERSION, ops=(OP,))
    assert set(meta_fns) == {OP}
    return meta_fns[OP][0]


@pytest.mark.parametrize("layout", ["SBH", "TND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fake_equals_wheel_meta(layout, dtype, wheel_meta):
    theirs_fn = wheel_meta
    args, kwargs = _inputs(layout, dtype)
    meta_args = tuple(a.to("meta") for a in args)
    ours = _op()(*meta_args, **kwargs)
    theirs = theirs_fn(*meta_args, **kwargs)
    assert _signature(ours) == _signature(theirs)
    assert all(o.device.type == "meta" for o in ours)
    # and the CPU kernel's outputs look the same
    assert _signature(_op()(*args, **kwargs)) == _signature(theirs)
    # both refuse what the other refuses: a float64 statistic
    bad = meta_args[:1] + (meta_args[1].double(),) + meta_args[2:]
    with pytest.raises(RuntimeError):
        theirs_fn(*bad, **kwargs)
    with pytest.raises(ValueError):
        _op()(*bad, **kwargs)


# ---------------------------------------------------------------- (d) merge_into: fused == float32


def _layout_tensor(layout: str, gen, dtype=torch.float32) -> torch.Tensor:
    bnsd = torch.randn(B, N, S, D, generator=gen)
    return L.from_bnsd(bnsd, layout).to(dtype)


def _zero_dead_rows(x: torch.Tensor, lse: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows with LSE = -inf hold 0 (what a kernel gives for a row that saw no key)."""
    keep = L.lse_view((~torch.isneginf(lse)).float(), layout)
    return (L.as_4d(x, layout, N) * keep.to(x.dtype)).reshape(x.shape)


def _merge_truth(acc_out, acc_lse, out_i, lse_i):
    """The logsumexp merge of BNSD rows in float64: (out, lse); rows dead on both sides: 0, -inf."""
    la, lb = acc_lse.double(), lse_i.double()
    lse = torch.logaddexp(la, lb)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = acc_out.double() * torch.exp(la - ref).unsqueeze(-1) + out_i.double() * torch.exp(lb - ref).unsqueeze(-1)
    return out, lse


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("step_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_merge_equals_float32_merge(layout, step_dtype):
    gen = torch.Generator().manual_seed(1)
    half = S // 2
    acc_lse = torch.randn(B, N, S, generator=gen) * 3
    acc_lse[0, 0, half] = float("-inf")  # no key seen so far
    acc_lse[1, 2, half + 1] = float("-inf")  # ... and none in this step either
    acc_out = _zero_dead_rows(_layout_tensor(layout, gen), acc_lse, layout)
    lse_i = torch.randn(B, N, S - half, generator=gen) * 3
    lse_i[1, 2, 1] = float("-inf")
    lse_i[0, 1, 2] = float("-inf")  # this step saw no key for the row
    out_i = _layout_tensor(layout, gen, step_dtype).narrow(L.seq_dim(layout), 0, S - half)
    out_i = _zero_dead_rows(out_i, lse_i, layout)

    results = {}
    for fused in (False, True):
        a_out, a_lse = acc_out.clone(), acc_lse.clone()
        # as the ring does: the accumulators' rows [half:], as views
        merge_into(L.narrow_seq(a_out, layout, half, S - half), a_lse.narrow(2, half, S - half),
                   out_i, lse_i, layout, N, fused=fused)
        results[fused] = (a_out, a_lse)
    (f_out, f_lse), (u_out, u_lse) = results[True], results[False]
    assert not f_out.isnan().any() and not f_lse.isnan().any()
    assert torch.equal(torch.isneginf(f_lse), torch.isneginf(u_lse))  # -inf where -inf
    # both against the merge in float64: the fused op within MERGE_BOUND of the float32 path
    t_out, t_lse = _merge_truth(L.to_bnsd(acc_out, layout, N)[:, :, half:], acc_lse[:, :, half:],
                                L.to_bnsd(out_i, layout, N), lse_i)
    live = torch.isfinite(t_lse)
    for got, plain, truth in ((f_lse[:, :, half:][live], u_lse[:, :, half:][live], t_lse[live]),
                              (L.to_bnsd(f_out, layout, N)[:, :, half:], L.to_bnsd(u_out, layout, N)[:, :, half:],
                               t_out)):
        err = (got.double() - truth).abs().max().item()
        bound = error_bound((plain.double() - truth).abs().max().item(), scale=truth.abs().max().item(),
                            **MERGE_BOUND)
        assert err <= bound, (err, bound)
    # rows [:half] untouched; the row dead on both sides stays -inf with output 0
    assert torch.equal(L.narrow_seq(f_out, layout, 0, half), L.narrow_seq(acc_out, layout, 0, half))
    assert torch.equal(f_lse[:, :, :half], acc_lse[:, :, :half])
    assert torch.isneginf(f_lse[1, 2, half + 1])
    assert (L.to_bnsd(f_out, layout, N)[1, 2, half + 1] == 0).all()


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_fused_first_merge_takes_the_step(layout):
    """The ring starts from out 0 / LSE -inf: the first merge yields the step's result."""
    gen = torch.Generator().manual_seed(2)
    out_i = _layout_tensor(layout, gen, torch.bfloat16)
    lse_i = torch.randn(B, N, S, generator=gen)
    acc_out = torch.zeros(out_i.shape)
    acc_lse = torch.full((B, N, S), float("-inf"))
    merge_into(acc_out, acc_lse, out_i, lse_i, layout, N, fused=True)
    # weights exp(0) / 1 and LSE max + log(1): exact up to a rounding or two
    torch.testing.assert_close(acc_out, out_i.float(), rtol=4 * eps(), atol=0)
    torch.testing.assert_close(acc_lse, lse_i, rtol=4 * eps(), atol=4 * eps() * lse_i.abs().max().item())


def test_fused_merge_switch(monkeypatch):
    assert fused_merge_available()
    monkeypatch.delenv(FUSED_MERGE_ENV, raising=False)
    assert resolve_config().fused_merge
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    assert not resolve_config().fused_merge
    assert resolve_config(fused_merge=True).fused_merge  # the argument wins
    monkeypatch.setenv(FUSED_MERGE_ENV, "maybe")
    with pytest.raises(ValueError, match="CP_CACHE_FUSED_MERGE='maybe'"):
        resolve_config()


# ---------------------------------------------------------------- (e) opcheck


@pytest.mark.parametrize("layout,dtype", [("SBH", torch.float32), ("SBH", torch.bfloat16), ("TND", torch.float16)],
                         ids=str)
def test_opcheck(layout, dtype):
    args, kwargs = _inputs(layout, dtype)
    torch.library.opcheck(_op().default, args, kwargs)
