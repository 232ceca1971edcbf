"""Packed documents (TND) through the ring: the per-step plan covers exactly the
block-diagonal (causal) pairs under every placement, and the DTensor handlers match a dense
float64 block-diagonal reference at W = 1, 2, 4 (per-document head-tail and contiguous,
causal and full, GQA, bf16, dropout, both step-cache policies, checkpointing; the balanced
placement's uneven shards: test_document_layout.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from cp_cache.documents import document_positions
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import error_bound, rel_err
from cp_cache.testing.varlen_reference import dense_tnd_attention, document_masked
from cp_cache.algorithms.packed import plan_varlen_step, step_pairs

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

D = 8
WORLDS = (1, 2, 4)


# ---------------------------------------------------------------- the plan, without processes


def _covered(cu, world, causal, placement):
    """Every (query, key) global pair the ring's steps compute, counted, and pairs per rank."""
    T = cu[-1]
    count = torch.zeros(T, T, dtype=torch.int64)
    per_rank = []
    for rank in range(world):
        qpos = document_positions(cu, rank, world, placement)
        pairs = 0
        for index in range(world):
            step = plan_varlen_step(cu, rank, index, world, causal, placement)
            kpos = document_positions(cu, (rank - index) % world, world, placement)
            for s in step.segments:
                qi = qpos[s.q_start:s.q_start + s.q_len]
                ki = kpos[s.kv_start:s.kv_start + s.kv_len]
                block = torch.ones(s.q_len, s.kv_len, dtype=torch.int64)
                if step.mask.kind == "causal":
                    block = block.tril()
                count[qi.view(-1, 1), ki.view(1, -1)] += block
            pairs += step_pairs(step)
        per_rank.append(pairs)
    return count, per_rank


PLAN_DOCS = {"mixed": [8, 32, 40, 64], "one": [64], "many_short": list(range(8, 72, 8)),
             "odd": [3, 8, 9, 30, 37, 64]}


# odd lengths not per-document head-tail (it refuses them: test_varlen_bad_input.py)
PLACEMENTS = ("balanced", "head_tail", "contiguous")
PLAN_CASES = [(docs, p) for docs in PLAN_DOCS for p in PLACEMENTS if not (p == "head_tail" and docs == "odd")]


@pytest.mark.parametrize("world", (1, 2, 4))
@pytest.mark.parametrize("docs, placement", PLAN_CASES, ids=[f"{d}-{p}" for d, p in PLAN_CASES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_plan_covers_the_block_diagonal_exactly_once(world, docs, placement, causal):
    cu = PLAN_DOCS[docs]
    count, per_rank = _covered(cu, world, causal, placement)
    allowed = ~document_masked(cu, cu, "left_up" if causal else "full")
    assert torch.equal(count, allowed.long())  # every pair once, nothing outside
    assert sum(per_rank) == int(allowed.sum())  # FLOPs counted from the segments = the block-diagonal minimum
    if placement == "head_tail":  # every rank computes the same number of pairs
        assert len(set(per_rank)) == 1, per_rank


def test_steps_without_work_make_no_kernel_call():
    # contiguous causal: blocks from higher ranks are skipped; a block sharing no document too
    cu = [16, 32, 48, 64]  # one document per rank at W = 4
    for rank in range(4):
        for index in range(1, 4):
            step = plan_varlen_step(cu, rank, index, 4, True, "contiguous")
            assert step.part == "skip" and step.segments == ()


# ---------------------------------------------------------------- through the handlers, against dense float64


@dataclass(frozen=True)
class Case:
    docs: tuple  # document lengths
    causal: bool
    lb: bool
    nq: int = 2
    nkv: int = 2
    dtype: str = "float32"

    @property
    def name(self) -> str:
        kind = ("causal" if self.causal else "full") + ("_lb" if self.lb else "")
        return f"{'-'.join(map(str, self.docs))}-{kind}-{self.nq}x{self.nkv}-{self.dtype}"

    @property
    def cu(self) -> list[int]:
        return torch.tensor(self.docs).cumsum(0).tolist()


MIXED = (8, 24, 16, 16)
CASES = [
    *(Case(MIXED, c, lb) for c in (True, False) for lb in (True, False)),
    Case((64,), True, True), Case((64,), True, False),  # one document spanning everything
    Case((8,) * 8, True, True), Case((8,) * 8, False, True),  # many short documents
    Case((3, 5, 1, 20, 7, 28), True, False), Case((3, 5, 1, 20, 7, 28), False, False),  # shorter than a chunk
    Case(MIXED, True, True, nq=4, nkv=2), Case(MIXED, True, False, nq=4, nkv=1),  # GQA
    Case(MIXED, True, True, dtype="bfloat16"),
]

REFERENCE_KERNEL_CASES = [Case(MIXED, True, True, nq=4, nkv=2), Case((3, 5, 1, 20, 7, 28), True, False)]


def _global_inputs(case: Case):
    T = sum(case.docs)
    g = torch.Generator().manual_seed(len(case.name) * 7919 + sum(case.docs))
    q, dout = (torch.randn(T, case.nq, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, case.nkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    dtype = getattr(torch, case.dtype)
    return [t.to(dtype).double() for t in (q, k, v, dout)]


def _op_kwargs(case: Case, **extra):
    from cp_cache.npu_ops import causal_mask

    kw = dict(scale=1.0 / math.sqrt(D), actual_seq_qlen=torch.tensor(case.cu), actual_seq_kvlen=torch.tensor(case.cu))
    if case.causal:
        kw.update(atten_mask=causal_mask("cpu"), sparse_mode=3, next_tockens=0)
    kw.update(extra)
    return kw


def _run_case(case: Case, mesh) -> dict:
    import cp_cache
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    _cp_options.enable_load_balance = case.lb
    dtype = getattr(torch, case.dtype)
    full = _global_inputs(case)
    local = [cp_cache.shard_documents(t, case.cu, mesh).to(dtype) for t in full]
    qd, kd, vd = (DTensor.from_local(t.clone(), mesh, [Shard(0)]).requires_grad_() for t in local[:3])
    res = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, case.nq, "TND", **_op_kwargs(case))
    res[0].backward(DTensor.from_local(local[3], mesh, [Shard(0)]))
    got = {"out": res[0], "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}
    got = {n: cp_cache.unshard_documents(t.to_local(), case.cu, mesh).double() for n, t in got.items()}
    stats = cp_cache.unshard_documents(res[1].to_local()[..., 0].contiguous(), case.cu, mesh)
    mode = "left_up" if case.causal else "full"
    ref = dense_tnd_attention(*full, case.cu, case.cu, mode)
    errors = {n: rel_err(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    errors["lse"] = float((stats.double() - ref["lse"]).abs().max())
    # dense torch in the case dtype on the same inputs: the reference error of the bounds
    low = dense_tnd_attention(*full, case.cu, case.cu, mode, dtype=dtype)
    for n in ("out", "dq", "dk", "dv"):
        errors[f"dense_{n}"] = rel_err(low[n].double(), ref[n])
    errors["dense_lse"] = float((low["lse"] - ref["lse"]).abs().max())
    errors["lse_scale"] = float(ref["lse"].abs().max())
    return dict(errors=errors, live=cp_cache.stats()["live_entries"],
                fused_merge=cp_cache.call_stats()["forward"]["fused_merge"])


def _dropout_check(mesh, rank: int, lb: bool) -> list[tuple[float, float]]:
    """Model-free: autograd's slope of sum(out * proj) against central differences, the RNG
    reset per forward (same masks); (error, bound) per direction, the bound measured from the
    differences themselves (steps eps and eps/2)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    import cp_cache
    from cp_cache.testing.reference import directional_derivative_check

    _cp_options.enable_load_balance = lb
    case = Case(MIXED, True, lb, nq=2, nkv=1)
    full = _global_inputs(case)
    params = [cp_cache.shard_documents(t, case.cu, mesh).float().requires_grad_() for t in full[:3]]
    proj = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(rank))

    def loss():
        torch.manual_seed(123 + rank)
        qd, kd, vd = (DTensor.from_local(t, mesh, [Shard(0)]) for t in params)
        out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, 2, "TND", **_op_kwargs(case, keep_prob=0.8))[0]
        return (out.to_local() * proj).sum()

    def total(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    return directional_derivative_check(loss, params, directions=3, eps=5e-2, reduce=total)


def _checkpoint_and_stack(mesh) -> dict:
    """Checkpointed forward (nothing alive between forward and backward), then the stack policy."""
    import cp_cache
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    from torch.utils.checkpoint import checkpoint

    case = Case(MIXED, True, True)
    _cp_options.enable_load_balance = True
    full = _global_inputs(case)
    ref = dense_tnd_attention(*full, case.cu, case.cu, "left_up")
    low = dense_tnd_attention(*full, case.cu, case.cu, "left_up", dtype=torch.float32)
    out = {"dense_dq": rel_err(low["dq"].double(), ref["dq"])}  # dense torch in float32: the bound's reference
    for policy in ("handle", "stack"):
        cp_cache.enable(policy, documents="head_tail")
        local = [cp_cache.shard_documents(t, case.cu, mesh).float() for t in full]
        qd, kd, vd = (DTensor.from_local(t.clone(), mesh, [Shard(0)]).requires_grad_() for t in local[:3])

        def attention(q, k, v):
            return torch.ops.npu.npu_fusion_attention_v3(q, k, v, case.nq, "TND", **_op_kwargs(case))[0]

        y = checkpoint(attention, qd, kd, vd, use_reentrant=False)
        between = cp_cache.stats()
        y.backward(DTensor.from_local(local[3], mesh, [Shard(0)]))
        dq = cp_cache.unshard_documents(qd.grad.to_local(), case.cu, mesh).double()
        after = cp_cache.stats()
        out[policy] = dict(live_between=between["live_entries"], stack_between=between["stack_depth"],
                           live_after=after["live_entries"], stack_after=after["stack_depth"],
                           dq=rel_err(dq, ref["dq"]))
    cp_cache.enable("handle", documents="head_tail")
    return out


def _ranks(rank: int, world: int) -> dict:
    import cp_cache
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    with cp_cache.context_parallel(mesh):
        cp_cache.enable(documents="head_tail")  # the cases' lb: per-document head-tail
        results = {case.name: _run_case(case, mesh) for case in CASES}
        if world > 1:
            results["dropout"] = {lb: _dropout_check(mesh, rank, lb) for lb in (True, False)}
        results["checkpoint"] = _checkpoint_and_stack(mesh)
        # the plain-torch step kernel has no TND: the ring calls it once per segment (BSND, batch 1);
        # with the float32 merge in plain torch (the cases above merge with the fused op)
        cp_cache.enable(kernel="reference", fused_merge=False, documents="head_tail")
        results["reference_kernel"] = {case.name: _run_case(case, mesh) for case in REFERENCE_KERNEL_CASES}
    return results


_RESULTS: dict = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_ranks, world, timeout=600)
    return _RESULTS[world]


def _check_float32(errors: dict, where: tuple) -> None:
    """Each error against float64 within 20x dense torch's float32 error on the same inputs + 32 eps."""
    for name in ("out", "dq", "dk", "dv"):
        bound = error_bound(errors[f"dense_{name}"])
        assert errors[name] <= bound, (*where, name, errors[name], bound)
    bound = error_bound(errors["dense_lse"], scale=errors["lse_scale"])
    assert errors["lse"] <= bound, (*where, errors["lse"], bound)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_dense_float64(world, case):
    for rank, res in enumerate(_results(world)):
        errors = res[case.name]["errors"]
        if case.dtype == "float32":
            _check_float32(errors, (case.name, rank))
        else:  # bf16, computed in float32 and rounded once (dense bf16 rounds every op): 4x + eps/2
            for name in ("out", "dq", "dk", "dv"):
                bound = error_bound(errors[f"dense_{name}"], dtype=torch.bfloat16, factor=4.0, floor=0.5)
                assert errors[name] <= bound, (case.name, rank, name, errors, bound)
        assert res[case.name]["live"] == 0
        assert res[case.name]["fused_merge"]  # the emulator's npu_ring_attention_update, in TND


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", REFERENCE_KERNEL_CASES, ids=[c.name for c in REFERENCE_KERNEL_CASES])
def test_reference_kernel_per_segment(world, case):
    for rank, res in enumerate(_results(world)):
        _check_float32(res["reference_kernel"][case.name]["errors"], (case.name, rank))
        assert not res["reference_kernel"][case.name]["fused_merge"]


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("lb", [True, False], ids=["lb", "contiguous"])
def test_dropout_directional_derivative(world, lb):
    for rank, res in enumerate(_results(world)):
        checks = res["dropout"][lb]
        assert all(err <= bound for err, bound in checks), (lb, rank, checks)
        assert min(bound for _, bound in checks) < 0.1, checks  # some direction resolves a 10 % wrong slope


@pytest.mark.parametrize("world", WORLDS)
def test_checkpointing_and_both_policies(world):
    for rank, res in enumerate(_results(world)):
        dense_dq = res["checkpoint"].pop("dense_dq")
        for policy, r in res["checkpoint"].items():
            if policy == "handle":  # the checkpoint dropped the forward's cache at once
                assert r["live_between"] == 0 and r["stack_between"] == 0, (policy, rank, r)
            else:  # torch_npu's discipline: the original forward's entry waits on the stack
                assert r["stack_between"] == 1, (policy, rank, r)
            assert r["live_after"] == 0 and r["stack_after"] == 0, (policy, rank, r)
            assert r["dq"] <= error_bound(dense_dq), (policy, rank, r, dense_dq)  # 20x dense float32 + 32 eps


# ---------------------------------------------------------------- the README's training step


def _tiny_model(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    vocab, dim = 32, 2 * D
    return {name: (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_()
            for name, shape in (("embed", (vocab, dim)), ("qkv", (dim, 3 * dim)), ("head", (dim, vocab)))}


def _model_loss(params, tokens, labels, real, attention, real_total):
    x = params["embed"][tokens]
    q, k, v = (t.reshape(t.size(0), 2, D) for t in (x @ params["qkv"]).chunk(3, dim=-1))
    out = attention(q, k, v)
    logits = out.reshape(out.size(0), -1) @ params["head"]
    per_token = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (per_token * real).sum() / real_total


def _training_step(rank: int, world: int) -> dict:
    """The README's packed training step (pad, shard, Shard(0) attention, masked loss) on W
    ranks, against the same step on one process on the whole sequence."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from cp_cache.npu_ops import causal_mask
    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    cu_seqlens = torch.tensor([5, 18, 27, 48])  # documents of 5, 13, 9 and 21 tokens
    tokens = torch.randint(0, 32, (48,), generator=g)
    labels = torch.randint(0, 32, (48,), generator=g)
    tokens, cu, real = cp_cache.pad_documents(tokens, cu_seqlens, 2 * world)
    labels, _, _ = cp_cache.pad_documents(labels, cu_seqlens, 2 * world)
    kw = dict(scale=D ** -0.5, atten_mask=causal_mask("cpu"), sparse_mode=3, actual_seq_qlen=cu, actual_seq_kvlen=cu)

    def one_process(q, k, v):  # the whole padded sequence, no CP
        return torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "TND", **kw)[0]

    reference = _tiny_model(dtype=torch.float64)
    ref_loss = _model_loss(reference, tokens, labels, real.double(), one_process, real.sum())
    ref_loss.backward()
    # the same step on one process in float32: its error against float64 sets the bounds
    single = _tiny_model()
    single_loss = _model_loss(single, tokens, labels, real.float(), one_process, real.sum())
    single_loss.backward()

    def context_parallel(q, k, v):  # the balanced placement: local lengths may differ, give the global shape
        shape = (int(cu[-1]), *q.shape[1:])
        q, k, v = (DTensor.from_local(t, mesh, [Shard(0)], shape=shape, stride=(shape[1] * shape[2], shape[2], 1))
                   for t in (q, k, v))
        return torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "TND", **kw)[0].to_local()

    params = _tiny_model()
    local = [cp_cache.shard_documents(t, cu, mesh) for t in (tokens, labels, real)]
    with cp_cache.context_parallel(mesh):
        loss = _model_loss(params, local[0], local[1], local[2].float(), context_parallel, real.sum())
        loss.backward()
    total = loss.detach().double().reshape(1)
    dist.all_reduce(total)
    ref = float(ref_loss.detach())
    errors = {"loss": abs(float(total) - ref) / abs(ref)}
    single_errors = {"loss": abs(float(single_loss.detach()) - ref) / abs(ref)}
    for name, p in params.items():
        grad = p.grad.double()
        dist.all_reduce(grad)  # data-parallel style: each rank's part of the gradient
        errors[name] = rel_err(grad, reference[name].grad)
        single_errors[name] = rel_err(single[name].grad.double(), reference[name].grad)
    return dict(errors=errors, single_errors=single_errors, padded_tokens=int(cu[-1]),
                live=cp_cache.stats()["live_entries"])


def test_readme_training_step_on_packed_documents():
    for rank, res in enumerate(run_ranks(_training_step, 2, timeout=300)):
        assert res["padded_tokens"] == 60  # documents of 5, 13, 9, 21 tokens padded to 8, 16, 12, 24
        assert res["live"] == 0
        for name, err in res["errors"].items():
            # 20x the float32 single process's error against float64 + 32 eps
            assert err <= error_bound(res["single_errors"][name]), (rank, name, err, res["single_errors"][name])
