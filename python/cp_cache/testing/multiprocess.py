"""Run a function on several ranks, each in its own new process, over loopback.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (start
method ``START_METHOD``: "spawn", or "forkserver"), each initialises ``torch.distributed``
with a TCP store on 127.0.0.1, calls ``fn(rank, world_size, *args)`` and sends its return
value back (pickled, so tensors are copied, not shared). ``fn`` must be importable by
name (a module-level function). Any failing rank or the overall timeout kills
the rank processes this call started and raises RuntimeError with every
rank's traceback.

A spawned rank imports torch and cp_cache afresh (seconds of CPU each); with "forkserver"
every rank is forked from one server process that imported ``FORKSERVER_PRELOAD`` once (and
nothing else: each rank is still a new process, with that server's environment). The test
suite uses "forkserver" (tests/python/conftest.py); the default stays "spawn".
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["run_ranks", "free_port", "capture", "cp_region", "START_METHOD", "FORKSERVER_PRELOAD"]

log = logging.getLogger("cp_cache")

_LOOPBACK = "127.0.0.1"

START_METHOD = "spawn"  # or "forkserver"
# what the forkserver imports once for every rank it forks (only modules every rank imports anyway)
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "cp_cache", "cp_cache.emulator",
                      "cp_cache.testing.multiprocess", "cp_cache.testing.reference")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


def _rank_main(fn, rank: int, world_size: int, port: int, backend: str, timeout: float, args, results,
               pg_timeout: float | None = None) -> None:
    # keep gloo on the loopback interface
    if os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["MASTER_ADDR"] = _LOOPBACK
    os.environ["MASTER_PORT"] = str(port)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{_LOOPBACK}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout if pg_timeout is None else pg_timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        payload = ("ok", rank, pickle.dumps(value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", rank, traceback.format_exc())
    results.put(payload)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    pg_timeout: float | None = None,
    expect_dead: tuple[int, ...] = (),
    start_method: str | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; their results by rank.

    ``timeout``: the whole run's deadline; ``pg_timeout``: the process group's timeout (how
    long a rank's collective or receive waits for its peers), ``timeout`` when None;
    ``expect_dead``: ranks that are meant to die without a result (a test killing a rank):
    their slot is None, and the others must still answer; ``start_method``: "spawn" or
    "forkserver" (None: ``START_METHOD``)."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    method = start_method or START_METHOD
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method={method!r}: use 'spawn' or 'forkserver'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the server starts (the first call)
    results = ctx.Queue()
    port = free_port()
    procs = []
    for r in range(world_size):
        p = ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, port, backend, timeout, args, results, pg_timeout),
            name=f"cp_cache-rank{r}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    log.debug("run_ranks: started %s on %d ranks (port %d, pids %s)",
              getattr(fn, "__name__", fn), world_size, port, [p.pid for p in procs])

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    reason = None
    try:
        while len(values) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = f"timed out after {timeout:.0f} s"
                break
            try:
                kind, rank, data = results.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [
                    p for r, p in enumerate(procs)
                    if r not in values and r not in errors and not p.is_alive()
                ]
                if dead:
                    # give a queued message a moment to arrive before declaring the rank lost
                    try:
                        kind, rank, data = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        for p in dead:
                            r = procs.index(p)
                            if r in expect_dead:
                                values[r] = None
                                continue
                            errors[r] = (
                                f"rank {r} (pid {p.pid}) exited with code {p.exitcode} without a result "
                                "(it died before running fn, e.g. while importing; see its stderr)"
                            )
                        continue
                else:
                    continue
            if kind == "ok":
                values[rank] = pickle.loads(data)
            else:
                errors[rank] = data
                # other ranks are likely blocked on this one: collect briefly, then stop
                deadline = min(deadline, time.monotonic() + 3.0)
                reason = reason or f"rank {rank} failed"
    finally:
        for p in procs:
            p.join(timeout=5.0 if reason is None else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()

    if errors or reason is not None or len(values) < world_size:
        lines = [f"run_ranks({getattr(fn, '__name__', fn)}, world_size={world_size}): {reason or 'ranks failed'}"]
        for r in range(world_size):
            if r in errors:
                lines.append(f"--- rank {r} ---\n{errors[r]}")
            elif r not in values:
                lines.append(f"--- rank {r} --- no result (killed or hung)")
        raise RuntimeError("\n".join(lines))
    return [values[r] for r in range(world_size)]


def capture(fn) -> tuple[str, str]:
    """(exception type name, message) of ``fn()``, or ("no error", ""): what a rank reports
    of a call meant to fail on every rank."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return type(exc).__name__, str(exc)
    return "no error", ""


@contextlib.contextmanager
def cp_region(world_size: int):
    """A CP region over a 1-D CPU mesh of the whole world, for rank workers that call the
    attention ops on sequence-sharded DTensors themselves: cp_cache serves such calls only
    inside a CP region (its handlers decide from the DTensors' placements, whatever mesh the
    region names)."""
    import cp_cache
    from torch.distributed.device_mesh import init_device_mesh

    with cp_cache.context_parallel(init_device_mesh("cpu", (world_size,))):
        yield
