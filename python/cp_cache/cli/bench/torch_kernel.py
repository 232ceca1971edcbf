"""The ``torch_kernel`` section of ``python -m cp_cache bench``: cp_cache on torch's own fused kernel
(the "torch" step kernel, cp_cache's op ``torch.ops.cp_cache.fusion_attention``: CPU, or CUDA with
``--device cuda``) at realistic shapes, beside one process on the same kernel and torch's
``_templated_ring_attention`` driving the same kernel, in one run on the same ranks.

Cases (B=1, float32 on CPU, bfloat16 on CUDA): causal with head-tail load balancing, a causal sliding
window (a band, head-tail), and packed documents (TND, the balanced placement), forward and forward +
backward, median seconds over ``repeats`` after a warm-up. On CPU each rank runs one thread (its own
core), and so does the one process. ``efficiency`` = one process's time / (W x cp_cache's): 1.0 is the
ideal W x speed-up; ``vs_torch_ring`` = torch's ring's time / cp_cache's (causal only: torch's ring
takes ``is_causal`` and no other mask). Rank 0's figures; ``bench_torch_kernel.png``.
"""

from __future__ import annotations

import itertools
import statistics
import time

from .._common import pyplot, save_figure, table
from .shared import Section, several_ranks

__all__ = ["SECTION"]

CASES = ("causal", "window", "documents")


def _device(plan: dict, rank: int):
    import os

    import torch

    if plan.get("device") == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    torch.set_num_threads(1)
    return torch.device("cpu")


def _timed(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _mask_arguments(case: str, cfg: dict, device) -> dict:
    from ...npu_ops import band_arguments, causal_arguments

    if case == "window":
        return band_arguments(device, cfg["window"] - 1)
    return causal_arguments(device, right_down=case == "documents")


def _inputs(cfg: dict, device, dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    shape = (1, cfg["heads"], cfg["seq"], cfg["head_dim"])
    return [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(4)]


def _call(case: str, cfg: dict, tensors, heads: int, scale: float, backward: bool, wrap, device):
    """One forward (and backward) of cp_cache's op on ``tensors`` (q, k, v, dout; ``wrap`` makes the
    DTensors of a CP call, or leaves plain tensors)."""
    import torch

    from ... import layout as L

    q, k, v, dout = tensors
    extra = {}
    if case == "documents":
        ends = torch.tensor(cfg["documents"]).cumsum(0)
        extra = dict(actual_seq_qlen=ends, actual_seq_kvlen=ends)
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    args = wrap(leaves)
    out = torch.ops.cp_cache.fusion_attention(*args, heads, L.TND if case == "documents" else "BNSD", scale=scale,
                                              **_mask_arguments(case, cfg, device), **extra)[0]
    if backward:
        (out.to_local() if hasattr(out, "to_local") else out).backward(dout)


def _local(case: str, cfg: dict, full, rank: int, world: int):
    """This rank's rows of q, k, v, dout: head-tail for dense cases, the balanced placement for documents
    (as [T_r, N, D])."""
    import cp_cache
    from cp_cache.documents import sequence_positions

    if case == "documents":
        ends = list(itertools.accumulate(cfg["documents"]))
        held = cp_cache.document_layout(ends, world, placement="balanced")[rank]
        return [t[0].transpose(0, 1).index_select(0, held.to(t.device)).contiguous() for t in full]
    pos = sequence_positions(rank, world, cfg["seq"] // world, True).to(full[0].device)
    return [t.index_select(2, pos).contiguous() for t in full]


def _cp_wrap(case: str, cfg: dict, mesh, world: int):
    from torch.distributed.tensor import DTensor, Shard

    def wrap(leaves):
        if case != "documents":
            return [DTensor.from_local(t, mesh, [Shard(2)]) for t in leaves]
        shape = (cfg["seq"], *leaves[0].shape[1:])
        stride = (leaves[0].shape[1] * leaves[0].shape[2], leaves[0].shape[2], 1)
        return [DTensor.from_local(t, mesh, [Shard(0)], shape=shape, stride=stride) for t in leaves]

    return wrap


def _torch_ring(local, mesh, scale: float, backward: bool) -> None:
    """torch's templated ring on the same fused kernel, causal (its load balancing on)."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention, _templated_ring_attention_backward)

    def step(query, key, value, *, is_causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                          scale=scale)

    def step_backward(*, query, key, value, out, logsumexp, is_causal, grad_out, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)

    q, k, v, dout = local
    group = mesh.get_group()
    with torch.no_grad():  # its backward is called explicitly, as torch's own autograd function does
        out, lse = _templated_ring_attention(group, 2, step, q, k, v, is_causal=True, scale=scale)[:2]
    if backward:
        with torch.no_grad():
            _templated_ring_attention_backward(group, 2, step_backward, dout, "grad_out", q, k, v, out, lse, True,
                                               scale=scale)


def torch_kernel_rank(plan: dict, rank: int, world: int, mesh) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    import cp_cache

    cfg = plan["torch_kernel"]
    device = _device(plan, rank)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)  # noqa: E731
    heads, scale, repeats = cfg["heads"], cfg["head_dim"] ** -0.5, cfg["repeats"]
    full = _inputs(cfg, device, dtype)
    rows = []
    cp_cache.enable(kernel="torch", fused_merge=False)
    load_balance = _cp_options.enable_load_balance
    try:
        for case in CASES:
            row = dict(case=case, world_size=world, device=device.type, dtype=str(dtype).replace("torch.", ""),
                       seq=cfg["seq"], heads=heads, head_dim=cfg["head_dim"])
            for backward in (False, True):
                direction = "forward_backward" if backward else "forward"
                single = None
                if rank == 0:  # one process, the others waiting
                    tensors = full if case != "documents" else [t[0].transpose(0, 1).contiguous() for t in full]
                    single = _timed(lambda: _call(case, cfg, tensors, heads, scale, backward, lambda x: x, device),
                                    repeats, sync)
                dist.barrier()
                _cp_options.enable_load_balance = True
                local = _local(case, cfg, full, rank, world)
                with cp_cache.context_parallel(mesh):
                    wrap = _cp_wrap(case, cfg, mesh, world)
                    cp = _timed(lambda: _call(case, cfg, local, heads, scale, backward, wrap, device), repeats, sync)
                ring = None
                if case == "causal" and device.type == "cpu":
                    ring = _timed(lambda: _torch_ring(local, mesh, scale, backward), repeats, sync)
                row.update({f"{direction}_single_s": single, f"{direction}_cp_cache_s": cp,
                            f"{direction}_torch_ring_s": ring})
                if single is not None:
                    row[f"{direction}_efficiency"] = single / (world * cp)
                if ring is not None:
                    row[f"{direction}_vs_torch_ring"] = ring / cp
            rows.append(row)
    finally:
        _cp_options.enable_load_balance = load_balance
        cp_cache.disable()
    return rows


def print_torch_kernel(report: dict) -> None:
    rows = report.get("torch_kernel") or []
    if not rows:
        return
    print("\ncp_cache on torch's fused kernel (rank 0; seconds; efficiency = one process / (W x cp_cache))")
    lines = []
    for r in rows:
        for d in ("forward", "forward_backward"):
            ring = r.get(f"{d}_torch_ring_s")
            lines.append([f"{r['case']} W={r['world_size']} {d}", f"{r[f'{d}_single_s']:.3f}",
                          f"{r[f'{d}_cp_cache_s']:.3f}", "-" if ring is None else f"{ring:.3f}",
                          f"{r[f'{d}_efficiency']:.2f}",
                          "-" if ring is None else f"{r[f'{d}_vs_torch_ring']:.2f}"])
    print(table(["case", "one process", "cp_cache", "torch ring", "efficiency", "torch ring / cp_cache"], lines))


def draw_torch_kernel(report: dict, path) -> bool:
    plt = pyplot()
    rows = [r for r in report.get("torch_kernel") or [] if r.get("forward_backward_efficiency") is not None]
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['case']}\nW={r['world_size']}" for r in rows]
    x = range(len(rows))
    ideal = [r["forward_backward_single_s"] / r["world_size"] for r in rows]
    ax.bar([i - 0.27 for i in x], ideal, width=0.27, label="one process / W (ideal)")
    ax.bar(list(x), [r["forward_backward_cp_cache_s"] for r in rows], width=0.27, label="cp_cache")
    ax.bar([i + 0.27 for i in x], [r["forward_backward_torch_ring_s"] or 0 for r in rows], width=0.27,
           label="torch's ring (causal only)")
    for i, r in enumerate(rows):
        ax.text(i, r["forward_backward_cp_cache_s"], f"{r['forward_backward_efficiency']:.2f}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds per forward + backward (rank 0)")
    ax.set_title(f"torch's fused kernel, {rows[0]['device']}, S={rows[0]['seq']}, N={rows[0]['heads']}, "
                 f"D={rows[0]['head_dim']}")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


SECTION = Section(
    name="torch_kernel",
    about="cp_cache on torch's fused kernel (CPU, or CUDA with --device cuda) beside one process on the same "
          "kernel and torch's ring driving it: causal, a sliding window and packed documents, forward and "
          "backward, efficiency against the ideal W x",
    quick=dict(torch_kernel=dict(seq=256, heads=2, head_dim=16, window=48, documents=[40, 96, 24, 64, 32],
                                 repeats=1)),
    full=dict(torch_kernel=dict(seq=8192, heads=8, head_dim=64, window=1024,
                                documents=[3072, 1536, 1024, 896, 640, 512, 256, 256], repeats=3)),
    rank=torch_kernel_rank, runs_at=several_ranks, all_ranks=False, summary=print_torch_kernel,
    plots=(("bench_torch_kernel.png", draw_torch_kernel),),
)
