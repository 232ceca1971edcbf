"""The ``overhead`` section of ``python -m cp_cache bench``: host overhead per attention call,
cp_cache next to torch's own ring, forward and backward, at tiny shapes where the kernels cost
little and the code around them shows.

Causal attention with torch's head-tail load balancing on, B=1, N=2 heads, 8 tokens per rank,
D=8, float32, the emulator's ``npu_fusion_attention_v3`` / ``npu_fusion_attention_grad_v3`` as
the kernel everywhere, at each W > 1 of the run. Four systems, measured in the same run on the
same ranks, their calls interleaved:

* ``cp_cache``: the v3 op on DTensors ``Shard(2)`` inside ``cp_cache.context_parallel(mesh)``
  with ``cp_cache.enable(policy="handle", fused_merge=False)`` (step results merged in float32
  with plain torch ops, as torch's ring merges them: the fused merge is an NPU kernel, and its
  CPU stand-in would count as host overhead here) and ``npu_ops.causal_arguments``; backward through
  ``out.to_local().backward(dy)`` (``to_local`` taken before the backward's clock starts);
* ``torch_ring``: torch's ``_templated_ring_attention`` (and its backward) driving the same
  kernel (``compare/systems/torch_ring.py``'s ``TorchRing``), ``_cp_options.enable_load_balance``
  on, as it was afterwards;
* ``kernels``: the kernel calls alone that a W-rank head-tail causal ring makes on this rank
  (step 0 causal over the local block; step i <= rank all queries against the K/V head, step
  i > rank the query tail against the whole K/V block; the backward likewise), no
  communication and no merges;
* ``dtensor_floor``: the same call as ``cp_cache``, served by handlers that only wrap again the
  results of its first real call (no ring, no kernel, no check): what serving the op on DTensors
  costs any handler (the op's autograd, DTensor's dispatch to the handler table, the results
  wrapped). torch's ring called directly pays none of it;
* ``torch_npu``: the same call served by torch_npu's own CP handlers (the newest torch-npu
  release whose handlers run on this torch and whose files are fetched: ``make torch-npu-wheels``;
  absent otherwise), loaded over the emulator (``testing/torch_npu_wheel``) with cp_cache
  disabled: torch's ring behind a DTensor handler, as Ascend users run it today. It pays the
  DTensor floor as cp_cache does. Timed after the other four (loading it patches torch's CP
  dispatcher), on the same ranks in the same run.

Per system and direction, the median seconds per call over ``repeats`` calls after ``warmup``,
each direction timed after a ``torch.distributed.barrier()``, with
``torch.autograd.set_multithreading_enabled(False)`` (the backward on the calling thread).
``overhead`` = time per call - the kernels' time in the same direction; ``ratio`` = cp_cache's
overhead / torch's ring's; ``ratio_beyond_floor`` = (cp_cache's overhead - the DTensor floor) /
torch's ring's overhead: what cp_cache adds beyond serving a DTensor call; ``ratio_vs_torch_npu``
= cp_cache's overhead / torch_npu's (``torch_npu_version``; None without it). The same from the
calling thread's CPU time (``*_cpu_us``, ``*_cpu_overhead_us``, ``cpu_ratio``,
``cpu_ratio_beyond_floor``): the host's own work, without the time blocked on the other ranks,
which on 2 shared cores swings by milliseconds with scheduling and on an accelerator is the
device's wait, not the host's (there only the agreement blocks the host).
Rank 0's figures. Also ``bench_overhead.png``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .._common import cp_session, pyplot, save_figure, table
from .shared import Section, several_ranks

__all__ = ["SECTION", "SYSTEMS", "torch_npu_release"]

SYSTEMS = ("cp_cache", "torch_ring", "kernels", "dtensor_floor")  # timed interleaved; then torch_npu
DIRECTIONS = ("forward", "backward")


@dataclass
class _System:
    """One way of running the call: ``prepare()`` (untimed) gives the forward's inputs,
    ``forward(inputs)`` and ``backward(settled)`` are timed, ``settle(out)`` (untimed) turns the
    forward's output into what the backward starts from, ``finish()`` (untimed) ends the pair."""

    prepare: Callable[[], Any]
    forward: Callable[[Any], Any]
    settle: Callable[[Any], Any]
    backward: Callable[[Any], None]
    finish: Callable[[], None] = lambda: None


def _dtensor_call(local: list, dy, mesh, heads: int, scale: float) -> _System:
    """The v3 op on DTensors ``Shard(2)``: served by the handler in DTensor's table (cp_cache's
    inside ``cp_session``, torch_npu's inside its session)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from ...npu_ops import causal_arguments

    causal = causal_arguments("cpu")

    def prepare():
        for t in local:
            t.grad = None
        return [DTensor.from_local(t, mesh, [Shard(2)]) for t in local]

    def forward(inputs):
        return torch.ops.npu.npu_fusion_attention_v3(*inputs, heads, "BNSD", scale=scale, **causal)[0]

    # torch_npu 2.12.0's handler returns plain tensors
    return _System(prepare, forward, lambda out: out.to_local() if isinstance(out, DTensor) else out,
                   lambda out: out.backward(dy))


def _dtensor_floor(local: list, dy, mesh, heads: int, scale: float) -> _System:
    """The same call as ``_cp_cache``, served by handlers that only wrap again the results of the
    first real call (cp_cache's), without reading the call: no ring, no kernel, no check, no
    agreement. What remains is what serving the op on DTensors costs any handler: the op's
    autograd, DTensor's dispatch to the handler table, the results wrapped as DTensors."""
    import torch
    from torch.distributed.tensor import DTensor

    ops = (torch.ops.npu.npu_fusion_attention_v3.default, torch.ops.npu.npu_fusion_attention_grad_v3.default)
    served, recorded = {}, {}
    table = lambda: DTensor._op_dispatcher._custom_op_handlers  # noqa: E731 - the live one (enable() may replace it)

    def replaying(op):
        def handler(op_call, args, kwargs):
            if op not in recorded:
                recorded[op] = served[op](op_call, args, kwargs)
            return tuple(DTensor(r._local_tensor, r._spec, requires_grad=False) if isinstance(r, DTensor)
                         else r.detach() for r in recorded[op])
        return handler

    replay = {op: replaying(op) for op in ops}
    call = _dtensor_call(local, dy, mesh, heads, scale)

    def prepare():
        served.update((op, table()[op]) for op in ops)
        table().update(replay)
        return call.prepare()

    return _System(prepare, call.forward, call.settle, call.backward, finish=lambda: table().update(served))


def torch_npu_release() -> Optional[str]:
    """The newest torch-npu release whose CP handlers run on this torch and whose files are
    fetched (the same on every rank of one machine); None where there is none."""
    from ...testing.torch_npu_wheel import VERSIONS, cp_strategy_breaks_on_this_torch, wheel_root

    for version in VERSIONS:
        try:
            wheel_root(version)
        except FileNotFoundError:
            continue
        if not cp_strategy_breaks_on_this_torch(version):
            return version
    return None


def _torch_npu_session(mesh, version: str):
    """torch_npu ``version``'s CP handlers in torch's CP dispatcher, cp_cache disabled (compare's system)."""
    from ..compare.catalogue import DROPOUT_ONLY, TORCH_NPU_RELEASES
    from ..compare.systems.torch_npu import TorchNpuSystem

    name = next(n for n, v in TORCH_NPU_RELEASES.items() if v == version and n not in DROPOUT_ONLY)
    return TorchNpuSystem(mesh, name).session()


def _torch_ring(local: list, dy, mesh, scale: float) -> _System:
    from ..compare.systems.torch_ring import _torch_ring_function

    ring, group = _torch_ring_function(), mesh.get_group()

    def prepare():
        for t in local:
            t.grad = None
        return local

    return _System(prepare, lambda inputs: ring.apply(*inputs, group, True, scale), lambda out: out,
                   lambda out: out.backward(dy))


def _kernels(local: list, dy, rank: int, world_size: int, scale: float) -> _System:
    """The step kernels of torch's head-tail causal ring on this rank, on views made up front."""
    from ..compare.systems.torch_ring import _ring_step_backward, _ring_step_forward

    q, k, v = (t.detach() for t in local)
    out, lse = _ring_step_forward(q, k, v, is_causal=True, scale=scale)
    head, tail = (lambda t: t.chunk(2, dim=2)[0]), (lambda t: t.chunk(2, dim=2)[1])
    steps = [dict(query=q, key=k, value=v, out=out, logsumexp=lse, grad_out=dy, is_causal=True)]
    for i in range(1, world_size):
        if i <= rank:  # all queries against the K/V head
            steps.append(dict(query=q, key=head(k), value=head(v), out=out, logsumexp=lse, grad_out=dy,
                              is_causal=False))
        else:  # the query tail against the whole K/V block
            steps.append(dict(query=tail(q), key=k, value=v, out=tail(out), logsumexp=tail(lse).contiguous(),
                              grad_out=tail(dy), is_causal=False))

    def forward(_):
        for s in steps:
            _ring_step_forward(s["query"], s["key"], s["value"], is_causal=s["is_causal"], scale=scale)

    def backward(_):
        for s in steps:
            _ring_step_backward(**s, scale=scale)

    return _System(lambda: None, forward, lambda out: out, backward)


def _timed(system: _System, barrier: Callable[[], None]) -> tuple[tuple[float, float], tuple[float, float]]:
    """(wall seconds, this thread's CPU seconds) of one forward and of its backward, each started
    after a barrier."""
    inputs = system.prepare()
    barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    out = system.forward(inputs)
    forward = (time.perf_counter() - wall, time.thread_time() - cpu)
    settled = system.settle(out)
    barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    system.backward(settled)
    backward = (time.perf_counter() - wall, time.thread_time() - cpu)
    system.finish()
    return forward, backward


def overhead_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    o = plan["overhead"]
    b, n, s, d = o["batch"], o["heads"], o["seq_per_rank"], o["head_dim"]
    scale = 1.0 / math.sqrt(d)
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(b, n, s, d, generator=g).requires_grad_() for _ in range(3)]
    dy = torch.randn(b, n, s, d, generator=g)
    systems = {"cp_cache": _dtensor_call(local, dy, mesh, n, scale), "torch_ring": _torch_ring(local, dy, mesh, scale),
               "kernels": _kernels(local, dy, rank, world_size, scale),
               "dtensor_floor": _dtensor_floor(local, dy, mesh, n, scale)}
    samples = {name: {direction: [] for direction in DIRECTIONS} for name in (*systems, "torch_npu")}

    def run(timed: dict[str, _System]) -> None:  # their calls interleaved
        for i in range(o["warmup"] + o["repeats"]):
            for name, system in timed.items():
                times = _timed(system, dist.barrier)
                if i >= o["warmup"]:
                    for direction, seconds in zip(DIRECTIONS, times):
                        samples[name][direction].append(seconds)

    # cp_session restores torch's load-balancing option on exit
    # the float32 merge, as torch's ring merges: the fused merge is an NPU kernel whose CPU stand-in
    # (the emulator's) would count as host overhead here
    with torch.autograd.set_multithreading_enabled(False):
        with cp_session(mesh, policy="handle", fused_merge=False):
            _cp_options.enable_load_balance = True
            run(systems)
        version = torch_npu_release()
        if version is not None:
            balanced = _cp_options.enable_load_balance
            with _torch_npu_session(mesh, version):
                _cp_options.enable_load_balance = True
                try:
                    run({"torch_npu": systems["cp_cache"]})
                finally:
                    _cp_options.enable_load_balance = balanced
    return [_row(samples, direction, world_size, rank, o, version) for direction in DIRECTIONS]


# (the clock's index in a _timed sample, its key suffix, its ratio's key, what the table shows)
_CLOCKS = ((0, "", "ratio", "time per call - the kernels' alone"),
           (1, "_cpu", "cpu_ratio", "the same in the calling thread's CPU time only (host work; waits on the "
                                    "other ranks left out)"))


def _row(samples: dict, direction: str, world_size: int, rank: int, o: dict, npu_version: Optional[str]) -> dict:
    row = dict(world_size=world_size, rank=rank, direction=direction, shape=o, torch_npu_version=npu_version)
    timed = SYSTEMS + (("torch_npu",) if npu_version else ())
    for clock, suffix, ratio, _ in _CLOCKS:
        us = {name: statistics.median(t[clock] for t in samples[name][direction]) * 1e6 for name in timed}
        over = {name: us[name] - us["kernels"] for name in ("cp_cache", "torch_ring", "torch_npu") if name in us}
        row.update({f"{name}{suffix}_us": us[name] for name in timed})
        row.update({f"{name}{suffix}_overhead_us": over[name] for name in over})
        row[ratio] = _ratio(over["cp_cache"], over["torch_ring"])
        # cp_cache's own overhead: less what serving the op on DTensors costs any handler
        row[f"{ratio}_beyond_floor"] = _ratio(over["cp_cache"] - us["dtensor_floor"], over["torch_ring"])
        row[f"{ratio}_vs_torch_npu"] = _ratio(over["cp_cache"], over["torch_npu"]) if npu_version else None
    return row


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b > 0 else None


def print_overhead(report: dict) -> None:
    rows = report["overhead"]
    if not rows:
        return
    o = rows[0]["shape"]
    print(f"\nhost overhead per attention call (rank 0, medians of {o['repeats']}; causal head-tail, B={o['batch']}, "
          f"N={o['heads']}, {o['seq_per_rank']} tokens per rank, D={o['head_dim']}, fp32)")
    keys = ("cp_cache{}_us", "torch_ring{}_us", "kernels{}_us", "cp_cache{}_overhead_us", "torch_ring{}_overhead_us",
            "dtensor_floor{}_us")
    show = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    npu = rows[0]["torch_npu_version"]
    for _, suffix, ratio, shown in _CLOCKS:
        print(f"{shown}, µs" + (f"; torch_npu {npu}'s CP handlers" if npu else "; torch_npu's handlers not run"))
        body = [[r["world_size"], r["direction"], *(f"{r[key.format(suffix)]:.0f}" for key in keys),
                 show(r[ratio]), show(r[f"{ratio}_beyond_floor"]),
                 *((f"{r[f'torch_npu{suffix}_overhead_us']:.0f}", show(r[f"{ratio}_vs_torch_npu"])) if npu else ())]
                for r in rows]
        print(table(["W", "direction", "cp_cache", "torch ring", "kernels alone", "cp_cache overhead",
                     "torch ring overhead", "DTensor floor", "ratio", "ratio beyond floor",
                     *(("torch_npu overhead", "ratio vs torch_npu") if npu else ())], body))


def _draw(ax, rows: list[dict], directions=DIRECTIONS) -> None:
    """Overhead of cp_cache, of torch's ring (and of torch_npu's handlers where they ran) over W,
    per direction."""
    for direction, style in zip(DIRECTIONS, ("-", "--")):
        if direction not in directions:
            continue
        pts = sorted((r for r in rows if r["direction"] == direction), key=lambda r: r["world_size"])
        ws = [r["world_size"] for r in pts]
        npu = pts[0]["torch_npu_version"] if pts else None
        lines = [("cp_cache", "o", "C0", "cp_cache"), ("torch_ring", "s", "C1", "torch's ring")]
        lines += [("torch_npu", "^", "C2", f"torch_npu {npu}'s handlers")] if npu else []
        for name, marker, color, label in lines:
            ax.plot(ws, [r[f"{name}_overhead_us"] for r in pts], marker + style, color=color,
                    label=f"{label}, {direction}")
    ax.set_xticks(sorted({r["world_size"] for r in rows}))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("W")
    ax.set_ylabel("µs per call: time - kernels alone (median, rank 0)")
    ax.legend(fontsize=8)


def overhead_panel(ax, report: dict) -> None:
    if report["overhead"]:
        _draw(ax, report["overhead"])
        ax.set_title("host overhead per call, cp_cache vs torch's ring (tiny shapes)")


def plot_overhead(report: dict, path) -> bool:
    plt = pyplot()
    rows = report["overhead"]
    if plt is None or not rows:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, direction in zip(axes, DIRECTIONS):
        _draw(ax, rows, (direction,))
        ax.set_title(direction)
    o = rows[0]["shape"]
    fig.suptitle(f"host overhead per attention call: causal head-tail, B={o['batch']}, N={o['heads']}, "
                 f"{o['seq_per_rank']} tokens per rank, D={o['head_dim']}, fp32 (CPU, emulator kernel)")
    return save_figure(fig, path)


SECTION = Section(
    name="overhead",
    about="host overhead per attention call, forward and backward, at tiny shapes (causal head-tail, B=1, N=2, "
          "8 tokens per rank, D=8, fp32), W > 1: cp_cache (the v3 op on DTensors), torch's own ring on the same "
          "kernel and the kernel calls alone, measured in the same run; overhead = time - kernels alone, ratio = "
          "cp_cache's / torch's ring's (also bench_overhead.png)",
    quick=dict(overhead=dict(batch=1, heads=2, seq_per_rank=8, head_dim=8, repeats=30, warmup=5)),
    full=dict(overhead=dict(batch=1, heads=2, seq_per_rank=8, head_dim=8, repeats=200, warmup=20)),
    rank=overhead_rank, runs_at=several_ranks, all_ranks=False, summary=print_overhead,
    plots=(("bench_overhead.png", plot_overhead),), panels=(overhead_panel,),
)
