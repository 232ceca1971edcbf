"""Benchmarks of the CP attention path: ``python -m cp_cache bench``, one module per section
(``cli/bench/<section>.py``, each declaring its ``SECTION``: name, plan entries, rank or
in-process function, summary and plots), listed once in ``registry.py`` and run by
``driver.py``. ``DESCRIPTION`` is what ``bench --help`` shows a user: a line per section."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from .registry import NAMES, SECTIONS

NAME = "bench"
HELP = "memory, overhead, traffic and accuracy benchmarks; JSON and a PNG plot under --out"

# a line per section for --help (a section without one shows the start of its own description)
SUMMARIES = {
    "memory": "step-cache bytes kept from forward to backward per layer, beside torch_npu's",
    "overhead": "host time per attention call beside torch's ring on the same kernel",
    "calls": "bytes one causal call sends per rank, against the lower bound",
    "traffic": "K/V bytes received per call for causal, windows, masks, packed documents",
    "sequences": "bytes per call for a sequence of different calls on one CP group",
    "accuracy": "error against float64 in fp32, bf16 and fp16, against the world size",
    "windows": "sliding windows: bytes and time per call against the window size",
    "floor": "what one call keeps from forward to backward, against output + LSE",
    "overlap": "time computing and waiting on receives, per call",
    "agreement": "the ranks' agreement before each call, in microseconds",
    "varlen": "packed documents: work per rank for each sharding, time per call",
    "placement": "where packed documents go: tokens, work and K/V traffic per rank, W = 2 to 64",
    "algorithms": "ring, Ulysses and hybrid: bytes, time, error, and what auto picks",
    "models": "a gpt-oss-shaped model's attention: bytes, time, error per layer kind",
    "packed_models": "a packed Gemma-3-shaped step: peak memory beside the unpacked one",
    "torch_kernel": "torch's fused kernels: efficiency beside one process and torch's ring",
    "mixers": "recurrent mixer layers (Gated DeltaNet) under CP beside one process",
    "store": "the native store's operations, ns per call",
}


def _summary(section) -> str:
    if section.name in SUMMARIES:
        return SUMMARIES[section.name]
    first = re.split(r"[:;(]", section.about)[0].replace("``", "").strip().rstrip(",")
    return first if len(first) <= 72 else first[:72].rsplit(" ", 1)[0] + " ..."


DESCRIPTION = "\n".join([
    "Benchmarks of the CP attention path: JSON and PNG plots under --out (default results/).", "",
    "sections (all by default; --only picks some):",
    *(f"  {s.name:<14} {_summary(s)}" for s in SECTIONS), "",
    "Benchmarks measure and report; they assert nothing about timings. On CPU the kernel times are CPU",
    "times: compare host overheads with them only as orders of magnitude. Pages: docs/benchmarks.md."])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default results/)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (for tests)")
    p.add_argument("--only", nargs="+", choices=NAMES, metavar="SECTION", help="run only these sections (above)")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="CP world sizes (default 1 2 4)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the torch_kernel section on this machine's GPUs (under torchrun, NCCL)")


def run(args: argparse.Namespace) -> int:
    from .driver import run as run_sections

    return run_sections(args)
