"""A rank that dies in the middle of a ring (SIGKILL, in forward or in backward): the other
ranks raise within the process group's timeout, nothing hangs past the test's deadline, and
the survivors' step-cache stores hold nothing once the failed call's graph is dropped."""

from __future__ import annotations

import math
import time

import pytest

from cp_cache.testing.multiprocess import run_ranks

WORLD, PG_TIMEOUT = 2, 4.0
B, N, S_LOCAL, D = 1, 2, 16, 8


def _dying_rank(rank: int, world: int, direction: str) -> dict:
    import gc
    import os
    import signal

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from cp_cache.kernels.npu import NpuKernel
    from cp_cache.npu_ops import causal_mask
    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    victim = world - 1
    if rank == victim:
        calls = {"n": 0}
        original = getattr(NpuKernel, direction)

        def die_on_second_call(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:  # after the first hop was posted: in the middle of the ring
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args, **kwargs)

        setattr(NpuKernel, direction, die_on_second_call)
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(B, N, S_LOCAL, D, generator=g) for _ in range(4)]
    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]).requires_grad_() for t in local[:3])
    started = time.monotonic()
    error = None
    try:
        with cp_cache.context_parallel(mesh):
            out = torch.ops.npu.npu_fusion_attention_v3(
                q, k, v, N, "BNSD", atten_mask=causal_mask("cpu"), scale=1 / math.sqrt(D), sparse_mode=2,
                next_tockens=0)[0]
            out.backward(DTensor.from_local(local[3], mesh, [Shard(2)]))
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - started
    out = q = k = v = None
    gc.collect()
    return dict(error=error, elapsed=elapsed, live=cp_cache.stats()["live_entries"])


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_survivors_raise_within_the_timeout(direction):
    started = time.monotonic()
    results = run_ranks(_dying_rank, WORLD, direction, timeout=90, pg_timeout=PG_TIMEOUT,
                        expect_dead=(WORLD - 1,))
    assert results[WORLD - 1] is None  # the victim died without a result
    for rank, r in enumerate(results[:-1]):
        assert r["error"] is not None, (rank, r)
        assert r["elapsed"] < 3 * PG_TIMEOUT + 10, (rank, r)  # bounded by the group's timeout
        assert r["live"] == 0, (rank, r)
    assert time.monotonic() - started < 90
