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

Small and mid-sized mixes (``SMALL_MIXES``: tens of documents of uniformly drawn lengths,
seeds 0-7) at W = 2 to 16: per placement the worst tokens and work max/mean over the draws,
the draws within the tolerance and the rows summed over the draws, beside the rows of the best
of several strategies within the tolerance on each draw (the balanced placement, the widening
greedy it replaced, per-document head-tail), so a regression of the balanced placement shows.
And the time to compute the balanced placement of 1,000 documents at W = 64.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

from .._common import pyplot, save_figure, table
from .shared import Section

__all__ = ["MIXES", "SMALL_MIXES", "SECTION", "draw_uniform", "placement_rows", "small_mix_rows", "timing_row"]

# (name, total tokens, seed, shortest, Pareto tail index): one mix whose longest documents
# exceed T/W at W >= 4, and one of many documents of a few thousand tokens at most
MIXES = (("long-tailed", 65536, 0, 32, 0.8), ("many mid-sized", 131072, 1, 64, 1.1))
PLACEMENT_ORDER = ("balanced", "head_tail", "contiguous")
# (name, documents, shortest, longest, total tokens or None, worlds): the first is issue 29's
SMALL_MIXES = (("12 of 8-64, T=256", 12, 8, 64, 256, (2, 4, 8)), ("24 of 16-256", 24, 16, 256, None, (2, 4, 8, 16)),
               ("48 of 32-512", 48, 32, 512, None, (4, 8, 16)), ("64 of 8-1024", 64, 8, 1024, None, (4, 8, 16)))
SMALL_SEEDS = tuple(range(8))
TIMED = (1000, 64, 4096, 64)  # documents, shortest, longest, W of the timed placement


def draw_uniform(count: int, shortest: int, longest: int, seed: int, total: int | None = None) -> list[int]:
    """``count`` document lengths drawn uniformly from ``shortest``..``longest`` (fixed seed); with
    ``total``, moved a token at a time (within the range) until they sum to it."""
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(shortest, longest) for _ in range(count)]
    if total is not None:
        if not count * shortest <= total <= count * longest:
            raise ValueError(f"total={total}: {count} documents of {shortest}..{longest} tokens cannot sum to it")
        while sum(lengths) != total:
            doc, step = rng.randrange(count), 1 if sum(lengths) < total else -1
            if shortest <= lengths[doc] + step <= longest:
                lengths[doc] += step
    return lengths


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


def placement_rows(worlds: Sequence[int], mixes=MIXES, small: bool = True) -> dict:
    """The placement table: one row per (mix, W, placement); with ``small``, the small mixes'
    rows and the timed placement too."""
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
    from ...placement import BALANCE_TOLERANCE

    return dict(mixes=described, rows=rows, small_mixes=small_mix_rows() if small else [],
                timed=timing_row() if small else None, tolerance=BALANCE_TOLERANCE,
                note="rows needed: K/V rows a rank receives at the causal lower bound (each row: Nkv heads of K and "
                     "of V); placement_ms: wall time on the machine that ran it")


def small_mix_rows(mixes=SMALL_MIXES, seeds=SMALL_SEEDS) -> list[dict]:
    """Per small mix, W and placement: the worst balance over the draws, the draws within the
    tolerance, the rows summed over the draws, and the rows of the best strategy within the
    tolerance on each draw (balanced, the widening greedy it replaced, per-document head-tail)."""
    import torch

    from ...packing import pad_documents
    from ...placement import BALANCE_TOLERANCE, _widening_cost, placement_cost

    rows = []
    for name, count, shortest, longest, total, worlds in mixes:
        for world in worlds:
            sums: dict[str, list] = {p: [0.0, 0.0, 0, 0] for p in PLACEMENT_ORDER + ("widening greedy",)}
            best = 0
            for seed in seeds:
                cu = list(itertools.accumulate(draw_uniform(count, shortest, longest, seed, total)))
                _, padded, _ = pad_documents(torch.zeros(cu[-1]), cu, 2 * world)
                costs = {"balanced": placement_cost(cu, world, "balanced"),
                         "head_tail": placement_cost(padded.tolist(), world, "head_tail"),
                         "widening greedy": _widening_cost(cu, world)}
                if cu[-1] % world == 0:
                    costs["contiguous"] = placement_cost(cu, world, "contiguous")
                within = {p: max(c.token_ratio, c.work_ratio) <= BALANCE_TOLERANCE for p, c in costs.items()}
                best += min(sum(c.rows_needed) for p, c in costs.items() if within[p] and p != "contiguous")
                for placement, cost in costs.items():
                    entry = sums[placement]
                    entry[0] = max(entry[0], cost.token_ratio)
                    entry[1] = max(entry[1], cost.work_ratio)
                    entry[2] += within[placement]
                    entry[3] += sum(cost.rows_needed)
            for placement, (tokens, work, within, needed) in sums.items():
                if tokens:
                    rows.append(dict(mix=name, world_size=world, placement=placement, draws=len(seeds),
                                     tokens_max_over_mean=tokens, work_max_over_mean=work, draws_within=within,
                                     rows_needed_total=needed, best_rows_within=best))
    return rows


def timing_row(timed=TIMED, repeats: int = 5) -> dict:
    """The fastest of ``repeats`` computations (not from the cache) of the balanced placement of
    ``timed``'s documents."""
    from ...placement import _pieces, placement_cost

    count, shortest, longest, world = timed
    cu = tuple(itertools.accumulate(draw_uniform(count, shortest, longest, 0)))
    times = []
    for _ in range(repeats):
        _pieces.cache_clear()
        started = time.perf_counter()
        _pieces(cu, world, "balanced")
        times.append(time.perf_counter() - started)
    cost = placement_cost(cu, world, "balanced")
    return dict(documents=count, shortest=shortest, longest=longest, world_size=world, placement_ms=min(times) * 1e3,
                tokens_max_over_mean=cost.token_ratio, work_max_over_mean=cost.work_ratio,
                rows_needed_total=sum(cost.rows_needed))


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
    small = report.get("small_mixes", [])
    if small:
        print(f"\nsmall and mid-sized mixes (uniform lengths, {small[0]['draws']} draws each; worst max/mean, "
              f"draws within {report['tolerance']}, rows summed over the draws; best: the fewest rows within the "
              f"tolerance of balanced, the widening greedy and head_tail, per draw)")
        print(table(["mix", "W", "placement", "tokens max/mean", "work max/mean", "within", "rows needed", "best"],
                    [[r["mix"], r["world_size"], r["placement"], f"{r['tokens_max_over_mean']:.3f}",
                      f"{r['work_max_over_mean']:.3f}", f"{r['draws_within']}/{r['draws']}", r["rows_needed_total"],
                      r["best_rows_within"]] for r in small]))
    timed = report.get("timed")
    if timed:
        print(f"\nbalanced placement of {timed['documents']} documents ({timed['shortest']}..{timed['longest']} "
              f"tokens) over W={timed['world_size']}: {timed['placement_ms']:.1f} ms (fastest of 5), tokens "
              f"{timed['tokens_max_over_mean']:.3f}, work {timed['work_max_over_mean']:.3f} of the mean")


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
    return save_figure(fig, path)


SECTION = Section(
    name="placement",
    about="where packed documents go, computed without ranks: per placement (balanced, per-document head-tail, "
          "contiguous) and W = 2 to 64, tokens and causal work per rank (max/mean) and the K/V rows each rank "
          "needs from the others (also bench_placement.png); small and mid-sized mixes beside the best strategy "
          "per draw; the time for 1,000 documents at W = 64",
    quick=dict(placement=dict(worlds=[2, 4], small=False)),
    full=dict(placement=dict(worlds=[2, 4, 8, 16, 32, 64], small=True)),
    local=lambda plan: placement_rows(plan["placement"]["worlds"], small=plan["placement"].get("small", True)),
    summary=print_placement, plots=(("bench_placement.png", plot_placement),),
)
