"""The SDPA front end on a machine without the NPU op (no emulator in these processes): with cp_cache
enabled, ``F.scaled_dot_product_attention`` inside ``cp_cache.context_parallel(mesh, buffers=...)``
runs cp_cache's own op (``torch.ops.cp_cache.fusion_attention``): its strategies, step cache and
agreement on torch's fused CPU kernel. torch's own ring test cases (test/distributed/tensor/
test_attention.py: is_causal, load balancing with causal, compiled with aot_eager and fullgraph,
forward only; q/k/v [8, 8, 64 per rank, 32]; buffers sharded in place, ``context_parallel_unshard``)
at W = 2 and 4, each equal to one process's SDPA within a bound from float32's own error against
float64 measured in the same run; so is a bool attn_mask sharded with the queries (a 3-D one, which
torch's wrapper would shard on its key dim, is refused). Also: cp_cache's op on plain tensors (one process) against float64
for every mask kind, layout and packed documents; enable()/disable() route SDPA and give it back; and
transformers models with attn_implementation="cp_cache" (a sliding window, packed documents, sinks,
bf16 autocast) training under CP on that op equal to one process with "eager"."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import error_bound, rel_err

import transformers_cases as tc

B, N, S_LOCAL, D = 8, 8, 64, 32


@dataclasses.dataclass(frozen=True)
class Case:
    is_causal: bool
    load_balance: bool
    compiled: bool
    forward_only: bool

    @property
    def name(self) -> str:
        return "-".join(n for n, on in (("causal", self.is_causal), ("lb", self.load_balance),
                                       ("compiled", self.compiled), ("fwd", self.forward_only)) if on) or "full"


# torch's subtests: load balancing only with causal
CASES = [Case(c, lb, comp, fwd) for c in (True, False) for lb in (True, False) for comp in (False, True)
         for fwd in (False, True) if c or not lb]


def _inputs(world: int, dtype):
    g = torch.Generator().manual_seed(10)
    return [torch.rand(B, N, world * S_LOCAL, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _one_process(q, k, v, dout, case: Case, dtype, attn_mask=None) -> dict:
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal, attn_mask=attn_mask)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _cp(mesh, q, k, v, dout, case: Case, attn_mask=None) -> dict:
    import cp_cache
    from torch.distributed.tensor.experimental._context_parallel._attention import (_cp_options,
                                                                                    context_parallel_unshard)

    _cp_options.enable_load_balance = case.load_balance
    torch._dynamo.reset()  # a compiled graph holds the layout it was traced with (the next test)
    cq, ck, cv, cd = (t.detach().clone() for t in (q, k, v, dout))
    buffers = (cq, ck, cv, cd) if attn_mask is None else (cq, ck, cv, cd, attn_mask := attn_mask.clone())
    before = cp_cache.call_stats()["forward"]["calls"]
    with cp_cache.context_parallel(mesh, buffers=buffers, buffer_seq_dims=(2,) * len(buffers)):
        fn = (torch.compile(F.scaled_dot_product_attention, fullgraph=True, backend="aot_eager") if case.compiled
              else F.scaled_dot_product_attention)
        for t in (cq, ck, cv):
            t.requires_grad = True
        if case.forward_only:
            with torch.no_grad():
                out = fn(cq, ck, cv, is_causal=case.is_causal, attn_mask=attn_mask)
        else:
            out = fn(cq, ck, cv, is_causal=case.is_causal, attn_mask=attn_mask)
            out.backward(cd)
        names = ["out"] + ([] if case.forward_only else ["dq", "dk", "dv"])
        local = [out] + ([] if case.forward_only else [cq.grad, ck.grad, cv.grad])
        res = dict(zip(names, context_parallel_unshard(mesh, [t.detach() for t in local], [2] * len(local))))
        for t in (cq, ck, cv):  # torch restores the buffers' storage on exit: no grad then
            t.requires_grad = False
    res["calls"] = cp_cache.call_stats()["forward"]["calls"] - before
    res["live"] = cp_cache.stats()["live_entries"]
    return res


MASKED = [Case(False, lb, comp, False) for lb, comp in ((False, False), (True, False), (True, True))]


def _allowed(seq: int) -> torch.Tensor:
    """A window of 24 before each query and a random fifth of the rest (True = attend), [1, 1, S, S]."""
    i, j = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    sprinkled = torch.rand(seq, seq, generator=torch.Generator().manual_seed(3)) < 0.2
    return (((i - j >= 0) & (i - j < 24)) | sprinkled).view(1, 1, seq, seq)


def _rank(rank: int, world: int) -> dict:
    import cp_cache
    from cp_cache import sdpa
    from torch.distributed.device_mesh import init_device_mesh

    assert not hasattr(torch.ops.npu, "npu_fusion_attention_v3"), "these processes run without the NPU op"
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    q, k, v, dout = _inputs(world, torch.float64)
    truth = {c: _one_process(q, k, v, dout, c, torch.float64) for c in (CASES[0], CASES[-1])}  # causal, full
    ref = {c: _one_process(q, k, v, dout, c, torch.float32) for c in (CASES[0], CASES[-1])}
    out = {}
    for case in CASES:
        key = CASES[0] if case.is_causal else CASES[-1]
        got = _cp(mesh, q.float(), k.float(), v.float(), dout.float(), case)
        errors = {n: rel_err(got[n].double(), truth[key][n]) for n in ("out", "dq", "dk", "dv") if n in got}
        bounds = {n: error_bound(rel_err(ref[key][n].double(), truth[key][n])) for n in errors}
        out[case.name] = dict(errors=errors, bounds=bounds, calls=got["calls"], live=got["live"])
    for case in MASKED:  # a bool attn_mask [1, 1, S, S], sharded with the queries as a buffer
        allowed = _allowed(world * S_LOCAL)
        truth_m, ref_m = (_one_process(q, k, v, dout, case, dtype, allowed) for dtype in (torch.float64, torch.float32))
        got = _cp(mesh, q.float(), k.float(), v.float(), dout.float(), case, attn_mask=allowed)
        errors = {n: rel_err(got[n].double(), truth_m[n]) for n in ("out", "dq", "dk", "dv")}
        bounds = {n: error_bound(rel_err(ref_m[n].double(), truth_m[n])) for n in errors}
        out[f"mask-{case.name}"] = dict(errors=errors, bounds=bounds, calls=got["calls"], live=got["live"])
    out["stale_graph"] = _stale_graph(mesh, q.float(), k.float(), v.float())
    out["mask_3d"] = _mask_3d(mesh, q.float(), k.float(), v.float())
    from cp_cache.integrations.transformers import register

    register()
    out["train"] = {case.name: tc.train_cp(case, mesh) for case in MODELS}
    cp_cache.enable()
    out["sdpa_routed"] = F.scaled_dot_product_attention is sdpa.scaled_dot_product_attention
    cp_cache.disable()
    out["sdpa_restored"] = F.scaled_dot_product_attention is not sdpa.scaled_dot_product_attention
    return out


def _stale_graph(mesh, q, k, v) -> tuple[str, str]:
    """A graph compiled with load balancing on, run after it was switched off: refused, not wrong."""
    import cp_cache
    from cp_cache.testing.multiprocess import capture
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    torch._dynamo.reset()
    fn, outcome = None, ("", "")
    for load_balance in (True, False):
        _cp_options.enable_load_balance = load_balance
        cq, ck, cv = (t.clone() for t in (q, k, v))
        with cp_cache.context_parallel(mesh, buffers=(cq, ck, cv), buffer_seq_dims=(2, 2, 2)):
            # compiled inside the region, as torch's tests do: SDPA is torch's CP wrapper there
            fn = fn or torch.compile(F.scaled_dot_product_attention, fullgraph=True, backend="aot_eager")
            outcome = capture(lambda: fn(cq, ck, cv, is_causal=True))
    return outcome


def _mask_3d(mesh, q, k, v) -> tuple[str, str]:
    """A [1, S, S] mask, which torch's CP wrapper would shard on its key dim: refused, naming it."""
    import cp_cache
    from cp_cache.testing.multiprocess import capture

    cq, ck, cv = (t.clone() for t in (q, k, v))
    seq = q.size(2)
    with cp_cache.context_parallel(mesh, buffers=(cq, ck, cv), buffer_seq_dims=(2, 2, 2)):
        return capture(lambda: F.scaled_dot_product_attention(cq, ck, cv, attn_mask=_allowed(seq).view(1, seq, seq)))


_RESULTS: dict = {}
# transformers models on cp_cache's own op (no NPU op in the ranks)
MODELS = [tc.Case("qwen3", "qwen3"), tc.Case("packed_gemma3", "gemma3", packed=True, documents=True),
          tc.Case("gpt_oss", "gpt_oss"), tc.Case("qwen3_bf16", "qwen3", autocast=True),
          tc.Case("packed_gemma3_bf16", "gemma3", packed=True, documents=True, autocast=True)]


def _results(world: int) -> list:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank, world, timeout=900.0)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", MODELS, ids=lambda c: c.name)
def test_transformers_models_train_on_the_torch_kernel(world, case):
    tc.check_training(_results(world), case, tc.train_single(case))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", [c.name for c in CASES] + [f"mask-{c.name}" for c in MASKED])
def test_torch_ring_cases_through_sdpa(world, name):
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["calls"] == 1 and r["live"] == 0, (rank, r)  # cp_cache's op ran the call, nothing stays alive
        for tensor, err in r["errors"].items():
            assert err <= r["bounds"][tensor], (world, rank, name, tensor, r)
        assert res["sdpa_routed"] and res["sdpa_restored"]
        kind, message = res["stale_graph"]
        assert kind == "RuntimeError" and "traced with torch's CP load balancing on" in message, res["stale_graph"]
        kind, message = res["mask_3d"]
        assert kind == "ValueError" and "bool attn_mask (True = attend) as [B or 1, N or 1, S, S]" in message, res["mask_3d"]


# ---------------------------------------------------------------- one process: cp_cache's op on plain tensors


def _dense(q, k, v, allowed, scale, sink=None):
    """Dense float64 attention ([B, N, S, D], K/V at N heads), ``allowed`` [S, S] bool or None."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1).nan_to_num()
    return torch.matmul(p[..., :k.size(2)], v)


MASKS = ("none", "causal", "band", "given", "documents")


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("gqa", [False, True])
def test_plain_op_matches_float64(mask, gqa):
    import cp_cache  # noqa: F401  (defines the op)
    from cp_cache.npu_ops import SparseMode, band_arguments, causal_arguments

    g = torch.Generator().manual_seed(3)
    nq, nkv, s = 4, 2 if gqa else 4, 40
    q, k, v, dout = (torch.randn(1, n, s, 16, generator=g, dtype=torch.float64) for n in (nq, nkv, nkv, nq))
    i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    given = torch.rand(s, s, generator=g) > 0.3
    given[5] = False  # a row that sees no key
    ends = torch.tensor([13, 29, 40])
    doc = torch.searchsorted(ends, torch.arange(s), right=True)
    allowed, kwargs, layout = {
        "none": (None, {}, "BNSD"),
        "causal": (j <= i, causal_arguments("cpu"), "BNSD"),
        "band": ((j <= i) & (i - j <= 6), band_arguments("cpu", 6), "BSND"),
        "given": (given, dict(atten_mask=~given, sparse_mode=int(SparseMode.ALL_MASK)), "BNSD"),
        "documents": ((j <= i) & (doc.view(-1, 1) == doc.view(1, -1)), dict(causal_arguments("cpu", right_down=True),
                      actual_seq_qlen=ends, actual_seq_kvlen=ends), "TND"),
    }[mask]
    expand = (lambda t: t.repeat_interleave(nq // nkv, 1))  # noqa: E731
    results = {}
    for dtype in (torch.float64, torch.float32):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        if layout == "TND":
            args = [t[0].transpose(0, 1) for t in leaves]
        else:
            args = [t.transpose(1, 2) if layout == "BSND" else t for t in leaves]
        if dtype == torch.float64:
            out = _dense(leaves[0], expand(leaves[1]), expand(leaves[2]), allowed, 0.25)
        else:
            out = torch.ops.cp_cache.fusion_attention(*args, nq, layout, scale=0.25, **kwargs)[0]
            out = out.transpose(0, 1).unsqueeze(0) if layout == "TND" else out.transpose(1, 2) \
                if layout == "BSND" else out
        out.backward(dout.to(dtype))
        results[dtype] = [out.detach().double()] + [t.grad.double() for t in leaves]
    low = [t.float().detach().requires_grad_() for t in (q, k, v)]
    ref_out = _dense(low[0], expand(low[1]), expand(low[2]), allowed, 0.25)
    ref_out.backward(dout.float())
    reference = [ref_out.detach().double()] + [t.grad.double() for t in low]
    for name, got, truth, plain in zip(("out", "dq", "dk", "dv"), results[torch.float32], results[torch.float64],
                                       reference):
        assert rel_err(got, truth) <= error_bound(rel_err(plain, truth)), (mask, gqa, name)
