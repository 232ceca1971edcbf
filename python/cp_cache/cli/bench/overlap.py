"""The ``overlap`` section of ``python -m cp_cache bench``: per attention call, the ring's time
computing (kernels, merges, accumulation) and blocked on receives, forward and backward:
``exposed_fraction`` = waiting / (computing + waiting), for the default shapes and for one where
communication dominates, W > 1."""

from __future__ import annotations

import statistics

from .._common import table
from .shared import Section, causal_call, several_ranks

__all__ = ["SECTION"]


def overlap_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import cp_cache

    rows = []
    cp_cache.enable(policy="handle")
    for name in ("attn", "comm_bound"):
        inputs, call = causal_call(plan[name], mesh, world_size, rank)
        samples: dict[str, list] = {"forward": [], "backward": []}
        with cp_cache.context_parallel(mesh):
            for i in range(plan["warmup"] + plan["repeats"]):
                for t in inputs[:3]:
                    t.grad = None
                call().backward(inputs[3])
                stats = cp_cache.call_stats()
                if i >= plan["warmup"]:
                    for direction in samples:
                        samples[direction].append(stats[direction])
        for direction, records in samples.items():
            rows.append(dict(
                world_size=world_size, rank=rank, shape="default" if name == "attn" else "comm_bound",
                dims=plan[name], direction=direction,
                exposed_fraction=statistics.median(r["exposed_fraction"] for r in records),
                compute_ms=statistics.median(r["compute_seconds"] for r in records) * 1e3,
                wait_ms=statistics.median(r["wait_seconds"] for r in records) * 1e3,
            ))
    cp_cache.disable()
    return rows


def exposed_fraction(plan: dict, rows: list[dict]) -> dict:
    """{"exposed_fraction": {"W=2": {"default": {"forward": f, "backward": f}, "comm_bound": {...}}, ...}}:
    the largest fraction over ranks (the slowest rank sets the pace)."""
    out: dict = {}
    for r in rows:
        cell = out.setdefault(f"W={r['world_size']}", {}).setdefault(r["shape"], {})
        cell[r["direction"]] = max(cell.get(r["direction"], 0.0), r["exposed_fraction"])
    return {"exposed_fraction": out}


def print_exposed(report: dict) -> None:
    exposed = report["exposed_fraction"]
    if not exposed:
        return
    print("\ncommunication not hidden by compute (exposed fraction, max over ranks)")
    rows = [[w, shape, f"{d.get('forward', float('nan')):.2f}", f"{d.get('backward', float('nan')):.2f}"]
            for w, shapes in exposed.items() for shape, d in shapes.items()]
    print(table(["W", "shape", "forward", "backward"], rows))


SECTION = Section(
    name="overlap",
    about="per attention call, the ring's time computing (kernels, merges, accumulation) and blocked on receives, "
          "forward and backward: exposed_fraction = waiting / (computing + waiting), for the default shapes and "
          "for one where communication dominates",
    quick=dict(comm_bound=dict(batch=1, heads=4, seq=16, head_dim=32)),
    full=dict(comm_bound=dict(batch=1, heads=8, seq=32, head_dim=128)),  # tiny blocks: the hops dominate
    rank=overlap_rank, runs_at=several_ranks, derived=exposed_fraction, summary=print_exposed,
)
