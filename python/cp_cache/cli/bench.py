"""Benchmarks of the CP attention path: memory held between forward and backward,
handler overhead, bytes sent, numerical error, and the store's own cost.

Sections (``--only`` picks some):

* ``memory``: step-cache bytes alive between forward and backward, per layer, for
  TinyDecoder under ``cp_cache.context_parallel`` (layers x W x checkpoint mode x
  policy), next to what torch_npu's original entry holds for the same shapes
  (computed from the shapes; formula in the JSON);
* ``overhead``: per attention call, the handler's own time (``cp_cache.call_stats()``'s
  overhead_seconds: handler time minus kernels and communication) against the ring time, W = 1, 2, 4;
* ``traffic``: K/V bytes each rank receives per call, forward and backward, against the
  mask's lower bound and against the whole-block ring, for causal attention, windows,
  given masks and packed documents at the largest W, with the exposed communication and the
  time per call (``cli/bench_traffic.py``; also ``bench_traffic.png``); the ``overhead``
  rows also carry each call's bytes sent and its lower bound, with and without GQA;
* ``accuracy``: max error of output and gradients versus a float64 dense reference,
  fp32 and bf16, against W;
* ``windows``: band (sliding-window) attention at the largest W: bytes sent and time per
  call against the window size, next to the full-causal ring, with the kernel calls made
  and the blocks skipped; contiguous and head-tail shards (also ``bench_windows.png``);
* ``floor``: what one causal CP attention call keeps from forward to backward (the distinct
  storages autograd saves for it, inputs and mask excluded, plus the store's live bytes)
  against the floor output + LSE and against output + contiguous [B, N, S, 8] statistics
  (B=1, N=8, S=4096, D=64, fp32; the memory floor), both policies, and whether the ring
  merged its steps with the fused op;
* ``overlap``: per attention call, the ring's time computing (kernels, merges,
  accumulation) and blocked on receives, forward and backward: ``exposed_fraction`` =
  waiting / (computing + waiting), for the default shapes and for one where communication
  dominates;
* ``agreement``: the ranks' agreement before each ring call (``cp_cache.engine.agreement``): microseconds
  per call on the ring's group, the first call of a configuration (signature built, then
  all-gathered) and the steady state (cached signature, all-gathered), W > 1;
* ``varlen``: packed documents (TND): work per rank (max/mean) and FLOPs against the
  block-diagonal minimum for per-document head-tail, contiguous and whole-sequence
  head-tail sharding, and time per call (``cli/bench_varlen.py``);
* ``placement``: where packed documents go, computed without ranks: per placement (balanced,
  per-document head-tail, contiguous) and W = 2 to 64, tokens and causal work per rank
  (max/mean) and the K/V rows each rank needs from the others (``cli/bench_placement.py``;
  also ``bench_placement.png``);
* ``algorithms``: ring, Ulysses and hybrid (2 x 2 CP mesh at W = 4) on one causal call,
  MHA and GQA: bytes sent per rank, time per call, fp32 error against dense float64, and
  what ``algorithm="auto"`` picks (``cli/bench_algorithms.py``; also ``bench_algorithms.png``);
* ``models``: the attention of a gpt-oss-shaped model (sinks, GQA, alternating window and full
  causal layers under head-tail): bytes each layer kind moves, time per call, fp32 error
  (``cli/bench_models.py``);
* ``store``: the store micro-benchmark (``cli/bench_store.py``).

Benchmarks measure and report; they assert nothing about timings. On CPU the
attention kernel is the emulator (plain torch), so kernel times are CPU times:
compare the handler overhead with them only as orders of magnitude.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ._common import cp_session, fmt_bytes, launch, pyplot, table

NAME = "bench"
HELP = "memory, overhead, traffic and accuracy benchmarks; JSON and a PNG plot under --out"

_WITHOUT_RANKS = ("placement", "store")  # computed in this process, after the rank sections


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default results/)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (for tests)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="CP world sizes (default 1 2 4)")


def _plan(quick: bool, worlds: list[int] | None) -> dict:
    if quick:
        return dict(
            worlds=worlds or [1, 2], layers=[1, 2], modes=["none", "non_reentrant"],
            model=dict(batch=1, seq=32, dim=32, heads=4, kv_heads=4),
            attn=dict(batch=1, heads=4, seq=64, head_dim=16), repeats=3, warmup=1,
            floor=dict(batch=1, heads=4, seq=128, head_dim=16),
            comm_bound=dict(batch=1, heads=4, seq=16, head_dim=32),
            store=dict(number=2000, repeat=2),
            agreement=dict(calls=50), traffic=dict(batch=1, heads=4, head_dim=16, seq=128),
            varlen=dict(tokens=256, heads=2, head_dim=16), varlen_balance=dict(tokens=4096, worlds=[2, 4]),
            placement=dict(worlds=[2, 4]),
            algorithms=dict(batch=1, heads=4, kv_heads=[4, 2], seq=64, head_dim=16),
            models=dict(batch=1, heads=4, kv_heads=2, seq=64, head_dim=16, window=8),
        )
    return dict(
        worlds=worlds or [1, 2, 4], layers=[1, 2, 4],
        modes=["none", "non_reentrant", "reentrant", "selective_save_attention"],
        model=dict(batch=1, seq=128, dim=32, heads=4, kv_heads=4),
        attn=dict(batch=1, heads=8, seq=1024, head_dim=64), repeats=5, warmup=1,
        floor=dict(batch=1, heads=8, seq=4096, head_dim=64),
        comm_bound=dict(batch=1, heads=8, seq=32, head_dim=128),  # tiny blocks: the hops dominate
        store=dict(number=100_000, repeat=5),
        agreement=dict(calls=500), traffic=dict(batch=1, heads=4, head_dim=16, seq=128),
        varlen=dict(tokens=2048, heads=4, head_dim=32), varlen_balance=dict(tokens=65536, worlds=[2, 4, 8]),
        placement=dict(worlds=[2, 4, 8, 16, 32, 64]),
        algorithms=dict(batch=1, heads=8, kv_heads=[8, 2], seq=1024, head_dim=64),
        # gpt-oss: 64/8 heads of 64, a 128-token window; here 8/1 heads at S=1024 so the window is 1/8 of S
        models=dict(batch=1, heads=8, kv_heads=1, seq=1024, head_dim=64, window=128),
    )


# ---------------------------------------------------------------- one rank


def _memory(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch

    import cp_cache
    from ..testing.models import ModelConfig, TinyDecoder, loss_fn, make_batch
    from ._shapes import torch_npu_entry_bytes

    m = plan["model"]
    rows = []
    for policy in ("handle", "stack"):
        cp_cache.enable(policy=policy)
        for mode in plan["modes"]:
            for layers in plan["layers"]:
                torch.manual_seed(0)
                config = ModelConfig(dim=m["dim"], heads=m["heads"], kv_heads=m["kv_heads"], layers=layers,
                                     max_seq=m["seq"], dropout=0.1)
                model = TinyDecoder(config, checkpoint=mode)
                tokens, labels, positions = make_batch(m["batch"], m["seq"], config.vocab, seed=1)
                before = cp_cache.stats()
                with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions],
                                               buffer_seq_dims=[1, 1, 1]):
                    loss = loss_fn(model(tokens, positions), labels)
                    held = cp_cache.stats()
                    loss.backward()
                after = cp_cache.stats()
                del loss, model
                entries = held["live_entries"] - before["live_entries"]
                nbytes = held["live_bytes"] - before["live_bytes"]
                npu = torch_npu_entry_bytes(m["batch"], m["heads"], m["seq"] // world_size,
                                            m["dim"] // m["heads"], 4, world_size)
                rows.append(dict(
                    world_size=world_size, policy=policy, checkpoint=mode, layers=layers,
                    held_entries=entries, held_bytes=nbytes, held_bytes_per_layer=nbytes / layers,
                    left_after_backward=after["live_entries"] - before["live_entries"],
                    torch_npu_bytes_per_layer=npu["total"], torch_npu_bytes=npu["total"] * layers,
                ))
        cp_cache.disable()
    return rows


def _attention_call(plan_attn: dict, kv_heads: int, dtype, mesh, world_size: int, seed: int = 0):
    """One causal CP attention call (forward + backward) through the v3 op on DTensors.
    Returns the gathered output and gradients in global order, and the inputs."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from ..npu_ops import causal_arguments
    from ..testing.reference import head_tail_positions

    a = plan_attn
    g = torch.Generator().manual_seed(seed)
    b, n, s, d = a["batch"], a["heads"], a["seq"], a["head_dim"]
    q = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64)
    dy = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    order = head_tail_positions(s, world_size)
    inverse = torch.argsort(order)
    dist_ = [distribute_tensor(t.index_select(2, order).to(dtype), mesh, [Shard(2)]) for t in (q, k, v, dy)]
    qd, kd, vd = (t.requires_grad_() for t in dist_[:3])
    out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, n, "BNSD", scale=1.0 / math.sqrt(d),
                                                **causal_arguments("cpu"))[0]
    out.backward(dist_[3])
    gathered = [t.detach().full_tensor().index_select(2, inverse) for t in (out, qd.grad, kd.grad, vd.grad)]
    return gathered, (q, k, v, dy)


def _overhead_traffic(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch

    import cp_cache

    a = plan["attn"]
    rows = []
    cp_cache.enable(policy="handle")
    with cp_cache.context_parallel(mesh):
        for kv_heads in (a["heads"], max(1, a["heads"] // 4)):
            samples = {k: [] for k in ("fwd_handler", "fwd_ring", "fwd_over", "bwd_handler", "bwd_ring",
                                       "bwd_over")}
            for i in range(plan["warmup"] + plan["repeats"]):
                _attention_call(a, kv_heads, torch.float32, mesh, world_size, seed=i)
                if i < plan["warmup"]:
                    continue
                calls = cp_cache.call_stats()
                for prefix, direction in (("fwd", "forward"), ("bwd", "backward")):
                    samples[f"{prefix}_handler"].append(calls[direction]["handler_seconds"])
                    samples[f"{prefix}_ring"].append(calls[direction]["ring_seconds"])
                    samples[f"{prefix}_over"].append(calls[direction]["overhead_seconds"])
            block = a["batch"] * kv_heads * (a["seq"] // world_size) * a["head_dim"] * 4  # one K block, fp32
            minimum = (world_size - 1) * 2 * block
            rows.append(dict(
                world_size=world_size, rank=rank, kv_heads=kv_heads, heads=a["heads"],
                gqa=kv_heads != a["heads"],
                **{f"{k}_us_median": statistics.median(v) * 1e6 for k, v in samples.items()},
                fwd_bytes_sent=calls["forward"]["bytes_sent"], bwd_bytes_sent=calls["backward"]["bytes_sent"],
                fwd_bytes_lower_bound=calls["forward"]["bytes_lower_bound"],
                bwd_bytes_lower_bound=calls["backward"]["bytes_lower_bound"],
                ring_minimum_bytes=minimum, kv_block_bytes=2 * block,
            ))
    cp_cache.disable()
    return rows


def _accuracy(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch

    import cp_cache
    from ..testing.reference import dense_attention

    a = plan["attn"]
    rows = []
    cp_cache.enable(policy="handle")
    with cp_cache.context_parallel(mesh):
        for dtype in (torch.float32, torch.bfloat16):
            for kv_heads in (a["heads"],):
                got, (q, k, v, dy) = _attention_call(a, kv_heads, dtype, mesh, world_size, seed=123)
                if rank != 0:
                    continue
                ref = dense_attention(q, k, v, dy, causal=True)
                ref = [ref[name] for name in ("out", "dq", "dk", "dv")]
                errors = {}
                for name, x, y in zip(("out", "dq", "dk", "dv"), got, ref):
                    diff = (x.double() - y).abs()
                    errors[f"{name}_max_abs"] = float(diff.max())
                    errors[f"{name}_rel"] = float(diff.norm() / y.norm())
                rows.append(dict(world_size=world_size, dtype=str(dtype).replace("torch.", ""), **errors))
    cp_cache.disable()
    return rows


def _windows(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    import cp_cache
    from ..npu_ops import band_arguments, causal_arguments
    from ..engine.steps import plan_step
    from ..plan import MaskSpec

    a = plan["attn"]
    b, n, s, d = a["batch"], a["heads"], a["seq"], a["head_dim"]
    s_local = s // world_size
    windows = sorted({max(2, s_local // 4), s_local // 2, s_local, 2 * s_local, s})
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(b, n, s_local, d, generator=g) for _ in range(4)]
    rows = []
    with cp_session(mesh, policy="handle"):
        for load_balance in (False, True):
            _cp_options.enable_load_balance = load_balance
            for window in windows + [None]:  # None: the full-causal ring (sparse_mode 2)
                if window is None:
                    spec, mask = MaskSpec(causal=True), causal_arguments("cpu")
                else:
                    # what the handler runs: a window over the whole sequence is causal
                    spec = MaskSpec(window=True, pre_tockens=window - 1, next_tockens=0).simplified(s)
                    mask = band_arguments("cpu", window - 1)
                tasks = [plan_step(rank, i, world_size, load_balance, spec, s_local, s_local)[1]
                         for i in range(world_size)]
                times = {"fwd": [], "bwd": []}
                for i in range(plan["warmup"] + plan["repeats"]):
                    q, k, v = (DTensor.from_local(t.clone(), mesh, [Shard(2)]).requires_grad_() for t in local[:3])
                    out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, n, "BNSD", scale=1.0 / math.sqrt(d),
                                                                **mask)[0]
                    out.backward(DTensor.from_local(local[3], mesh, [Shard(2)]))
                    calls = cp_cache.call_stats()
                    if i >= plan["warmup"]:
                        times["fwd"].append(calls["forward"]["handler_seconds"])
                        times["bwd"].append(calls["backward"]["handler_seconds"])
                chunks = 2 if load_balance else 1
                rows.append(dict(
                    world_size=world_size, rank=rank, load_balance=load_balance,
                    window=window if window is not None else "causal", s_local=s_local,
                    fwd_bytes_sent=calls["forward"]["bytes_sent"], bwd_bytes_sent=calls["backward"]["bytes_sent"],
                    kv_block_bytes=2 * local[1].nbytes,
                    hops=calls["forward"]["bytes_sent"] // (2 * local[1].nbytes),
                    kernel_calls=sum(len(t) for t in tasks),
                    blocks_skipped=world_size * chunks * chunks - sum(len(t) for t in tasks) if spec.window else None,
                    fwd_ms_median=statistics.median(times["fwd"]) * 1e3,
                    bwd_ms_median=statistics.median(times["bwd"]) * 1e3,
                ))
    return rows


def _causal_call(shape: dict, mesh, world_size: int, rank: int, seed: int = 0):
    """Local causal q, k, v, dy as DTensors (Shard(2), BNSD, fp32) and the v3 call on them (v and dy
    at ``shape["v_head_dim"]`` when given: MLA)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from ..npu_ops import causal_arguments

    b, n, s, d = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
    dv = shape.get("v_head_dim", d)
    g = torch.Generator().manual_seed(seed + rank)
    local = [torch.randn(b, n, s // world_size, dim, generator=g) for dim in (d, d, dv, dv)]
    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]).requires_grad_() for t in local[:3])
    dy = DTensor.from_local(local[3], mesh, [Shard(2)])
    causal = causal_arguments("cpu")

    def call():
        return torch.ops.npu.npu_fusion_attention_v3(q, k, v, n, "BNSD", scale=1.0 / math.sqrt(d), **causal)[0]

    return (q, k, v, dy, causal["atten_mask"]), call


def _floor(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import cp_cache
    from ._measure import SavedStorages

    f = plan["floor"]
    s_local = f["seq"] // world_size
    tokens = f["batch"] * f["heads"] * s_local
    output, lse = tokens * f.get("v_head_dim", f["head_dim"]) * 4, tokens * 4  # the output has V's head size
    contiguous_stats = 2 * tokens * 8 * 4
    rows = []
    for policy in ("handle", "stack"):
        cp_cache.enable(policy=policy)
        inputs, call = _causal_call(f, mesh, world_size, rank)
        store_before = cp_cache.stats()["live_bytes"]
        with cp_cache.context_parallel(mesh):
            with SavedStorages(exclude=inputs) as saved:
                out = call()
            store_bytes = cp_cache.stats()["live_bytes"] - store_before
            fused = cp_cache.call_stats()["forward"]["fused_merge"]
            out.backward(inputs[3])
        kept = saved.nbytes + store_bytes
        rows.append(dict(
            world_size=world_size, rank=rank, policy=policy, shape=f, kept_bytes=kept,
            autograd_saved_bytes=saved.nbytes, store_bytes=store_bytes,
            output_bytes=output, lse_bytes=lse, floor_bytes=output + lse,
            above_floor_bytes=kept - (output + lse),
            with_contiguous_stats_bytes=output + contiguous_stats,
            saved_per_call_bytes=output + contiguous_stats - kept,
            fused_merge=fused,
        ))
        cp_cache.disable()
    return rows


def _overlap(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import cp_cache

    rows = []
    cp_cache.enable(policy="handle")
    for name in ("attn", "comm_bound"):
        inputs, call = _causal_call(plan[name], mesh, world_size, rank)
        samples: dict[str, list] = {"forward": [], "backward": []}
        with cp_cache.context_parallel(mesh):
            for i in range(plan["warmup"] + plan["repeats"]):
                for t in inputs[:3]:
                    t.grad = None
                call().backward(inputs[3])
                stats = cp_cache.call_stats()
                if i >= plan["warmup"]:
                    for direction in samples:
                        samples[direction].append(stats[direction])
        for direction, records in samples.items():
            rows.append(dict(
                world_size=world_size, rank=rank, shape="default" if name == "attn" else "comm_bound",
                dims=plan[name], direction=direction,
                exposed_fraction=statistics.median(r["exposed_fraction"] for r in records),
                compute_ms=statistics.median(r["compute_seconds"] for r in records) * 1e3,
                wait_ms=statistics.median(r["wait_seconds"] for r in records) * 1e3,
            ))
    cp_cache.disable()
    return rows


def _agreement(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    """Microseconds of the ring's agreement per call: first call of a configuration (the
    signature built, then exchanged) and steady state (the cached signature, exchanged)."""
    import torch
    import torch.distributed as dist

    from ..engine import agreement
    from ..plan import CallPlan, MaskSpec

    group = mesh.get_group()
    a = plan["attn"]
    s_local = a["seq"] // world_size
    q = torch.empty(a["batch"], a["heads"], s_local, a["head_dim"])
    call_plan = CallPlan(world_size=world_size, rank=rank, mask=MaskSpec(causal=True), load_balance=True,
                     layout="BNSD", head_num=a["heads"], scale=a["head_dim"] ** -0.5, keep_prob=1.0)

    def once() -> float:
        dist.barrier(group=group)  # start together: time the exchange, not a late peer
        started = time.perf_counter()
        sig = agreement.signature(direction="forward", plan=call_plan, q=q, k=q, v=q, kv_heads=a["heads"],
                                  kernel="npu")
        agreement.agree(sig, group, world_size)
        return time.perf_counter() - started

    agreement.reset_counters()  # the signature cache too: the next call builds it
    first = once()
    steady = [once() for _ in range(plan["agreement"]["calls"])]
    build_started = time.perf_counter()
    for _ in range(100):
        agreement.signature(direction="forward", plan=call_plan, q=q, k=q, v=q, kv_heads=a["heads"], kernel="npu")
    cached_build = (time.perf_counter() - build_started) / 100
    return [dict(world_size=world_size, rank=rank, signature_len=agreement.SIGNATURE_LEN,
                 first_call_us=first * 1e6, steady_us=statistics.median(steady) * 1e6,
                 steady_p90_us=sorted(steady)[int(0.9 * (len(steady) - 1))] * 1e6,
                 cached_signature_us=cached_build * 1e6, calls=len(steady))]


def bench_rank(rank: int, world_size: int, plan: dict, sections: list[str]) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ._common import rank_device, setup_ops

    ops = setup_ops()
    device = rank_device(rank)
    mesh = init_device_mesh(device.type, (world_size,))
    out = dict(rank=rank, world_size=world_size, ops=ops, torch=torch.__version__)
    for section in RANK_SECTIONS:
        if section.name in sections and section.runs_at(plan, world_size):
            out[section.key] = section.run(plan, rank, world_size, mesh)
    return out


# ---------------------------------------------------------------- driver


def _store_bench(plan: dict) -> dict:
    from .bench_store import run

    return run(plan["store"]["number"], plan["store"]["repeat"])


def _exposed_fraction(rows: list[dict]) -> dict:
    """{"W=2": {"default": {"forward": f, "backward": f}, "comm_bound": {...}}, ...}: the
    largest fraction over ranks (the slowest rank sets the pace)."""
    out: dict = {}
    for r in rows:
        cell = out.setdefault(f"W={r['world_size']}", {}).setdefault(r["shape"], {})
        cell[r["direction"]] = max(cell.get(r["direction"], 0.0), r["exposed_fraction"])
    return out


def _collect(per_world: list[list[dict]], key: str, all_ranks: bool = False) -> list[dict]:
    rows = []
    for results in per_world:
        for r in results if all_ranks else results[:1]:
            rows.extend(r.get(key, []))
    return rows


@dataclass(frozen=True)
class RankSection:
    """A bench section measured on ranks: ``run(plan, rank, W, mesh)`` gives its rows at each W
    where ``runs_at(plan, W)``; the report keeps them under ``key`` (rank 0's or, ``all_ranks``,
    every rank's) with what ``derived(plan, rows)`` adds beside them."""

    name: str
    key: str
    run: Callable[[dict, int, int, Any], list]
    runs_at: Callable[[dict, int], bool] = lambda plan, world: True
    all_ranks: bool = True
    derived: Optional[Callable[[dict, list], dict]] = None


def _largest_world_only(plan: dict, world: int) -> bool:
    return world == max(plan["worlds"]) and world > 1


def _several_ranks(plan: dict, world: int) -> bool:
    return world > 1


def _traffic_rank(plan, rank, world, mesh):
    from .bench_traffic import traffic_rank

    return traffic_rank(plan, rank, world)


def _traffic_summary(plan, rows):
    from .bench_traffic import summary

    return {"traffic_summary": summary(rows)}


def _varlen_rank(plan, rank, world, mesh):
    from .bench_varlen import varlen_rank

    return varlen_rank(plan["varlen"], plan["repeats"], plan["warmup"], rank, world, mesh)


def _varlen_balance(plan, rows):
    from .bench_varlen import balance_rows

    return {"varlen_balance": balance_rows(plan["varlen_balance"]["tokens"], plan["varlen_balance"]["worlds"])}


def _algorithms_rank(plan, rank, world, mesh):
    from .bench_algorithms import algorithms_rank

    return algorithms_rank(plan, rank, world)


def _models_rank(plan, rank, world, mesh):
    from .bench_models import models_rank

    return models_rank(plan, rank, world, mesh)


RANK_SECTIONS = (
    RankSection("memory", "memory", _memory, all_ranks=False),
    RankSection("overhead", "calls", _overhead_traffic),
    RankSection("traffic", "traffic", _traffic_rank, _largest_world_only, derived=_traffic_summary),
    RankSection("accuracy", "accuracy", _accuracy, all_ranks=False),
    RankSection("windows", "windows", _windows, _largest_world_only),
    RankSection("floor", "floor", _floor, all_ranks=False),
    RankSection("overlap", "overlap", _overlap, _several_ranks,
                derived=lambda plan, rows: {"exposed_fraction": _exposed_fraction(rows)}),
    RankSection("agreement", "agreement", _agreement, _several_ranks),
    RankSection("varlen", "varlen", _varlen_rank, derived=_varlen_balance),
    RankSection("algorithms", "algorithms", _algorithms_rank),
    RankSection("models", "models", _models_rank),
)
SECTIONS = tuple(section.name for section in RANK_SECTIONS) + _WITHOUT_RANKS


def _print_summary(report: dict) -> None:
    _print_memory(report.get("memory"))
    _print_calls(report.get("calls"))
    _print_accuracy(report.get("accuracy"))
    _print_windows(report.get("windows") or [])
    _print_floor([r for r in report.get("floor") or [] if r["rank"] == 0])
    _print_exposed(report.get("exposed_fraction"))
    _print_agreement(report.get("agreement"))
    if report.get("varlen") or report.get("varlen_balance"):
        from .bench_varlen import print_varlen

        print_varlen(report)
    store = report.get("store")
    if store:
        print("\nstore (ns per call): " + ", ".join(f"{k} {v}" for k, v in store["ns_per_call"].items()))
    ref = report["torch_npu_reference_shapes"]
    print(f"\ntorch_npu's original entry at {ref['shapes']}: {fmt_bytes(ref['per_layer'])} per layer, "
          f"{fmt_bytes(ref['model'])} for {ref['layers']} layers (computed)")


def _print_memory(mem: list[dict] | None) -> None:
    if not mem:
        return
    print("\nmemory: step-cache bytes alive between forward and backward, per layer (rank 0)")
    rows = [[r["world_size"], r["checkpoint"], r["layers"], r["policy"], r["held_entries"],
             fmt_bytes(r["held_bytes_per_layer"]), fmt_bytes(r["torch_npu_bytes_per_layer"]),
             r["left_after_backward"]]
            for r in mem if r["layers"] == max(x["layers"] for x in mem)]
    print(table(["W", "checkpoint", "layers", "policy", "entries held", "bytes/layer",
                 "torch_npu bytes/layer", "left after bwd"], rows))


def _print_calls(calls: list[dict] | None) -> None:
    if not calls:
        return
    print("\noverhead and traffic per attention call (rank 0, medians)")
    rows = [[r["world_size"], f"{r['heads']}/{r['kv_heads']}",
             f"{r['fwd_over_us_median']:.0f}", f"{r['fwd_ring_us_median']:.0f}",
             f"{r['bwd_over_us_median']:.0f}", f"{r['bwd_ring_us_median']:.0f}",
             fmt_bytes(r["fwd_bytes_sent"]), fmt_bytes(r["bwd_bytes_sent"]), fmt_bytes(r["ring_minimum_bytes"])]
            for r in calls if r["rank"] == 0]
    print(table(["W", "heads q/kv", "fwd overhead us", "fwd ring us", "bwd overhead us", "bwd ring us",
                 "fwd sent", "bwd sent", "whole-block ring fwd"], rows))


def _print_accuracy(acc: list[dict] | None) -> None:
    if not acc:
        return
    print("\nerror versus a float64 dense reference (max abs)")
    rows = [[r["world_size"], r["dtype"]] + [f"{r[f'{n}_max_abs']:.1e}" for n in ("out", "dq", "dk", "dv")]
            for r in acc]
    print(table(["W", "dtype", "out", "dq", "dk", "dv"], rows))


def _print_windows(all_windows: list[dict]) -> None:
    windows = [r for r in all_windows if r["rank"] == 0]
    if not windows:
        return
    print(f"\nband attention (causal window of w tokens) at W={windows[0]['world_size']}, "
          f"S_local={windows[0]['s_local']}: bytes and times of rank 0, kernel calls and "
          "blocks skipped summed over ranks")

    def summed(r, key):
        same = [x[key] for x in all_windows if (x["load_balance"], x["window"]) == (r["load_balance"], r["window"])]
        return "-" if None in same else sum(same)

    rows = [[("head-tail" if r["load_balance"] else "contiguous"), r["window"], r["hops"],
             fmt_bytes(r["fwd_bytes_sent"]), fmt_bytes(r["bwd_bytes_sent"]), summed(r, "kernel_calls"),
             summed(r, "blocks_skipped"), f"{r['fwd_ms_median']:.1f}", f"{r['bwd_ms_median']:.1f}"]
            for r in windows]
    print(table(["shards", "window", "hops", "fwd sent", "bwd sent", "kernel calls", "blocks skipped",
                 "fwd ms", "bwd ms"], rows))


def _print_floor(floor: list[dict]) -> None:
    if not floor:
        return
    print("\nmemory floor: kept from forward to backward per causal attention call (rank 0)")
    rows = [[r["world_size"], r["policy"], fmt_bytes(r["kept_bytes"]), fmt_bytes(r["floor_bytes"]),
             fmt_bytes(r["above_floor_bytes"]), fmt_bytes(r["with_contiguous_stats_bytes"]),
             fmt_bytes(r["saved_per_call_bytes"]), "fused" if r["fused_merge"] else "float32"] for r in floor]
    print(table(["W", "policy", "kept", "output + LSE", "above floor", "with [B,N,S,8] stats",
                 "saved per call", "merge"], rows))


def _print_exposed(exposed: dict | None) -> None:
    if not exposed:
        return
    print("\ncommunication not hidden by compute (exposed fraction, max over ranks)")
    rows = [[w, shape, f"{d.get('forward', float('nan')):.2f}", f"{d.get('backward', float('nan')):.2f}"]
            for w, shapes in exposed.items() for shape, d in shapes.items()]
    print(table(["W", "shape", "forward", "backward"], rows))


def _print_agreement(agree: list[dict] | None) -> None:
    if not agree:
        return
    print("\nranks' agreement before each ring call (µs per call; max over ranks)")
    worlds = sorted({r["world_size"] for r in agree})
    rows = []
    for w in worlds:
        rs = [r for r in agree if r["world_size"] == w]
        rows.append([w, rs[0]["signature_len"], f"{max(r['first_call_us'] for r in rs):.0f}",
                     f"{max(r['steady_us'] for r in rs):.0f}", f"{max(r['steady_p90_us'] for r in rs):.0f}",
                     f"{max(r['cached_signature_us'] for r in rs):.1f}"])
    print(table(["W", "int64s", "first call", "steady (median)", "steady (p90)", "signature (cached)"], rows))


def _reference_shapes() -> dict:
    """torch_npu's entry at a large-model shape (computed, not measured)."""
    from ._shapes import torch_npu_entry_bytes

    b, n, seq, d, w, layers = 1, 32, 131072, 128, 8, 32
    entry = torch_npu_entry_bytes(b, n, seq // w, d, 2, w)
    return dict(shapes=f"B={b}, N={n}, S={seq} over W={w} (S_local={seq // w}), D={d}, bf16",
                layers=layers, per_layer=entry["total"], model=entry["total"] * layers, parts=entry)


def run(args: argparse.Namespace) -> int:
    sections = list(args.only or SECTIONS)
    plan = _plan(args.quick, args.worlds)
    started = time.perf_counter()
    per_world = _run_ranks(plan, [s for s in sections if s not in _WITHOUT_RANKS])
    if per_world is None:
        return 0  # torchrun rank > 0
    report = _report(args, plan, sections, per_world)
    if "placement" in sections:
        from .bench_placement import placement_rows

        print("bench: placement of packed documents ...", flush=True)
        report["placement"] = placement_rows(plan["placement"]["worlds"])
    if "store" in sections:
        print("bench: store micro-benchmark ...", flush=True)
        report["store"] = _store_bench(plan)
    report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    _publish(report, args.out)
    return 0


def _run_ranks(plan: dict, rank_sections: list[str]) -> list[list[dict]] | None:
    """Every rank's results for each W (none without rank sections); None on a torchrun rank > 0."""
    per_world = []
    if rank_sections:
        for world_size in plan["worlds"]:
            print(f"bench: W={world_size} ({', '.join(rank_sections)}) ...", flush=True)
            results = launch(bench_rank, world_size, plan, rank_sections, timeout=900.0)
            if results is None:
                return None
            per_world.append(results)
    return per_world


def _report(args: argparse.Namespace, plan: dict, sections: list[str], per_world: list[list[dict]]) -> dict:
    """The report of the rank sections (meta, torch_npu's formula, one key per section)."""
    from ._shapes import FORMULA

    report = dict(
        meta=dict(
            python=platform.python_version(), machine=platform.machine(),
            torch=per_world[0][0]["torch"] if per_world else None,
            ops=per_world[0][0]["ops"] if per_world else None, quick=args.quick, plan=plan,
            note="CPU timings with the emulator kernel; overhead = handler time minus ring time",
        ),
        torch_npu_formula=FORMULA,
        torch_npu_reference_shapes=_reference_shapes(),
    )
    for section in RANK_SECTIONS:
        if section.name in sections:
            report[section.key] = _collect(per_world, section.key, all_ranks=section.all_ranks)
            if section.derived is not None:
                report.update(section.derived(plan, report[section.key]))
    return report


def _section_outputs() -> dict:
    """{report key: (its summary printer, its plotter or None, the plot's file name)} of the sections
    that live in modules of their own, in the order they print."""
    from . import bench_algorithms, bench_models, bench_placement, bench_traffic

    return {
        "algorithms": (bench_algorithms.print_summary, bench_algorithms.plot, "bench_algorithms.png"),
        "traffic": (bench_traffic.print_summary, bench_traffic.plot, "bench_traffic.png"),
        "placement": (bench_placement.print_placement, bench_placement.plot_placement, "bench_placement.png"),
        "models": (bench_models.print_summary, None, None),
    }


def _publish(report: dict, out: Path) -> None:
    """Write bench.json and the plots under ``out`` and print the summary."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(report, indent=2))
    _print_summary(report)
    png_path = out / "bench.png"
    plotted = _plot(report, png_path)
    for key, (summarize, draw, png_name) in _section_outputs().items():
        if report.get(key):
            summarize(report[key])
            if draw is not None and draw(report[key], out / png_name):
                print(f"written: {out / png_name}")
    if report.get("windows"):
        windows_png = out / "bench_windows.png"
        if _plot_windows(report, windows_png):
            print(f"written: {windows_png}")
    print(f"\nwritten: {json_path}")
    print(f"written: {png_path}" if plotted else "no plot (matplotlib missing: run make build)")
    print(f"bench took {report['meta']['seconds']:.1f} s")


def _plot(report: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    (ax_mem, ax_over), (ax_traffic, ax_acc) = axes
    _plot_memory(ax_mem, report.get("memory") or [])
    _plot_calls(ax_over, ax_traffic, [r for r in report.get("calls") or [] if r["rank"] == 0])
    _plot_accuracy(ax_acc, report.get("accuracy") or [])
    fig.suptitle("cp_cache benchmarks (" + ("quick, " if report["meta"]["quick"] else "")
                 + f"torch {report['meta']['torch']}, {report['meta']['ops']} ops)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_memory(ax, mem: list[dict]) -> None:
    """Step-cache bytes held against layers at the largest W, per policy and checkpointing."""
    if not mem:
        return
    w = max(r["world_size"] for r in mem)
    for policy, mode, style in (("handle", "none", "o-"), ("handle", "non_reentrant", "s-"),
                                ("stack", "non_reentrant", "^--"), ("stack", "none", "v--")):
        pts = sorted((r["layers"], r["held_bytes"]) for r in mem
                     if r["world_size"] == w and r["policy"] == policy and r["checkpoint"] == mode)
        if pts:
            ax.plot(*zip(*pts), style, label=f"cp_cache {policy}, checkpoint={mode}")
    pts = sorted({(r["layers"], r["torch_npu_bytes"]) for r in mem if r["world_size"] == w})
    ax.plot(*zip(*pts), "k:", marker="x", label="torch_npu original (computed)")
    ax.set_yscale("symlog", linthresh=16)
    ax.set_xlabel("layers")
    ax.set_ylabel("bytes alive between forward and backward (rank 0)")
    ax.set_title(f"step-cache memory held, W={w}")
    ax.legend(fontsize=8, loc="center right")
    ax.set_xticks(sorted({r["layers"] for r in mem}))


def _plot_calls(ax_over, ax_traffic, calls: list[dict]) -> None:
    """Handler overhead against ring time, and bytes sent against the whole-block ring's, over W."""
    if not calls:
        return
    for gqa, marker in ((False, "o"), (True, "x")):
        rows = sorted((r for r in calls if r["gqa"] == gqa), key=lambda r: r["world_size"])
        if not rows:
            continue
        ws = [r["world_size"] for r in rows]
        tag = "GQA" if gqa else "MHA"
        ax_over.plot(ws, [r["fwd_over_us_median"] for r in rows], marker + "-", label=f"fwd handler overhead ({tag})")
        ax_over.plot(ws, [r["bwd_over_us_median"] for r in rows], marker + "--", label=f"bwd handler overhead ({tag})")
        ax_over.plot(ws, [r["fwd_ring_us_median"] for r in rows], marker + ":", label=f"fwd ring: kernels + comm ({tag})")
        ratio_f = [r["fwd_bytes_sent"] / r["ring_minimum_bytes"] if r["ring_minimum_bytes"] else float("nan") for r in rows]
        ratio_b = [r["bwd_bytes_sent"] / r["ring_minimum_bytes"] if r["ring_minimum_bytes"] else float("nan") for r in rows]
        ax_traffic.plot(ws, ratio_f, marker + "-", label=f"forward ({tag})")
        ax_traffic.plot(ws, ratio_b, marker + "--", label=f"backward ({tag})")
    ax_over.set_yscale("log")
    for ax in (ax_over, ax_traffic):
        ax.set_xticks(sorted({r["world_size"] for r in calls}))
    ax_over.set_xlabel("W")
    ax_over.set_ylabel("microseconds per attention call (median)")
    ax_over.set_title("handler overhead vs ring time (CPU, emulator kernel)")
    ax_over.legend(fontsize=7)
    ax_traffic.set_xlabel("W")
    ax_traffic.set_ylabel("bytes sent / ((W-1) * K+V block bytes)")
    ax_traffic.set_title("bytes sent per rank per call vs the whole-block ring's forward")
    ax_traffic.legend(fontsize=8)


def _plot_accuracy(ax, acc: list[dict]) -> None:
    """Max abs error of the output and the gradients over W, per dtype."""
    if not acc:
        return
    for dtype, marker in (("float32", "o"), ("bfloat16", "s")):
        rows = sorted((r for r in acc if r["dtype"] == dtype), key=lambda r: r["world_size"])
        if rows:
            ws = [r["world_size"] for r in rows]
            ax.plot(ws, [r["out_max_abs"] for r in rows], marker + "-", label=f"out ({dtype})")
            ax.plot(ws, [max(r["dq_max_abs"], r["dk_max_abs"], r["dv_max_abs"]) for r in rows],
                    marker + "--", label=f"max of dq, dk, dv ({dtype})")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["world_size"] for r in acc}))
    ax.set_xlabel("W")
    ax.set_ylabel("max abs error vs float64 dense")
    ax.set_title("numerical error vs W")
    ax.legend(fontsize=8)


def _plot_windows(report: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in report["windows"] if r["rank"] == 0]
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for load_balance, style in ((False, "o-"), (True, "s--")):
        band = sorted((r for r in rows if r["load_balance"] == load_balance and r["window"] != "causal"),
                      key=lambda r: r["window"])
        causal = [r for r in rows if r["load_balance"] == load_balance and r["window"] == "causal"]
        tag = "head-tail" if load_balance else "contiguous"
        ws = [r["window"] for r in band]
        ax_bytes.plot(ws, [r["fwd_bytes_sent"] / 2**20 for r in band], style, label=f"band, {tag}")
        ax_time.plot(ws, [r["fwd_ms_median"] + r["bwd_ms_median"] for r in band], style, label=f"band, {tag}")
        if causal:
            ax_bytes.axhline(causal[0]["fwd_bytes_sent"] / 2**20, ls=":", color="gray",
                             label=f"full-causal ring, {tag}" if load_balance else "full-causal ring")
            ax_time.axhline(causal[0]["fwd_ms_median"] + causal[0]["bwd_ms_median"], ls=":",
                            color="gray" if not load_balance else "black", label=f"full-causal ring, {tag}")
    for ax in (ax_bytes, ax_time):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("causal window w (tokens)")
        ax.legend(fontsize=7)
    ax_bytes.set_ylabel("forward MiB sent per rank per call")
    ax_time.set_ylabel("forward + backward ms per call (median)")
    w = rows[0]
    fig.suptitle(f"band attention at W={w['world_size']}, S_local={w['s_local']} (CPU, emulator kernel)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
