"""The store micro-benchmark: ns per call of the step-cache store's operations from Python.

    python bench/bench_store.py [--number N] [--repeat R] [--out results/store_overhead.json]
"""

from cp_cache.cli.bench.store import main

if __name__ == "__main__":
    main()
