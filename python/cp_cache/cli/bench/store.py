"""Cost of the store's operations seen from Python, in ns per call (the ``store`` section
of ``python -m cp_cache bench``; also ``python bench/bench_store.py``).

Method: timeit over N calls of each operation, best of R repeats, minus the
cost of an empty Python call of the same shape (measured the same way)."""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path

from ... import _C
from .shared import Section


def measure(stmt, setup_globals, number: int, repeat: int) -> float:
    timer = timeit.Timer(stmt, globals=setup_globals)
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e9


def run(number: int = 200_000, repeat: int = 5) -> dict:
    store = _C.StepCacheStore()
    cache = store.create()
    handle = store.attach(store.create())

    def noop(_=None):
        return None

    env = {"store": store, "cache": cache, "handle": handle, "noop": noop}
    baseline = measure("noop(cache)", env, number, repeat)
    results = {
        "create+attach+drop": measure("store.attach(store.create())", env, number, repeat),
        "resolve": measure("store.resolve(handle)", env, number, repeat),
        "push+pop": measure("store.push(cache); store.pop()", env, number, repeat),
        "push+pop(expected_id)": measure(
            "store.push(cache); store.pop(cache.id)", env, number, repeat
        ),
        "stats": measure("store.stats()", env, number // 10, repeat),
    }
    return {
        "method": f"timeit, best of {repeat} x {number} calls, ns per call; "
        "baseline = an empty Python call with one argument",
        "baseline_ns": round(baseline, 1),
        "ns_per_call": {name: round(value, 1) for name, value in results.items()},
    }


def print_store(report: dict) -> None:
    print("\nstore (ns per call): " + ", ".join(f"{k} {v}" for k, v in report["store"]["ns_per_call"].items()))


SECTION = Section(
    name="store",
    about="the store micro-benchmark: ns per call of the step-cache store's operations from Python",
    quick=dict(store=dict(number=2000, repeat=2)),
    full=dict(store=dict(number=100_000, repeat=5)),
    local=lambda plan: run(plan["store"]["number"], plan["store"]["repeat"]),
    summary=print_store,
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/store_overhead.json"))
    args = parser.parse_args(argv)
    result = run(args.number, args.repeat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
