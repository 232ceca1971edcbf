"""Benchmarks of the CP attention path: ``python -m cp_cache bench``, one module per section
(``cli/bench/<section>.py``, each declaring its ``SECTION``: name, plan entries, rank or
in-process function, summary and plots), listed once in ``registry.py`` and run by
``driver.py``. Sections (``--only`` picks some):

"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from .registry import NAMES, SECTIONS

NAME = "bench"
HELP = "memory, overhead, traffic and accuracy benchmarks; JSON and a PNG plot under --out"

__doc__ = (__doc__ or "") + ";\n".join(
    textwrap.fill(f"* ``{s.name}``: {s.about}", width=96, subsequent_indent="  ", break_on_hyphens=False)
    for s in SECTIONS) + """.

Benchmarks measure and report; they assert nothing about timings. On CPU the
attention kernel is the emulator (plain torch), so kernel times are CPU times:
compare the host overheads with them only as orders of magnitude.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default results/)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (for tests)")
    p.add_argument("--only", nargs="+", choices=NAMES, help="run only these sections")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="CP world sizes (default 1 2 4)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the torch_kernel section on this machine's GPUs (under torchrun, NCCL)")


def run(args: argparse.Namespace) -> int:
    from .driver import run as run_sections

    return run_sections(args)
