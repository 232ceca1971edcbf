"""The ``windows`` section of ``python -m cp_cache bench``: band (sliding-window) attention at the
largest W: bytes sent and time per call against the window size, next to the full-causal ring,
with the kernel calls made and the blocks skipped; contiguous and head-tail shards (also
``bench_windows.png``)."""

from __future__ import annotations

import math
import statistics

from .._common import cp_session, fmt_bytes, pyplot, save_figure, table
from .shared import Section, largest_world_only

__all__ = ["SECTION"]


def windows_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    a = plan["attn"]
    b, n, s, d = a["batch"], a["heads"], a["seq"], a["head_dim"]
    s_local = s // world_size
    windows = sorted({max(2, s_local // 4), s_local // 2, s_local, 2 * s_local, s})
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(b, n, s_local, d, generator=g) for _ in range(4)]
    rows = []
    with cp_session(mesh, policy="handle"):
        for load_balance in (False, True):
            _cp_options.enable_load_balance = load_balance
            for window in windows + [None]:  # None: the full-causal ring (sparse_mode 2)
                rows.append(dict(world_size=world_size, rank=rank, load_balance=load_balance,
                                 window=window if window is not None else "causal", s_local=s_local,
                                 **_one(window, load_balance, local, plan, rank, world_size, mesh)))
    return rows


def _one(window, load_balance: bool, local: list, plan: dict, rank: int, world_size: int, mesh) -> dict:
    """One window (None: causal) on the shards in force: bytes, kernel calls, times (medians)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from ...masks import plan_step
    from ...npu_ops import band_arguments, causal_arguments
    from ...plan import MaskSpec

    n, s_local, d = local[0].size(1), local[0].size(2), local[0].size(3)
    if window is None:
        spec, mask = MaskSpec(causal=True), causal_arguments("cpu")
    else:
        # what the handler runs: a window over the whole sequence is causal
        spec = MaskSpec(window=True, pre_tockens=window - 1, next_tockens=0).simplified(s_local * world_size)
        mask = band_arguments("cpu", window - 1)
    tasks = [plan_step(rank, i, world_size, load_balance, spec, s_local, s_local)[1] for i in range(world_size)]
    times = {"fwd": [], "bwd": []}
    for i in range(plan["warmup"] + plan["repeats"]):
        q, k, v = (DTensor.from_local(t.clone(), mesh, [Shard(2)]).requires_grad_() for t in local[:3])
        out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, n, "BNSD", scale=1.0 / math.sqrt(d), **mask)[0]
        out.backward(DTensor.from_local(local[3], mesh, [Shard(2)]))
        calls = cp_cache.call_stats()
        if i >= plan["warmup"]:
            times["fwd"].append(calls["forward"]["handler_seconds"])
            times["bwd"].append(calls["backward"]["handler_seconds"])
    chunks = 2 if load_balance else 1
    kernel_calls = sum(len(t) for t in tasks)
    return dict(
        fwd_bytes_sent=calls["forward"]["bytes_sent"], bwd_bytes_sent=calls["backward"]["bytes_sent"],
        kv_block_bytes=2 * local[1].nbytes, hops=calls["forward"]["bytes_sent"] // (2 * local[1].nbytes),
        kernel_calls=kernel_calls,
        blocks_skipped=world_size * chunks * chunks - kernel_calls if spec.window else None,
        fwd_ms_median=statistics.median(times["fwd"]) * 1e3, bwd_ms_median=statistics.median(times["bwd"]) * 1e3,
    )


def print_windows(report: dict) -> None:
    all_windows = report["windows"]
    windows = [r for r in all_windows if r["rank"] == 0]
    if not windows:
        return
    print(f"\nband attention (causal window of w tokens) at W={windows[0]['world_size']}, "
          f"S_local={windows[0]['s_local']}: bytes and times of rank 0, kernel calls and "
          "blocks skipped summed over ranks")

    def summed(r, key):
        same = [x[key] for x in all_windows if (x["load_balance"], x["window"]) == (r["load_balance"], r["window"])]
        return "-" if None in same else sum(same)

    rows = [[("head-tail" if r["load_balance"] else "contiguous"), r["window"], r["hops"],
             fmt_bytes(r["fwd_bytes_sent"]), fmt_bytes(r["bwd_bytes_sent"]), summed(r, "kernel_calls"),
             summed(r, "blocks_skipped"), f"{r['fwd_ms_median']:.1f}", f"{r['bwd_ms_median']:.1f}"]
            for r in windows]
    print(table(["shards", "window", "hops", "fwd sent", "bwd sent", "kernel calls", "blocks skipped",
                 "fwd ms", "bwd ms"], rows))


def plot_windows(report: dict, path) -> bool:
    plt = pyplot()
    rows = [r for r in report["windows"] if r["rank"] == 0]
    if plt is None or not rows:
        return False
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for load_balance, style in ((False, "o-"), (True, "s--")):
        band = sorted((r for r in rows if r["load_balance"] == load_balance and r["window"] != "causal"),
                      key=lambda r: r["window"])
        causal = [r for r in rows if r["load_balance"] == load_balance and r["window"] == "causal"]
        tag = "head-tail" if load_balance else "contiguous"
        ws = [r["window"] for r in band]
        ax_bytes.plot(ws, [r["fwd_bytes_sent"] / 2**20 for r in band], style, label=f"band, {tag}")
        ax_time.plot(ws, [r["fwd_ms_median"] + r["bwd_ms_median"] for r in band], style, label=f"band, {tag}")
        if causal:
            ax_bytes.axhline(causal[0]["fwd_bytes_sent"] / 2**20, ls=":", color="gray",
                             label=f"full-causal ring, {tag}" if load_balance else "full-causal ring")
            ax_time.axhline(causal[0]["fwd_ms_median"] + causal[0]["bwd_ms_median"], ls=":",
                            color="gray" if not load_balance else "black", label=f"full-causal ring, {tag}")
    for ax in (ax_bytes, ax_time):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("causal window w (tokens)")
        ax.legend(fontsize=7)
    ax_bytes.set_ylabel("forward MiB sent per rank per call")
    ax_time.set_ylabel("forward + backward ms per call (median)")
    w = rows[0]
    fig.suptitle(f"band attention at W={w['world_size']}, S_local={w['s_local']} (CPU, emulator kernel)")
    return save_figure(fig, path)


SECTION = Section(
    name="windows",
    about="band (sliding-window) attention at the largest W: bytes sent and time per call against the window "
          "size, next to the full-causal ring, with the kernel calls made and the blocks skipped; contiguous and "
          "head-tail shards (also bench_windows.png)",
    rank=windows_rank, runs_at=largest_world_only, summary=print_windows,
    plots=(("bench_windows.png", plot_windows),),
)
