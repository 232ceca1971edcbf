"""Repeated and alternating calls through the DTensor op, on 2 and 3 spawned ranks: a layer's
repeated call is bit for bit its first call's, results and bytes, with one agreement per
direction; calls of two configurations alternating are each still its own first call's (nothing
of one travels with the other); ranks that disagree after repeated calls raise the same error on
every rank, and the next call is right again."""

from __future__ import annotations

import pytest
import torch

from cp_cache.testing.multiprocess import run_ranks

S_LOCAL = 8


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from cp_cache.engine import agreement
    from cp_cache.npu_ops import causal_mask

    cp_cache.emulator.install_npu_emulator()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(1, 2, S_LOCAL, 8, generator=g, requires_grad=True) for _ in range(3)]
    longer = [torch.randn(1, 2, 2 * S_LOCAL, 8, generator=g, requires_grad=True) for _ in range(3)]
    mask = causal_mask("cpu")

    def call(scale: float, tensors=local) -> list:
        for t in tensors:
            t.grad = None
        q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)
        out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=2, scale=scale,
                                                    next_tockens=0)[0]
        out.to_local().sum().backward()
        stats = cp_cache.call_stats()
        traffic = torch.tensor([stats[d][f"bytes_{w}"] for d in ("forward", "backward") for w in ("sent", "received")])
        return [out.to_local().detach(), *(t.grad for t in tensors), traffic]

    def same(a: list, b: list) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    out = {}
    with cp_cache.context_parallel(mesh):
        cold = call(0.35)
        before = agreement.counters()
        hot = [call(0.35) for _ in range(3)]
        after = agreement.counters()
        out["hot"] = all(same(h, cold) for h in hot)
        out["hot_agreements"] = after["exchanges"] - before["exchanges"]
        other = call(0.25)
        alternating = [call(scale) for scale in (0.35, 0.25, 0.35, 0.25)]
        out["alternating"] = all(same(a, cold if i % 2 == 0 else other) for i, a in enumerate(alternating))
        call(0.35)
        last = rank == world - 1
        try:
            call(0.35, longer if last else local)
            out["disagree"] = ("", "")
        except RuntimeError as error:
            out["disagree"] = (type(error).__name__, str(error))
        out["after"] = same(call(0.35), cold) and same(call(0.35), cold)
    return out


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank, world, timeout=180)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 3])
def test_repeated_and_alternating_calls_are_their_first_calls(world):
    for rank, res in enumerate(_results(world)):
        assert res["hot"] and res["hot_agreements"] == 6, (rank, res)  # three repeats: one agreement a direction
        assert res["alternating"] and res["after"], (rank, res)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_after_a_repeated_call_raise_the_same_error(world):
    results = _results(world)
    messages = {res["disagree"][1] for res in results}
    for rank, res in enumerate(results):
        kind, message = res["disagree"]
        assert kind == "RuntimeError" and "local query shape" in message, (rank, res)
    assert len(messages) == 1, messages
