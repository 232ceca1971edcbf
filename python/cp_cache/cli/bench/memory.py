"""The ``memory`` section of ``python -m cp_cache bench``: step-cache bytes alive between forward
and backward, per layer, for TinyDecoder under ``cp_cache.context_parallel`` (layers x W x
checkpoint mode x policy), next to what torch_npu's original entry holds for the same shapes
(computed from the shapes; formula in the JSON)."""

from __future__ import annotations

from .._common import fmt_bytes, table
from .shared import Section

__all__ = ["SECTION"]


def memory_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import cp_cache

    rows = []
    for policy in ("handle", "stack"):
        cp_cache.enable(policy=policy)
        for mode in plan["modes"]:
            for layers in plan["layers"]:
                rows.append(dict(world_size=world_size, policy=policy, checkpoint=mode, layers=layers,
                                 **_one(plan["model"], mode, layers, world_size, mesh)))
        cp_cache.disable()
    return rows


def _one(m: dict, mode: str, layers: int, world_size: int, mesh) -> dict:
    """One training step of TinyDecoder: what the store holds between forward and backward."""
    import torch

    import cp_cache
    from ...testing.models import ModelConfig, TinyDecoder, loss_fn, make_batch
    from .._shapes import torch_npu_entry_bytes

    torch.manual_seed(0)
    config = ModelConfig(dim=m["dim"], heads=m["heads"], kv_heads=m["kv_heads"], layers=layers,
                         max_seq=m["seq"], dropout=0.1)
    model = TinyDecoder(config, checkpoint=mode)
    tokens, labels, positions = make_batch(m["batch"], m["seq"], config.vocab, seed=1)
    before = cp_cache.stats()
    with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1]):
        loss = loss_fn(model(tokens, positions), labels)
        held = cp_cache.stats()
        loss.backward()
    after = cp_cache.stats()
    del loss, model
    nbytes = held["live_bytes"] - before["live_bytes"]
    npu = torch_npu_entry_bytes(m["batch"], m["heads"], m["seq"] // world_size, m["dim"] // m["heads"], 4, world_size)
    return dict(held_entries=held["live_entries"] - before["live_entries"], held_bytes=nbytes,
                held_bytes_per_layer=nbytes / layers,
                left_after_backward=after["live_entries"] - before["live_entries"],
                torch_npu_bytes_per_layer=npu["total"], torch_npu_bytes=npu["total"] * layers)


def print_memory(report: dict) -> None:
    mem = report["memory"]
    if not mem:
        return
    print("\nmemory: step-cache bytes alive between forward and backward, per layer (rank 0)")
    rows = [[r["world_size"], r["checkpoint"], r["layers"], r["policy"], r["held_entries"],
             fmt_bytes(r["held_bytes_per_layer"]), fmt_bytes(r["torch_npu_bytes_per_layer"]),
             r["left_after_backward"]]
            for r in mem if r["layers"] == max(x["layers"] for x in mem)]
    print(table(["W", "checkpoint", "layers", "policy", "entries held", "bytes/layer",
                 "torch_npu bytes/layer", "left after bwd"], rows))


def memory_panel(ax, report: dict) -> None:
    """Step-cache bytes held against layers at the largest W, per policy and checkpointing."""
    mem = report["memory"]
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


SECTION = Section(
    name="memory",
    about="step-cache bytes alive between forward and backward, per layer, for TinyDecoder under "
          "cp_cache.context_parallel (layers x W x checkpoint mode x policy), next to torch_npu's original "
          "entry for the same shapes (computed; formula in the JSON)",
    quick=dict(layers=[1, 2], modes=["none", "non_reentrant"], model=dict(batch=1, seq=32, dim=32, heads=4,
                                                                          kv_heads=4)),
    full=dict(layers=[1, 2, 4], modes=["none", "non_reentrant", "reentrant", "selective_save_attention"],
              model=dict(batch=1, seq=128, dim=32, heads=4, kv_heads=4)),
    rank=memory_rank, all_ranks=False, summary=print_memory, panels=(memory_panel,),
)
