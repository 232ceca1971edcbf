"""The ``models`` section of ``python -m cp_cache bench``: the attention of a gpt-oss-shaped model.

gpt-oss alternates sliding-window layers (a band of 128 tokens) with full causal layers, every
layer with a learnable sink per query head, and GQA. Both layer kinds share one sharding of the
sequence, head-tail load balancing (the full layers need it). Per layer kind and W, one call
(forward and backward, fp32) of the v3 op on DTensors with a replicated sink: the bytes each rank
sends and receives (``cp_cache.call_stats()``, with the mask's lower bound where the exchange
reports it), time per call (median), and the fp32 error of out, dq/dk/dv and dsink against dense
float64 attention with the same sink, next to dense torch's own fp32 error on the same inputs.
"""

from __future__ import annotations

import math
import statistics

from .._common import cp_session, fmt_bytes, table
from .shared import Section

__all__ = ["SECTION", "models_rank"]


def _layer_kinds(window: int) -> dict:
    """The op's mask arguments of each layer kind."""
    from ...npu_ops import band_arguments, causal_arguments

    return {"full causal": causal_arguments("cpu"), f"window {window}": band_arguments("cpu", window - 1)}


def _inputs(shape: dict, world_size: int):
    import torch

    g = torch.Generator().manual_seed(17)
    b, n, nkv, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    q, dy = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, nkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(n, generator=g, dtype=torch.float64)
    return q, k, v, dy, sink


def _directional(calls: dict, direction: str) -> dict:
    """What call_stats says one direction sent, received and needed at least (bytes)."""
    stats = calls[direction]
    return {key: stats[key] for key in ("bytes_sent", "bytes_received", "bytes_lower_bound",
                                        "bytes_received_lower_bound") if key in stats}


def _one_kind(mask: dict, full: tuple, pos, mesh, shape: dict, plan: dict) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import cp_cache
    from ...testing.reference import band_masked, dense_attention, rel_err

    q, k, v, dy, sink = full
    n, d, s = shape["heads"], shape["head_dim"], shape["seq"]
    local = [t.index_select(2, pos).float() for t in (q, k, v, dy)]
    times = []
    for i in range(plan["warmup"] + plan["repeats"]):
        leaves = [DTensor.from_local(t.clone(), mesh, [Shard(2)]).requires_grad_() for t in local[:3]]
        sink_leaf = distribute_tensor(sink.float(), mesh, [Replicate()]).requires_grad_()
        out = torch.ops.npu.npu_fusion_attention_v3(*leaves, n, "BNSD", scale=1.0 / math.sqrt(d), sink=sink_leaf,
                                                    **mask)[0]
        out.backward(DTensor.from_local(local[3], mesh, [Shard(2)]))
        calls = cp_cache.call_stats()
        if i >= plan["warmup"]:
            times.append(calls["forward"]["handler_seconds"] + calls["backward"]["handler_seconds"])
    masked = None if mask["sparse_mode"] == 2 else band_masked(s, mask["pre_tockens"], 0)
    ref = dense_attention(q, k, v, dy, causal=True, masked=masked, sink=sink)
    got = {"out": out.to_local().detach(), "dq": leaves[0].grad.to_local(), "dk": leaves[1].grad.to_local(),
           "dv": leaves[2].grad.to_local()}
    low = dense_attention(q, k, v, dy, causal=True, masked=masked, sink=sink, dtype=torch.float32)
    errors = {name: rel_err(t.double(), ref[name].index_select(2, pos)) for name, t in got.items()}
    errors["dsink"] = rel_err(sink_leaf.grad.full_tensor().double(), ref["dsink"])
    dense = [rel_err(low[name].double(), ref[name]) for name in errors]
    return dict(fwd=_directional(calls, "forward"), bwd=_directional(calls, "backward"),
                ms_median=statistics.median(times) * 1e3, fp32_rel_error=max(errors.values()),
                dense_fp32_rel_error=max(dense))


def models_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from ...testing.reference import rank_positions

    shape = plan["models"]
    full = _inputs(shape, world_size)
    pos = rank_positions(world_size, rank, shape["seq"] // world_size, load_balance=True)
    rows = []
    with cp_session(mesh, policy="handle"):
        _cp_options.enable_load_balance = True
        for kind, mask in _layer_kinds(shape["window"]).items():
            rows.append(dict(world_size=world_size, rank=rank, model="gpt-oss-shaped", layer=kind,
                             heads=shape["heads"], kv_heads=shape["kv_heads"], seq=shape["seq"],
                             head_dim=shape["head_dim"], **_one_kind(mask, full, pos, mesh, shape, plan)))
    return rows


def print_summary(report: dict) -> None:
    rows = [r for r in report["models"] if r["world_size"] > 1]
    if not rows:
        return
    r0 = rows[0]
    print(f"\ngpt-oss-shaped attention (sinks, GQA {r0['heads']}/{r0['kv_heads']}, head-tail), one call per "
          f"layer kind, S={r0['seq']}, D={r0['head_dim']}, fp32 (busiest rank)")
    body = []
    for (world, layer) in sorted({(r["world_size"], r["layer"]) for r in rows}):
        group = [r for r in rows if r["world_size"] == world and r["layer"] == layer]
        cells = [world, layer]
        for direction in ("fwd", "bwd"):
            busiest = max(group, key=lambda r: r[direction].get("bytes_received", r[direction]["bytes_sent"]))
            moved = busiest[direction].get("bytes_received", busiest[direction]["bytes_sent"])
            bound = busiest[direction].get("bytes_received_lower_bound")  # the bound of what it received
            cells.append(fmt_bytes(moved) + ("" if bound is None else f" (bound {fmt_bytes(bound)})"))
        cells += [f"{max(r['ms_median'] for r in group):.1f}", f"{max(r['fp32_rel_error'] for r in group):.1e}"]
        body.append(cells)
    print(table(["W", "layer", "fwd moved", "bwd moved", "ms/call", "fp32 error (out, grads, dsink)"], body))


SECTION = Section(
    name="models",
    about="the attention of a gpt-oss-shaped model (sinks, GQA, alternating window and full causal layers under "
          "head-tail): bytes each layer kind moves, time per call, fp32 error",
    quick=dict(models=dict(batch=1, heads=4, kv_heads=2, seq=64, head_dim=16, window=8)),
    # gpt-oss: 64/8 heads of 64, a 128-token window; here 8/1 heads at S=1024 so the window is 1/8 of S
    full=dict(models=dict(batch=1, heads=8, kv_heads=1, seq=1024, head_dim=64, window=128)),
    rank=models_rank, summary=print_summary,
)
