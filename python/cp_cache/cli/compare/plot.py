"""compare.png: six panels from the report (correctness heatmap, bytes kept, peaks, time,
communication, gradients under dropout)."""

from __future__ import annotations

import math
from pathlib import Path

from .._common import pyplot, save_figure
from .catalogue import CASES, DROPOUT_CASE, DROPOUT_OK_BELOW, DROPOUT_ONLY, SHORT

MIB = 1 << 20


def plot(report: dict, path: Path) -> bool:
    """Draw the report into ``path``; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    (ax_acc, ax_kept, ax_peak), (ax_time, ax_sent, ax_drop) = axes
    _plot_correctness(fig, ax_acc, report)
    _plot_resources(ax_kept, ax_peak, ax_time, ax_sent, report)
    _plot_dropout(ax_drop, report)
    r = report["meta"]["plan"]["resources"]
    fig.suptitle(f"CP attention systems on the NPU emulator (torch {report['meta']['torch']}"
                 + (", quick" if report["meta"]["plan"]["quick"] else "")
                 + f"); resources at B={r['batch']} N={r['heads']} S={r['seq']} D={r['head_dim']} fp32 causal")
    return save_figure(fig, path, dpi=100)


def _correctness_grid(res: dict, systems: list, names: list):
    """log10 of each case's max error (the dropout row: pass -7 / fail 0) and the cells' labels."""
    import numpy as np

    grid = np.full((len(names), len(systems)), np.nan)
    labels = [["" for _ in systems] for _ in names]
    for j, s in enumerate(systems):
        for i, case in enumerate(names):
            c = res[s].get("dropout") if case == DROPOUT_CASE["name"] else res[s].get("cases", {}).get(case)
            if c is None:
                labels[i][j] = "(=2.13)" if s in DROPOUT_ONLY else "-"
                continue
            if c["status"] == "accepted" and case == DROPOUT_CASE["name"]:  # pass/fail of the check
                grid[i, j] = -7.0 if c["ok"] else 0.0
                labels[i][j] = ("ok " if c["ok"] else "WRONG ") + f"{c['max_error']:.0e}"
            elif c["status"] == "accepted":
                grid[i, j] = math.log10(max(c["max_error"], 1e-12))
                labels[i][j] = f"{c['max_error']:.0e}"
            else:
                labels[i][j] = "refused" if c["status"] == "refused" else "n/s"
    return grid, labels


def _plot_correctness(fig, ax, report: dict) -> None:
    """Heatmap of the cases' errors at the largest W."""
    systems = report["systems"]
    w = list(report["results"])[-1]
    names = [c["name"] for c in CASES] + [DROPOUT_CASE["name"]]
    grid, labels = _correctness_grid(report["results"][w], systems, names)
    im = ax.imshow(grid, cmap="RdYlGn_r", vmin=-8, vmax=0, aspect="auto")
    for i in range(len(names)):
        for j in range(len(systems)):
            ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(systems)), [SHORT[s] for s in systems], rotation=35, ha="right", fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_title(f"max rel. error vs dense (log10), W={w}; last row: dropout check (pass/fail)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)


def _paired_bars(ax, systems: list, worlds: list, value, keys: tuple, suffixes: tuple, ylabel: str,
                 title: str) -> None:
    """One group of bars per system: for each W, a plain and a hatched bar, ``value(W, system,
    key)`` for the two ``keys`` (None: no bar)."""
    import numpy as np

    x = np.arange(len(systems))
    width = 0.8 / (2 * len(worlds))
    for k, wk in enumerate(worlds):
        for off, (key, suffix, hatch) in enumerate(zip(keys, suffixes, (None, "//"))):
            vals = [value(wk, s, key) for s in systems]
            vals = [np.nan if v is None else v for v in vals]
            ax.bar(x + (2 * k + off - (2 * len(worlds) - 1) / 2) * width, vals, width, hatch=hatch,
                   label=f"W={wk}{suffix}")
    ax.set_xticks(x, [SHORT[s] for s in systems], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _plot_resources(ax_kept, ax_peak, ax_time, ax_sent, report: dict) -> None:
    """Bytes kept, peaks, time ratios and bytes sent: paired bars per system and W."""
    results = report["results"]
    worlds = list(results)
    measured = [s for s in report["systems"] if any("memory" in results[wk][s] for wk in worlds)]

    def memory(wk, s, key):
        return results[wk][s]["memory"][key] if "memory" in results[wk][s] else None

    def traffic(wk, s, key):
        return results[wk][s]["traffic"][key] / MIB if "traffic" in results[wk][s] else None

    def kept(wk, s, key):
        m = memory(wk, s, key)
        return None if m is None else m["total_bytes"] / MIB

    def peak(wk, s, key):
        m = memory(wk, s, "no_checkpoint")
        return None if m is None else m[key] / MIB

    def time_ratio(wk, s, key):
        return results[wk][s].get("time", {}).get(key)

    _paired_bars(ax_kept, measured, worlds, kept, ("no_checkpoint", "checkpoint"), ("", " checkpointed"),
                 "MiB kept from forward to backward (rank 0)", "bytes kept between forward and backward")
    _paired_bars(ax_peak, measured, worlds, peak, ("forward_peak_bytes", "backward_peak_bytes"),
                 (" forward", " backward"), "MiB above the starting level (rank 0)",
                 "peak allocated during forward / backward")
    _paired_bars(ax_time, measured, worlds, time_ratio, ("forward_ratio_to_cp_cache", "backward_ratio_to_cp_cache"),
                 (" forward", " backward"), "median time / cp_cache's",
                 "time per call relative to cp_cache (CPU, emulator)")
    ax_time.axhline(1.0, color="k", lw=0.8)
    _paired_bars(ax_sent, measured, worlds, traffic, ("forward_bytes", "backward_bytes"), (" forward", " backward"),
                 "MiB sent per rank per call (rank 0)", "communication")


def _plot_dropout(ax, report: dict) -> None:
    """The dropout check's error per system and W, with the controls of its validation."""
    import numpy as np

    systems = report["systems"]
    worlds = list(report["results"])
    width = 0.8 / max(len(worlds), 1)
    xs = np.arange(len(systems))
    for k, wk in enumerate(worlds):
        shift = (k - (len(worlds) - 1) / 2) * width
        drops = [report["results"][wk][s].get("dropout") or {} for s in systems]
        vals = [d["max_error"] if d.get("status") == "accepted" else np.nan for d in drops]
        ax.bar(xs + shift, vals, width, label=f"W={wk}")
        for j, d in enumerate(drops):
            if d.get("status") in ("refused", "not supported"):
                ax.text(xs[j] + shift, 1e-6, "refused" if d["status"] == "refused" else "n/s", rotation=90,
                        fontsize=7, ha="center", va="bottom")
    v = report["validation"]["directional_check"]
    ax.axhline(v["dense_op_max"], color="g", ls=":", label="dense op (control)")
    ax.axhline(v["wrong_backward_max"], color="r", ls=":", label="wrong backward (control)")
    ax.axhline(DROPOUT_OK_BELOW, color="k", lw=0.8, label="threshold")
    ax.set_yscale("log")
    ax.set_ylim(1e-6, 5)
    ax.set_xticks(xs, [SHORT[s] for s in systems], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("max directional-derivative error")
    ax.set_title(f"gradients under dropout (keep_prob {DROPOUT_CASE['keep_prob']})", fontsize=9)
    ax.legend(fontsize=7)
