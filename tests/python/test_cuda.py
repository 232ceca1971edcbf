"""The "torch" step kernel and the SDPA front end on CUDA (skipped where no GPU is present; a skip
is not a pass). One block of each mask kind, layout, GQA, MLA and packed segments against float64 on
the GPU, in half precision (the flash kernel) and float32 (the memory-efficient one), within a bound
from plain torch's own error in the same dtype; dropout replayed bit for bit in the backward; and,
with two GPUs, torch's ring test cases through SDPA on NCCL equal to one GPU."""

from __future__ import annotations

import pytest
import torch

from cp_cache import layout as L
from cp_cache.kernels import StepMask, get_kernel
from cp_cache.testing.reference import error_bound, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

MASKS = {"none": StepMask("none"), "causal": StepMask("causal"), "band": StepMask("band", 24, 0),
         "band_beside": StepMask("band", -2, 8),
         "band_minus_one": StepMask("band", -1, 8), "given": None}  # flash's -1 means "no limit": not flash


def _allowed(kind: str, sq: int, sk: int, given):
    i, j = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    d = sk - sq
    if kind == "none":
        return torch.ones(sq, sk, dtype=torch.bool)
    if kind == "causal":
        return j <= i
    if kind == "given":
        return ~given
    mask = MASKS[kind]
    return (j - i <= mask.next_tockens + d) & (i - j <= mask.pre_tockens - d)


def _dense(q, k, v, allowed, scale, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    groups = q.size(1) // k.size(1)
    s = torch.matmul(q, k.repeat_interleave(groups, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    out = torch.matmul(torch.softmax(s, -1).nan_to_num(), v.repeat_interleave(groups, 1))
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("heads", [(8, 8, 64), (8, 2, 64), (4, 4, 32)], ids=["mha", "gqa", "mla"])
def test_cuda_kernel_matches_float64(kind, dtype, heads):
    nq, nkv, dv = heads
    sq, sk, d = 96, 96 if kind == "causal" else 128, 64
    g = torch.Generator().manual_seed(5)
    given = torch.rand(sq, sk, generator=g) > 0.5
    mask = MASKS[kind] or StepMask("given", block=given.cuda())
    q, k, v, dout = (torch.randn(2, n, s, e, generator=g, dtype=torch.float64).cuda()
                     for n, s, e in ((nq, sq, d), (nkv, sk, d), (nkv, sk, dv), (nq, sq, dv)))
    allowed = _allowed(kind, sq, sk, given)
    truth = _dense(q, k, v, allowed, 0.125, dout)
    plain = _dense(*(t.to(dtype) for t in (q, k, v)), allowed, 0.125, dout.to(dtype))
    kernel = get_kernel("torch")
    args = [L.from_bnsd(t.to(dtype), "BSND") for t in (q, k, v)]
    fwd = kernel.forward(*args, layout="BSND", head_num=nq, scale=0.125, keep_prob=1.0, mask=mask)
    grads = kernel.backward(*args, L.from_bnsd(dout.to(dtype), "BSND"), fwd.out, fwd.lse, layout="BSND",
                            head_num=nq, scale=0.125, keep_prob=1.0, mask=mask, seed=fwd.seed, offset=fwd.offset)
    got = [L.to_bnsd(fwd.out, "BSND", nq)] + [L.to_bnsd(t, "BSND", n) for t, n in zip(grads, (nq, nkv, nkv))]
    for name, x, ref, low in zip(("out", "dq", "dk", "dv"), got, truth, plain):
        assert rel_err(x.double(), ref) <= error_bound(rel_err(low.double(), ref), dtype=dtype), (kind, name)


def test_cuda_dropout_replays_in_the_backward():
    kernel = get_kernel("torch")
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 128, 4, 64, generator=g).cuda().bfloat16() for _ in range(4))
    kw = dict(layout="BSND", head_num=4, scale=0.125, keep_prob=0.8, mask=StepMask("causal"))
    fwd = kernel.forward(q, k, v, **kw)
    assert fwd.seed is not None
    first = kernel.backward(q, k, v, dout, fwd.out, fwd.lse, seed=fwd.seed, offset=fwd.offset, **kw)
    again = kernel.backward(q, k, v, dout, fwd.out, fwd.lse, seed=fwd.seed, offset=fwd.offset, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def _sdpa_rank(rank: int, world: int) -> list:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import context_parallel_unshard

    import cp_cache

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,))
    g = torch.Generator().manual_seed(10)
    full = [torch.rand(8, 8, 64 * world, 32, generator=g, dtype=torch.float64).cuda() for _ in range(3)]

    def one_gpu(dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in full)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]

    truth, plain = one_gpu(torch.float64), one_gpu(torch.bfloat16)
    cq, ck, cv = (t.bfloat16() for t in full)
    with cp_cache.context_parallel(mesh, buffers=(cq, ck, cv), buffer_seq_dims=(2, 2, 2)):
        for t in (cq, ck, cv):
            t.requires_grad = True
        cp_out = F.scaled_dot_product_attention(cq, ck, cv, is_causal=True)
        cp_out.sum().backward()
        got = context_parallel_unshard(mesh, [cp_out.detach(), cq.grad, ck.grad, cv.grad], [2] * 4)
        for t in (cq, ck, cv):
            t.requires_grad = False
    return [(rel_err(x.double(), ref), error_bound(rel_err(low, ref), dtype=torch.bfloat16))
            for x, ref, low in zip(got, truth, plain)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two CUDA devices")
def test_sdpa_front_end_on_two_gpus():
    from cp_cache.testing.multiprocess import run_ranks

    for rank_errors in run_ranks(_sdpa_rank, 2, backend="nccl", timeout=600.0):
        for err, bound in rank_errors:
            assert err <= bound, rank_errors
