"""Attention sinks (gpt-oss's learnable per-head logit, ``sink=`` of the v3 op).

* the emulator's single-device op (dense layouts and TND) against dense float64 with the
  sink's column: output, LSE, dq/dk/dv and dsink; its fakes against torch_npu's meta
  functions live in test_npu_fidelity.py;
* CP at W = 2 (one spawned rank group): recompute (torch.utils.checkpoint), the stack policy and
  torch.compile against dense float64, and the refusals of a sharded sink and of heads split over
  a tensor-parallel mesh dimension.

The CP numerics with sinks (the ring with every mask, Ulysses, hybrid and packed documents, plain
and replicated DTensor sinks, dropout under the masks the call drew, W = 1 to 8) are drawn by the
random net, test_random_configs.py, with sinks in a third of its draws and fixed corners for a
window, hybrid, W = 8, TND and dropout with sinks.

Every bound is ``error_bound`` of dense torch's own float32 error on the same inputs.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from cp_cache import layout as L
from cp_cache.testing import install_npu_emulator
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import dense_attention, error_bound, rank_positions, rel_err
from cp_cache.testing.varlen_reference import dense_tnd_attention

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

B, N, D, S_LOCAL = 1, 8, 8, 4  # N = 8: Ulysses over 8 ranks
NKV_GQA = 2
KEYS = ("out", "lse", "dq", "dk", "dv", "dsink")


@dataclass(frozen=True)
class SinkCase:
    name: str
    algorithm: str = "ring"  # ring | ulysses | hybrid
    layout: str = "BNSD"  # a dense layout or TND (packed documents)
    mask: str = "causal"  # causal | full | band
    lb: bool = True
    gqa: bool = False
    dtensor_sink: bool = False  # the sink as a replicated DTensor (else a plain tensor)

    @property
    def nkv(self) -> int:
        return NKV_GQA if self.gqa else N


CASES = [SinkCase("ring-causal-lb", "ring", "BNSD", "causal", True)]  # what recompute, stack and compile run
WINDOW = S_LOCAL + 1  # keys i - WINDOW <= j <= i: crosses one block boundary


def _documents(world: int) -> tuple[int, ...]:
    """Cumulative ends of three documents of 4W, 2W and 2W tokens (each divides by 2W)."""
    return (4 * world, 6 * world, 8 * world)


def _seq(case: SinkCase, world: int) -> int:
    return 8 * world if case.layout == "TND" else S_LOCAL * world


def _inputs(case: SinkCase, world: int):
    """Full-sequence q, k, v, dout [B, N, S, D] (values rounded to float32, held in float64) and the sink."""
    S = _seq(case, world)
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))
    batch = 1 if case.layout == "TND" else B
    q, dout = (torch.randn(batch, N, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, case.nkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(N, generator=g, dtype=torch.float64) * 2.0
    return [t.float().double() for t in (q, k, v, dout, sink)]


def _reference(case: SinkCase, world: int, tensors, dtype) -> dict:
    q, k, v, dout, sink = tensors
    if case.layout == "TND":
        cu = _documents(world)
        tnd = [t[0].permute(1, 0, 2) for t in (q, k, v, dout)]
        res = dense_tnd_attention(*tnd, cu, mode="left_up" if case.mask == "causal" else "full", dtype=dtype,
                                  sink=sink)
        return {n: (res[n].permute(1, 0, 2).unsqueeze(0) if n in ("out", "dq", "dk", "dv") else
                    res[n].T.unsqueeze(0) if n == "lse" else res[n]) for n in KEYS}
    S = _seq(case, world)
    masked = None
    if case.mask == "band":
        i, j = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
        masked = (j > i) | (i - j > WINDOW)
    return dense_attention(q, k, v, dout, causal=case.mask == "causal", dtype=dtype, masked=masked, sink=sink)


def _positions(case: SinkCase, world: int, rank: int) -> torch.Tensor:
    from cp_cache.documents import document_positions

    if case.layout == "TND":
        return document_positions(_documents(world), rank, world, "head_tail" if case.lb else "contiguous")
    return rank_positions(world, rank, S_LOCAL, case.lb)


def _op_kwargs(case: SinkCase, world: int) -> dict:
    from cp_cache.npu_ops import causal_mask

    kw = dict(scale=1.0 / math.sqrt(D))
    if case.layout == "TND":
        cu = torch.tensor(_documents(world))
        kw.update(actual_seq_qlen=cu, actual_seq_kvlen=cu)
        if case.mask == "causal":
            kw.update(atten_mask=causal_mask("cpu"), sparse_mode=3, next_tockens=0)
    elif case.mask == "causal":
        kw.update(atten_mask=causal_mask("cpu"), sparse_mode=2, next_tockens=0)
    elif case.mask == "band":
        kw.update(atten_mask=causal_mask("cpu"), sparse_mode=4, pre_tockens=WINDOW, next_tockens=0)
    return kw


def _local(case: SinkCase, x, pos):
    """The rows ``pos`` of a full [B, N, S, D] tensor, float32, in the case's layout."""
    x = x.index_select(2, pos).float()
    return x[0].permute(1, 0, 2).contiguous() if case.layout == "TND" else L.from_bnsd(x, case.layout)


def _to_bnsd(case: SinkCase, x, heads: int):
    x = x.detach().double()
    return x.permute(1, 0, 2).unsqueeze(0) if case.layout == "TND" else L.to_bnsd(x, case.layout, heads)


def _mesh(case: SinkCase, world: int, meshes: dict):
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.cli.selftest import hybrid_sizes

    sizes = hybrid_sizes(world) if case.algorithm == "hybrid" else (world,)
    if sizes not in meshes:
        meshes[sizes] = init_device_mesh("cpu", sizes)
    return meshes[sizes]


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.detach().double().clone()
    dist.all_reduce(t)
    return t


def _cp_call(case: SinkCase, world: int, rank: int, mesh, tensors, *, run: str = "eager") -> dict:
    """One CP forward and backward of the case on this rank: its rows of out/lse/dq/dk/dv
    ([B, N, s, D] float64) and the sink's whole gradient (the ranks' shares summed). ``run``:
    "eager", "checkpoint" (torch.utils.checkpoint, non-reentrant) or "compile" (aot_eager, fullgraph)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.npu_ops import lse_from_stats

    _cp_options.enable_load_balance = case.lb
    pos = _positions(case, world, rank)
    seq_dim = 0 if case.layout == "TND" else L.seq_dim(case.layout)
    placements = [Shard(seq_dim)] * mesh.ndim
    local = [_local(case, t, pos) for t in tensors[:4]]
    qd, kd, vd = (DTensor.from_local(t.clone(), mesh, placements).requires_grad_() for t in local[:3])
    sink = tensors[4].float().clone()
    if case.dtensor_sink:
        sink = DTensor.from_local(sink, mesh, [Replicate()] * mesh.ndim)
    sink.requires_grad_()

    def attend(q, k, v, s):
        outs = torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, case.layout, sink=s, **_op_kwargs(case, world))
        return outs[0], outs[1].detach(), outs[2].detach()  # the statistics take no gradient

    if run == "checkpoint":
        outs = torch.utils.checkpoint.checkpoint(attend, qd, kd, vd, sink, use_reentrant=False)
    elif run == "compile":
        torch._dynamo.reset()
        outs = torch.compile(attend, backend="aot_eager", fullgraph=True)(qd, kd, vd, sink)
    else:
        outs = attend(qd, kd, vd, sink)
    outs[0].backward(DTensor.from_local(local[3], mesh, placements))
    lse = lse_from_stats(outs[1].to_local(), outs[2].to_local())
    got = {"out": _to_bnsd(case, outs[0].to_local().detach(), N),
           "lse": lse.double().T.unsqueeze(0) if case.layout == "TND" else lse.double()}
    for name, t, heads in (("dq", qd, N), ("dk", kd, case.nkv), ("dv", vd, case.nkv)):
        got[name] = _to_bnsd(case, t.grad.to_local(), heads)
    if case.dtensor_sink:
        got["sink_grad_partial"] = all(isinstance(p, Partial) for p in sink.grad.placements)
        got["dsink"] = sink.grad.full_tensor().double()
    else:
        got["dsink"] = _sum_over_ranks(sink.grad)
    return got


def _errors(case: SinkCase, world: int, rank: int, got: dict, tensors) -> dict:
    """{key: (error, bound)}: this rank's rows against dense float64, the bound from dense
    float32's error on the same rows."""
    ref, low = (_reference(case, world, tensors, dt) for dt in (torch.float64, torch.float32))
    pos = _positions(case, world, rank)
    result = {}
    for key in KEYS:
        if key == "dsink":
            want, dense = ref[key], low[key].double()
        else:  # this rank's rows (dk/dv: of its own K/V block)
            want, dense = ref[key].index_select(2, pos), low[key].double().index_select(2, pos)
        scale = float(ref[key].abs().max())
        err = float((got[key] - want).abs().max()) / scale
        result[key] = (err, error_bound(float((dense - want).abs().max()) / scale))
    return result


def _refusals(world: int, rank: int, meshes: dict) -> dict:
    """What the handlers refuse, on every rank alike: a sink DTensor sharded (not replicated), and
    a sink with the heads split over a tensor-parallel mesh dimension (a (W/2) x 2 mesh)."""
    from torch.distributed.tensor import DTensor, Shard

    case = SinkCase("refusals", "ring", "BNSD", "full", False)
    tensors = _inputs(case, world)
    pos = _positions(case, world, rank)
    mesh = _mesh(case, world, meshes)
    q = DTensor.from_local(_local(case, tensors[0], pos), mesh, [Shard(2)])
    sharded_sink = DTensor.from_local(tensors[4].float()[: N // world], mesh, [Shard(0)])
    got = {}
    for name, call in (
        ("sharded_sink", lambda: torch.ops.npu.npu_fusion_attention_v3(q, q, q, N, "BNSD", sink=sharded_sink)),
        ("tp_heads", lambda: _tp_call(tensors, pos, world)),
    ):
        try:
            call()
            got[name] = None
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            got[name] = f"{type(exc).__name__}: {exc}"
    return got


def _tp_call(tensors, pos, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("cp", "tp"))
    heads = N // 2
    local = tensors[0].index_select(2, rank_positions(world // 2, mesh.get_local_rank(0), 2 * S_LOCAL, False))
    local = local[:, mesh.get_local_rank(1) * heads:(mesh.get_local_rank(1) + 1) * heads].float()
    q = DTensor.from_local(local, mesh, [Shard(2), Shard(1)])
    return torch.ops.npu.npu_fusion_attention_v3(q, q, q, N, "BNSD", sink=tensors[4].float())


def _ranks(rank: int, world: int) -> dict:
    """Recompute, the stack policy and torch.compile, then the refusals; each call inside a CP
    region (where cp_cache takes the calls)."""
    import cp_cache

    install_npu_emulator(route_sdpa=False)
    meshes: dict = {}
    results = {}
    ring_mesh = _mesh(SinkCase("ring"), world, meshes)
    base = CASES[0]
    tensors = _inputs(base, world)
    for kind, policy, run in (("checkpoint", "handle", "checkpoint"), ("stack", "stack", "eager"),
                              ("compile", "handle", "compile")):
        cp_cache.enable(policy, documents="head_tail")
        with cp_cache.context_parallel(ring_mesh):
            got = _cp_call(base, world, rank, ring_mesh, tensors, run=run)
        results[kind] = dict(errors=_errors(base, world, rank, got, tensors), live=cp_cache.stats()["live_entries"])
    cp_cache.enable("handle", documents="head_tail")
    with cp_cache.context_parallel(ring_mesh):
        results["refusals"] = _refusals(world, rank, meshes)
    cp_cache.disable()
    return results


_RESULTS: dict = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_ranks, world, timeout=600)
    return _RESULTS[world]


WORLD = 2


def _assert_within(errors: dict, what) -> None:
    for key, (err, bound) in errors.items():
        assert err <= bound, (what, key, err, bound)


# ---------------------------------------------------------------- CP: recompute, stack, compile, refusals


@pytest.mark.parametrize("kind", ("checkpoint", "stack", "compile"))
def test_recompute_stack_policy_and_compile(kind):
    for rank, res in enumerate(_results(WORLD)):
        _assert_within(res[kind]["errors"], (kind, rank))
        assert res[kind]["live"] == 0


def test_refusals_name_the_sink():
    for rank, res in enumerate(_results(WORLD)):
        got = res["refusals"]
        assert got["sharded_sink"] and got["sharded_sink"].startswith("NotImplementedError") \
            and "replicated on the query's mesh" in got["sharded_sink"], (rank, got)
        assert got["tp_heads"] and got["tp_heads"].startswith("NotImplementedError") \
            and "tensor-parallel" in got["tp_heads"] and "sink=" in got["tp_heads"], (rank, got)


# ---------------------------------------------------------------- the emulator's single-device op


def _single_device(layout: str, mask: str, dtype, with_dropout: bool = False):
    """The v3 op on one device in ``dtype`` with a sink: (out, lse, dq, dk, dv, dsink) as
    [B, N, S, D] / [B, N, S] float64 (TND: batch 1), and the call's tensors."""
    install_npu_emulator(route_sdpa=False)
    case = SinkCase(f"single-{layout}-{mask}", "ring", layout, mask, False, gqa=layout == "BSH")
    world = 2
    tensors = _inputs(case, world)
    pos = torch.arange(_seq(case, world))
    q, k, v, dout = (_local(case, t, pos).to(dtype).requires_grad_() for t in tensors[:4])
    sink = tensors[4].to(torch.float32 if dtype != torch.float64 else dtype).requires_grad_()
    outs = torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, layout, sink=sink, **_op_kwargs(case, world))
    outs[0].backward(dout.detach())
    lse = (outs[1][..., 0] + torch.log(outs[2][..., 0])).detach().double()  # float64 stats for float64 inputs
    got = {"out": _to_bnsd(case, outs[0], N), "lse": lse.T.unsqueeze(0) if layout == "TND" else lse,
           "dq": _to_bnsd(case, q.grad, N), "dk": _to_bnsd(case, k.grad, case.nkv),
           "dv": _to_bnsd(case, v.grad, case.nkv), "dsink": sink.grad.double()}
    return case, world, tensors, got


@pytest.mark.parametrize("layout, mask", [("BNSD", "causal"), ("BSH", "full"), ("SBH", "band"), ("TND", "causal"),
                                          ("TND", "full")])
def test_emulator_op_matches_dense_float64(layout, mask):
    case, world, tensors, got = _single_device(layout, mask, torch.float32)
    ref, low = (_reference(case, world, tensors, dt) for dt in (torch.float64, torch.float32))
    for key in KEYS:
        scale = float(ref[key].abs().max())
        err = float((got[key].detach() - ref[key]).abs().max()) / scale
        bound = error_bound(float((low[key].double() - ref[key]).abs().max()) / scale)
        assert err <= bound, (layout, mask, key, err, bound)
    # float64 end to end: a few roundings of float64 (a wrong sink convention errs by O(1))
    _, _, _, exact = _single_device(layout, mask, torch.float64)
    for key in KEYS:
        bound = error_bound(0.0, dtype=torch.float64)
        assert rel_err(exact[key], ref[key]) <= bound, (layout, mask, key, rel_err(exact[key], ref[key]), bound)


def test_emulator_sink_gradcheck_and_fully_masked_rows():
    """gradcheck of q/k/v and the sink in float64; a TND query segment with no keys sees only
    the sink: out 0, LSE = sink, no NaN."""
    install_npu_emulator(route_sdpa=False)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sink = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, s):
        return torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.5, sink=s)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, sink))
    tq = torch.randn(6, 2, 4, dtype=torch.float64)
    tk = torch.randn(4, 2, 4, dtype=torch.float64)
    cu_q, cu_kv = torch.tensor([3, 6]), torch.tensor([4, 4])  # segment 1: three queries, no key
    out, smax, ssum = torch.ops.npu.npu_fusion_attention_v3(tq, tk, tk, 2, "TND", actual_seq_qlen=cu_q,
                                                            actual_seq_kvlen=cu_kv, sink=sink.detach())[:3]
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert torch.equal(smax[3:], sink.detach().view(1, 2, 1).expand(3, 2, 8))  # max = sink, sum = 1: LSE = sink
    assert torch.equal(ssum[3:], torch.ones_like(ssum[3:]))


@pytest.mark.parametrize("sink, error", [
    (torch.zeros(3), r"sink=Tensor of shape \[3\] must be a floating tensor of shape \[head_num\] = \[2\]"),
    (torch.zeros(2, dtype=torch.int64), r"must be a floating tensor"),
])
def test_emulator_refuses_a_bad_sink(sink, error):
    install_npu_emulator(route_sdpa=False)
    q = torch.randn(1, 2, 4, 4)
    with pytest.raises(ValueError, match=error):
        torch.ops.npu.npu_fusion_attention_v3(q, q, q, 2, "BNSD", sink=sink)


def test_backward_with_another_sink_presence_than_its_forward_is_refused():
    from dataclasses import replace

    from cp_cache.plan import CallPlan

    forward = CallPlan(world_size=2, rank=0, layout="BNSD", head_num=N, scale=0.3, keep_prob=1.0, sink=True)
    assert forward.backward_mismatch(forward) is None
    assert CallPlan.decode(forward.encode()) == forward
    mismatch = forward.backward_mismatch(replace(forward, sink=False))
    assert mismatch and "'sink': False" in mismatch and "'sink': True" in mismatch, mismatch
