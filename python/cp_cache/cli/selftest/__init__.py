"""Check every CP algorithm and feature on this machine's devices against one-device attention.

The first command to run on a new cluster. Launched by torchrun it runs in the launched
processes on whatever they find: NPUs with torch_npu (hccl), CUDA GPUs with torch's fused kernels
(the "torch" step kernel, nccl), else CPUs with the emulator (gloo). Not launched, it spawns ``--ranks`` CPU
ranks (default 2, gloo on loopback) twice: the path a user of this machine gets without an NPU (cp_cache's op on
the "torch" kernel; dropout n/a on CPU), then the NPU path over the emulator.

Every case runs through the public API (``cp_cache.enable(algorithm=...)``,
``torch.ops.npu.npu_fusion_attention_v3`` on DTensors laid out by ``shard_sequence`` /
``shard_documents``) at the launched world size, forward and backward. Its output, LSE and
gradients, gathered back on the full sequence, are compared with dense attention in float64;
the bound is 20x the error of the same attention on one device in float32 (the op on plain
tensors; on CUDA dense torch), measured in the same run, plus 32 eps. Dropout is checked by
directional derivatives, and its output must differ from the dropout-free one. Each row also reports the time per call (forward + backward) and the
forward's bytes sent against the least K/V traffic of the layout. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

from .._common import under_torchrun
from .cases import Case, cases, hybrid_sizes
from .checks import Row, selftest_rank
from .environment import pick_device
from .problems import kv_lower_bound, make_problem
from .report import LEGEND, report, verdict

__all__ = ["NAME", "HELP", "add_arguments", "run", "Case", "Row", "cases", "hybrid_sizes", "make_problem",
           "kv_lower_bound", "verdict", "report"]

NAME = "selftest"
HELP = "check every algorithm and feature on this machine's devices against one-device attention; exit 1 on failure"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks spawned when not launched by torchrun (default "
                   "2; 4 or more also runs hybrid)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case after the checked one (default 3)")
    p.add_argument("--cases", default="", metavar="TEXT",
                   help="run only the cases whose name contains TEXT (default: all)")
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)  # the failing verdict's test


def _launched(fn, kind: str, opts: dict) -> list | None:
    """Run ``fn`` in this torchrun process: hccl on NPUs, nccl on CUDA, gloo on CPUs; every
    rank's result on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    backend = {"npu": "hccl", "cuda": "nccl"}.get(kind, "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if kind == "npu":
        import torch_npu  # noqa: F401

        torch.npu.set_device(local)
    elif kind == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, timeout=timedelta(seconds=600))
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        value = fn(rank, size, kind, opts)
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
        return gathered
    finally:
        dist.destroy_process_group()


PATHS = {"npu": "NPUs, torch_npu's op", "cuda": "CUDA GPUs, torch's fused kernels",
         "torch": "torch's fused kernels through cp_cache's op: what SDPA and transformers get without an NPU",
         "cpu": "the NPU path, its ops emulated on CPU"}


def run(args: argparse.Namespace) -> int:
    from ...testing.multiprocess import run_ranks

    launched = under_torchrun()
    opts = dict(inject=args.inject_error, repeats=args.repeats, cases=args.cases)
    started = time.perf_counter()
    if launched:
        kind = pick_device(True)
        results = {kind: _launched(selftest_rank, kind, opts)}
        if results[kind] is None:
            return 0
    else:  # this machine's CPU ranks: the path a user without an NPU gets, then the NPU path emulated
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # spawned CPU ranks: no torch_npu
        results = {kind: run_ranks(selftest_rank, args.ranks, kind, opts, timeout=900.0) for kind in ("torch", "cpu")}
    first = next(iter(results.values()))[0]
    how = "torchrun" if launched else "spawned, gloo on loopback"
    print(f"cp_cache selftest: {len(next(iter(results.values())))} ranks on {first['device']}, torch {first['torch']}, "
          f"{how}; {len(results)} path{'s' if len(results) > 1 else ''}")
    print(LEGEND)
    verdicts = []
    for number, (kind, ranks) in enumerate(results.items(), 1):
        info = ranks[0]
        print(f"path {number}: {PATHS[kind]} ({info['ops']} attention ops, {info['kernel']} step kernel)")
        print(report(info["rows"]) + "\n")
        verdicts.append(verdict(info["rows"], len(ranks), info))
    for ok, text in verdicts:
        print(f"verdict: {text}")
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0 if all(ok for ok, _ in verdicts) else 1
