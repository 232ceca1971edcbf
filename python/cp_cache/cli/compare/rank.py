"""What one rank runs: every system of the plan in turn (cases, dropout check, resources), then
the timed rounds."""

from __future__ import annotations

import logging
import statistics
import time

from .catalogue import CASES, DROPOUT_CASE, DROPOUT_ONLY
from .correctness import refusal, run_case, run_dropout
from .inputs import case_spec, mask_for, resource_inputs
from .memory import resources
from .patches import set_load_balance
from .systems import make_system

log = logging.getLogger("cp_cache")


def compare_rank(rank: int, world: int, plan: dict) -> dict:
    """Every system of ``plan`` on this rank: cases, dropout check, resources, time."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ...emulator import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    result: dict = dict(rank=rank, world=world, torch=torch.__version__, systems={})
    for name in plan["systems"]:
        result["systems"][name] = _measure_system(name, mesh, plan, rank, world)
    _time_in_rounds(result["systems"], mesh, plan, rank, world)
    set_load_balance(True)
    return result


def _measure_system(name: str, mesh, plan: dict, rank: int, world: int) -> dict:
    """(a) the cases and the dropout check, (b, d) resources of one system, in its own session;
    a system that cannot even start is reported (with what it measured before)."""
    system = make_system(name, mesh)
    started = time.perf_counter()
    entry: dict = {}
    try:
        with system.session():
            cases = {}
            if name not in DROPOUT_ONLY:
                for case in CASES:
                    cases[case["name"]] = run_case(system, case_spec(case, plan["cases"]), rank, world)
            entry["cases"] = cases
            entry["dropout"] = run_dropout(system, case_spec(DROPOUT_CASE, plan["cases"]), rank, world, plan)
            if name not in DROPOUT_ONLY:
                entry.update(resources(system, plan, rank, world))
    except Exception as e:  # noqa: BLE001 - a system that cannot even start is reported
        log.exception("compare: %s failed on rank %d", name, rank)
        entry["session_error"] = refusal(e)
    finally:
        set_load_balance(True)
    entry["seconds"] = round(time.perf_counter() - started, 2)
    log.info("compare W=%d rank %d: %s took %.1f s", world, rank, name, entry["seconds"])
    return entry


def _time_in_rounds(by_system: dict, mesh, plan: dict, rank: int, world: int) -> None:
    """(c) time, into ``by_system[name]["time"]``: rounds over the systems (one call each per
    round), so that a change in the machine's load during the run spreads over every system
    instead of a few."""
    timed = [n for n in plan["systems"] if n not in DROPOUT_ONLY and "session_error" not in by_system[n]]
    inputs = resource_inputs(plan, rank, world)
    samples = {n: ([], []) for n in timed}
    for _ in range(plan["repeats"]):
        for name in timed:
            system = make_system(name, mesh)
            with system.session():
                f, b = _timed_call(system, inputs)
            samples[name][0].append(f)
            samples[name][1].append(b)
    for name, (fwd, bwd) in samples.items():
        by_system[name]["time"] = dict(forward_s=fwd, backward_s=bwd, forward_median_s=statistics.median(fwd),
                                       backward_median_s=statistics.median(bwd))


def _timed_call(system, inputs) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one call at the resource shape, ranks started together."""
    import torch.distributed as dist

    q, k, v, dout, spec = inputs
    set_load_balance(True)
    mask = mask_for(spec, 0)
    for t in (q, k, v):
        t.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    o = system.attention(q, k, v, spec, mask)
    t1 = time.perf_counter()
    o.backward(dout)
    t2 = time.perf_counter()
    system.clear_stack()
    return t1 - t0, t2 - t1
