"""How many product modules one dense causal call walks through, forward and backward (traced at
run time: cp_cache.testing.call_trace), on 2 spawned ranks.

The bounds are today's path, so that the path cannot grow unnoticed (issue 27's "before": 26
modules and 151 returns to a module already left forward, 25 and 169 backward; the backward's
step records are now checked by the one check the packed ring shares, engine/loop.check_step,
once per step: 171 returns at W = 2). The target of "one pass per call" is at most 16 modules per
direction and half the returns."""

from __future__ import annotations

import torch

from cp_cache.testing.call_trace import trace_modules
from cp_cache.testing.multiprocess import run_ranks

MAX_MODULES = {"forward": 26, "backward": 25}
MAX_RETURNS = {"forward": 151, "backward": 171}
CALLS = 3  # the last call is measured: the first ones create groups and caches


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from cp_cache.npu_ops import causal_mask

    cp_cache.emulator.install_npu_emulator()
    torch.autograd.set_multithreading_enabled(False)  # the backward on this thread, where the trace is
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(1, 2, 8, 8, generator=g, requires_grad=True) for _ in range(3)]
    paths, mask = {}, causal_mask("cpu")
    with cp_cache.context_parallel(mesh):
        for _ in range(CALLS):
            q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]) for t in local)
            result = {}

            def forward():
                result["out"] = torch.ops.npu.npu_fusion_attention_v3(
                    q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=2, scale=0.35, next_tockens=0)[0]

            paths["forward"] = trace_modules(forward)
            paths["backward"] = trace_modules(lambda: result["out"].to_local().sum().backward())
            calls = cp_cache.call_stats()
    return {"paths": paths, "calls": (calls["forward"]["calls"], calls["backward"]["calls"])}


def test_one_dense_call_walks_a_bounded_path():
    for res in run_ranks(_rank, 2, timeout=180):
        assert res["calls"] == (CALLS, CALLS), res["calls"]  # cp_cache served every call, both directions
        for direction, path in res["paths"].items():
            print(direction, path.modules, "modules,", path.returns, "returns:", path.names())
            assert "cp_cache.handlers.attention" in path.names()
            assert path.modules <= MAX_MODULES[direction], (direction, path.names())
            assert path.returns <= MAX_RETURNS[direction], (direction, path.returns)
