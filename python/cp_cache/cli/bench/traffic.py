"""The ``traffic`` section of ``python -m cp_cache bench``: K/V bytes against the mask's lower bound.

For each case (causal on contiguous and head-tail shards, windows under head-tail and on
contiguous shards, given masks, packed documents) and each exchange ("direct": each rank
sends each other rank only the rows its queries may attend to; "ring": whole blocks relayed
round the ring), one forward and backward per repeat, the strategy driven directly on the
largest W: bytes each rank receives, counted at the torch.distributed level (the sending and
receiving calls), against the lower bound of the layout (rows a rank's queries may attend to
that it does not hold, from the case's [S, S] mask: ``testing.reference.exchanged_rows``,
not cp_cache's need sets), the bound cp_cache reports, the communication left exposed
(``wait / (compute + wait)``) and the time per call.
"""

from __future__ import annotations

import math
import statistics

from .._common import pyplot, save_figure, table
from .shared import Section, largest_world_only

__all__ = ["CASES", "SECTION", "traffic_rank", "summary"]

DOCS = (20, 64, 100, 128)  # documents of a given block-diagonal mask (scaled to S), crossing shards
TND_DOCS = (24, 64, 96, 128)  # packed documents (scaled to S), lengths divisible by 2W up to W = 4
EXCHANGES = ("direct", "ring")

# name: (kind, mask fields): kind "dense" (BNSD), "given" (block-diagonal documents) or "tnd"
CASES = {
    "causal, contiguous": ("dense", dict(causal=True, load_balance=False)),
    "causal, head-tail": ("dense", dict(causal=True, load_balance=True)),
    "window 12, head-tail": ("dense", dict(window=True, pre_tockens=11, next_tockens=0, load_balance=True)),
    "window 12, contiguous": ("dense", dict(window=True, pre_tockens=11, next_tockens=0, load_balance=False)),
    "window 48, head-tail": ("dense", dict(window=True, pre_tockens=47, next_tockens=0, load_balance=True)),
    "given 4 documents, contiguous": ("given", dict(load_balance=False)),
    "given 4 documents, head-tail": ("given", dict(load_balance=True)),
    "TND documents causal, head-tail": ("tnd", dict(causal=True, load_balance=True)),
    "TND documents full, contiguous": ("tnd", dict(causal=False, load_balance=False)),
}


def _scaled(ends: tuple, seq: int) -> tuple:
    return tuple(e * seq // 128 for e in ends)


def _held(kind: str, fields: dict, rank: int, world: int, seq: int):
    from ...documents import document_positions
    from ...testing.reference import rank_positions

    if kind == "tnd":  # per-document head-tail under load balancing, else contiguous (the plan's default)
        placement = "head_tail" if fields["load_balance"] else "contiguous"
        return document_positions(_scaled(TND_DOCS, seq), rank, world, placement)
    return rank_positions(world, rank, seq // world, fields["load_balance"])


def _masked(kind: str, fields: dict, seq: int):
    import torch

    from ...testing.reference import band_masked
    from ...testing.varlen_reference import document_masked

    if kind == "tnd":
        ends = _scaled(TND_DOCS, seq)
        return document_masked(ends, ends, "left_up" if fields["causal"] else "full")
    if kind == "given":
        ends = _scaled(DOCS, seq)
        return document_masked(ends, ends, "full")
    if fields.get("causal"):
        return torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return band_masked(seq, fields["pre_tockens"], fields["next_tockens"])


def _plan(kind: str, fields: dict, rank: int, world: int, shape: dict, exchange: str):
    from ...testing.reference import ring_plan

    extra = dict(fields)
    if kind == "given":
        extra["given_mask"] = True
    if kind == "tnd":
        extra.update(layout="TND", documents=_scaled(TND_DOCS, shape["seq"]))
    extra.setdefault("layout", "BNSD")
    return ring_plan(world_size=world, rank=rank, head_num=shape["heads"], scale=1.0 / math.sqrt(shape["head_dim"]),
                     keep_prob=1.0, kernel="reference", exchange=exchange, **extra)


def _inputs(kind: str, held, shape: dict):
    import torch

    g = torch.Generator().manual_seed(5)
    full = [torch.randn(shape["batch"], shape["heads"], shape["seq"], shape["head_dim"], generator=g)
            for _ in range(4)]
    local = [t.index_select(2, held).contiguous() for t in full]
    if kind == "tnd":
        local = [t[0].permute(1, 0, 2).contiguous() for t in local]
    return local


def _one(kind: str, fields: dict, exchange: str, rank: int, world: int, shape: dict, plan: dict) -> dict:
    """One case with one exchange on this rank: bytes (last call), time and exposure (medians)."""
    import time

    import torch.distributed as dist

    from ...algorithms import run_backward, run_forward
    from ...handlers.attention import strategy_for
    from ...kernels import get_kernel
    from ..compare.patches import SentCounter

    held = _held(kind, fields, rank, world, shape["seq"])
    q, k, v, dout = _inputs(kind, held, shape)
    call = _plan(kind, fields, rank, world, shape, exchange)
    mask = _masked(kind, fields, shape["seq"]).index_select(0, held) if kind == "given" else None
    strategy, kernel, groups = strategy_for(call), get_kernel("reference"), [dist.group.WORLD]
    samples: dict = {key: [] for key in ("fwd_ms", "bwd_ms", "fwd_exposed", "bwd_exposed")}
    for i in range(plan["warmup"] + plan["repeats"]):
        dist.barrier()
        with SentCounter() as counter:
            counter.phase, started = "forward", time.perf_counter()
            fwd = run_forward(strategy, call, q, k, v, groups=groups, kernel=kernel, mask=mask)
            counter.phase, between = "backward", time.perf_counter()
            bwd = run_backward(strategy, call, dout, q, k, v, fwd.out, fwd.lse, fwd.steps, groups=groups,
                               kernel=kernel, mask=mask)
            finished = time.perf_counter()
        if i >= plan["warmup"]:
            samples["fwd_ms"].append((between - started) * 1e3)
            samples["bwd_ms"].append((finished - between) * 1e3)
            for prefix, res in (("fwd", fwd), ("bwd", bwd)):
                busy = res.compute_seconds + res.wait_seconds
                samples[f"{prefix}_exposed"].append(res.wait_seconds / busy if busy else 0.0)
    row = {f"{key}_median": statistics.median(values) for key, values in samples.items()}
    for prefix, direction, res in (("fwd", "forward", fwd), ("bwd", "backward", bwd)):
        row.update({f"{prefix}_received": counter.received_by_phase.get(direction, 0),
                    f"{prefix}_sent": counter.by_phase.get(direction, 0),
                    f"{prefix}_reported_received_bound": res.bytes_received_lower_bound})
    return row


def traffic_rank(plan: dict, rank: int, world_size: int, mesh=None) -> list[dict]:
    """Every case and exchange on this rank (``plan["traffic"]``: batch, heads, head_dim, seq)."""
    from ...testing.reference import exchanged_rows

    shape = plan["traffic"]
    row_bytes = 2 * shape["batch"] * shape["heads"] * shape["head_dim"] * 4  # a K row and a V row, fp32
    rows = []
    for name, (kind, fields) in CASES.items():
        held = [_held(kind, fields, r, world_size, shape["seq"]) for r in range(world_size)]
        _, received = exchanged_rows(_masked(kind, fields, shape["seq"]), held)
        for exchange in EXCHANGES:
            rows.append(dict(case=name, exchange=exchange, world_size=world_size, rank=rank,
                             bound_received=received[rank] * row_bytes, **shape,
                             **_one(kind, fields, exchange, rank, world_size, shape, plan)))
    return rows


# ---------------------------------------------------------------- report


def summary(rows: list[dict]) -> list[dict]:
    """Per case and exchange: bytes received over all ranks and by the busiest, as multiples of
    the forward lower bound (total / busiest), forward and backward; exposure and time: the
    slowest rank."""
    out = []
    for name in dict.fromkeys(r["case"] for r in rows):
        for exchange in EXCHANGES:
            group = [r for r in rows if r["case"] == name and r["exchange"] == exchange]
            if not group:
                continue
            bound = [r["bound_received"] for r in group]
            cell = dict(case=name, exchange=exchange, world_size=group[0]["world_size"],
                        bound_total=sum(bound), bound_busiest=max(bound))
            for prefix in ("fwd", "bwd"):
                got = [r[f"{prefix}_received"] for r in group]
                cell[f"{prefix}_total_ratio"] = sum(got) / sum(bound) if sum(bound) else math.nan
                cell[f"{prefix}_busiest_ratio"] = max(got) / max(bound) if max(bound) else math.nan
                cell[f"{prefix}_received_total"] = sum(got)
                cell[f"{prefix}_exposed"] = max(r[f"{prefix}_exposed_median"] for r in group)
                cell[f"{prefix}_ms"] = max(r[f"{prefix}_ms_median"] for r in group)
            out.append(cell)
    return out


def print_summary(report: dict) -> None:
    rows = report["traffic"]
    cells = summary(rows)
    if not cells:
        return
    r0 = rows[0]
    print(f"\nK/V traffic vs the mask's lower bound: bytes received per call, all ranks / busiest rank, as multiples "
          f"of the forward bound (W={r0['world_size']}, N={r0['heads']}, D={r0['head_dim']}, S={r0['seq']}, fp32)")
    body = [[c["case"], c["exchange"], c["bound_total"], f"{c['fwd_total_ratio']:.2f} / {c['fwd_busiest_ratio']:.2f}",
             f"{c['bwd_total_ratio']:.2f} / {c['bwd_busiest_ratio']:.2f}",
             f"{c['fwd_exposed']:.2f} / {c['bwd_exposed']:.2f}", f"{c['fwd_ms']:.1f} / {c['bwd_ms']:.1f}"]
            for c in cells]
    print(table(["case", "exchange", "bound B", "fwd total/busiest", "bwd total/busiest", "exposed fwd/bwd",
                 "ms fwd/bwd"], body))


def plot(report: dict, path) -> bool:
    rows = report["traffic"]
    plt = pyplot()
    if plt is None:
        return False
    cells = summary(rows)
    if not cells:
        return False
    names = list(dict.fromkeys(c["case"] for c in cells))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    width = 0.38
    for ax, prefix, title in ((axes[0], "fwd", "forward"), (axes[1], "bwd", "backward")):
        for j, exchange in enumerate(EXCHANGES):
            values = [next(c[f"{prefix}_total_ratio"] for c in cells if c["case"] == n and c["exchange"] == exchange)
                      for n in names]
            ax.bar([i + (j - 0.5) * width for i in range(len(names))], values, width,
                   label="direct exchange" if exchange == "direct" else "whole-block ring")
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{title}: bytes received (all ranks) / forward lower bound", fontsize=9)
        ax.legend(fontsize=8)
    r0 = rows[0]
    fig.suptitle(f"K/V traffic at W={r0['world_size']}, N={r0['heads']}, D={r0['head_dim']}, S={r0['seq']}, fp32 "
                 "(torch.distributed byte counts)")
    return save_figure(fig, path)


SECTION = Section(
    name="traffic",
    about="K/V bytes each rank receives per call, forward and backward, against the mask's lower bound and "
          "against the whole-block ring, for causal attention, windows, given masks and packed documents at the "
          "largest W, with the exposed communication and the time per call (also bench_traffic.png)",
    quick=dict(traffic=dict(batch=1, heads=4, head_dim=16, seq=128)),
    full=dict(traffic=dict(batch=1, heads=4, head_dim=16, seq=128)),
    rank=traffic_rank, runs_at=largest_world_only,
    derived=lambda plan, rows: {"traffic_summary": summary(rows)},
    summary=print_summary, plots=(("bench_traffic.png", plot),),
)
