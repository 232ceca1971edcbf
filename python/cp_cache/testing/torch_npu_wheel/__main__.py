"""python -m cp_cache.testing.torch_npu_wheel fetch [--version V ...]"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .fetch import CACHE_DIR, CACHE_ENV, VERSIONS, fetch


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_cache.testing.torch_npu_wheel",
                                     description="Fetch torch-npu wheels' CP Python files for the CPU loader.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_fetch = sub.add_parser("fetch", help="download and extract (default: every supported version)")
    p_fetch.add_argument("--version", action="append", dest="versions", metavar="V",
                         help=f"a torch-npu version (repeatable; default {' '.join(VERSIONS)})")
    p_fetch.add_argument("--cache-dir", default=None, help=f"default {CACHE_DIR} (env {CACHE_ENV})")
    args = parser.parse_args(argv)
    status = 0
    for version in args.versions or VERSIONS:
        try:
            print(f"torch-npu {version}: {fetch(version, args.cache_dir)}")
        except (RuntimeError, OSError) as e:
            print(f"torch-npu {version}: FAILED: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
