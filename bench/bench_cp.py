"""The CP benchmarks (memory held between forward and backward, host overhead next to
torch's ring, bytes sent, numerical error, store cost, ...): the same as ``python -m cp_cache bench``.

    python bench/bench_cp.py [--out results] [--quick] [--only memory overhead calls traffic accuracy store]
"""

from __future__ import annotations

import sys

from cp_cache.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
