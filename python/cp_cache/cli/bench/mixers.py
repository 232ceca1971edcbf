"""The ``mixers`` section of ``python -m cp_cache bench``: recurrent mixer layers under CP beside one process on the
same kernels, in one run on the same ranks: a Gated DeltaNet layer (its short conv, K = 4, on q/k/v, then the delta
rule; 4 value and key heads, d_k = d_v = 128) and a Mamba-2 layer (its conv on x/B/C, then the SSD scan; 8 heads,
d_head 64, d_state 128, one group), each in both CP forms ("state": the chunks' summaries chained; "heads": the
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


def _inputs(layer: str, cfg: dict):
    import torch
    g = torch.Generator().manual_seed(0)
    s, h, d = cfg["seq"], cfg["heads"], cfg["head_dim"]
    channels = {"gated_delta": 3 * h * d, "mamba2": h * d + 2 * cfg.get("state", 0), "mamba1": h * d}[layer]
    made = {"mixed": torch.randn(1, channels, s, generator=g), "weight": torch.randn(channels, 4, generator=g) * 0.5}
    if layer == "gated_delta":
        return made | {"g": -torch.rand(1, s, h, generator=g) * 0.1, "beta": torch.rand(1, s, h, generator=g),
                       "dout": torch.randn(1, s, h, d, generator=g)}
    if layer == "mamba2":
        return made | {"dt": torch.rand(1, s, h, generator=g) * 0.1, "A": -torch.rand(h, generator=g) - 0.5,
                       "D": torch.randn(h, generator=g), "dout": torch.randn(1, s, h, d, generator=g)}
    n = cfg["state"]
    return made | {"delta": torch.randn(1, channels, s, generator=g), "B": torch.randn(1, n, s, generator=g),
                   "C": torch.randn(1, n, s, generator=g), "z": torch.randn(1, channels, s, generator=g),
                   "A": -torch.rand(channels, n, generator=g) * 4, "D": torch.randn(channels, generator=g),
                   "bias": torch.randn(channels, generator=g), "dout": torch.randn(1, channels, s, generator=g)}


def _layer(layer: str, x: dict, cfg: dict, conv, mix, backward: bool, track: bool = False):
    """The conv, then the recurrent core (the delta rule with l2-normalised q/k, the SSD scan, the selective scan),
    as the models run them; ``track``: a forward that autograd records (what a training step keeps for its
    backward)."""
    h, d = cfg["heads"], cfg["head_dim"]
    mixed = conv(x["mixed"].detach().requires_grad_(backward or track), x["weight"])
    if layer == "mamba1":
        out = mix(mixed, x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["bias"])
    elif layer == "gated_delta":
        mixed = mixed.transpose(1, 2)
        q, k, v = (t.reshape(1, mixed.size(1), h, d) for t in mixed.split(h * d, dim=-1))
        out = mix(q, k, v, x["g"], x["beta"])
    else:
        xs, B, C = mixed.transpose(1, 2).split([h * d, cfg["state"], cfg["state"]], dim=-1)
        out = mix(xs.reshape(1, xs.size(1), h, d), x["dt"], x["A"], B[:, :, None], C[:, :, None], x["D"])
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
    s, d = cfg["seq"] // world, 128
    with cp_cache.context_parallel(mesh):
        q, k, v = (DTensor.from_local(torch.randn(1, n, s, d), mesh, [Shard(2)]) for n in (8, 2, 2))
        torch.ops.cp_cache.fusion_attention(q, k, v, 8, "BNSD", scale=d ** -0.5, **causal_arguments("cpu"))
        return int(cp_cache.call_stats()["forward"]["bytes_sent"])


def _single_row(layer: str, cfg: dict, x: dict) -> dict:
    from ...mixers.delta_rule import chunk_gated_delta_rule
    from ...mixers.selective_scan import selective_scan
    from ...mixers.short_conv import causal_conv_documents
    from ...mixers.ssd import ssd_scan

    def conv(t, w):
        return causal_conv_documents(t, w, None, (t.size(-1),), "silu")

    def mix(*args):
        if layer == "gated_delta":
            return chunk_gated_delta_rule(*args, use_qk_l2norm=True)[0]
        if layer == "mamba1":
            return selective_scan(*args[:5], D=args[5], z=args[6], delta_bias=args[7], delta_softplus=True)[0]
        return ssd_scan(*args[:5], D=args[5])[0]

    row = {}
    for backward in (False, True):
        name = "forward_backward" if backward else "forward"
        row[f"{name}_single_s"] = _timed(lambda: _layer(layer, x, cfg, conv, mix, backward), cfg["repeats"])
    row["saved_single_bytes"] = _saved_bytes(lambda: _layer(layer, x, cfg, conv, mix, False, track=True))
    return row


def _cp_mix(layer: str, seq, algorithm: str):
    from ...mixers.gated_delta import delta_rule_under_cp
    from ...mixers.mamba1 import selective_scan_under_cp
    from ...mixers.mamba2 import ssd_under_cp

    def mix(*args):
        if layer == "gated_delta":
            return delta_rule_under_cp(*args, seq, algorithm=algorithm, use_qk_l2norm=True)
        if layer == "mamba1":
            return selective_scan_under_cp(*args[:5], seq, D=args[5], z=args[6], delta_bias=args[7],
                                           delta_softplus=True, algorithm=algorithm)
        return ssd_under_cp(*args, seq, algorithm)
    return mix


def _heads(layer: str, cfg: dict) -> int:
    """What the head form shards: heads, or Mamba's channels."""
    return cfg["heads"] * cfg["head_dim"] if layer == "mamba1" else cfg["heads"]


def mixers_rank(plan: dict, rank: int, world: int, mesh) -> list[dict]:
    import torch
    import torch.distributed as dist

    import cp_cache
    from ...documents import sequence_positions
    from ...mixers import sequence
    from ...mixers.short_conv import causal_conv_under_cp

    torch.set_num_threads(1)
    rows = []
    for layer, cfg in plan["mixers"].items():
        full = _inputs(layer, cfg)
        single = _single_row(layer, cfg, full) if rank == 0 else {}
        dist.barrier()
        held = sequence_positions(rank, world, cfg["seq"] // world, True)
        seq_dim = {"mixed": 2} if layer != "mamba1" else {n: 2 for n in ("mixed", "delta", "B", "C", "z", "dout")}
        local = {n: t if t.dim() < 3 else t.index_select(seq_dim.get(n, 1), held) for n, t in full.items()}
        for form, algorithm in FORMS.items():
            if form == "heads" and _heads(layer, cfg) % world:
                continue
            with cp_cache.context_parallel(mesh, algorithm=algorithm):
                seq = sequence.current(held.numel())
                mix = _cp_mix(layer, seq, algorithm)

                def conv(t, w):
                    return causal_conv_under_cp(t, w, None, seq, "silu")

                def run(backward: bool, track: bool = False):
                    return _layer(layer, local, cfg, conv, mix, backward, track)

                row = dict(layer=layer, form=form, world_size=world, seq=cfg["seq"], heads=cfg["heads"],
                           head_dim=cfg["head_dim"], **single)
                for backward in (False, True):
                    name = "forward_backward" if backward else "forward"
                    row[f"{name}_cp_s"] = _timed(lambda: run(backward), cfg["repeats"])
                    if single:
                        row[f"{name}_efficiency"] = single[f"{name}_single_s"] / (world * row[f"{name}_cp_s"])
                row["sent_bytes"] = _sent_bytes(lambda: run(False))
                row["saved_cp_bytes"] = _saved_bytes(lambda: run(False, track=True))
            row["attention_sent_bytes"] = _attention_bytes(cfg, mesh, world)
            rows.append(row)
    return rows


def print_mixers(report: dict) -> None:
    rows = report.get("mixers") or []
    if not rows:
        return
    print("\nrecurrent mixer layers under CP (rank 0; seconds; efficiency = one process / (W x CP); MiB per layer)")
    lines = [[f"{r['layer']} {r['form']} W={r['world_size']}", f"{r['forward_single_s']:.3f}",
              f"{r['forward_cp_s']:.3f}", f"{r['forward_efficiency']:.2f}", f"{r['forward_backward_single_s']:.3f}",
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
    ax.set_title(f"recurrent mixer layers under CP, CPU, S={rows[0]['seq']}")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


SECTION = Section(
    name="mixers",
    about="recurrent mixer layers under CP (Gated DeltaNet and Mamba-2, both CP forms) beside one process on the same "
          "kernels: efficiency against the ideal W x, bytes sent beside an attention layer's, bytes kept",
    quick=dict(mixers=dict(gated_delta=dict(seq=256, heads=4, head_dim=16, repeats=1),
                           mamba2=dict(seq=256, heads=4, head_dim=16, state=16, repeats=1),
                           mamba1=dict(seq=256, heads=4, head_dim=16, state=8, repeats=1))),
    full=dict(mixers=dict(gated_delta=dict(seq=8192, heads=4, head_dim=128, repeats=5),
                          mamba2=dict(seq=8192, heads=8, head_dim=64, state=128, repeats=5),
                          mamba1=dict(seq=8192, heads=4, head_dim=64, state=16, repeats=3))),
    rank=mixers_rank, runs_at=lambda plan, world: world == 2, all_ranks=False, summary=print_mixers,
    plots=(("bench_mixers.png", draw_mixers),),
)
