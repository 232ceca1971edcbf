"""How many product modules one dense causal call walks through, forward and backward (traced at
run time: cp_cache.testing.call_trace), on 2 spawned ranks.

The bounds are "one path per call"'s: at most 12 product modules per direction and at most 40 returns
to a module already left (the product's own functions, not what the emulator calls while standing in
for the NPU op, nor code generated at run time such as a dataclass's __init__)."""

from __future__ import annotations

import contextlib

import torch

from cp_cache.testing.call_trace import trace_modules
from cp_cache.testing.multiprocess import run_ranks

MAX_MODULES = {"forward": 12, "backward": 12}
MAX_RETURNS = {"forward": 40, "backward": 40}
CALLS = 3  # the last call is measured: the first ones create groups and caches


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from cp_cache.engine import agreement
    from cp_cache.npu_ops import causal_mask

    cp_cache.emulator.install_npu_emulator()
    torch.autograd.set_multithreading_enabled(False)  # the backward on this thread, where the trace is
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(1, 2, 8, 8, generator=g, requires_grad=True) for _ in range(3)]
    paths, mask = {}, causal_mask("cpu")
    with _counting_reads() as reads, cp_cache.context_parallel(mesh):
        for scale in (0.35,) * CALLS:
            q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]) for t in local)
            result = {}

            def forward():
                result["out"] = torch.ops.npu.npu_fusion_attention_v3(
                    q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=2, scale=scale, next_tockens=0)[0]

            before = agreement.counters()["exchanges"]
            paths["forward"] = trace_modules(forward)
            between = agreement.counters()["exchanges"]
            paths["backward"] = trace_modules(lambda: result["out"].to_local().sum().backward())
            agreements = (between - before, agreement.counters()["exchanges"] - between)
            calls = cp_cache.call_stats()
        repeated = list(reads)
        for scale in (0.25, 0.35, 0.25):  # another scale is read afresh, then both are repeats
            q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]) for t in local)
            out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=2,
                                                        scale=scale, next_tockens=0)[0]
            out.to_local().sum().backward()
    return {"paths": paths, "calls": (calls["forward"]["calls"], calls["backward"]["calls"]), "agreements": agreements,
            "reads": (repeated, list(reads))}


@contextlib.contextmanager
def _counting_reads():
    """The directions of the calls read afresh (``handlers/spec._read_call``) inside, in order; the
    reader as it was afterwards."""
    from cp_cache.handlers import spec

    reads, read = [], spec._read_call

    def counted(a, cp, backward):
        reads.append("backward" if backward else "forward")
        return read(a, cp, backward)

    spec._read_call = counted
    try:
        yield reads
    finally:
        spec._read_call = read


def test_one_dense_call_walks_a_bounded_path_and_agrees_once_per_direction():
    for res in run_ranks(_rank, 2, timeout=180):
        assert res["calls"] == (CALLS, CALLS), res["calls"]  # cp_cache served every call, both directions
        assert res["agreements"] == (1, 1), res["agreements"]  # the ranks agree once per direction
        # a layer's repeated call takes its plan from the first (handlers/spec.read_call); another
        # scale is read once, each direction
        assert res["reads"] == (["forward", "backward"], ["forward", "backward"] * 2), res["reads"]
        for direction, path in res["paths"].items():
            print(direction, path.modules, "modules,", path.returns, "returns:", path.names())
            assert "cp_cache.handlers.attention" in path.names()
            assert path.modules <= MAX_MODULES[direction], (direction, path.names())
            assert path.returns <= MAX_RETURNS[direction], (direction, path.returns)
