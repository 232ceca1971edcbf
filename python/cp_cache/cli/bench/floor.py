"""The ``floor`` section of ``python -m cp_cache bench``: what one causal CP attention call keeps
from forward to backward (the distinct storages autograd saves for it, inputs and mask excluded,
plus the store's live bytes) against the floor output + LSE and against output + contiguous
[B, N, S, 8] statistics (the memory floor), both policies, and whether the ring merged its steps
with the fused op; and with ``keep_kv`` (handle policy), whose step cache also holds the K/V rows
the forward received (``kv_kept_bytes``, from ``call_stats()``)."""

from __future__ import annotations

from .._common import fmt_bytes, table
from .shared import Section, causal_call

__all__ = ["SECTION"]


def floor_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import cp_cache
    from .._measure import SavedStorages

    f = plan["floor"]
    s_local = f["seq"] // world_size
    tokens = f["batch"] * f["heads"] * s_local
    output, lse = tokens * f.get("v_head_dim", f["head_dim"]) * 4, tokens * 4  # the output has V's head size
    contiguous_stats = 2 * tokens * 8 * 4
    rows = []
    for policy, keep_kv in (("handle", False), ("stack", False), ("handle", True)):
        cp_cache.enable(policy=policy, keep_kv=keep_kv)
        inputs, call = causal_call(f, mesh, world_size, rank)
        store_before = cp_cache.stats()["live_bytes"]
        with cp_cache.context_parallel(mesh):
            with SavedStorages(exclude=inputs) as saved:
                out = call()
            store_bytes = cp_cache.stats()["live_bytes"] - store_before
            forward = cp_cache.call_stats()["forward"]
            fused = forward["fused_merge"]
            out.backward(inputs[3])
        kept = saved.nbytes + store_bytes
        rows.append(dict(
            world_size=world_size, rank=rank, policy=policy, keep_kv=keep_kv, kv_kept_bytes=forward["kept_bytes"],
            shape=f, kept_bytes=kept,
            autograd_saved_bytes=saved.nbytes, store_bytes=store_bytes,
            output_bytes=output, lse_bytes=lse, floor_bytes=output + lse,
            above_floor_bytes=kept - (output + lse),
            with_contiguous_stats_bytes=output + contiguous_stats,
            saved_per_call_bytes=output + contiguous_stats - kept,
            fused_merge=fused,
        ))
        cp_cache.disable()
    return rows


def print_floor(report: dict) -> None:
    floor = [r for r in report["floor"] if r["rank"] == 0]
    if not floor:
        return
    print("\nmemory floor: kept from forward to backward per causal attention call (rank 0)")
    rows = [[r["world_size"], r["policy"] + (" + keep_kv" if r.get("keep_kv") else ""), fmt_bytes(r["kept_bytes"]),
             fmt_bytes(r["floor_bytes"]), fmt_bytes(r["above_floor_bytes"]), fmt_bytes(r.get("kv_kept_bytes", 0)),
             fmt_bytes(r["with_contiguous_stats_bytes"]), fmt_bytes(r["saved_per_call_bytes"]),
             "fused" if r["fused_merge"] else "float32"] for r in floor]
    print(table(["W", "policy", "kept", "output + LSE", "above floor", "of it K/V kept", "with [B,N,S,8] stats",
                 "saved per call", "merge"], rows))


SECTION = Section(
    name="floor",
    about="what one causal CP attention call keeps from forward to backward (autograd's saved storages, inputs and "
          "mask excluded, plus the store's live bytes) against output + LSE and against output + [B, N, S, 8] "
          "statistics (B=1, N=8, S=4096, D=64, fp32; the memory floor), both policies, and whether the ring merged "
          "its steps with the fused op; and with keep_kv (the K/V rows the forward received, kept)",
    quick=dict(floor=dict(batch=1, heads=4, seq=128, head_dim=16)),
    full=dict(floor=dict(batch=1, heads=8, seq=4096, head_dim=64)),
    rank=floor_rank, all_ranks=False, summary=print_floor,
)
