"""The ``agreement`` section of ``python -m cp_cache bench``: the ranks' agreement before each ring
call (``cp_cache.engine.agreement``): microseconds per call on the ring's group, the first call of
a configuration (signature built, then all-gathered) and the steady state (cached signature,
all-gathered), W > 1."""

from __future__ import annotations

import statistics
import time

from .._common import table
from .shared import Section, several_ranks

__all__ = ["SECTION"]


def agreement_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    """Microseconds of the ring's agreement per call: first call of a configuration (the
    signature built, then exchanged) and steady state (the cached signature, exchanged)."""
    import torch
    import torch.distributed as dist

    from ...engine import agreement
    from ...plan import CallPlan, MaskSpec

    group = mesh.get_group()
    a = plan["attn"]
    s_local = a["seq"] // world_size
    q = torch.empty(a["batch"], a["heads"], s_local, a["head_dim"])
    call_plan = CallPlan(world_size=world_size, rank=rank, mask=MaskSpec(causal=True), load_balance=True,
                         layout="BNSD", head_num=a["heads"], scale=a["head_dim"] ** -0.5, keep_prob=1.0)

    def once() -> float:
        dist.barrier(group=group)  # start together: time the exchange, not a late peer
        started = time.perf_counter()
        sig = agreement.signature(direction="forward", plan=call_plan, q=q, k=q, v=q, kv_heads=a["heads"],
                                  kernel="npu")
        agreement.agree(sig, group, world_size)
        return time.perf_counter() - started

    agreement.reset_counters()  # the signature cache too: the next call builds it
    first = once()
    steady = [once() for _ in range(plan["agreement"]["calls"])]
    build_started = time.perf_counter()
    for _ in range(100):
        agreement.signature(direction="forward", plan=call_plan, q=q, k=q, v=q, kv_heads=a["heads"], kernel="npu")
    cached_build = (time.perf_counter() - build_started) / 100
    return [dict(world_size=world_size, rank=rank, signature_len=agreement.SIGNATURE_LEN,
                 first_call_us=first * 1e6, steady_us=statistics.median(steady) * 1e6,
                 steady_p90_us=sorted(steady)[int(0.9 * (len(steady) - 1))] * 1e6,
                 cached_signature_us=cached_build * 1e6, calls=len(steady))]


def print_agreement(report: dict) -> None:
    agree = report["agreement"]
    if not agree:
        return
    print("\nranks' agreement before each ring call (µs per call; max over ranks)")
    rows = []
    for w in sorted({r["world_size"] for r in agree}):
        rs = [r for r in agree if r["world_size"] == w]
        rows.append([w, rs[0]["signature_len"], f"{max(r['first_call_us'] for r in rs):.0f}",
                     f"{max(r['steady_us'] for r in rs):.0f}", f"{max(r['steady_p90_us'] for r in rs):.0f}",
                     f"{max(r['cached_signature_us'] for r in rs):.1f}"])
    print(table(["W", "int64s", "first call", "steady (median)", "steady (p90)", "signature (cached)"], rows))


SECTION = Section(
    name="agreement",
    about="the ranks' agreement before each ring call (cp_cache.engine.agreement): microseconds per call on the "
          "ring's group, the first call of a configuration (signature built, then all-gathered) and the steady "
          "state (cached signature, all-gathered), W > 1",
    quick=dict(agreement=dict(calls=50)),
    full=dict(agreement=dict(calls=500)),
    rank=agreement_rank, runs_at=several_ranks, summary=print_agreement,
)
