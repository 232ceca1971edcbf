"""The emulator's input_layout="TND" (packed documents) against a dense float64
block-diagonal reference, and its fake shapes against torch_npu 2.14.0's meta functions."""

from __future__ import annotations

import math

import pytest
import torch

from cp_cache.npu_ops import causal_mask, lse_from_stats
from cp_cache.testing import dropout_keep_mask, install_npu_emulator
from cp_cache.testing.reference import eps, error_bound, rel_err
from cp_cache.testing.torch_npu_wheel import NEWEST
from cp_cache.testing.varlen_reference import dense_tnd_attention

D = 8
# float64 against the float64 reference: a few roundings of eps 2.2e-16 (measured: 4.4 eps), relative
# to the largest value
F64 = 256 * eps(torch.float64)


@pytest.fixture(scope="module", autouse=True)
def emulator():
    install_npu_emulator(route_sdpa=False)


def _inputs(tq, tkv, nq, nkv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(tq, nq, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(tkv, nkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.to(dtype) for t in (q, k, v, dout)]


MODES = {0: "full", 2: "left_up", 3: "right_down"}
SEGMENTS = {
    "equal": ([5, 12, 13, 20], [5, 12, 13, 20]),
    "cross": ([3, 10, 10, 16], [6, 8, 12, 19]),  # differing q/kv lengths, an empty q segment
    "empty_kv": ([4, 8, 12], [5, 5, 9]),  # queries 4..8 see no key: out 0, LSE -inf, no NaN
}


def _mask_kwargs(sparse_mode):
    return {} if sparse_mode == 0 else dict(atten_mask=causal_mask("cpu"), sparse_mode=sparse_mode)


@pytest.mark.parametrize("sparse_mode", [0, 2, 3])
@pytest.mark.parametrize("segments", list(SEGMENTS))
@pytest.mark.parametrize("nkv", [4, 2], ids=["mha", "gqa"])
def test_v3_matches_dense_block_diagonal(sparse_mode, segments, nkv):
    cu_q, cu_kv = SEGMENTS[segments]
    q, k, v, dout = _inputs(cu_q[-1], cu_kv[-1], 4, nkv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = torch.ops.npu.npu_fusion_attention_v3(
        *leaves, 4, "TND", scale=1 / math.sqrt(D), actual_seq_qlen=torch.tensor(cu_q),
        actual_seq_kvlen=torch.tensor(cu_kv), **_mask_kwargs(sparse_mode))
    assert res[1].shape == (cu_q[-1], 4, 8) and res[2].shape == (cu_q[-1], 4, 8)
    res[0].backward(dout)
    ref = dense_tnd_attention(q, k, v, dout, cu_q, cu_kv, MODES[sparse_mode])
    assert rel_err(res[0].detach(), ref["out"]) < F64
    lse = lse_from_stats(res[1], res[2]).double()
    live = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isfinite(lse), live)
    # lse_from_stats reads the float32 statistics: max and log(sum) each rounded to float32
    assert (lse[live] - ref["lse"][live]).abs().max() <= 4 * eps() * (ref["lse"][live].abs().max() + 1)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert rel_err(leaf.grad, ref[name]) < F64, name


def test_v1_lists_and_float32():
    cu = [4, 9, 16]
    q, k, v, dout = _inputs(16, 16, 2, 2, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = torch.ops.npu.npu_fusion_attention(*leaves, 2, "TND", scale=1 / math.sqrt(D), actual_seq_qlen=cu,
                                             actual_seq_kvlen=cu, **_mask_kwargs(3))
    res[0].backward(dout)
    ref = dense_tnd_attention(*(t.double() for t in (q, k, v, dout)), cu, cu, "right_down")
    # dense torch in float32 on the same inputs: 20x its error + 32 eps
    low = dense_tnd_attention(q, k, v, dout, cu, cu, "right_down", dtype=torch.float32)
    assert rel_err(res[0].detach().double(), ref["out"]) <= error_bound(rel_err(low["out"].double(), ref["out"]))
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert rel_err(leaf.grad.double(), ref[name]) <= error_bound(rel_err(low[name].double(), ref[name])), name


def test_dropout_keep_mask_per_segment():
    cu = [6, 10, 17]
    q, k, v, dout = _inputs(17, 17, 2, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = torch.ops.npu.npu_fusion_attention_v3(*leaves, 2, "TND", scale=1 / math.sqrt(D), keep_prob=0.7,
                                                actual_seq_qlen=torch.tensor(cu), actual_seq_kvlen=torch.tensor(cu),
                                                **_mask_kwargs(2))
    res[0].backward(dout)
    keep = torch.ones(1, 2, 17, 17, dtype=torch.bool)  # outside the segments: masked anyway
    for i, (a, b) in enumerate(zip([0] + cu[:-1], cu)):  # segment i: (seed, offset + i) over its own block
        keep[:, :, a:b, a:b] = dropout_keep_mask(int(res[4]), int(res[5]) + i, (1, 2, b - a, b - a), 0.7)
    assert not bool(keep.all())
    ref = dense_tnd_attention(q, k, v, dout, cu, cu, "left_up", keep=keep, keep_prob=0.7)
    assert rel_err(res[0].detach(), ref["out"]) < F64
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert rel_err(leaf.grad, ref[name]) < F64, name


@pytest.mark.parametrize("kwargs, message", [
    (dict(actual_seq_qlen=torch.tensor([4, 3, 16])), "non-decreasing"),
    (dict(actual_seq_qlen=torch.tensor([4, 15])), "ends at 15"),
    (dict(actual_seq_qlen=torch.tensor([4, 16]), actual_seq_kvlen=torch.tensor([16])), "same count"),
    (dict(actual_seq_qlen=None), "needs actual_seq_qlen"),
])
def test_bad_lengths_raise(kwargs, message):
    q, k, v, _ = _inputs(16, 16, 2, 2)
    call = dict(actual_seq_qlen=torch.tensor([4, 16]), actual_seq_kvlen=torch.tensor([4, 16]))
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "TND", **call)


def test_explicit_mask_with_tnd_is_not_implemented():
    q, k, v, _ = _inputs(8, 8, 2, 2)
    with pytest.raises(NotImplementedError, match="explicit atten_mask"):
        torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "TND", atten_mask=torch.zeros(8, 8, dtype=torch.bool),
                                              actual_seq_qlen=torch.tensor([8]), actual_seq_kvlen=torch.tensor([8]))


# ---------------------------------------------------------------- fake kernels vs torch_npu's meta

VERSION = NEWEST  # torch-npu 2.14.0


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("nkv", [4, 2], ids=["mha", "gqa"])
def test_fakes_equal_wheel_meta(dtype, nkv):
    from cp_cache.testing.torch_npu_wheel import fetch, wheel_meta_functions

    fetch(VERSION)
    meta = {name: fn for name, (fn, _where) in wheel_meta_functions(VERSION).items()}
    q = torch.empty(24, 4, D, device="meta", dtype=dtype)
    k, v = (torch.empty(24, nkv, D, device="meta", dtype=dtype) for _ in range(2))

    def sig(outputs):
        return [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else o for o in outputs]

    cu = torch.tensor([10, 24])
    ours = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 4, "TND", actual_seq_qlen=cu, actual_seq_kvlen=cu)
    theirs = meta["npu_fusion_attention_v3"](q, k, v, 4, "TND", actual_seq_qlen=cu, actual_seq_kvlen=cu)
    assert sig(ours) == sig(theirs)
    assert sig(ours)[1] == ((24, 4, 8), torch.float32)
    ours = torch.ops.npu.npu_fusion_attention(q, k, v, 4, "TND", actual_seq_qlen=[10, 24], actual_seq_kvlen=[10, 24])
    theirs = meta["npu_fusion_attention"](q, k, v, 4, "TND", actual_seq_qlen=[10, 24], actual_seq_kvlen=[10, 24])
    assert sig(ours)[:4] == sig(theirs)[:4]
    stats = torch.empty(24, 4, 8, device="meta")
    for name in ("npu_fusion_attention_grad_v3", "npu_fusion_attention_grad"):
        lens = cu if name.endswith("v3") else [10, 24]
        kw = dict(softmax_max=stats, softmax_sum=stats, attention_in=q, actual_seq_qlen=lens, actual_seq_kvlen=lens)
        ours = getattr(torch.ops.npu, name)(q, k, v, q, 4, "TND", **kw)
        theirs = meta[name](q, k, v, q, 4, "TND", **kw)
        if name == "npu_fusion_attention_grad":  # the wheel's v1 meta gives None for dpse (as in test_npu_fidelity)
            ours, theirs = ours[:3] + ours[4:], theirs[:3] + theirs[4:]
        assert sig(ours) == sig(theirs), name


BAND = dict(pre_tockens=3, next_tockens=-1)  # a band beside the diagonal, anchored at each segment's bottom right


@pytest.mark.parametrize("sparse_mode, modes", [(4, "band"), (7, ("right_down",) * 3 + ("band",)),
                                                (8, ("band",) + ("left_up",) * 3)], ids=["4", "7", "8"])
@pytest.mark.parametrize("segments", ["equal", "cross"])  # cross: q/kv lengths differ, segment 2 has no queries
def test_band_modes_match_dense_block_diagonal(sparse_mode, modes, segments):
    """sparse_mode 4: the band of pre/next_tockens in every segment, anchored at its bottom-right
    corner (non-square segments shift it); 7 and 8 (the op's varlen external-split modes): the
    last (7) or first (8) segment with queries takes the band, the others right-down (7) or
    left-up (8) causal."""
    cu_q, cu_kv = SEGMENTS[segments]
    q, k, v, dout = _inputs(cu_q[-1], cu_kv[-1], 4, 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = torch.ops.npu.npu_fusion_attention_v3(
        *leaves, 4, "TND", scale=1 / math.sqrt(D), actual_seq_qlen=torch.tensor(cu_q),
        actual_seq_kvlen=torch.tensor(cu_kv), **_mask_kwargs(sparse_mode), **BAND)
    res[0].backward(dout)
    ref = dense_tnd_attention(q, k, v, dout, cu_q, cu_kv, modes, **BAND)
    assert rel_err(res[0].detach(), ref["out"]) < F64
    assert torch.equal(torch.isfinite(lse_from_stats(res[1], res[2])), torch.isfinite(ref["lse"]))
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert rel_err(leaf.grad, ref[name]) < F64, name


def test_band_per_segment():
    """sparse_mode 4 in TND: the band of each segment, anchored at its own corner (square
    segments: query i sees key j of its segment iff i - pre <= j <= i + next)."""
    cu, pre, nxt = [5, 12, 20], 2, 1
    q, k, v, dout = _inputs(20, 20, 2, 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = torch.ops.npu.npu_fusion_attention_v3(
        *leaves, 2, "TND", scale=1 / math.sqrt(D), atten_mask=causal_mask("cpu"), sparse_mode=4, pre_tockens=pre,
        next_tockens=nxt, actual_seq_qlen=torch.tensor(cu), actual_seq_kvlen=torch.tensor(cu))
    res[0].backward(dout)
    from cp_cache.testing.reference import band_masked, dense_attention
    from cp_cache.testing.varlen_reference import document_masked

    masked = document_masked(cu, cu) | band_masked(20, pre, nxt)  # within a segment, positions shift alike
    dense = [t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v, dout)]
    ref = dense_attention(*dense, causal=False, masked=masked)
    assert rel_err(res[0].detach().permute(1, 0, 2).unsqueeze(0), ref["out"]) < F64
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert rel_err(leaf.grad.permute(1, 0, 2).unsqueeze(0), ref[name]) < F64, name
