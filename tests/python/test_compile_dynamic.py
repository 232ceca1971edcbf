"""One compiled graph for every sequence length (issue 30, dense calls): a block calling the v3
op on DTensors sharded on the sequence, ``torch.compile(dynamic=True, backend="aot_eager")``
inside ``cp_cache.context_parallel``, run at six local lengths in a row. The handler reads the
call from symbolic sizes (``layout.dims`` keeps them symbolic; the plan holds no length), so
Dynamo compiles the block once: ``unique_graphs`` is 1 for the ring and for Ulysses, where it
was one graph per length. Output and gradients equal the eager block's at every length (the
same custom op on the same shards: bit for bit).

One spawned group of W = 2 ranks serves both algorithms."""

from __future__ import annotations

import pytest
import torch

from cp_cache.testing.multiprocess import run_ranks

WORLD = 2
LOCAL_LENGTHS = (6, 8, 10, 12, 14, 16)  # head-tail needs even local lengths; none equals N or D
HEADS, HEAD_DIM = 4, 16
ALGORITHMS = ("ring", "ulysses")


def _lengths_rank(rank: int, world: int) -> dict:
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    import cp_cache
    from cp_cache.npu_ops import causal_arguments
    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    _cp_options.enable_load_balance = True
    mesh = init_device_mesh("cpu", (world,))
    causal = causal_arguments("cpu")

    def block(q, k, v):
        qd, kd, vd = (DTensor.from_local(t, mesh, [Shard(2)]) for t in (q, k, v))
        out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, HEADS, "BNSD", scale=HEAD_DIM ** -0.5, **causal)[0]
        return out.to_local()

    results = {}
    for algorithm in ALGORITHMS:
        cp_cache.enable(algorithm=algorithm)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(block, dynamic=True, backend="aot_eager")
        differing = []
        with cp_cache.context_parallel(mesh):
            for s in LOCAL_LENGTHS:
                g = torch.Generator().manual_seed(s * 10 + rank)
                x = [torch.randn(1, HEADS, s, HEAD_DIM, generator=g) for _ in range(4)]
                got = []
                for fn in (block, compiled):
                    q, k, v = (t.clone().requires_grad_() for t in x[:3])
                    out = fn(q, k, v)
                    out.backward(x[3])
                    got.append((out.detach(), q.grad, k.grad, v.grad))
                differing += [(s, name) for name, a, b in zip(("out", "dq", "dk", "dv"), *got) if not torch.equal(a, b)]
        results[algorithm] = dict(graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"], differing=differing,
                                  live=cp_cache.stats()["live_entries"])
        cp_cache.disable()
    return results


_RESULTS: list = []


def _results() -> list[dict]:
    if not _RESULTS:
        _RESULTS.extend(run_ranks(_lengths_rank, WORLD, timeout=600))
    return _RESULTS


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_one_graph_for_every_length(algorithm):
    for rank, res in enumerate(_results()):
        r = res[algorithm]
        assert r["graphs"] == 1, (rank, algorithm, r)
        assert r["differing"] == [], (rank, algorithm, r)
        assert r["live"] == 0, (rank, algorithm, r)
