"""The ``placement`` section of ``python -m cp_cache bench``: where packed documents go,
computed without ranks (``cp_cache.placement``; no kernels, no processes).

For long-tailed document mixes (``varlen.draw_documents``, fixed seeds) at W = 2 to 64,
per placement ("balanced", "head_tail", "contiguous"): tokens and causal attention work per
rank as max/mean, the K/V rows each rank needs from the others (keys of its documents before
one of its queries, held elsewhere: the lower bound of a causal call's forward traffic, in
rows of K and of V), in total and on the busiest rank, the documents split over more than
one rank, and the time to compute the placement. Per-document head-tail needs every
document padded to a multiple of 2W (``pad_documents``): its figures are on the padded
documents (the padding counted); contiguous needs T divisible by W.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

from .._common import pyplot, table
from .shared import Section

__all__ = ["MIXES", "SECTION", "placement_rows"]

# (name, total tokens, seed, shortest, Pareto tail index): one mix whose longest documents
# exceed T/W at W >= 4, and one of many documents of a few thousand tokens at most
MIXES = (("long-tailed", 65536, 0, 32, 0.8), ("many mid-sized", 131072, 1, 64, 1.1))
PLACEMENT_ORDER = ("balanced", "head_tail", "contiguous")


def _cost_row(name: str, cu: list[int], world: int, placement: str, padding: int) -> dict:
    from ...placement import placement_cost, placement_pieces

    started = time.perf_counter()
    pieces = placement_pieces(cu, world, placement)
    seconds = time.perf_counter() - started
    cost = placement_cost(cu, world, placement)
    holders: dict[int, set] = {}
    for rank, held in enumerate(pieces):
        for p in held:
            holders.setdefault(p.document, set()).add(rank)
    return dict(mix=name, world_size=world, placement=placement, padding_tokens=padding,
                tokens_max_over_mean=cost.token_ratio, work_max_over_mean=cost.work_ratio,
                rows_needed_total=sum(cost.rows_needed), rows_needed_max=max(cost.rows_needed),
                documents_split=sum(len(r) > 1 for r in holders.values()), documents=len(cu),
                placement_ms=seconds * 1e3)


def placement_rows(worlds: Sequence[int], mixes=MIXES) -> dict:
    """The placement table: one row per (mix, W, placement)."""
    import torch

    from ...packing import pad_documents
    from .varlen import draw_documents

    rows, described = [], []
    for name, total, seed, shortest, alpha in mixes:
        lengths = draw_documents(total, seed, shortest, alpha)
        cu = list(itertools.accumulate(lengths))
        described.append(dict(mix=name, tokens=total, documents=len(lengths), shortest=min(lengths),
                              longest=max(lengths), seed=seed, pareto_alpha=alpha))
        for world in worlds:
            _, padded, _ = pad_documents(torch.zeros(total), cu, 2 * world)
            padded = padded.tolist()
            rows.append(_cost_row(name, cu, world, "balanced", 0))
            rows.append(_cost_row(name, padded, world, "head_tail", padded[-1] - total))
            if total % world == 0:
                rows.append(_cost_row(name, cu, world, "contiguous", 0))
    return dict(mixes=described, rows=rows, note="rows needed: K/V rows a rank receives at the causal lower bound "
                                                 "(each row: Nkv heads of K and of V)")


def print_placement(report: dict) -> None:
    report = report["placement"]
    for mix in report["mixes"]:
        print(f"\nplacement of packed documents, {mix['mix']} mix: {mix['documents']} documents in {mix['tokens']} "
              f"tokens ({mix['shortest']}..{mix['longest']}), causal")
        rows = [[r["world_size"], r["placement"], f"{r['tokens_max_over_mean']:.3f}", f"{r['work_max_over_mean']:.3f}",
                 r["rows_needed_total"], r["rows_needed_max"], r["documents_split"], r["padding_tokens"],
                 f"{r['placement_ms']:.1f}"] for r in report["rows"] if r["mix"] == mix["mix"]]
        print(table(["W", "placement", "tokens max/mean", "work max/mean", "rows needed", "busiest rank",
                     "docs split", "padding", "ms"], rows))


def plot_placement(report: dict, path) -> bool:
    """Rows needed (total) and the worse of tokens/work max/mean against W, per mix and placement."""
    report = report["placement"]
    plt = pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    mixes = [m["mix"] for m in report["mixes"]]
    fig, axes = plt.subplots(2, len(mixes), figsize=(6 * len(mixes), 8), squeeze=False)
    for column, mix in enumerate(mixes):
        for placement in PLACEMENT_ORDER:
            rows = [r for r in report["rows"] if (r["mix"], r["placement"]) == (mix, placement)]
            worlds = [r["world_size"] for r in rows]
            axes[0][column].plot(worlds, [max(r["rows_needed_total"], 1) for r in rows], marker="o", label=placement)
            axes[1][column].plot(worlds, [max(r["tokens_max_over_mean"], r["work_max_over_mean"]) for r in rows],
                                 marker="o", label=placement)
        axes[0][column].set(yscale="log", title=f"{mix}: K/V rows needed from other ranks",
                            xlabel="W", ylabel="rows, all ranks (none: drawn at 1)")
        axes[1][column].axhline(1.05, color="grey", linestyle=":", label="1.05")
        axes[1][column].set(title=f"{mix}: max/mean of tokens and work (the worse)", xlabel="W",
                            ylabel="max / mean")
        for ax in axes[:, column]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["world_size"] for r in report["rows"]}))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


SECTION = Section(
    name="placement",
    about="where packed documents go, computed without ranks: per placement (balanced, per-document head-tail, "
          "contiguous) and W = 2 to 64, tokens and causal work per rank (max/mean) and the K/V rows each rank "
          "needs from the others (also bench_placement.png)",
    quick=dict(placement=dict(worlds=[2, 4])),
    full=dict(placement=dict(worlds=[2, 4, 8, 16, 32, 64])),
    local=lambda plan: placement_rows(plan["placement"]["worlds"]),
    summary=print_placement, plots=(("bench_placement.png", plot_placement),),
)
