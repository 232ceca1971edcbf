"""Packed documents (TND) through the ring: the per-step plan covers exactly the
block-diagonal (causal) pairs under every placement, steps without work make no kernel call,
and the README's packed training step matches one process.

The DTensor handlers on packed documents against a dense float64 block-diagonal reference
(every placement, causal and full, GQA, bf16, dropout under the masks the call drew, both step
kernels, both step-cache policies, checkpointing, W = 1 to 8) are drawn by the random net,
test_random_configs.py (TND in a quarter of its draws, random document mixes; the balanced
placement's uneven shards on the fixed mix: test_document_layout.py)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cp_cache.documents import document_positions
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.engine.exchange import exchange_plan
from cp_cache.npu_ops import INT_MAX
from cp_cache.plan import CallPlan, MaskSpec
from cp_cache.testing.reference import error_bound, exchanged_rows, rel_err
from cp_cache.testing.varlen_reference import band_modes, document_masked
from cp_cache.masks import document_step, step_pairs

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

D = 8


# ---------------------------------------------------------------- the plan, without processes


def _covered(cu, world, placement, spec):
    """Every (query, key) global pair the ring's steps compute, counted, pairs per rank, and the
    number of kernel calls; each call's segments must not share query rows (they merge row by row)."""
    T = cu[-1]
    count = torch.zeros(T, T, dtype=torch.int64)
    per_rank, calls = [], 0
    for rank in range(world):
        qpos = document_positions(cu, rank, world, placement)
        pairs = 0
        for index in range(world):
            step = document_step(cu, rank, index, world, placement, spec)
            kpos = document_positions(cu, (rank - index) % world, world, placement)
            calls += len(step.calls)
            for call in step.calls:
                rows = [r for s in call.segments for r in range(s.q_start, s.q_start + s.q_len)]
                assert len(rows) == len(set(rows)), (rank, index, call)
                for s in call.segments:
                    qi = qpos[s.q_start:s.q_start + s.q_len]
                    ki = kpos[s.kv_start:s.kv_start + s.kv_len]
                    masked = document_masked([s.q_len], [s.kv_len], _MODES[call.mask.kind], call.mask.pre_tockens,
                                             call.mask.next_tockens)
                    count[qi.view(-1, 1), ki.view(1, -1)] += (~masked).long()
            pairs += step_pairs(step)
        per_rank.append(pairs)
    return count, per_rank, calls


# the op's mask of a call on one segment, as the reference spells it (the TND kernel's causal is
# right-down; the ring's causal segments are square)
_MODES = {"none": "full", "causal": "right_down", "band": "band"}


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
    count, per_rank, _ = _covered(cu, world, placement, MaskSpec(causal=causal))
    allowed = ~document_masked(cu, cu, "left_up" if causal else "full")
    assert torch.equal(count, allowed.long())  # every pair once, nothing outside
    assert sum(per_rank) == int(allowed.sum())  # FLOPs counted from the segments = the block-diagonal minimum
    if placement == "head_tail":  # every rank computes the same number of pairs
        assert len(set(per_rank)) == 1, per_rank


def _band_cases(count: int, seed: int = 29) -> list:
    """Seeded draws of (W, placement, document lengths, pre_tockens, next_tockens): windows inside a
    piece, across pieces and documents, beside the diagonal, covering whole documents."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        world, placement = rng.choice((2, 3, 4)), rng.choice(PLACEMENTS)
        if placement == "head_tail":
            docs = [2 * world * rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        else:
            docs = [rng.randint(1, 30) for _ in range(rng.randint(1, 6))]
            while placement == "contiguous" and sum(docs) % world or sum(docs) < 2 * world:
                docs.append(rng.randint(1, 9))
        longest = max(docs)
        pre = rng.choice((0, 1, 2, 3, longest // 3, longest - 1, longest + 2, INT_MAX))
        nxt = rng.choice((0, 0, 1, 4, longest // 2, INT_MAX))
        if rng.random() < 0.2:  # a band beside the diagonal
            pre, nxt = rng.choice(((-1, 3), (4, -2), (-2, 2)))
        mode = rng.choice((4, 4, 7, 8))
        cases.append((world, placement, tuple(itertools.accumulate(docs)), pre, nxt, mode))
    return cases


BAND_CASES = _band_cases(24)
BAND_DOCUMENT = {4: "", 7: "last", 8: "first"}  # sparse_mode 7 / 8: the band in the last / first document


@pytest.mark.parametrize("world, placement, cu, pre, nxt, mode", BAND_CASES,
                         ids=[f"W{w}-{p}-{len(cu)}docs-pre{a}-next{b}-mode{m}" for w, p, cu, a, b, m in BAND_CASES])
def test_band_plan_covers_the_band_inside_documents_exactly_once(world, placement, cu, pre, nxt, mode):
    """sparse_mode 4 with packed documents (7 / 8: in the last / first document, the others
    causal): every pair of the mask computed once and nothing else, and the direct exchange
    moves exactly the rows the mask needs."""
    spec = MaskSpec(window=True, pre_tockens=pre, next_tockens=nxt, band_document=BAND_DOCUMENT[mode])
    count, per_rank, calls = _covered(cu, world, placement, spec)
    allowed = ~document_masked(cu, cu, band_modes(len(cu), mode), pre, nxt)
    assert torch.equal(count, allowed.long())
    assert sum(per_rank) == int(allowed.sum())
    held = [document_positions(cu, r, world, placement) for r in range(world)]
    sent, received = exchanged_rows(~allowed, held)
    for rank in range(world):
        plan = CallPlan(world_size=world, rank=rank, layout="TND", head_num=1, scale=1.0, keep_prob=1.0, mask=spec,
                        load_balance=placement != "contiguous", documents=cu, placement=placement)
        exchange = exchange_plan(plan, [(len(p), len(p)) for p in held])
        assert (exchange.rows_sent, exchange.rows_received) == (sent[rank], received[rank]), rank


def test_band_bytes_below_causal_under_every_placement():
    """A causal window of w tokens needs fewer K/V rows than causal attention per document."""
    cu = tuple(itertools.accumulate([40, 96, 24, 64]))  # lengths divisible by 2W = 8
    for placement in PLACEMENTS:
        held = [document_positions(cu, r, 4, placement) for r in range(4)]
        causal = sum(exchanged_rows(document_masked(cu, cu, "left_up"), held)[1])
        window = sum(exchanged_rows(document_masked(cu, cu, "band", 7, 0), held)[1])
        assert window < causal, (placement, window, causal)


def test_steps_without_work_make_no_kernel_call():
    # contiguous causal: blocks from higher ranks are skipped; a block sharing no document too
    cu = [16, 32, 48, 64]  # one document per rank at W = 4
    for rank in range(4):
        for index in range(1, 4):
            step = document_step(cu, rank, index, 4, "contiguous", MaskSpec(causal=True))
            assert step.part == "skip" and step.calls == ()


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
