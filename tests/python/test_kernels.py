"""Step kernels: the "torch" kernel (torch's fused CPU attention) on one block against float64
dense for every mask kind, layout, GQA, MLA (the reference math), bfloat16 and rows that see no
key, within error_bound of dense torch in the same dtype; its dropout refusal; and the registry:
a kernel registered on every rank runs a CP call (packed documents per segment, as it takes no
TND), bad registrations and unknown names are refused naming them, and ranks that run different
kernels raise the same error naming the kernel."""

from __future__ import annotations

import pytest
import torch

from cp_cache import layout as L
from cp_cache.kernels import StepMask, get_kernel, kernel_names, register
from cp_cache.testing.multiprocess import capture, run_ranks
from cp_cache.testing.reference import error_bound, rel_err

SQ, SK, D = 6, 10, 8


def _masks():
    g = torch.Generator().manual_seed(4)
    given = torch.rand(SQ, SK, generator=g) > 0.6
    given[1] = True  # a row that sees no key
    return {"none": StepMask("none"), "causal": StepMask("causal"), "band": StepMask("band", 3, 0),
            "given": StepMask("given", block=given)}


def _dense(q, k, v, dout, masked, scale, dtype):
    """Dense attention in ``dtype`` ([B, N, S, D], K/V already at N heads): out, lse, dq, dk, dv."""
    q, k, v, dout = (t.to(dtype).detach().requires_grad_(t is not dout) for t in (q, k, v, dout))
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.matmul(p, v)
    out.backward(dout)
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _block(mask: StepMask):
    from cp_cache.kernels.base import masked_positions

    sk = SQ if mask.kind == "causal" else SK  # the ring's causal blocks are square
    return sk, masked_positions(mask, SQ, sk, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "band", "given"])
@pytest.mark.parametrize("heads", [(4, 4, D), (4, 2, D), (2, 2, 4)], ids=["mha", "gqa", "mla"])
def test_torch_kernel_matches_float64(mask_kind, layout, dtype, heads):
    nq, nkv, dv = heads
    mask = _masks()[mask_kind]
    sk, masked = _block(mask)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, nq, SQ, D, generator=g, dtype=torch.float64).to(dtype).double()
    k = torch.randn(1, nkv, sk, D, generator=g, dtype=torch.float64).to(dtype).double()
    v = torch.randn(1, nkv, sk, dv, generator=g, dtype=torch.float64).to(dtype).double()
    dout = torch.randn(1, nq, SQ, dv, generator=g, dtype=torch.float64).to(dtype).double()
    expand = lambda t: t.repeat_interleave(nq // nkv, 1)  # noqa: E731
    truth = _dense(q, expand(k), expand(v), dout, masked, 0.3, torch.float64)
    low = _dense(q, expand(k), expand(v), dout, masked, 0.3, dtype)
    kernel, lay = get_kernel("torch"), layout
    args = [L.from_bnsd(t.to(dtype), lay) for t in (q, k, v)]
    fwd = kernel.forward(*args, layout=lay, head_num=nq, scale=0.3, keep_prob=1.0, mask=mask)
    assert fwd.out.dtype == dtype and fwd.lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(fwd.lse), torch.isneginf(truth["lse"]))  # the row that sees nothing
    grads = kernel.backward(*args, L.from_bnsd(dout.to(dtype), lay), L.from_bnsd(truth["out"].to(dtype), lay),
                            truth["lse"].float(), layout=lay, head_num=nq, scale=0.3, keep_prob=1.0, mask=mask,
                            seed=None, offset=None)
    got = {"out": L.to_bnsd(fwd.out, lay, nq), "dq": L.to_bnsd(grads[0], lay, nq),
           "dk": L.to_bnsd(grads[1], lay, nkv), "dv": L.to_bnsd(grads[2], lay, nkv)}
    truth["dk"], truth["dv"], low["dk"], low["dv"] = (t.view(1, nkv, -1, *t.shape[2:]).sum(2) for t in (
        truth["dk"], truth["dv"], low["dk"], low["dv"]))
    live = torch.isfinite(truth["lse"])
    factor, floor = (20.0, 32.0) if dtype == torch.float32 else (4.0, 0.5)
    for name, value in got.items():
        bound = error_bound(rel_err(low[name].double(), truth[name]), dtype=dtype, factor=factor, floor=floor)
        assert rel_err(value.double(), truth[name]) <= bound, (name, rel_err(value.double(), truth[name]), bound)
    lse_bound = error_bound(rel_err(low["lse"][live].double(), truth["lse"][live]), dtype=dtype, factor=factor,
                            floor=floor)
    assert rel_err(fwd.lse[live].double(), truth["lse"][live]) <= lse_bound


@pytest.mark.parametrize("band", [(150, 3), (-2, 40), (700, 0)], ids=["window", "beside", "wide"])
def test_torch_kernel_band_in_tiles_matches_float64(band):
    """A band over many tiles (each its rows' key span), rectangular blocks and rows that see no key."""
    pre, nxt = band
    sq, sk = 600, 700
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, 2, sq, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, sk, D, generator=g, dtype=torch.float64) for _ in range(2))
    i, j, d = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1), sk - sq
    masked = (j - i > nxt + d) | (i - j > pre - d)
    truth, low = _dense(q, k, v, dout, masked, 0.3, torch.float64), _dense(q, k, v, dout, masked, 0.3, torch.float32)
    kernel, mask = get_kernel("torch"), StepMask("band", pre, nxt)
    fwd = kernel.forward(q.float(), k.float(), v.float(), layout="BNSD", head_num=2, scale=0.3, keep_prob=1.0,
                         mask=mask)
    grads = kernel.backward(q.float(), k.float(), v.float(), dout.float(), fwd.out, fwd.lse, layout="BNSD",
                            head_num=2, scale=0.3, keep_prob=1.0, mask=mask, seed=None, offset=None)
    assert torch.equal(torch.isneginf(fwd.lse), torch.isneginf(truth["lse"]))
    for name, value in zip(("out", "dq", "dk", "dv"), (fwd.out, *grads)):
        bound = error_bound(rel_err(low[name].double(), truth[name]))
        assert rel_err(value.double(), truth[name]) <= bound, (name, band)


def test_torch_kernel_refuses_dropout_naming_itself():
    q = torch.randn(1, 2, 4, 8)
    kind, message = capture(lambda: get_kernel("torch").forward(q, q, q, layout="BNSD", head_num=2, scale=0.3,
                                                                keep_prob=0.9, mask=StepMask("none")))
    assert kind == "NotImplementedError" and 'the "torch" kernel' in message and "keep_prob=0.9" in message
    assert "dropout_p=0.1" in message  # SDPA's name for it: the front end most callers use


class _Counted:
    """The reference kernel, counting its calls: a kernel of the user's, registered by name."""

    name = "counted"
    takes_tnd = False

    def __init__(self):
        self.calls = 0
        self._inner = get_kernel("reference")

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self._inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls += 1
        return self._inner.backward(*args, **kwargs)


def test_registry_refuses_what_it_cannot_take():
    assert {"npu", "torch", "reference"} <= set(kernel_names())
    kind, message = capture(lambda: register(object()))
    assert kind == "TypeError" and "name" in message
    kind, message = capture(lambda: register(type("K", (), {"name": "half", "forward": None})()))
    assert kind == "TypeError" and "'half'" in message and "StepKernel" in message
    kind, message = capture(lambda: register(type(get_kernel("reference"))()))
    assert kind == "ValueError" and "'reference'" in message and "replace=True" in message
    kind, message = capture(lambda: get_kernel("nope"))
    assert kind == "ValueError" and "'nope'" in message and "reference" in message
    import cp_cache

    kind, message = capture(lambda: cp_cache.enable(kernel="nope"))
    assert kind == "ValueError" and "kernel='nope'" in message


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from cp_cache.npu_ops import causal_arguments

    cp_cache.emulator.install_npu_emulator()
    counted = register(_Counted())
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    out = {}

    def call(kernel: str, layout: str = "BNSD"):
        cp_cache.enable(kernel=kernel)
        try:
            with cp_cache.context_parallel(mesh):
                if layout == "TND":
                    cu = torch.tensor([5, 12, 20])
                    local = [torch.randn(10, 2, 8, generator=g, requires_grad=True) for _ in range(3)]
                    q, k, v = (DTensor.from_local(t, mesh, [Shard(0)], shape=(20, 2, 8), stride=(16, 8, 1))
                               for t in local)
                    extra = dict(actual_seq_qlen=cu, actual_seq_kvlen=cu)
                else:
                    local = [torch.randn(1, 2, 4, 8, generator=g, requires_grad=True) for _ in range(3)]
                    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]) for t in local)
                    extra = {}
                res = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, layout, scale=0.3,
                                                            **causal_arguments("cpu"), **extra)
                res[0].to_local().sum().backward()
        finally:
            cp_cache.disable()

    before = counted.calls
    call("counted")
    out["dense_calls"] = counted.calls - before
    before = counted.calls
    call("counted", "TND")
    out["tnd_calls"] = counted.calls - before
    out["differ"] = capture(lambda: call("torch" if rank == 0 else "reference"))
    return out


def test_a_registered_kernel_runs_and_ranks_that_differ_raise_together():
    results = run_ranks(_rank, 2, timeout=120.0)
    for rank, res in enumerate(results):
        assert res["dense_calls"] >= 4, res  # two steps forward, two backward
        assert res["tnd_calls"] >= 4, res  # per segment: as many calls as a step has segments
        kind, message = res["differ"]
        assert kind == "RuntimeError" and "kernel: rank 0 'torch', rank 1 'reference'" in message, res
    assert results[0]["differ"] == results[1]["differ"]


_GPU_MASKS_LAYOUTS = [(m, lay) for m in ("none", "causal", "band", "band_beside", "band_minus_one", "given")
                      for lay in ("BNSD", "BSND", "TND") if (m, lay) != ("given", "TND")]  # given: dense calls'


@pytest.mark.parametrize("keep_prob", [1.0, 0.9], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["flash", "efficient"])
@pytest.mark.parametrize("mask_kind,layout", _GPU_MASKS_LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 4, 64), (4, 2, 64), (4, 4, 32)], ids=["mha", "gqa", "mla"])
def test_torch_kernel_gpu_calls_on_meta_tensors(heads, mask_kind, layout, dtype, keep_prob):
    """The GPU branch (flash or memory-efficient attention) on meta tensors, which take it: torch's own
    meta functions check every argument the kernel passes and the shapes it returns; any host read of a
    device value raises. A GPU session runs the numerics (test_cuda.py)."""
    nq, nkv, dv = heads
    mask = {"band": StepMask("band", 24, 0), "band_beside": StepMask("band", -2, 8),
            "band_minus_one": StepMask("band", -1, 8),
            "given": StepMask("given", block=torch.zeros(48, 64, dtype=torch.bool, device="meta"))}.get(
                mask_kind, StepMask(mask_kind))
    sq, sk = 48, 48 if mask_kind == "causal" else 64
    if layout == "TND":
        sizes = [(sq, nq, 64), (sk, nkv, 64), (sk, nkv, dv), (sq, nq, dv)]
        lens = dict(actual_seq_lens=(torch.tensor([20, sq]), torch.tensor([20 + sk - sq, sk])))
    else:
        sizes = [(2, n, s, e) if layout == "BNSD" else (2, s, n, e)
                 for n, s, e in ((nq, sq, 64), (nkv, sk, 64), (nkv, sk, dv), (nq, sq, dv))]
        lens = {}
    q, k, v, dout = (torch.empty(size, dtype=dtype, device="meta") for size in sizes)
    kw = dict(layout=layout, head_num=nq, scale=0.125, keep_prob=keep_prob, mask=mask, **lens)
    kernel = get_kernel("torch")
    fwd = kernel.forward(q, k, v, **kw)
    lse_shape = (sq, nq) if layout == "TND" else (2, nq, sq)
    assert fwd.out.shape == dout.shape and fwd.out.dtype == dtype
    assert fwd.lse.shape == lse_shape and fwd.lse.dtype == torch.float32
    assert (fwd.seed is not None) == (keep_prob < 1.0)
    grads = kernel.backward(q, k, v, dout, fwd.out, fwd.lse, seed=fwd.seed, offset=fwd.offset, **kw)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_segment_calls_replay_each_segments_dropout():
    """A kernel without TND runs packed segments one call each; each call's dropout is replayed in its
    backward. out = P v with P the kept probabilities, so <out, dout> = <v, dv> holds only when the
    backward drops what the forward dropped: checked against the same identity without dropout, and
    failing with the segments' seeds swapped."""
    from cp_cache import emulator
    from cp_cache.kernels import segments_backward, segments_forward

    installed = emulator.emulator_installed()
    emulator.install_npu_emulator(route_sdpa=False)
    try:
        g = torch.Generator().manual_seed(3)
        ends = torch.tensor([9, 20, 32])
        q, k, v, dout = (torch.randn(32, 2, 16, generator=g) for _ in range(4))
        kernel = get_kernel("npu")

        def identity_error(keep_prob, swap=False):
            kw = dict(actual_seq_lens=(ends, ends), mask=StepMask("causal"), head_num=2, scale=0.25,
                      keep_prob=keep_prob)
            fwd = segments_forward(kernel, q, k, v, **kw)
            seed, offset = (t.flip(0) if swap else t for t in (fwd.seed, fwd.offset))
            dv = segments_backward(kernel, q, k, v, dout, fwd.out, fwd.lse, seed=seed, offset=offset, **kw)[2]
            terms = (fwd.out.double() * dout, v.double() * dv)
            return abs(float(terms[0].sum() - terms[1].sum())), float(terms[0].abs().sum())

        error, size = identity_error(1.0)
        bound = 10 * error + 8 * torch.finfo(torch.float32).eps * size
        assert identity_error(0.5)[0] <= bound
        assert identity_error(0.5, swap=True)[0] > bound
    finally:
        if not installed:
            emulator.uninstall_npu_emulator()
