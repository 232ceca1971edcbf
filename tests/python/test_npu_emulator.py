"""Tests of cp_cache.emulator against a dense float64 reference."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from cp_cache.npu_ops import causal_mask
from cp_cache import emulator as emu
from cp_cache.emulator import (
    dropout_keep_mask,
    emulator_installed,
    install_npu_emulator,
    uninstall_npu_emulator,
)
from cp_cache.testing.reference import error_bound

ORIGINAL_SDPA = torch._C._nn.scaled_dot_product_attention  # what F exposes when nothing patched it
INT_MAX = 2147483647
LOWEST = float(torch.finfo(torch.float32).min)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def emulator():
    # Other test modules may have installed the emulator (possibly without the route): leave the
    # process as this module found it.
    was_installed = emulator_installed()
    was_routed = F.scaled_dot_product_attention is emu.scaled_dot_product_attention
    assert install_npu_emulator(route_sdpa=True) is True
    yield
    uninstall_npu_emulator()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    assert not emulator_installed()
    if was_installed:
        assert install_npu_emulator(route_sdpa=was_routed) is True


def v3(*args, **kwargs):
    return torch.ops.npu.npu_fusion_attention_v3(*args, **kwargs)


def grad_v3(*args, **kwargs):
    return torch.ops.npu.npu_fusion_attention_grad_v3(*args, **kwargs)


# ---------------------------------------------------------------------------
# the dense float64 reference (written independently of the emulator)
# ---------------------------------------------------------------------------


def to_layout(x, layout):
    """BNSD -> layout."""
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.transpose(1, 2).contiguous()
    if layout == "BSH":
        return x.transpose(1, 2).reshape(b, s, n * d).contiguous()
    if layout == "SBH":
        return x.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()
    raise AssertionError(layout)


def from_layout(x, layout, n):
    """layout -> BNSD."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).transpose(1, 2)
    s, b, h = x.shape
    return x.reshape(s, b, n, h // n).permute(1, 2, 0, 3)


def allowed_matrix(sq, skv, rule):
    """Python-loop construction of a 'may attend' matrix from a predicate rule(i, j)."""
    m = torch.zeros(sq, skv, dtype=torch.bool)
    for i in range(sq):
        for j in range(skv):
            m[i, j] = bool(rule(i, j))
    return m


def reference(q, k, v, allowed, scale, keep=None, keep_prob=1.0):
    """float64 softmax(QK^T*scale + mask) @ V on BNSD tensors; returns (out, lse, rowmax)."""
    nq, nkv = q.shape[1], k.shape[1]
    g = nq // nkv
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    s = q @ kk.transpose(-1, -2) * scale
    if allowed is not None:
        allowed = allowed.expand_as(s)
        dead = ~allowed.any(-1, keepdim=True)
        s = s.masked_fill(~allowed, float("-inf"))
        s_safe = torch.where(dead, torch.zeros_like(s), s)
        p = torch.softmax(s_safe, dim=-1) * (~dead)
    else:
        p = torch.softmax(s, dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    rowmax = s.amax(-1)
    if keep is not None:
        p = p * keep.to(p.dtype) / keep_prob
    return p @ vv, lse, rowmax


def make_qkv(B, Nq, Nkv, Sq, Skv, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Nq, Sq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Nkv, Skv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Nkv, Skv, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, Nq, Sq, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype)


def max_err(got, want) -> float:
    return float((got.detach().double() - want.detach().double()).abs().max())


def bounded(got, want, plain, name="", **kw):
    """max|got - want| within ``error_bound`` of plain torch's max|plain - want| in the same dtype
    (the reference computation run on the same inputs in this process), the floor scaled by
    max|want|: 20x + 32 eps unless ``kw`` says otherwise."""
    err, base = max_err(got, want), max_err(plain, want)
    bound = error_bound(base, scale=float(want.abs().max()), **kw)
    assert err <= bound, (name, err, base, bound)


B, SQ, SKV, D = 2, 12, 16, 8
COMPRESSED = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)


def mask_case(name, B, N, Sq, Skv):
    """Returns (op kwargs, allowed [*, *, Sq, Skv] or None)."""
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.rand(*shape, generator=g) < 0.3  # noqa: E731  True = masked out
    if name == "none":
        return {}, None
    if name == "none_mode3":  # no mask: full attention whatever sparse_mode says
        return {"sparse_mode": 3}, None
    if name == "m0_band":
        m = rand(Sq, Skv)
        pre, nxt = 3, 2
        band = allowed_matrix(Sq, Skv, lambda i, j: (j - i) <= nxt and (i - j) <= pre)
        return ({"atten_mask": m, "sparse_mode": 0, "pre_tockens": pre, "next_tockens": nxt},
                (~m & band).view(1, 1, Sq, Skv))
    if name.startswith("m0_"):
        shape = {"m0_SS": (Sq, Skv), "m0_11SS": (1, 1, Sq, Skv), "m0_B1SS": (B, 1, Sq, Skv),
                 "m0_BNSS": (B, N, Sq, Skv)}[name]
        m = rand(*shape)
        allowed = ~m
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)
        kwargs = {"atten_mask": m, "sparse_mode": 0}
        if name == "m0_11SS":
            kwargs["atten_mask"] = m.to(torch.uint8)
        return kwargs, allowed
    if name == "m1":
        m = rand(B, 1, Sq, Skv)
        # pre/next ignored in mode 1
        return {"atten_mask": m, "sparse_mode": 1, "pre_tockens": 0, "next_tockens": 0}, ~m
    if name == "m2":
        return ({"atten_mask": COMPRESSED, "sparse_mode": 2},
                allowed_matrix(Sq, Skv, lambda i, j: j <= i).view(1, 1, Sq, Skv))
    if name == "m3":
        return ({"atten_mask": COMPRESSED, "sparse_mode": 3},
                allowed_matrix(Sq, Skv, lambda i, j: j <= i + Skv - Sq).view(1, 1, Sq, Skv))
    if name == "m4":
        pre, nxt = 6, 1
        dlt = Skv - Sq
        # band around the diagonal that starts at the bottom-right corner: j = i + (Skv - Sq)
        rule = lambda i, j: (i + dlt) - j <= pre and j - (i + dlt) <= nxt  # noqa: E731
        return ({"atten_mask": COMPRESSED, "sparse_mode": 4, "pre_tockens": pre, "next_tockens": nxt},
                allowed_matrix(Sq, Skv, rule).view(1, 1, Sq, Skv))
    raise AssertionError(name)


MASK_CASES = ["none", "none_mode3", "m0_SS", "m0_11SS", "m0_B1SS", "m0_BNSS", "m0_band", "m1", "m2", "m3", "m4"]
LAYOUTS = ["BNSD", "BSND", "BSH", "SBH"]


def run_case(layout, mask_name, heads, keep_prob, dtype, scale=0.35, Sq=SQ, Skv=SKV):
    Nq, Nkv = heads
    q, k, v, do = make_qkv(B, Nq, Nkv, Sq, Skv, D, dtype=torch.float64)
    kwargs, allowed = mask_case(mask_name, B, Nq, Sq, Skv)
    ql, kl, vl = (to_layout(t, layout).to(dtype).requires_grad_() for t in (q, k, v))
    out = v3(ql, kl, vl, Nq, layout, scale=scale, keep_prob=keep_prob, **kwargs)
    attn, smax, ssum, sout, seed, offset = out
    assert attn.dtype == dtype and attn.shape == ql.shape
    assert smax.shape == (B, Nq, Sq, 8) and ssum.shape == (B, Nq, Sq, 8)
    assert sout.numel() == 0 and sout.dtype == dtype
    assert seed.shape == (1,) and offset.shape == (1,) and seed.dtype == torch.int64
    keep = None
    if keep_prob < 1.0:
        keep = dropout_keep_mask(int(seed), int(offset), (B, Nq, Sq, Skv), keep_prob)
    else:
        assert int(seed) == 0 and int(offset) == 0
    attn.backward(to_layout(do, layout).to(dtype))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, ref_max = reference(qr, kr, vr, allowed, scale, keep, keep_prob)
    ref_out.backward(do)
    # the same reference computed in ``dtype``: plain torch's error, which bounds the op's
    qp, kp, vp = (t.to(dtype).requires_grad_() for t in (q, k, v))
    plain_out, plain_lse, plain_max = reference(qp, kp, vp, allowed, scale, keep, keep_prob)
    plain_out.backward(do.to(dtype))
    return dict(
        plain_out=plain_out.detach().double(), plain_lse=plain_lse.detach().double(),
        plain_max=plain_max.detach().double(),
        plain_dq=qp.grad.double(), plain_dk=kp.grad.double(), plain_dv=vp.grad.double(),
        out=from_layout(attn.detach(), layout, Nq).double(),
        dq=from_layout(ql.grad, layout, Nq).double(),
        dk=from_layout(kl.grad, layout, Nkv).double(),
        dv=from_layout(vl.grad, layout, Nkv).double(),
        smax=smax, ssum=ssum,
        ref_out=ref_out.detach(), ref_lse=ref_lse.detach(), ref_max=ref_max.detach(),
        ref_dq=qr.grad, ref_dk=kr.grad, ref_dv=vr.grad, keep=keep,
    )


@pytest.mark.parametrize("keep_prob", [1.0, 0.7], ids=["nodrop", "drop"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask_name", MASK_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_backward_fp32_matches_reference(layout, mask_name, heads, keep_prob):
    r = run_case(layout, mask_name, heads, keep_prob, torch.float32)
    for name in ("out", "dq", "dk", "dv"):
        bounded(r[name], r["ref_" + name], r["plain_" + name], name)
    smax, ssum = r["smax"], r["ssum"]
    assert smax.dtype == torch.float32 and ssum.dtype == torch.float32
    assert torch.equal(smax, smax[..., :1].expand_as(smax)) and torch.equal(ssum, ssum[..., :1].expand_as(ssum))
    lse = smax[..., 0].double() + torch.log(ssum[..., 0].double())
    live = torch.isfinite(r["ref_lse"])
    bounded(lse[live], r["ref_lse"][live], r["plain_lse"][live], "lse")
    bounded(smax[..., 0].double()[live], r["ref_max"][live], r["plain_max"][live], "max")
    assert torch.isneginf(lse[~live]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [("BNSD", "none", (4, 4), 1.0), ("BSH", "m3", (4, 2), 1.0),
                                  ("SBH", "m0_band", (4, 2), 0.8)])
def test_low_precision_bounded_by_plain_torch_error(dtype, case):
    layout, mask_name, heads, keep_prob = case
    r = run_case(layout, mask_name, heads, keep_prob, dtype)
    # plain torch in the same dtype vs the float64 reference (run_case's "plain_*"): the op computes
    # in float32, so 2x plain torch's error + 2 eps of the dtype at the largest value (the inputs and
    # the result rounded to the dtype)
    for name in ("out", "dq", "dk", "dv"):
        bounded(r[name], r["ref_" + name], r["plain_" + name], name, dtype=dtype, factor=2.0, floor=2.0)


# ---------------------------------------------------------------------------
# gradcheck (float64)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout,heads,kwargs",
    [
        ("BNSD", (2, 2), {}),
        ("BSH", (2, 1), {"atten_mask": COMPRESSED, "sparse_mode": 3}),
        ("SBH", (2, 2), {"atten_mask": COMPRESSED, "sparse_mode": 4, "pre_tockens": 2, "next_tockens": 0}),
        ("BSND", (2, 1), {"keep_prob": 0.75}),
    ],
)
def test_gradcheck_float64(layout, heads, kwargs):
    Nq, Nkv = heads
    q, k, v, _ = make_qkv(1, Nq, Nkv, 4, 5, 3)
    ql, kl, vl = (to_layout(t, layout).requires_grad_() for t in (q, k, v))

    def fn(a, b, c):
        # a fixed default-generator state per call so that dropout draws the same seed every time
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            return v3(a, b, c, Nq, layout, scale=0.5, **kwargs)[0]

    assert torch.autograd.gradcheck(fn, (ql, kl, vl))


def test_gradcheck_grad_op_direct_with_fixed_seed():
    q, k, v, do = make_qkv(1, 2, 1, 4, 5, 3)
    seed, offset = torch.tensor([11]), torch.tensor([5])
    keep = dropout_keep_mask(11, 5, (1, 2, 4, 5), 0.6)

    def loss_ref(a, b, c):
        return (reference(a, b, c, None, 0.5, keep, 0.6)[0] * do).sum()

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    loss_ref(qr, kr, vr).backward()
    out, lse, _ = reference(q, k, v, None, 0.5, keep, 0.6)
    smax = lse.unsqueeze(-1).expand(1, 2, 4, 8).contiguous()
    ssum = torch.ones_like(smax)
    dq, dk, dv, dpse, dsink = grad_v3(q, k, v, do, 2, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                      attention_in=out, scale_value=0.5, keep_prob=0.6, seed=seed, offset=offset)
    torch.testing.assert_close(dq, qr.grad)
    torch.testing.assert_close(dk, kr.grad)
    torch.testing.assert_close(dv, vr.grad)
    assert dpse.numel() == 0 and dsink.dim() == 0  # dsink 0-d, as torch_npu's meta function


# ---------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------


def test_dropout_keep_mask_deterministic_and_fraction():
    shape = (2, 4, 64, 64)
    state = torch.random.get_rng_state()
    a = dropout_keep_mask(3, 9, shape, 0.8)
    assert torch.equal(torch.random.get_rng_state(), state), "must not touch the default generator"
    assert a.dtype == torch.bool and tuple(a.shape) == shape
    assert torch.equal(a, dropout_keep_mask(3, 9, shape, 0.8))
    assert not torch.equal(a, dropout_keep_mask(3, 10, shape, 0.8))
    assert not torch.equal(a, dropout_keep_mask(4, 9, shape, 0.8))
    assert abs(a.float().mean().item() - 0.8) < 0.01
    assert abs(dropout_keep_mask(1, 2, shape, 0.3).float().mean().item() - 0.3) < 0.01


def test_dropout_advances_default_generator_only_when_on():
    q, k, v, _ = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
    state = torch.random.get_rng_state()
    out = v3(q, k, v, 2, "BNSD")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert int(out[4]) == 0 and int(out[5]) == 0
    torch.manual_seed(5)
    out1 = v3(q, k, v, 2, "BNSD", keep_prob=0.5)
    assert not torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(5)
    out2 = v3(q, k, v, 2, "BNSD", keep_prob=0.5)
    assert torch.equal(out1[4], out2[4]) and torch.equal(out1[5], out2[5])
    assert torch.equal(out1[0], out2[0])
    out3 = v3(q, k, v, 2, "BNSD", keep_prob=0.5)
    assert not torch.equal(out1[4], out3[4])


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_replays_identical_seeds(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    q, k, v, do = make_qkv(2, 2, 2, 6, 6, 4, dtype=torch.float32)
    seen = []

    def block(a, b, c):
        out = v3(a, b, c, 2, "BNSD", scale=0.5, keep_prob=0.6)
        seen.append((int(out[4]), int(out[5])))
        return out[0]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(77)
    # early stop off: otherwise the recompute stops right after the op saved its tensors, before
    # `block` records the seed (the op itself does run again)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        y = checkpoint(block, *leaves, use_reentrant=use_reentrant, preserve_rng_state=True)
    y.backward(do)
    assert len(seen) == 2 and seen[0] == seen[1]
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(77)
    block(*plain).backward(do)
    assert seen[2] == seen[0]
    for a, b in zip(leaves, plain):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)


def test_backward_passes_saved_seed_offset_tensors_through_torch_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.npu.npu_fusion_attention_grad_v3.default:
                calls.append(kwargs)
            return func(*args, **kwargs)

    q, k, v, do = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = v3(*leaves, 2, "BNSD", keep_prob=0.5)
    assert not out[4].requires_grad and not out[5].requires_grad
    with Spy():
        out[0].backward(do)
    assert len(calls) == 1
    kw = calls[0]
    assert kw["seed"].untyped_storage().data_ptr() == out[4].untyped_storage().data_ptr()
    assert kw["offset"].untyped_storage().data_ptr() == out[5].untyped_storage().data_ptr()
    assert kw["attention_in"].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()
    assert kw["softmax_max"].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    assert kw["softmax_sum"].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
    assert kw["keep_prob"] == 0.5


def test_grad_op_reads_seed_from_tensor_subclass():
    class Handle(torch.Tensor):
        pass

    q, k, v, do = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
    out = v3(q, k, v, 2, "BNSD", keep_prob=0.5)
    common = dict(softmax_max=out[1], softmax_sum=out[2], attention_in=out[0], keep_prob=0.5)
    g1 = grad_v3(q, k, v, do, 2, "BNSD", seed=out[4], offset=out[5], **common)
    g2 = grad_v3(q, k, v, do, 2, "BNSD", seed=out[4].clone().as_subclass(Handle),
                 offset=out[5].clone().as_subclass(Handle), **common)
    for a, b in zip(g1[:3], g2[:3]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# statistics and fully masked rows
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("keep_prob", [1.0, 0.7])
def test_lse_with_unit_sum_gives_identical_gradients(keep_prob):
    q, k, v, do = make_qkv(2, 4, 2, 8, 8, 8, dtype=torch.float32)
    out = v3(q, k, v, 4, "BNSD", atten_mask=COMPRESSED, sparse_mode=2, next_tockens=0, scale=0.3,
             keep_prob=keep_prob)
    common = dict(atten_mask=COMPRESSED, sparse_mode=2, next_tockens=0, scale_value=0.3, keep_prob=keep_prob,
                  seed=out[4], offset=out[5], attention_in=out[0])
    g1 = grad_v3(q, k, v, do, 4, "BNSD", softmax_max=out[1], softmax_sum=out[2], **common)
    lse = out[1] + torch.log(out[2])
    g2 = grad_v3(q, k, v, do, 4, "BNSD", softmax_max=lse, softmax_sum=torch.ones_like(lse), **common)
    for a, b in zip(g1[:3], g2[:3]):
        assert torch.equal(a, b)


def test_fully_masked_rows():
    Bq, N, S = 2, 2, 6
    q, k, v, do = make_qkv(Bq, N, N, S, S, 4, dtype=torch.float32)
    mask = torch.rand(Bq, N, S, S, generator=torch.Generator().manual_seed(1)) < 0.3
    mask[0, 1, 2, :] = True
    mask[1, 0, 5, :] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = v3(*leaves, N, "BNSD", atten_mask=mask, sparse_mode=1)
    attn, smax, ssum = out[:3]
    assert torch.equal(attn[0, 1, 2], torch.zeros(4)) and torch.equal(attn[1, 0, 5], torch.zeros(4))
    assert smax[0, 1, 2, 0].item() == LOWEST and ssum[0, 1, 2, 0].item() == 0.0
    lse = smax + torch.log(ssum)
    assert torch.isneginf(lse[0, 1, 2]).all() and torch.isneginf(lse[1, 0, 5]).all()
    assert torch.isfinite(smax).all() and not torch.isnan(ssum).any()
    attn.backward(do)
    for t in leaves:
        assert torch.isfinite(t.grad).all()
    assert torch.equal(leaves[0].grad[0, 1, 2], torch.zeros(4))
    ref = reference(*(t.double().requires_grad_() for t in (q, k, v)), ~mask, 1.0)[0]
    plain = reference(q, k, v, ~mask, 1.0)[0]  # the same in float32: its error bounds the op's
    bounded(attn.detach(), ref.detach(), plain)


def test_right_down_causal_with_more_queries_than_keys_has_dead_rows():
    q, k, v, do = make_qkv(1, 2, 2, 8, 5, 4, dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = v3(*leaves, 2, "BNSD", atten_mask=COMPRESSED, sparse_mode=3)
    assert torch.equal(out[0][:, :, :3], torch.zeros(1, 2, 3, 4))
    out[0].backward(do)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert torch.equal(leaves[0].grad[:, :, :3], torch.zeros(1, 2, 3, 4))


# ---------------------------------------------------------------------------
# v1
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("keep_prob", [1.0, 0.7])
def test_v1_matches_reference(keep_prob):
    q, k, v, do = make_qkv(2, 4, 2, 6, 8, 8)
    ql, kl, vl = (to_layout(t, "BSND").float().requires_grad_() for t in (q, k, v))
    out = torch.ops.npu.npu_fusion_attention(ql, kl, vl, 4, "BSND", atten_mask=COMPRESSED, sparse_mode=3,
                                             scale=0.4, keep_prob=keep_prob)
    assert len(out) == 7 and all(isinstance(x, int) for x in out[4:])
    seed, offset, numels = out[4:]
    assert numels == (2 * 4 * 6 * 8 if keep_prob < 1 else 0)
    keep = dropout_keep_mask(seed, offset, (2, 4, 6, 8), keep_prob) if keep_prob < 1 else None
    out[0].backward(to_layout(do, "BSND").float())
    allowed = allowed_matrix(6, 8, lambda i, j: j <= i + 2).view(1, 1, 6, 8)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, allowed, 0.4, keep, keep_prob)[0]
    ref.backward(do)
    qp, kp, vp = (t.float().requires_grad_() for t in (q, k, v))  # the same in float32: the bounds
    plain = reference(qp, kp, vp, allowed, 0.4, keep, keep_prob)[0]
    plain.backward(do.float())
    bounded(from_layout(out[0].detach(), "BSND", 4), ref.detach(), plain.detach(), "out")
    bounded(from_layout(ql.grad, "BSND", 4), qr.grad, qp.grad, "dq")
    bounded(from_layout(kl.grad, "BSND", 2), kr.grad, kp.grad, "dk")
    bounded(from_layout(vl.grad, "BSND", 2), vr.grad, vp.grad, "dv")


# ---------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------


def test_opcheck_v3_forward():
    q, k, v, _ = make_qkv(2, 4, 2, 6, 8, 8, dtype=torch.float32)
    for kwargs in ({}, {"atten_mask": COMPRESSED, "sparse_mode": 3, "scale": 0.3}):
        args = tuple(t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())) + (4, "BNSD")
        torch.library.opcheck(torch.ops.npu.npu_fusion_attention_v3.default, args, kwargs)


def test_opcheck_v3_forward_with_dropout():
    # With dropout each call draws a fresh seed from the default generator, so the utilities that
    # compare two executions (test_aot_dispatch_dynamic) cannot agree; schema, autograd registration
    # and fake-tensor checks still apply.
    q, k, v, _ = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
    args = tuple(t.requires_grad_() for t in (q, k, v)) + (2, "BNSD")
    torch.library.opcheck(torch.ops.npu.npu_fusion_attention_v3.default, args, {"keep_prob": 0.5},
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_opcheck_v3_grad():
    q, k, v, do = make_qkv(2, 4, 2, 6, 8, 8, dtype=torch.float32)
    out = v3(q, k, v, 4, "BNSD", keep_prob=0.8)
    kwargs = dict(softmax_max=out[1], softmax_sum=out[2], attention_in=out[0], keep_prob=0.8,
                  seed=out[4], offset=out[5])
    torch.library.opcheck(torch.ops.npu.npu_fusion_attention_grad_v3.default, (q, k, v, do, 4, "BNSD"), kwargs)


# ---------------------------------------------------------------------------
# SDPA route
# ---------------------------------------------------------------------------


def test_route_function_name_and_installed():
    assert F.scaled_dot_product_attention is emu.scaled_dot_product_attention
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"
    assert emulator_installed()


@pytest.mark.parametrize(
    "case",
    ["causal", "causal_sq_ne_skv", "noncausal", "mask_SS", "mask_B1SS", "mask_BNSS", "mask_1NSS", "gqa_causal",
     "gqa_mask", "scale"],
)
def test_route_matches_original_sdpa(case):
    Nq, Nkv, Sq, Skv = 4, 4, 8, 8
    if case.startswith("gqa"):
        Nkv = 2
    if case == "causal_sq_ne_skv":
        Sq, Skv = 6, 10
    q, k, v, do = make_qkv(2, Nq, Nkv, Sq, Skv, 8, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    kwargs = {}
    if "causal" in case:
        kwargs["is_causal"] = True
    if "mask" in case:
        shape = {"mask_SS": (Sq, Skv), "mask_B1SS": (2, 1, Sq, Skv), "mask_BNSS": (2, Nq, Sq, Skv),
                 "mask_1NSS": (1, Nq, Sq, Skv), "gqa_mask": (Sq, Skv)}[case]
        m = torch.rand(*shape, generator=g) > 0.3  # True = attend (torch convention)
        m[..., 0] = True  # no fully masked rows
        kwargs["attn_mask"] = m
    if case == "scale":
        kwargs["scale"] = 0.17
    if case.startswith("gqa"):
        kwargs["enable_gqa"] = True
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    b = [t.clone().requires_grad_() for t in (q, k, v)]
    c = [t.double().requires_grad_() for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*a, **kwargs)
    y.backward(do)
    y_ref = ORIGINAL_SDPA(*b, **kwargs)
    y_ref.backward(do)
    y64 = ORIGINAL_SDPA(*c, **kwargs)  # torch in float64: the truth both float32 runs are measured against
    y64.backward(do.double())
    bounded(y.detach(), y64.detach(), y_ref.detach(), "out")
    for name, x, z, t in zip(("dq", "dk", "dv"), a, b, c):
        bounded(x.grad, t.grad, z.grad, name)


def bind_schema(op, args, kwargs):
    """All arguments of a dispatched call by schema name (defaults filled in)."""
    bound = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value
    return bound


def test_route_calls_v3_op_like_torch_npu():
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.npu.npu_fusion_attention_v3.default:
                calls.append((args, kwargs))
            return func(*args, **kwargs)

    q, k, v, _ = make_qkv(1, 2, 2, 4, 4, 16, dtype=torch.float32)
    with Spy():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert len(calls) == 2
    calls = [bind_schema(torch.ops.npu.npu_fusion_attention_v3.default, *c) for c in calls]
    kw = calls[0]
    assert kw["head_num"] == 2 and kw["input_layout"] == "BNSD"
    assert kw["sparse_mode"] == 2 and kw["next_tockens"] == 0 and kw["keep_prob"] == 1.0
    assert kw["scale"] == pytest.approx(0.25)
    mask = kw["atten_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2048, 2048) and torch.equal(mask, COMPRESSED)
    assert mask is causal_mask(torch.device("cpu")) is causal_mask(torch.device("cpu"))  # one cached mask
    kw = calls[1]
    assert kw["sparse_mode"] == 0 and not kw["atten_mask"].any()  # inverted: nothing masked out


def test_route_dropout_reaches_op():
    q, k, v, _ = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
    torch.manual_seed(3)
    y1 = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(3)
    out = v3(q, k, v, 2, "BNSD", scale=0.5, keep_prob=0.6)
    assert torch.equal(y1, out[0])


def test_route_falls_back():
    q, k, v, _ = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
    fmask = torch.randn(4, 4)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=fmask),
                               ORIGINAL_SDPA(q, k, v, attn_mask=fmask))
    qm, km, vm = (t.to("meta") for t in (q, k, v))
    assert F.scaled_dot_product_attention(qm, km, vm).shape == (1, 2, 4, 4)
    # GQA without enable_gqa: torch's own error
    q4, k2, v2, _ = make_qkv(1, 4, 2, 4, 4, 4, dtype=torch.float32)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q4, k2, v2)
    with pytest.raises(RuntimeError):
        ORIGINAL_SDPA(q4, k2, v2)


def test_route_survives_context_parallel_style_patching():
    # torch's context_parallel() replaces SDPA with setattr(F, fn.__name__, wrapper)
    fn = F.scaled_dot_product_attention
    seen = []

    def wrapper(*args, **kwargs):
        seen.append(1)
        return fn(*args, **kwargs)

    setattr(F, fn.__name__, wrapper)
    try:
        q, k, v, _ = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
        F.scaled_dot_product_attention(q, k, v)
        assert seen == [1]
    finally:
        setattr(F, fn.__name__, fn)


# ---------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------


def test_install_idempotent_and_uninstall_reinstall():
    assert install_npu_emulator() is True
    assert install_npu_emulator() is True
    uninstall_npu_emulator()
    assert not emulator_installed()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    assert not hasattr(torch.ops.npu, "npu_fusion_attention_v3")
    assert install_npu_emulator(route_sdpa=False) is True
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    q, k, v, _ = make_qkv(1, 2, 2, 4, 4, 4, dtype=torch.float32)
    assert v3(q, k, v, 2, "BNSD")[0].shape == q.shape
    assert install_npu_emulator(route_sdpa=True) is True  # adds the route
    assert F.scaled_dot_product_attention is emu.scaled_dot_product_attention


def _run_child(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python process that imports cp_cache the way this process did (same
    sys.path), else from the source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [os.path.join(REPO, "python")])
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_install_refused_when_real_op_exists():
    script = textwrap.dedent(
        """
        import logging, torch
        import torch.nn.functional as F
        logging.basicConfig(level=logging.INFO)
        lib = torch.library.Library("npu", "FRAGMENT")
        lib.define("npu_fusion_attention_v3(Tensor query) -> Tensor")
        before = F.scaled_dot_product_attention
        from cp_cache.emulator import install_npu_emulator, emulator_installed
        assert install_npu_emulator() is False
        assert not emulator_installed()
        assert F.scaled_dot_product_attention is before
        assert not hasattr(torch.ops.npu, "npu_fusion_attention_grad_v3")
        assert not hasattr(torch.ops.npu, "npu_fusion_attention")
        print("REFUSED-OK")
        """
    )
    proc = _run_child(script)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED-OK" in proc.stdout
    assert "already exists" in proc.stderr


def test_testing_reexports_the_emulator():
    import cp_cache.testing as testing

    for name in ("install_npu_emulator", "uninstall_npu_emulator", "dropout_keep_mask", "emulator_installed"):
        assert getattr(testing, name) is getattr(emu, name), name


def test_emulator_is_product_code_and_enable_works_without_it():
    """Without the NPU ops, enable() routes SDPA to cp_cache's own op (torch's kernels) and disable()
    gives SDPA back; the emulator loads without the tools."""
    script = textwrap.dedent(
        """
        import sys
        import torch.nn.functional as F
        import cp_cache, cp_cache.emulator
        assert not [m for m in sys.modules if m.startswith(("cp_cache.testing", "cp_cache.cli"))], sorted(sys.modules)
        original = F.scaled_dot_product_attention
        cp_cache.enable()
        assert F.scaled_dot_product_attention is cp_cache.sdpa.scaled_dot_product_attention
        cp_cache.disable()
        assert F.scaled_dot_product_attention is original
        print("PRODUCT-OK")
        """
    )
    proc = _run_child(script)
    assert proc.returncode == 0, proc.stderr
    assert "PRODUCT-OK" in proc.stdout


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def _qkv4(Nq=4, Nkv=4, S=4, Dh=4):
    q, k, v, _ = make_qkv(1, Nq, Nkv, S, S, Dh, dtype=torch.float32)
    return q, k, v


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(layout="TND"), ValueError, r"3-D \[T, N, D\] for input_layout='TND'"),
        (lambda a: a.update(layout="XYZ"), ValueError, r"input_layout='XYZ'"),
        (lambda a: a.update(head_num=3), ValueError, r"head_num=3.*4"),
        (lambda a: a.update(layout="BSH", q=a["q"].reshape(1, 4, 16), k=a["k"].reshape(1, 4, 16),
                            v=a["v"].reshape(1, 4, 16), head_num=3), ValueError, r"head_num=3.*H=16"),
        (lambda a: a.update(q=a["q"][0]), ValueError, r"query must be 4-D.*'BNSD'.*3-D"),
        (lambda a: a.update(k=a["k"][:, :3], v=a["v"][:, :3]), ValueError, r"Nq=4.*Nkv=3"),
        (lambda a: a.update(v=a["v"][:, :2]), ValueError, r"key and value must agree on every dim but the head size"),
        (lambda a: a["kw"].update(keep_prob=0.0), ValueError, r"keep_prob=0.0"),
        (lambda a: a["kw"].update(keep_prob=1.5), ValueError, r"keep_prob=1.5"),
        (lambda a: a["kw"].update(sparse_mode=9), ValueError, r"sparse_mode=9"),
        (lambda a: a["kw"].update(sparse_mode=-1), ValueError, r"sparse_mode=-1"),
        (lambda a: a["kw"].update(sparse_mode=5), NotImplementedError, r"sparse_mode=5"),
        (lambda a: a["kw"].update(sparse_mode=8), NotImplementedError, r"sparse_mode=8"),
        (lambda a: a["kw"].update(atten_mask=torch.zeros(1, 4, 4, dtype=torch.bool)), ValueError,
         r"atten_mask shape \[1, 4, 4\]"),
        (lambda a: a["kw"].update(atten_mask=torch.zeros(1, 2, 4, 4, dtype=torch.bool)), ValueError,
         r"atten_mask shape \[1, 2, 4, 4\]"),
        (lambda a: a["kw"].update(atten_mask=torch.zeros(4, 4)), ValueError, r"atten_mask dtype torch.float32"),
        (lambda a: a["kw"].update(atten_mask=torch.zeros(4, 4, dtype=torch.bool), sparse_mode=2), ValueError,
         r"sparse_mode=2.*2048x2048.*\[4, 4\]"),
        (lambda a: a["kw"].update(pse=torch.zeros(1, 4, 4, 4)), NotImplementedError, r"pse=Tensor of shape \[1, 4, 4, 4\]"),
        (lambda a: a["kw"].update(padding_mask=torch.zeros(4, 4)), NotImplementedError, r"padding_mask="),
        (lambda a: a["kw"].update(prefix=[1]), NotImplementedError, r"prefix=\[1\]"),
        (lambda a: a["kw"].update(actual_seq_qlen=torch.tensor([4])), NotImplementedError, r"actual_seq_qlen="),
        (lambda a: a["kw"].update(actual_seq_kvlen=torch.tensor([4])), NotImplementedError, r"actual_seq_kvlen="),
        (lambda a: a["kw"].update(sink=torch.zeros(3)), ValueError,
         r"sink=Tensor of shape \[3\] must be a floating tensor of shape \[head_num\] = \[4\]"),
        (lambda a: a["kw"].update(softmax_layout="TND"), NotImplementedError, r"softmax_layout='TND'"),
    ],
)
@pytest.mark.parametrize("which", ["fwd", "grad"])
def test_errors(mutate, exc, match, which):
    q, k, v = _qkv4()
    a = dict(q=q, k=k, v=v, head_num=4, layout="BNSD", kw={})
    mutate(a)
    if which == "fwd":
        with pytest.raises(exc, match=match):
            v3(a["q"], a["k"], a["v"], a["head_num"], a["layout"], **a["kw"])
    else:
        kw = dict(a["kw"])
        if "keep_prob" not in kw:
            kw["keep_prob"] = 1.0
        if "scale" in kw:
            kw["scale_value"] = kw.pop("scale")
        with pytest.raises(exc, match=match):
            grad_v3(a["q"], a["k"], a["v"], a["q"], a["head_num"], a["layout"], **kw)


def test_error_in_fake_kernel_too():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 4, 4, 4)
        with pytest.raises(ValueError, match=r"head_num=3"):
            v3(q, q, q, 3, "BNSD")
        out = v3(q, q, q, 4, "BNSD")
        assert out[1].shape == (1, 4, 4, 8) and out[4].shape == (1,) and out[4].dtype == torch.int64
