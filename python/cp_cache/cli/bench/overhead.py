"""The ``overhead`` section of ``python -m cp_cache bench``: per attention call, the handler's own
time (``cp_cache.call_stats()``'s overhead_seconds: handler time minus kernels and communication)
against the ring time, with each call's bytes sent and its lower bound, with and without GQA."""

from __future__ import annotations

import statistics

from .._common import fmt_bytes, table
from .shared import Section, attention_call

__all__ = ["SECTION"]


def overhead_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch

    import cp_cache

    a = plan["attn"]
    rows = []
    cp_cache.enable(policy="handle")
    with cp_cache.context_parallel(mesh):
        for kv_heads in (a["heads"], max(1, a["heads"] // 4)):
            samples = {k: [] for k in ("fwd_handler", "fwd_ring", "fwd_over", "bwd_handler", "bwd_ring",
                                       "bwd_over")}
            for i in range(plan["warmup"] + plan["repeats"]):
                attention_call(a, kv_heads, torch.float32, mesh, world_size, seed=i)
                if i < plan["warmup"]:
                    continue
                calls = cp_cache.call_stats()
                for prefix, direction in (("fwd", "forward"), ("bwd", "backward")):
                    samples[f"{prefix}_handler"].append(calls[direction]["handler_seconds"])
                    samples[f"{prefix}_ring"].append(calls[direction]["ring_seconds"])
                    samples[f"{prefix}_over"].append(calls[direction]["overhead_seconds"])
            block = a["batch"] * kv_heads * (a["seq"] // world_size) * a["head_dim"] * 4  # one K block, fp32
            minimum = (world_size - 1) * 2 * block
            rows.append(dict(
                world_size=world_size, rank=rank, kv_heads=kv_heads, heads=a["heads"],
                gqa=kv_heads != a["heads"],
                **{f"{k}_us_median": statistics.median(v) * 1e6 for k, v in samples.items()},
                fwd_bytes_sent=calls["forward"]["bytes_sent"], bwd_bytes_sent=calls["backward"]["bytes_sent"],
                fwd_bytes_lower_bound=calls["forward"]["bytes_lower_bound"],
                bwd_bytes_lower_bound=calls["backward"]["bytes_lower_bound"],
                ring_minimum_bytes=minimum, kv_block_bytes=2 * block,
            ))
    cp_cache.disable()
    return rows


def print_calls(report: dict) -> None:
    calls = report["calls"]
    if not calls:
        return
    print("\noverhead and traffic per attention call (rank 0, medians)")
    rows = [[r["world_size"], f"{r['heads']}/{r['kv_heads']}",
             f"{r['fwd_over_us_median']:.0f}", f"{r['fwd_ring_us_median']:.0f}",
             f"{r['bwd_over_us_median']:.0f}", f"{r['bwd_ring_us_median']:.0f}",
             fmt_bytes(r["fwd_bytes_sent"]), fmt_bytes(r["bwd_bytes_sent"]), fmt_bytes(r["ring_minimum_bytes"])]
            for r in calls if r["rank"] == 0]
    print(table(["W", "heads q/kv", "fwd overhead us", "fwd ring us", "bwd overhead us", "bwd ring us",
                 "fwd sent", "bwd sent", "whole-block ring fwd"], rows))


def _rows(report: dict, gqa: bool) -> list[dict]:
    return sorted((r for r in report["calls"] if r["rank"] == 0 and r["gqa"] == gqa), key=lambda r: r["world_size"])


def overhead_panel(ax, report: dict) -> None:
    """Handler overhead against ring time over W."""
    for gqa, marker in ((False, "o"), (True, "x")):
        rows = _rows(report, gqa)
        if not rows:
            continue
        ws = [r["world_size"] for r in rows]
        tag = "GQA" if gqa else "MHA"
        ax.plot(ws, [r["fwd_over_us_median"] for r in rows], marker + "-", label=f"fwd handler overhead ({tag})")
        ax.plot(ws, [r["bwd_over_us_median"] for r in rows], marker + "--", label=f"bwd handler overhead ({tag})")
        ax.plot(ws, [r["fwd_ring_us_median"] for r in rows], marker + ":", label=f"fwd ring: kernels + comm ({tag})")
    if not report["calls"]:
        return
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["world_size"] for r in report["calls"]}))
    ax.set_xlabel("W")
    ax.set_ylabel("microseconds per attention call (median)")
    ax.set_title("handler overhead vs ring time (CPU, emulator kernel)")
    ax.legend(fontsize=7)


def traffic_panel(ax, report: dict) -> None:
    """Bytes sent against the whole-block ring's forward, over W."""
    for gqa, marker in ((False, "o"), (True, "x")):
        rows = _rows(report, gqa)
        if not rows:
            continue
        ws = [r["world_size"] for r in rows]
        tag = "GQA" if gqa else "MHA"
        ratio_f = [r["fwd_bytes_sent"] / r["ring_minimum_bytes"] if r["ring_minimum_bytes"] else float("nan")
                   for r in rows]
        ratio_b = [r["bwd_bytes_sent"] / r["ring_minimum_bytes"] if r["ring_minimum_bytes"] else float("nan")
                   for r in rows]
        ax.plot(ws, ratio_f, marker + "-", label=f"forward ({tag})")
        ax.plot(ws, ratio_b, marker + "--", label=f"backward ({tag})")
    if not report["calls"]:
        return
    ax.set_xticks(sorted({r["world_size"] for r in report["calls"]}))
    ax.set_xlabel("W")
    ax.set_ylabel("bytes sent / ((W-1) * K+V block bytes)")
    ax.set_title("bytes sent per rank per call vs the whole-block ring's forward")
    ax.legend(fontsize=8)


SECTION = Section(
    name="overhead",
    about="per attention call, the handler's own time (cp_cache.call_stats()'s overhead_seconds: handler time "
          "minus kernels and communication) against the ring time, with each call's bytes sent and its lower "
          "bound, with and without GQA",
    key="calls", rank=overhead_rank, summary=print_calls, panels=(overhead_panel, traffic_panel),
)
