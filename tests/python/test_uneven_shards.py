"""Uneven shards and refusals across ranks (issue 16).

Ranks may hold local sequences of different lengths for full and causal attention on
contiguous shards: the ring exchanges blocks of their own size (the ranks learn every
length in their agreement) and the outputs carry the true global length. Positional
modes (head-tail load balancing, windows, masks) refuse uneven shards on every rank.
A rank whose arguments the handler refuses before the ring still takes part in the
agreement, so every rank raises, naming it, instead of waiting for a ring it will not
enter; a handle from another process is such a refusal.

One spawned run per W executes every case; each case returns its errors or outcome. Uneven
shards through the op on DTensors (torch.chunk's lengths, as distribute_tensor gives them: full and
causal attention, both step kernels, every layout, with the outputs' global shapes) are drawn by
the random net, test_random_configs.py, with fixed corners at W = 3 and 4.
"""

from __future__ import annotations

import math

import pytest
import torch

from cp_cache import layout as L
from cp_cache.kernels import ReferenceKernel
from cp_cache.algorithms import RING, run_backward, run_forward
from cp_cache.testing.reference import ring_plan
from cp_cache.testing.multiprocess import capture, run_ranks
from cp_cache.testing.reference import dense_attention

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

B, N, D = 1, 4, 8
PG_TIMEOUT = 20.0

# W -> local lengths by rank (13 over 4 ranks is what torch.chunk / distribute_tensor gives)
RING_LENGTHS = {2: [(3, 6), (6, 3)], 4: [(4, 4, 4, 1), (2, 5, 3, 6)]}


def _global(seq: int, nkv: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, seq, D, generator=g, dtype=torch.float64) for h in (N, nkv, nkv, N)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _ring_case(rank: int, world: int, lengths: tuple, causal: bool, layout: str, nkv: int) -> dict:
    import torch.distributed as dist

    full = _global(sum(lengths), nkv)
    start = sum(lengths[:rank])
    local = [L.from_bnsd(t.narrow(2, start, lengths[rank]).float(), layout) for t in full]
    config = ring_plan(world_size=world, rank=rank, causal=causal, load_balance=False, layout=layout,
                       head_num=N, scale=1 / math.sqrt(D), keep_prob=1.0)
    ker, group = ReferenceKernel(), dist.group.WORLD
    fwd = run_forward(RING, config, *local[:3], groups=[group], kernel=ker)
    bwd = run_backward(RING, config, local[3], *local[:3], fwd.out, fwd.lse, fwd.steps, groups=[group], kernel=ker)
    ref = dense_attention(*full, causal=causal)
    errors = {name: _rel(L.to_bnsd(got, layout, N if name in ("out", "dq") else nkv),
                         ref[name].narrow(2, start, lengths[rank]))
              for name, got in (("out", fwd.out), ("dq", bwd.dq), ("dk", bwd.dk), ("dv", bwd.dv))}
    return dict(errors=errors, lengths=fwd.lengths, bytes_sent=fwd.bytes_sent)


def _refused_in_ring(rank: int, world: int, **change) -> tuple:
    import torch.distributed as dist

    lengths = RING_LENGTHS[world][0]
    full = _global(sum(lengths), N)
    start = sum(lengths[:rank])
    q, k, v, _ = (t.narrow(2, start, lengths[rank]).float() for t in full)
    if change.get("load_balance") and lengths[rank] % 2:  # keep every rank's own check passing
        q, k, v = (t.narrow(2, 0, lengths[rank] - 1) for t in (q, k, v))
    config = ring_plan(**dict(dict(world_size=world, rank=rank, causal=True, load_balance=False, layout="BNSD",
                                   head_num=N, scale=0.3, keep_prob=1.0), **change))
    return capture(lambda: run_forward(RING, config, q, k, v, groups=[dist.group.WORLD], kernel=ReferenceKernel()))


def _handler_refusals(rank: int, world: int, mesh) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache

    last = world - 1
    full = _global(4 * world, N)
    local = [t.narrow(2, 4 * rank, 4).float() for t in full]
    qd, kd, vd, dd = (DTensor.from_local(t, mesh, [Shard(2)]) for t in local)
    results = {}

    # one rank's arguments are refused by the handler (pse): every rank raises, naming it
    pse = torch.zeros(B, N, 4, 4) if rank == last else None
    results["pse"] = capture(lambda: torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, N, "BNSD", pse=pse,
                                                                            scale=0.3))

    # a handle from another process: the rank holding it refuses, every rank raises
    with torch.no_grad():
        out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, N, "BNSD", scale=0.3)
    seed = out[4]
    foreign = seed.clone()
    dist.broadcast(foreign, src=0)
    given = foreign if rank == last else seed
    results["foreign_handle"] = capture(lambda: torch.ops.npu.npu_fusion_attention_grad_v3(
        qd, kd, vd, dd, N, "BNSD", softmax_max=out[1], softmax_sum=out[2], attention_in=out[0],
        scale_value=0.3, seed=given, offset=out[5]))
    del out, seed, given
    results["live_after"] = cp_cache.stats()["live_entries"]

    # the process group still works after the refusals: a right answer
    outs = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, N, "BNSD", scale=1 / math.sqrt(D))
    ref = dense_attention(*full, causal=False)
    results["after_error"] = _rel(outs[0].to_local(), ref["out"].narrow(2, 4 * rank, 4))
    return results


def _ranks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    import cp_cache
    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    _cp_options.enable_load_balance = False
    results = {"ring": {}, "refused": {}}
    for lengths in RING_LENGTHS[world]:
        for causal in (True, False):
            for layout, nkv in (("BNSD", N), ("BSH", 2)):
                results["ring"][(lengths, causal, layout)] = _ring_case(rank, world, lengths, causal, layout, nkv)
    with cp_cache.context_parallel(mesh):
        results["refused"]["load_balance"] = _refused_in_ring(rank, world, load_balance=True)
        results["refused"]["window"] = _refused_in_ring(rank, world, causal=False, window=True, pre_tockens=2,
                                                        next_tockens=0)
        results["handler"] = _handler_refusals(rank, world, mesh)
    results["live"] = cp_cache.stats()["live_entries"]
    return results


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_ranks, world, timeout=300.0, pg_timeout=PG_TIMEOUT)
    return _RESULTS[world]


def _bounds(seq: int, nkv: int, causal: bool, start: int = 0, length: int | None = None) -> dict:
    """The bound of each ``_rel`` over positions [start, start + length) of ``_global(seq, nkv)``:
    20x dense torch's float32 error there (+ 32 eps), measured on the same inputs."""
    from cp_cache.testing.reference import error_bound

    full = _global(seq, nkv)
    ref, low = (dense_attention(*full, causal=causal, dtype=dt) for dt in (torch.float64, torch.float32))
    length = seq - start if length is None else length
    return {n: error_bound(_rel(low[n].narrow(2, start, length), ref[n].narrow(2, start, length)))
            for n in ("out", "dq", "dk", "dv")}


@pytest.mark.parametrize("world", [2, 4])
def test_ring_with_uneven_shards_matches_dense(world):
    for rank, res in enumerate(_results(world)):
        assert len(res["ring"]) == 2 * 2 * 2
        for (lengths, causal, layout), case in res["ring"].items():
            assert case["lengths"] == [(n, n) for n in lengths], case["lengths"]
            bound = _bounds(sum(lengths), N if layout == "BNSD" else 2, causal, sum(lengths[:rank]), lengths[rank])
            assert all(case["errors"][n] <= bound[n] for n in bound), (rank, lengths, causal, layout,
                                                                       case["errors"], bound)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_sends_blocks_of_their_own_size(world):
    """Forward bytes: the rank's own block, at its own length, to every rank that needs it (full:
    all others; causal on contiguous shards: the later ranks)."""
    for rank, res in enumerate(_results(world)):
        for (lengths, causal, layout), case in res["ring"].items():
            kv_heads = N if layout == "BNSD" else 2
            receivers = world - 1 - rank if causal else world - 1
            assert case["bytes_sent"] == 2 * B * kv_heads * D * 4 * lengths[rank] * receivers, \
                (rank, lengths, case["bytes_sent"])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["load_balance", "window"])
def test_positional_modes_refuse_uneven_shards_on_every_rank(world, mode):
    lengths = RING_LENGTHS[world][0]
    messages = set()
    for res in _results(world):
        kind, message = res["refused"][mode]
        assert kind == "RuntimeError", message
        assert "local query shape: rank 0 (1, 4, " in message, message
        assert "only for full or causal attention without load balancing" in message
        messages.add(message)
    assert len(messages) == 1, messages
    assert lengths[0] != lengths[-1]


@pytest.mark.parametrize("world", [2, 4])
def test_a_handler_refusal_on_one_rank_fails_every_rank(world):
    last = world - 1
    messages = set()
    for rank, res in enumerate(_results(world)):
        kind, message = res["handler"]["pse"]
        assert kind == "RuntimeError", (rank, kind, message)
        assert f"rank {last} refused the call (NotImplementedError: cp_cache ring attention does not support pse=" \
            in message, message
        assert "argument checks: rank 0 'passed'" in message
        messages.add(message)
    assert len(messages) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_a_handle_from_another_process_fails_every_rank(world):
    last = world - 1
    for rank, res in enumerate(_results(world)):
        kind, message = res["handler"]["foreign_handle"]
        assert kind == "RuntimeError", (rank, kind, message)
        assert f"rank {last} refused the call (RuntimeError: " in message and "handle" in message, message
        assert res["handler"]["live_after"] == 0
        assert res["handler"]["after_error"] <= _bounds(4 * world, N, False, 4 * rank, 4)["out"]
        assert res["live"] == 0
