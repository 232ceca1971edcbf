"""The ranks' results put together, by W and system: each case's error against a dense float64
reference, the dropout check, memory, traffic and time (max over ranks, ratios to cp_cache)."""

from __future__ import annotations

from .catalogue import CASES, CP_CACHE, WRONG_ABOVE
from .inputs import case_spec, full_inputs


def summarise(plan: dict, per_world: dict[int, list[dict]]) -> dict:
    """``{str(W): {system: row}}`` from the results of every rank of every W."""
    results: dict = {}
    for world, ranks in per_world.items():
        references = _dense_references(plan, world)
        by_system = {name: _summarise_system(plan, world, [r["systems"][name] for r in ranks], references)
                     for name in plan["systems"]}
        _add_time_ratios(by_system)
        results[str(world)] = by_system
    return results


def _dense_references(plan: dict, world: int) -> dict:
    """Each case's output and gradients from dense float64 attention on the full sequence."""
    from ...testing.reference import dense_attention

    refs = {}
    for case in CASES:
        spec = case_spec(case, plan["cases"])
        q, k, v, dout = full_inputs(spec, world)
        refs[case["name"]] = dense_attention(q, k, v, dout, causal=spec["mask"] == "causal")
    return refs


def _summarise_system(plan: dict, world: int, entries: list[dict], references: dict) -> dict:
    """One system's row from its entries on every rank."""
    first = entries[0]
    row: dict = dict(seconds=max(e["seconds"] for e in entries))
    if "session_error" in first:
        row["session_error"] = first["session_error"]
        return row
    row["cases"] = _summarise_cases(plan, world, entries, references)
    drop = first["dropout"]
    if drop["status"] == "accepted":
        drop = dict(drop, stack_entries_left=[e["dropout"].get("stack_entries_left") for e in entries])
    row["dropout"] = drop
    if "memory" in first:
        row.update(_summarise_resources(entries))
    return row


def _summarise_cases(plan: dict, world: int, entries: list[dict], references: dict) -> dict:
    cases = {}
    for case in CASES:
        if case["name"] not in entries[0]["cases"]:
            continue
        spec = case_spec(case, plan["cases"])
        per_rank = [e["cases"][case["name"]] for e in entries]
        cases[case["name"]] = _summarise_case(spec, world, per_rank, references[case["name"]])
    return cases


def _summarise_case(spec: dict, world: int, per_rank: list[dict], reference: dict) -> dict:
    """Accepted on every rank: the errors of the gathered tensors; else the first refusal."""
    statuses = {p["status"] for p in per_rank}
    if statuses == {"accepted"}:
        errs = _errors(per_rank, spec, world, reference)
        worst = max(errs.values())
        return dict(status="accepted", errors=errs, max_error=worst, silently_wrong=worst > WRONG_ABOVE)
    p = next(p for p in per_rank if p["status"] != "accepted")
    summary = {k: v for k, v in p.items() if k not in ("pos", "local")}
    if len(statuses) > 1:
        summary["note"] = f"ranks disagree: {sorted(statuses)}"
    return summary


def _errors(per_rank: list[dict], spec: dict, world: int, reference: dict) -> dict:
    """Relative error of out, dq, dk, dv gathered from the ranks' positions, against the reference."""
    import torch

    from ...testing.reference import rel_err

    S = spec["s_local"] * world
    errors = {}
    for name in ("out", "dq", "dk", "dv"):
        heads = per_rank[0]["local"][name].size(1)
        full = torch.zeros(1, heads, S, spec["head_dim"], dtype=torch.float64)
        for r in per_rank:
            full[:, :, r["pos"]] = r["local"][name]
        errors[name] = rel_err(full, reference[name])
    return errors


def _summarise_resources(entries: list[dict]) -> dict:
    """Memory and traffic of rank 0 (all ranks kept too), eval leftovers, time (max over ranks)."""
    first = entries[0]
    return dict(
        memory={"no_checkpoint": first["memory"], "checkpoint": first["memory_checkpoint"],
                "no_checkpoint_all_ranks": [e["memory"] for e in entries],
                "checkpoint_all_ranks": [e["memory_checkpoint"] for e in entries]},
        eval_no_grad=first["eval"],
        traffic=first["traffic"],
        traffic_all_ranks=[e["traffic"] for e in entries],
        time=dict(
            forward_median_s=max(e["time"]["forward_median_s"] for e in entries),
            backward_median_s=max(e["time"]["backward_median_s"] for e in entries),
            per_rank=[e["time"] for e in entries],
            note="max over ranks of each rank's median"),
    )


def _add_time_ratios(by_system: dict) -> None:
    base = by_system.get(CP_CACHE, {}).get("time")
    for row in by_system.values():
        if base and "time" in row:
            row["time"]["forward_ratio_to_cp_cache"] = row["time"]["forward_median_s"] / base["forward_median_s"]
            row["time"]["backward_ratio_to_cp_cache"] = (row["time"]["backward_median_s"]
                                                         / base["backward_median_s"])
