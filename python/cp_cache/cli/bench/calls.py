"""The ``calls`` section of ``python -m cp_cache bench``: the bytes one causal head-tail attention
call sends per rank, forward and backward, with and without GQA, against the lower bound
``cp_cache.call_stats()`` reports and against the whole-block ring's forward ((W-1) K+V blocks)."""

from __future__ import annotations

from .._common import fmt_bytes, table
from .shared import Section, attention_call

__all__ = ["SECTION"]


def calls_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    """One call per head configuration (the bytes are exact: no repeats)."""
    import torch

    import cp_cache

    a = plan["attn"]
    rows = []
    cp_cache.enable(policy="handle")
    with cp_cache.context_parallel(mesh):
        for kv_heads in (a["heads"], max(1, a["heads"] // 4)):
            attention_call(a, kv_heads, torch.float32, mesh, world_size)
            calls = cp_cache.call_stats()
            block = a["batch"] * kv_heads * (a["seq"] // world_size) * a["head_dim"] * 4  # one K block, fp32
            rows.append(dict(
                world_size=world_size, rank=rank, kv_heads=kv_heads, heads=a["heads"], gqa=kv_heads != a["heads"],
                fwd_bytes_sent=calls["forward"]["bytes_sent"], bwd_bytes_sent=calls["backward"]["bytes_sent"],
                fwd_bytes_lower_bound=calls["forward"]["bytes_lower_bound"],
                bwd_bytes_lower_bound=calls["backward"]["bytes_lower_bound"],
                ring_minimum_bytes=(world_size - 1) * 2 * block, kv_block_bytes=2 * block,
            ))
    cp_cache.disable()
    return rows


def print_calls(report: dict) -> None:
    rows = [r for r in report["calls"] if r["rank"] == 0]
    if not rows:
        return
    print("\nbytes sent per attention call (rank 0; causal, head-tail, fp32)")
    body = [[r["world_size"], f"{r['heads']}/{r['kv_heads']}", fmt_bytes(r["fwd_bytes_sent"]),
             fmt_bytes(r["fwd_bytes_lower_bound"]), fmt_bytes(r["bwd_bytes_sent"]),
             fmt_bytes(r["bwd_bytes_lower_bound"]), fmt_bytes(r["ring_minimum_bytes"])] for r in rows]
    print(table(["W", "heads q/kv", "fwd sent", "fwd lower bound", "bwd sent", "bwd lower bound",
                 "whole-block ring fwd"], body))


def calls_panel(ax, report: dict) -> None:
    """Bytes sent against the whole-block ring's forward, over W."""
    calls = [r for r in report["calls"] if r["rank"] == 0]
    if not calls:
        return
    for gqa, marker in ((False, "o"), (True, "x")):
        rows = sorted((r for r in calls if r["gqa"] == gqa), key=lambda r: r["world_size"])
        if not rows:
            continue
        ws = [r["world_size"] for r in rows]
        tag = "GQA" if gqa else "MHA"
        for prefix, style, label in (("fwd", "-", "forward"), ("bwd", "--", "backward")):
            ax.plot(ws, [r[f"{prefix}_bytes_sent"] / r["ring_minimum_bytes"] if r["ring_minimum_bytes"]
                         else float("nan") for r in rows], marker + style, label=f"{label} ({tag})")
    ax.set_xticks(sorted({r["world_size"] for r in calls}))
    ax.set_xlabel("W")
    ax.set_ylabel("bytes sent / ((W-1) * K+V block bytes)")
    ax.set_title("bytes sent per rank per call vs the whole-block ring's forward")
    ax.legend(fontsize=8)


SECTION = Section(
    name="calls",
    about="bytes one causal head-tail call sends per rank, forward and backward, with and without GQA, against "
          "the lower bound cp_cache.call_stats() reports and the whole-block ring's forward",
    rank=calls_rank, summary=print_calls, panels=(calls_panel,),
)
