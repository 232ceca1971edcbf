"""The ``mixers`` section of ``python -m cp_cache bench``: a recurrent mixer layer under CP beside one process on the
same kernel, in one run on the same ranks: a Gated DeltaNet layer (its short conv, K = 4, on q/k/v, then the delta
rule; 4 value and key heads, d_k = d_v = 128) in both CP forms ("state": the chunks' summaries chained; "heads": the
head all-to-all), one sequence of S tokens in head-tail shards, forward and forward + backward, float32, one
thread per rank (its own core) and one for the one process. ``efficiency`` = one process's time / (W x the CP
form's): 1.0 is the ideal W x. Also per layer and rank: the bytes the form sends to other ranks in the forward
(counted from the tensors it hands to torch.distributed), beside a causal attention layer's K/V bytes at the same
S (8 query heads, 2 K/V heads of 128, cp_cache's direct exchange), and the bytes autograd keeps from the forward
(distinct storages) against one process's. Rank 0's figures; ``bench_mixers.png``."""

from __future__ import annotations

import statistics
import time

from .._common import pyplot, save_figure, table
from .shared import Section

__all__ = ["SECTION"]

FORMS = {"state": "ring", "heads": "ulysses"}  # form -> the algorithm that picks it


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _inputs(cfg: dict):
    import torch
    g = torch.Generator().manual_seed(0)
    s, h, d = cfg["seq"], cfg["heads"], cfg["head_dim"]
    return {"qkv": torch.randn(1, 3 * h * d, s, generator=g), "weight": torch.randn(3 * h * d, 4, generator=g) * 0.5,
            "g": -torch.rand(1, s, h, generator=g) * 0.1, "beta": torch.rand(1, s, h, generator=g),
            "dout": torch.randn(1, s, h, d, generator=g)}


def _layer(x: dict, cfg: dict, conv, rule, backward: bool):
    """The conv on q/k/v, then the delta rule (l2-normalised q/k, as the models run it)."""
    h, d = cfg["heads"], cfg["head_dim"]
    qkv = x["qkv"].detach().requires_grad_(backward)
    mixed = conv(qkv, x["weight"]).transpose(1, 2)
    q, k, v = (t.reshape(1, mixed.size(1), h, d) for t in mixed.split(h * d, dim=-1))
    out = rule(q, k, v, x["g"], x["beta"])
    if backward:
        out.backward(x["dout"])
    return out


def _saved_bytes(fn) -> int:
    import torch
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _sent_bytes(fn) -> int:
    """Bytes this rank hands to other ranks through all_gather_into_tensor / all_to_all_single during ``fn``."""
    import torch.distributed as dist
    counted, world = [0], dist.get_world_size()
    originals = (dist.all_gather_into_tensor, dist.all_to_all_single)

    def gather(out, local, *args, **kwargs):
        counted[0] += local.nbytes * (world - 1)
        return originals[0](out, local, *args, **kwargs)

    def exchange(out, send, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        mine = send.nbytes // world if input_split_sizes is None else (
            input_split_sizes[dist.get_rank(kwargs.get("group"))] * send.element_size())
        counted[0] += send.nbytes - mine
        return originals[1](out, send, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_gather_into_tensor, dist.all_to_all_single = gather, exchange
    try:
        fn()
    finally:
        dist.all_gather_into_tensor, dist.all_to_all_single = originals
    return counted[0]


def _attention_bytes(cfg: dict, mesh, world: int) -> int:
    """A causal attention layer's forward K/V bytes at the same S (cp_cache's direct exchange, head-tail)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from ...npu_ops import causal_arguments
    s, d = cfg["seq"] // world, cfg["head_dim"]
    with cp_cache.context_parallel(mesh):
        q, k, v = (DTensor.from_local(torch.randn(1, n, s, d), mesh, [Shard(2)]) for n in (8, 2, 2))
        torch.ops.cp_cache.fusion_attention(q, k, v, 8, "BNSD", scale=d ** -0.5, **causal_arguments("cpu"))
        return int(cp_cache.call_stats()["forward"]["bytes_sent"])


def _single_row(cfg: dict, x: dict) -> dict:
    from ...mixers.delta_rule import chunk_gated_delta_rule
    from ...mixers.short_conv import causal_conv_documents

    def conv(t, w):
        return causal_conv_documents(t, w, None, (t.size(-1),), "silu")

    def rule(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0]

    row = {}
    for backward in (False, True):
        name = "forward_backward" if backward else "forward"
        row[f"{name}_single_s"] = _timed(lambda: _layer(x, cfg, conv, rule, backward), cfg["repeats"])
    row["saved_single_bytes"] = _saved_bytes(lambda: _layer(x, cfg, conv, rule, False))
    return row


def mixers_rank(plan: dict, rank: int, world: int, mesh) -> list[dict]:
    import torch
    import torch.distributed as dist

    import cp_cache
    from ...mixers import sequence
    from ...mixers.gated_delta import delta_rule_under_cp
    from ...mixers.short_conv import causal_conv_under_cp
    from ...documents import sequence_positions

    torch.set_num_threads(1)
    cfg = plan["mixers"]
    full = _inputs(cfg)
    single = _single_row(cfg, full) if rank == 0 else {}
    dist.barrier()
    held = sequence_positions(rank, world, cfg["seq"] // world, True)
    local = {n: (t.index_select(2 if n == "qkv" else 1, held) if n != "weight" else t) for n, t in full.items()}
    rows = []
    for form, algorithm in FORMS.items():
        if form == "heads" and cfg["heads"] % world:
            continue
        with cp_cache.context_parallel(mesh, algorithm=algorithm):
            seq = sequence.current(held.numel())

            def conv(t, w):
                return causal_conv_under_cp(t, w, None, seq, "silu")

            def rule(q, k, v, g, beta):
                return delta_rule_under_cp(q, k, v, g, beta, seq, algorithm=algorithm, use_qk_l2norm=True)

            row = dict(layer="gated_delta", form=form, world_size=world, seq=cfg["seq"], heads=cfg["heads"],
                       head_dim=cfg["head_dim"], **single)
            for backward in (False, True):
                name = "forward_backward" if backward else "forward"
                row[f"{name}_cp_s"] = _timed(lambda: _layer(local, cfg, conv, rule, backward), cfg["repeats"])
                if single:
                    row[f"{name}_efficiency"] = single[f"{name}_single_s"] / (world * row[f"{name}_cp_s"])
            row["sent_bytes"] = _sent_bytes(lambda: _layer(local, cfg, conv, rule, False))
            row["saved_cp_bytes"] = _saved_bytes(lambda: _layer(local, cfg, conv, rule, False))
        row["attention_sent_bytes"] = _attention_bytes(cfg, mesh, world)
        rows.append(row)
    return rows


def print_mixers(report: dict) -> None:
    rows = report.get("mixers") or []
    if not rows:
        return
    print("\nrecurrent mixer layers under CP (rank 0; seconds; efficiency = one process / (W x CP); MiB per layer)")
    lines = [[f"{r['layer']} {r['form']} W={r['world_size']}", f"{r['forward_single_s']:.3f}", f"{r['forward_cp_s']:.3f}",
              f"{r['forward_efficiency']:.2f}", f"{r['forward_backward_single_s']:.3f}",
              f"{r['forward_backward_cp_s']:.3f}", f"{r['forward_backward_efficiency']:.2f}",
              f"{r['sent_bytes'] / 2**20:.2f}", f"{r['attention_sent_bytes'] / 2**20:.2f}",
              f"{r['saved_cp_bytes'] / 2**20:.1f} / {r['saved_single_bytes'] / 2**20:.1f}"] for r in rows]
    print(table(["layer", "fwd one", "fwd CP", "eff", "fwd+bwd one", "fwd+bwd CP", "eff", "sent", "attention sent",
                 "kept CP / one"], lines))


def draw_mixers(report: dict, path) -> bool:
    plt = pyplot()
    rows = report.get("mixers") or []
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['layer']}\n{r['form']} W={r['world_size']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["forward_backward_single_s"] / r["world_size"] for r in rows], width=0.4,
           label="one process / W (ideal)")
    ax.bar([i + 0.2 for i in x], [r["forward_backward_cp_s"] for r in rows], width=0.4, label="under CP")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["forward_backward_cp_s"], f"{r['forward_backward_efficiency']:.2f}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds per forward + backward (rank 0)")
    ax.set_title(f"recurrent mixer layers, CPU, S={rows[0]['seq']}")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


SECTION = Section(
    name="mixers",
    about="recurrent mixer layers under CP (a Gated DeltaNet layer, both CP forms) beside one process on the same "
          "kernel: efficiency against the ideal W x, bytes sent beside an attention layer's, bytes kept",
    quick=dict(mixers=dict(seq=256, heads=4, head_dim=16, repeats=1)),
    full=dict(mixers=dict(seq=8192, heads=4, head_dim=128, repeats=3)),
    rank=mixers_rank, runs_at=lambda plan, world: world == 2, all_ranks=False, summary=print_mixers,
    plots=(("bench_mixers.png", draw_mixers),),
)
