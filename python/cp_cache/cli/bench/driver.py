"""What runs the bench sections of the registry: the plan, the ranks, the report, its files."""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

from .._common import fmt_bytes, launch, pyplot, save_figure
from .registry import SECTIONS, by_name
from .shared import Section, collect, common_plan

__all__ = ["plan_for", "run", "bench_rank"]


def plan_for(quick: bool, worlds: list[int] | None) -> dict:
    """The common entries and every section's own (all sections', whichever run: the JSON
    records one plan)."""
    plan = common_plan(quick, worlds)
    for section in SECTIONS:
        entries = section.quick if quick else section.full
        clash = set(entries) & set(plan)
        assert not clash, f"bench section {section.name}: plan entries {sorted(clash)} already taken"
        plan.update(entries)
    return plan


def run(args: argparse.Namespace) -> int:
    sections = by_name(args.only or [s.name for s in SECTIONS])
    plan = plan_for(args.quick, args.worlds)
    plan["device"] = getattr(args, "device", "cpu")
    if plan["device"] == "cuda" and [s.name for s in sections] != ["torch_kernel"]:
        raise SystemExit("bench --device cuda runs the torch_kernel section only (the others time the NPU op or "
                         "its CPU emulator): add --only torch_kernel")
    started = time.perf_counter()
    per_world = _run_ranks(plan, [s for s in sections if s.on_ranks])
    if per_world is None:
        return 0  # torchrun rank > 0
    report = _report(args, plan, per_world)
    for section in sections:
        if section.on_ranks:
            report[section.report_key] = collect(per_world, section.report_key, all_ranks=section.all_ranks)
        else:
            print(f"bench: {section.name} (in this process) ...", flush=True)
            report[section.report_key] = section.local(plan)
        if section.derived is not None:
            report.update(section.derived(plan, report[section.report_key]))
    report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    _publish(report, args.out, sections)
    return 0


def _run_ranks(plan: dict, sections: list[Section]) -> list[list[dict]] | None:
    """Every rank's results for each W where one of ``sections`` runs; None on a torchrun rank > 0."""
    per_world = []
    for world_size in plan["worlds"]:
        names = [s.name for s in sections if s.runs_at(plan, world_size)]
        if not names:
            continue
        print(f"bench: W={world_size} ({', '.join(names)}) ...", flush=True)
        results = launch(bench_rank, world_size, plan, names, timeout=900.0,
                         backend="nccl" if plan["device"] == "cuda" else None)
        if results is None:
            return None
        per_world.append(results)
    return per_world


def bench_rank(rank: int, world_size: int, plan: dict, names: list[str]) -> dict:
    """One rank of one W: the rows of each named section that runs at this W, under its report key."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from .._common import rank_device, setup_ops

    ops = setup_ops() if plan.get("device") != "cuda" else "torch"
    device = rank_device(rank) if plan.get("device") != "cuda" else torch.device("cuda")
    mesh = init_device_mesh(device.type, (world_size,))
    out = dict(rank=rank, world_size=world_size, ops=ops, torch=torch.__version__)
    for section in by_name(names):
        if section.runs_at(plan, world_size):
            out[section.report_key] = section.rank(plan, rank, world_size, mesh)
    return out


def _report(args: argparse.Namespace, plan: dict, per_world: list[list[dict]]) -> dict:
    """The report before the sections' rows: meta, torch_npu's formula and its entry at a large shape."""
    from .._shapes import FORMULA

    return dict(
        meta=dict(
            python=platform.python_version(), machine=platform.machine(),
            torch=per_world[0][0]["torch"] if per_world else None,
            ops=per_world[0][0]["ops"] if per_world else None, quick=args.quick, plan=plan,
            note="CPU timings with the emulator kernel",
        ),
        torch_npu_formula=FORMULA,
        torch_npu_reference_shapes=_reference_shapes(),
    )


def _reference_shapes() -> dict:
    """torch_npu's entry at a large-model shape (computed, not measured)."""
    from .._shapes import torch_npu_entry_bytes

    b, n, seq, d, w, layers = 1, 32, 131072, 128, 8, 32
    entry = torch_npu_entry_bytes(b, n, seq // w, d, 2, w)
    return dict(shapes=f"B={b}, N={n}, S={seq} over W={w} (S_local={seq // w}), D={d}, bf16",
                layers=layers, per_layer=entry["total"], model=entry["total"] * layers, parts=entry)


def _publish(report: dict, out: Path, sections: list[Section]) -> None:
    """Write bench.json and the plots under ``out`` and print the summary."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(report, indent=2))
    written = []
    for section in sections:
        if section.summary is not None:
            section.summary(report)
        for name, draw in section.plots:
            if draw(report, out / name):
                written.append(out / name)
    ref = report["torch_npu_reference_shapes"]
    print(f"\ntorch_npu's original entry at {ref['shapes']}: {fmt_bytes(ref['per_layer'])} per layer, "
          f"{fmt_bytes(ref['model'])} for {ref['layers']} layers (computed)")
    png_path = out / "bench.png"
    panels = [draw for section in sections for draw in section.panels]
    if panels and _plot_panels(report, panels, png_path):
        written.append(png_path)
    print(f"\nwritten: {json_path}")
    for path in written:
        print(f"written: {path}")
    if pyplot() is None:
        print("no plots (matplotlib missing: run make build)")
    print(f"bench took {report['meta']['seconds']:.1f} s")


def _plot_panels(report: dict, panels: list, path: Path) -> bool:
    """bench.png: the panels of the sections run, two a row."""
    plt = pyplot()
    if plt is None:
        return False
    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), squeeze=False)
    for ax, draw in zip(axes.flat, panels):
        draw(ax, report)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("cp_cache benchmarks (" + ("quick, " if report["meta"]["quick"] else "")
                 + f"torch {report['meta']['torch']}, {report['meta']['ops']} ops)")
    return save_figure(fig, path)
