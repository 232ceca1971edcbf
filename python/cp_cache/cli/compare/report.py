"""The report: its JSON (meta, notes, validation, results), the tables printed, the files written."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from .._common import fmt_bytes, table
from .catalogue import CASES, DROPOUT_CASE, DROPOUT_OK_BELOW, DROPOUT_ONLY, RNG_SEED, SHORT, WRONG_ABOVE
from .plot import plot
from .summary import summarise


def build_report(plan: dict, per_world: dict[int, list[dict]], validation: dict, started: float) -> dict:
    """The report written to compare.json; ``started``: the run's ``time.perf_counter()`` at start."""
    report = dict(
        meta=dict(
            python=platform.python_version(), machine=platform.machine(),
            torch=per_world[plan["worlds"][0]][0]["torch"], plan=plan,
            cases={c["name"]: c["what"] for c in CASES + (DROPOUT_CASE,)},
            repeats=dict(warmup=plan["warmup"], timed=plan["repeats"], eval_forwards=3,
                         directions=plan["directions"]),
            thresholds=dict(silently_wrong_above=WRONG_ABOVE, dropout_ok_below=DROPOUT_OK_BELOW),
            notes=_notes(plan),
        ),
        validation=validation,
        systems=list(plan["systems"]),
        results=summarise(plan, per_world),
    )
    report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _notes(plan: dict) -> dict:
    """How each figure of the report is measured."""
    return dict(
        kernels="every system runs the CPU emulator of npu_fusion_attention_v3 / _grad_v3",
        errors="max|x - ref| / max|ref| per tensor vs dense float64 attention (fp32 inputs); "
               "max_error = max over out, dq, dk, dv",
        dropout="directional-derivative check (cp_cache.testing.reference): |g.d - fd| / max(|g.d|, |fd|), "
                f"max over directions; eps {plan['eps']} (with fp32 kernels 1e-2 leaves 1e-3..6e-3 of rounding "
                f"noise); RNG reset with torch.manual_seed({RNG_SEED} + rank) per forward",
        kept="bytes kept from forward to backward: distinct storages saved by autograd during the "
             "attention forward (saved_tensors_hooks; q, k, v and the mask excluded; a DTensor counts "
             "its local tensor), union the storages held by torch_npu 2.12.0's _step_cache_stack "
             "entries, plus cp_cache's store live bytes",
        peaks="allocation/free events of torch.profiler (profile_memory=True) summed in time order; "
              "peak above the level at the phase's start; fwd and bwd in one profile, after gc.collect(); "
              "freed_by_gc_after_backward: bytes a gc.collect() right after backward frees (garbage "
              "held in reference cycles)",
        traffic="bytes handed to torch.distributed sending calls during the forward and the backward of "
                "the first memory pass; all_gather counted as "
                "input bytes x (W-1) (= (W-1)/W of the gathered output); all_to_all: the parts "
                "for other ranks; cp_cache_reported = cp_cache.call_stats()",
        time="CPU, one thread per rank; W ranks share the machine's cores (oversubscribed when W > cores); "
             "timed in rounds (each round calls every system once, in its own session) after every "
             "system has run its cases and memory passes in the same process; per-rank samples kept",
        guard_lifted="torch_npu 2.13.0 (guard lifted): its CP strategies read keep_prob as 1.0 "
                     "(monkeypatch in cli/compare/patches.py, this process only) so its handler runs under "
                     "dropout; measured for the dropout check only",
        torch_ring="torch's _templated_ring_attention(_backward) driven with a step wrapper around the "
                   "emulator op (cli/compare/systems/torch_ring.py); BNSD, is_causal only, no dropout",
    )


def publish(report: dict, out: Path) -> None:
    """Write compare.json and compare.png under ``out`` and print the tables."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "compare.json"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    _print_report(report)
    png_path = out / "compare.png"
    plotted = plot(report, png_path)
    print(f"\nwritten: {json_path}")
    print(f"written: {png_path}" if plotted else "no plot (matplotlib missing: run make build)")
    print(f"compare took {report['meta']['seconds']:.1f} s")


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    if c["status"] == "accepted":
        e = c["max_error"]
        return f"WRONG {e:.2g}" if c.get("silently_wrong") else f"ok {e:.0e}"
    if c["status"] == "refused":
        return "refused"
    return "n/s"


def _dropout_cell(d: dict | None) -> str:
    if d is None:
        return "-"
    if d["status"] == "accepted":
        return ("ok " if d["ok"] else "WRONG ") + f"{d['max_error']:.2g}"
    return "refused" if d["status"] == "refused" else "n/s"


def _print_report(report: dict) -> None:
    systems = report["meta"]["plan"]["systems"]
    for world, by_system in report["results"].items():
        _print_correctness(world, by_system, systems)
        _print_resources(world, by_system, systems, report["meta"]["plan"]["resources"])
        errors = [f"{s}: {by_system[s]['session_error']}" for s in systems if "session_error" in by_system[s]]
        for line in errors:
            print("SESSION ERROR " + line)
    v = report["validation"]
    d = v["directional_check"]
    print(f"\ndropout check validated on one process: dense op max error {d['dense_op_max']:.2g}, "
          f"wrong backward (negative control) {d['wrong_backward_max']:.2g} (threshold {d['threshold']})")
    m = v["memory_helper"]
    print(f"memory helper: {fmt_bytes(m['allocated'])} allocated, peak measured {m['measured_peak']} B "
          f"({'ok' if m['ok'] else 'OFF'})")


def _print_correctness(world: str, by_system: dict, systems: list) -> None:
    print(f"\n== W = {world}: acceptance and max relative error vs dense float64 (out/dq/dk/dv) ==")
    headers = ["case"] + [SHORT[s] for s in systems]
    rows = []
    for case in CASES:
        rows.append([case["name"]] + [
            "(=2.13)" if s in DROPOUT_ONLY else _cell(by_system[s].get("cases", {}).get(case["name"]))
            for s in systems])
    rows.append([DROPOUT_CASE["name"] + " (dir. deriv.)"] + [_dropout_cell(by_system[s].get("dropout"))
                                                               for s in systems])
    print(table(headers, rows))


def _print_resources(world: str, by_system: dict, systems: list, r: dict) -> None:
    print(f"\n== W = {world}: resources, B={r['batch']} N={r['heads']} S={r['seq']} D={r['head_dim']} fp32 causal "
          "load-balanced (rank 0; time: max over ranks of medians) ==")
    headers = ["system", "kept fwd->bwd", "kept (ckpt)", "fwd peak", "bwd peak", "fwd peak (ckpt)",
               "bwd peak (ckpt)", "eval entries", "fwd s", "bwd s", "fwd x", "bwd x", "sent fwd", "sent bwd"]
    rows = []
    for s in systems:
        row = by_system[s]
        if "memory" not in row:
            continue
        m, mc, t, tr = row["memory"]["no_checkpoint"], row["memory"]["checkpoint"], row["time"], row["traffic"]
        ev = row["eval_no_grad"]["stack_entries_left"]
        rows.append([SHORT[s], fmt_bytes(m["total_bytes"]), fmt_bytes(mc["total_bytes"]),
                     fmt_bytes(m["forward_peak_bytes"]), fmt_bytes(m["backward_peak_bytes"]),
                     fmt_bytes(mc["forward_peak_bytes"]), fmt_bytes(mc["backward_peak_bytes"]),
                     "n/a" if ev is None else ev, f"{t['forward_median_s']:.3f}", f"{t['backward_median_s']:.3f}",
                     f"{t.get('forward_ratio_to_cp_cache', float('nan')):.2f}",
                     f"{t.get('backward_ratio_to_cp_cache', float('nan')):.2f}",
                     fmt_bytes(tr["forward_bytes"]), fmt_bytes(tr["backward_bytes"])])
    print(table(headers, rows))
