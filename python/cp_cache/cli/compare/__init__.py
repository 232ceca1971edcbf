"""Side by side: the context-parallel (CP) attention systems an Ascend user can run, on the
same emulated NPU kernels (the CPU emulator of ``npu_fusion_attention_v3`` and its grad),
at W = 2 and 4 gloo ranks over loopback.

Systems:

* ``cp_cache`` (handle policy) and ``cp_cache-stack`` (stack policy): the v3 op on DTensors
  inside ``cp_cache.context_parallel(mesh)``;
* ``torch_npu 2.14.0``, ``torch_npu 2.13.0`` and ``torch_npu 2.12.0``: torch_npu's own CP handlers
  (2.14.0's CP files equal 2.13.0's but for ``version.py``), loaded from
  the wheels' Python files over the emulator (``cp_cache.testing.torch_npu_wheel``), called
  the same way inside torch's CP dispatcher;
* ``torch_npu 2.13.0 (guard lifted)``: 2.13.0 with its dropout refusal lifted *for this
  measurement only* (a monkeypatch, see ``patches.lift_dropout_guard``), to
  measure the gradients it would compute under dropout;
* ``torch ring (all-gather)`` / ``torch ring (all-to-all)``: torch's own
  ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with
  ``_cp_options.rotate_method`` ALL_GATHER / ALL_TO_ALL, driven on local tensors with a
  step wrapper (``systems.torch_ring``) around the emulator's v3 op.

Per system and W: (a) acceptance and error versus a dense float64 reference for layouts,
GQA, causal with and without load balancing, full attention, sparse_mode 1/2/3, and a
model-free directional-derivative check of the gradients under dropout; (b) peak bytes
during forward and backward (torch profiler memory events), bytes kept from forward to
backward (autograd's saved storages + cp_cache's store + torch_npu 2.12's stack), with and
without activation checkpointing, and stack entries left by eval forwards; (c) seconds per
forward and backward (medians) as a ratio to cp_cache; (d) bytes sent per rank per call.

Writes ``compare.json`` and ``compare.png`` under ``--out`` and prints tables. On CPU every
kernel is the emulator (plain torch): times compare the systems' structure, not NPU speed.
"""

# The modules, by concern: catalogue (systems, cases, thresholds), inputs, systems (one adapter
# family per module), patches (what is changed in torch.distributed, torch's CP options and
# torch_npu while measuring), correctness (a), memory (b, d), rank (what each rank runs, and c),
# summary (the ranks put together), report (JSON, tables) and plot (compare.png).

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .._common import launch, under_torchrun
from .catalogue import (
    CASES,
    CP_CACHE,
    CP_CACHE_STACK,
    DROPOUT_CASE,
    DROPOUT_ONLY,
    NPU_212,
    NPU_213,
    NPU_213_LIFTED,
    NPU_214,
    SYSTEMS,
    TORCH_A2A,
    TORCH_AG,
)
from .correctness import validate_directional_check
from .memory import validate_memory_helper
from .rank import compare_rank
from .report import build_report, publish

__all__ = ["NAME", "HELP", "add_arguments", "run", "SYSTEMS", "CASES", "DROPOUT_CASE", "DROPOUT_ONLY", "CP_CACHE",
           "CP_CACHE_STACK", "NPU_214", "NPU_213", "NPU_213_LIFTED", "NPU_212", "TORCH_AG", "TORCH_A2A"]

NAME = "compare"
HELP = "cp_cache vs torch_npu 2.14.0 / 2.13.0 / 2.12.0 vs torch's ring: correctness, memory, time, traffic (JSON + PNG)"

# ---------------------------------------------------------------- command line


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text!r}") from None
    if value < 2 or value > 16:
        raise argparse.ArgumentTypeError(f"must be between 2 and 16 (ranks spawned on this machine), got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results/compare"),
                   help="results folder for compare.json and compare.png (default results/compare)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, W=2 only, one repeat (for tests)")
    p.add_argument("--worlds", type=_world_size, nargs="+", default=None,
                   help="CP world sizes (default 2 4; --quick: 2)")
    p.add_argument("--repeats", type=_positive, default=None,
                   help="timed forward+backward repeats per system after one warm-up (default 3; --quick: 1)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None, metavar="SYSTEM",
                   help="run only these systems (default all: " + ", ".join(repr(s) for s in SYSTEMS) + ")")
    p.add_argument("--timeout", type=_positive, default=None,
                   help="seconds allowed per world size (default 900; --quick: 240)")


def _plan(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    if quick:
        plan = dict(worlds=[2], cases=dict(heads=4, s_local=16, head_dim=8),
                    resources=dict(batch=1, heads=2, seq=256, head_dim=16), repeats=1, warmup=0, directions=2,
                    timeout=240)
    else:
        plan = dict(worlds=[2, 4], cases=dict(heads=4, s_local=32, head_dim=16),
                    resources=dict(batch=1, heads=8, seq=4096, head_dim=64), repeats=3, warmup=0, directions=4,
                    timeout=900)
    if args.worlds:
        plan["worlds"] = sorted(set(args.worlds))
    if under_torchrun():  # the launcher fixed the world size
        plan["worlds"] = [int(os.environ["WORLD_SIZE"])]
    if args.repeats:
        plan["repeats"] = args.repeats
    if args.timeout:
        plan["timeout"] = args.timeout
    plan["systems"] = [s for s in SYSTEMS if s in (args.systems or SYSTEMS)]
    plan["quick"] = quick
    # the finite-difference step of the dropout check: with fp32 kernels eps = 1e-2 leaves
    # rounding noise of 1e-3..6e-3 (too close to the 1e-2 threshold); 1e-1 gives ~1e-4
    plan["eps"] = 1e-1
    plan["keep_prob"] = DROPOUT_CASE["keep_prob"]
    seq = plan["resources"]["seq"]
    for w in plan["worlds"]:
        if seq % (2 * w):
            raise SystemExit(f"compare: --worlds {w}: the sequence length {seq} must divide by 2*W = {2 * w}")
    return plan



def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    started = time.perf_counter()
    print(f"compare: systems {', '.join(plan['systems'])}; W = {plan['worlds']}", flush=True)
    validation = dict(directional_check=validate_directional_check(plan), memory_helper=validate_memory_helper())
    per_world = _run_worlds(plan)
    if per_world is None:
        return 0  # torchrun rank > 0
    publish(build_report(plan, per_world, validation, started), args.out)
    return 0


def _run_worlds(plan: dict) -> dict[int, list[dict]] | None:
    """Every rank's results for each W of the plan; None on a torchrun rank > 0."""
    per_world = {}
    for world in plan["worlds"]:
        t0 = time.perf_counter()
        print(f"compare: W={world} ...", flush=True)
        ranks = launch(compare_rank, world, plan, timeout=float(plan["timeout"]))
        if ranks is None:
            return None
        per_world[world] = ranks
        print(f"compare: W={world} took {time.perf_counter() - t0:.1f} s", flush=True)
    return per_world
