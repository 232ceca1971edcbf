"""What demo and bench share: how ranks are launched, which device and ops they use, formatting."""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta
from typing import Any, Callable

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its variables)."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def npu_present() -> bool:
    """Whether torch_npu imports and sees an NPU. Never raises."""
    try:
        import torch
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())
    except Exception:  # noqa: BLE001 - a broken torch_npu counts as absent
        return False


def setup_ops() -> str:
    """Make the NPU attention ops available: the real ones on an NPU, else the CPU emulator.
    Returns "torch_npu" or "emulator"."""
    if npu_present():
        return "torch_npu"
    from ..emulator import install_npu_emulator

    return "emulator" if install_npu_emulator(route_sdpa=True) else "torch_npu"


def rank_device(rank: int):
    """The device of this rank: its NPU when present, else the CPU."""
    import torch

    if npu_present():
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.npu.set_device(local)
        return torch.device("npu", local)
    return torch.device("cpu")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0,
           backend: str | None = None) -> list | None:
    """Run ``fn(rank, world_size, *args)`` on every rank; the results by rank (None on ranks > 0
    under torchrun).

    Under torchrun the current process is one rank (hccl on an NPU, else gloo) and
    ``world_size`` is ignored in favour of WORLD_SIZE; otherwise ``world_size`` ranks are
    spawned on this machine (gloo over loopback).
    """
    if not under_torchrun():
        from ..testing.multiprocess import run_ranks

        return run_ranks(fn, world_size, *args, timeout=timeout, backend=backend or "gloo")
    import torch.distributed as dist

    backend = backend or ("hccl" if npu_present() else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        value = fn(rank, size, *args)
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
        return gathered
    finally:
        dist.destroy_process_group()


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path, dpi: int = 110) -> bool:
    """Lay out, write and close ``fig``; True: a figure was written."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return True


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


class Progress:
    """A plain-text progress bar on stderr (one line, redrawn)."""

    def __init__(self, total: int, label: str, width: int = 30, stream=None):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream or sys.stderr

    def update(self, done: int, note: str = "") -> None:
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {note}   ")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


@contextlib.contextmanager
def cp_session(mesh, policy: str = "handle", **config):
    """cp_cache enabled for one bench section (``config``: more of ``enable``'s arguments), inside
    a CP region on ``mesh`` (cp_cache takes the calls made in one); on exit disabled again, and
    torch's CP load-balancing option (which sections change between calls) as it was on entry."""
    import cp_cache
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    load_balance_before = _cp_options.enable_load_balance
    cp_cache.enable(policy=policy, **config)
    try:
        with cp_cache.context_parallel(mesh):
            yield
    finally:
        _cp_options.enable_load_balance = load_balance_before
        cp_cache.disable()
