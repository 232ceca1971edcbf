"""The ``algorithms`` section of ``python -m cp_cache bench``: ring, Ulysses and hybrid.

For each W and head configuration (MHA and GQA), one causal attention call (forward and
backward, fp32, contiguous shards) through the v3 op on DTensors per algorithm: bytes sent
per rank (``cp_cache.call_stats()``), handler time per call (median), the fp32 error of the
output and gradients against the dense float64 reference, and what ``algorithm="auto"``
picks. Hybrid runs at W = 4 on a 2 x 2 CP mesh (Ulysses over the inner dimension).
"""

from __future__ import annotations

import math
import statistics

from .._common import cp_session, fmt_bytes, pyplot, save_figure, table
from .shared import Section

__all__ = ["SECTION", "algorithms_rank"]

ALGORITHMS = ("ring", "ulysses", "hybrid")


def _meshes(world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"ring": init_device_mesh("cpu", (world_size,))}
    meshes["ulysses"] = meshes["ring"]
    if world_size == 4:
        meshes["hybrid"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    return meshes


def _one(algorithm: str, mesh, shape: dict, kv_heads: int, plan: dict, rank: int) -> dict:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    import cp_cache
    from ...npu_ops import causal_arguments
    from ...testing.reference import dense_attention

    b, n, s, d = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
    g = torch.Generator().manual_seed(11)
    q, dy = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    placements = [Shard(2)] * mesh.ndim
    dq_, dk_, dv_, ddy = (distribute_tensor(t.float(), mesh, placements) for t in (q, k, v, dy))
    cp_cache.enable(policy="handle", algorithm=algorithm)
    causal = causal_arguments("cpu")
    times, sent = [], {}
    for i in range(plan["warmup"] + plan["repeats"]):
        leaves = [t.detach().requires_grad_() for t in (dq_, dk_, dv_)]
        out = torch.ops.npu.npu_fusion_attention_v3(*leaves, n, "BNSD", scale=1.0 / math.sqrt(d), **causal)[0]
        out.backward(ddy)
        calls = cp_cache.call_stats()
        if i >= plan["warmup"]:
            times.append(calls["forward"]["handler_seconds"] + calls["backward"]["handler_seconds"])
        sent = {"fwd": calls["forward"]["bytes_sent"], "bwd": calls["backward"]["bytes_sent"]}
    got = [t.detach().full_tensor().double() for t in (out, leaves[0].grad, leaves[1].grad, leaves[2].grad)]
    error = None
    if rank == 0:
        ref = dense_attention(q, k, v, dy, causal=True)
        error = max(float((x - ref[key]).abs().max() / ref[key].abs().max())
                    for x, key in zip(got, ("out", "dq", "dk", "dv")))
    return dict(fwd_bytes_sent=sent["fwd"], bwd_bytes_sent=sent["bwd"], ms_median=statistics.median(times) * 1e3,
                fp32_rel_error=error)


def algorithms_rank(plan: dict, rank: int, world_size: int, mesh=None) -> list[dict]:
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from ...plan import choose_algorithm, head_plan

    shape = plan["algorithms"]
    meshes = _meshes(world_size)
    rows = []
    with cp_session(meshes["ring"], policy="handle"):
        _cp_options.enable_load_balance = False  # hybrid lays the sequence out contiguously: all do here
        for kv_heads in shape["kv_heads"]:
            n = shape["heads"]
            auto = choose_algorithm(nq=n, nkv=kv_heads, world=world_size, given_mask=False, batch=shape["batch"],
                                    local_seq=shape["seq"] // world_size, head_dim=shape["head_dim"], itemsize=4)
            for algorithm in ALGORITHMS:
                if algorithm not in meshes:
                    continue
                row = dict(world_size=world_size, rank=rank, algorithm=algorithm, heads=n, kv_heads=kv_heads,
                           auto=auto, seq=shape["seq"], head_dim=shape["head_dim"])
                inner = world_size if algorithm == "ulysses" else (2 if algorithm == "hybrid" else 1)
                try:
                    head_plan(n, kv_heads, inner)
                except ValueError as exc:
                    rows.append(dict(row, skipped=str(exc)))
                    continue
                rows.append(dict(row, **_one(algorithm, meshes[algorithm], shape, kv_heads, plan, rank)))
    return rows


def print_summary(report: dict) -> None:
    rows = [r for r in report["algorithms"] if r["rank"] == 0 and "skipped" not in r]
    if not rows:
        return
    r0 = rows[0]
    print(f"\nring, Ulysses and hybrid: one causal call, forward + backward, fp32, S={r0['seq']}, "
          f"D={r0['head_dim']} (rank 0; hybrid: 2 x 2 CP mesh)")
    body = [[r["world_size"], f"{r['heads']}/{r['kv_heads']}", r["algorithm"] + (" *" if r["algorithm"] == r["auto"]
                                                                                  else ""),
             fmt_bytes(r["fwd_bytes_sent"]), fmt_bytes(r["bwd_bytes_sent"]),
             fmt_bytes(r["fwd_bytes_sent"] + r["bwd_bytes_sent"]), f"{r['ms_median']:.1f}",
             f"{r['fp32_rel_error']:.1e}"] for r in rows]
    print(table(["W", "heads q/kv", "algorithm (* = auto)", "fwd sent", "bwd sent", "total sent", "ms/call",
                 "fp32 error"], body))


def plot(report: dict, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in report["algorithms"] if r["rank"] == 0 and "skipped" not in r]
    if not rows:
        return False
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"ring": "o-", "ulysses": "s--", "hybrid": "^"}
    for kv_heads in sorted({r["kv_heads"] for r in rows}, reverse=True):
        for algorithm in ALGORITHMS:
            pts = sorted(((r["world_size"], r) for r in rows
                          if r["algorithm"] == algorithm and r["kv_heads"] == kv_heads), key=lambda p: p[0])
            if not pts:
                continue
            label = f"{algorithm}, {pts[0][1]['heads']}/{kv_heads} heads"
            ws = [w for w, _ in pts]
            ax_bytes.plot(ws, [(r["fwd_bytes_sent"] + r["bwd_bytes_sent"]) / 2**20 for _, r in pts],
                          styles[algorithm], label=label, alpha=1.0 if kv_heads == rows[0]["heads"] else 0.6)
            ax_time.plot(ws, [r["ms_median"] for _, r in pts], styles[algorithm], label=label,
                         alpha=1.0 if kv_heads == rows[0]["heads"] else 0.6)
    for ax in (ax_bytes, ax_time):
        ax.set_xlabel("W")
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.legend(fontsize=7)
    ax_bytes.set_ylabel("MiB sent per rank per call (forward + backward)")
    ax_time.set_ylabel("ms per call, forward + backward (median)")
    r0 = rows[0]
    fig.suptitle(f"ring vs Ulysses vs hybrid, causal, S={r0['seq']}, D={r0['head_dim']}, fp32 "
                 "(CPU, emulator kernel, gloo loopback)")
    return save_figure(fig, path)


SECTION = Section(
    name="algorithms",
    about="ring, Ulysses and hybrid (2 x 2 CP mesh at W = 4) on one causal call, MHA and GQA: bytes sent per rank, "
          "time per call, fp32 error against dense float64, and what algorithm=\"auto\" picks (also "
          "bench_algorithms.png)",
    quick=dict(algorithms=dict(batch=1, heads=4, kv_heads=[4, 2], seq=64, head_dim=16)),
    full=dict(algorithms=dict(batch=1, heads=8, kv_heads=[8, 2], seq=1024, head_dim=64)),
    rank=algorithms_rank, summary=print_summary, plots=(("bench_algorithms.png", plot),),
)
