"""Train a tiny decoder under context parallelism and watch the step caches.

Each rank runs ``TinyDecoder`` (attention through F.scaled_dot_product_attention,
which reaches ``npu_fusion_attention_v3``: the real op on an NPU, the CPU
emulator elsewhere) inside ``cp_cache.context_parallel``, which shards tokens,
labels and positions on the sequence (head-tail load balanced). Gradients are
averaged over the CP ranks, as a data-parallel wrapper would. The same run is
repeated under each policy from the same seed.

Per step the table shows the training loss (CP, dropout on), the parity check
(the same weights evaluated with dropout off under CP and on one process, over
the whole sequence), and the step caches alive (count and bytes, max over
ranks) after forward, after backward and after the no-grad evaluation, plus the
step's peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ._common import Progress, fmt_bytes, launch, table, under_torchrun

NAME = "demo"
HELP = "train a tiny decoder under context parallelism; loss parity and live step caches per step"

PARITY_TOL = 1e-4  # |eval loss CP - eval loss one process|, fp32


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..testing.models import CHECKPOINT_MODES

    p.add_argument("--steps", type=int, default=30, help="training steps per policy (default 30)")
    p.add_argument("--ranks", type=int, default=2, help="CP ranks spawned on this machine (default 2; "
                   "ignored under torchrun)")
    p.add_argument("--seq-len", type=int, default=256, help="global sequence length (default 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--policy", choices=("handle", "stack", "both"), default="both",
                   help="step-cache policy (default both, side by side)")
    p.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="non_reentrant",
                   help="activation checkpointing of each block (default non_reentrant: full)")
    p.add_argument("--dropout", type=float, default=0.1, help="attention dropout (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="K/V heads (GQA when fewer than --heads)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--compile", action="store_true",
                   help="compile each decoder block with torch.compile (the ring runs inside the compiled graphs)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend with --compile (default inductor; aot_eager compiles faster)")
    p.add_argument("--json", type=Path, default=None, help="also write the measured rows to this JSON file")


# ---------------------------------------------------------------- one rank


def _set_dropout(model, p: float) -> None:
    from ..testing.models import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            module.dropout = p


def _live():
    import cp_cache

    s = cp_cache.stats()
    return s["live_entries"], s["live_bytes"]


def _average_grads(model, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _global_mean(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _grad_parity(model, mesh, batch, device, world_size: int, rank: int) -> float:
    """max |grad CP - grad one process| of the loss with dropout off, same weights."""
    import cp_cache
    from ..testing.models import loss_fn

    tokens, labels, positions = (t.clone() for t in batch)
    _set_dropout(model, 0.0)
    try:
        model.zero_grad(set_to_none=True)
        with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1]):
            loss_fn(model(tokens, positions), labels).backward()
        _average_grads(model, world_size)
        cp_grads = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        diff = 0.0
        if rank == 0:
            loss_fn(model(*(batch[0], batch[2])), batch[1]).backward()
            diff = max(float((a - p.grad).abs().max()) for a, p in zip(cp_grads, model.parameters()))
            model.zero_grad(set_to_none=True)
        return diff
    finally:
        _set_dropout(model, model.config.dropout)


def _train(policy: str, opts: dict, rank: int, world_size: int, device, mesh, progress) -> dict:
    import torch

    import cp_cache

    cp_cache.enable(policy=policy)
    torch.manual_seed(opts["seed"])
    model, optimizer, batch = _model_optimizer_batch(opts, device)
    grad_diff = _grad_parity(model, mesh, batch, device, world_size, rank)
    rows = []
    started = time.perf_counter()
    for step in range(opts["steps"]):
        t0 = time.perf_counter()
        train_loss, alive = _train_step(model, optimizer, batch, mesh, world_size)
        train_seconds = time.perf_counter() - t0
        eval_cp, eval_one, after_eval = _eval_parity(model, batch, mesh, rank)
        stats = cp_cache.stats()
        rows.append(dict(
            step=step + 1, train_loss=train_loss, eval_cp=eval_cp, eval_one=eval_one, **alive,
            live_eval=after_eval[0], bytes_eval=after_eval[1],
            peak_entries=stats["peak_entries"], peak_bytes=stats["peak_bytes"],
            seconds=time.perf_counter() - t0, train_seconds=train_seconds,
        ))
        if progress is not None:
            progress.update(step + 1, f"loss {train_loss:.4f}")
    seconds = time.perf_counter() - started
    final = cp_cache.stats()
    cp_cache.disable()  # drops what the stack still holds
    return dict(policy=policy, rows=rows, grad_diff=grad_diff, seconds=seconds, final_stats=final)


def _model_optimizer_batch(opts: dict, device):
    """The tiny decoder (compiled when asked), its AdamW and the one fixed batch, on ``device``."""
    import torch

    from ..testing.models import ModelConfig, TinyDecoder, make_batch

    config = ModelConfig(
        vocab=64, dim=opts["dim"], heads=opts["heads"], kv_heads=opts["kv_heads"], layers=opts["layers"],
        max_seq=opts["seq_len"], dropout=opts["dropout"],
    )
    model = TinyDecoder(config, checkpoint=opts["checkpoint"])
    with torch.no_grad():  # small embeddings (the head is tied): a first loss near log(vocab)
        model.embed.weight.normal_(0.0, 0.02)
        model.position.weight.normal_(0.0, 0.02)
    model = model.to(device)
    if opts.get("compile"):
        _compile_blocks(model, opts.get("compile_backend", "inductor"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    # one fixed batch: the model memorises it, so the loss visibly falls in a few dozen steps
    batch = tuple(t.to(device) for t in make_batch(opts["batch"], opts["seq_len"], config.vocab, seed=opts["seed"]))
    return model, optimizer, batch


def _train_step(model, optimizer, batch, mesh, world_size: int) -> tuple[float, dict]:
    """One training step under CP: the loss (mean over ranks), and the step-cache entries and
    bytes new in the forward and alive after the forward and after the backward."""
    import cp_cache
    from ..testing.models import loss_fn

    tokens, labels, positions = (t.clone() for t in batch)
    before = _live()
    cp_cache.reset_peak()
    model.train()
    with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1]):
        loss = loss_fn(model(tokens, positions), labels)
        fwd = _live()
        loss.backward()
    bwd = _live()
    train_loss = _global_mean(float(loss.detach()))
    del loss
    _average_grads(model, world_size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return train_loss, dict(new_fwd=fwd[0] - before[0], new_bytes_fwd=fwd[1] - before[1],
                            live_fwd=fwd[0], bytes_fwd=fwd[1], live_bwd=bwd[0], bytes_bwd=bwd[1])


def _eval_parity(model, batch, mesh, rank: int) -> tuple[float, float, tuple]:
    """Parity: the eval loss of the updated weights, dropout off, under CP and on one process
    (rank 0; NaN elsewhere), and the (entries, bytes) alive after the CP eval."""
    import torch

    import cp_cache
    from ..testing.models import loss_fn

    model.eval()
    tokens, labels, positions = (t.clone() for t in batch)
    with torch.no_grad():
        with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1]):
            eval_cp = _global_mean(float(loss_fn(model(tokens, positions), labels)))
        after_eval = _live()
        eval_one = float(loss_fn(model(batch[0], batch[2]), batch[1])) if rank == 0 else float("nan")
    return eval_cp, eval_one, after_eval


def _compile_blocks(model, backend: str) -> None:
    """Each block compiled, as torchtitan does; the graphs are traced afresh for each policy."""
    import torch
    import torch._functorch.config as functorch_config

    # torch's AOTAutograd cache can crash (SIGSEGV in pickle) saving a backward graph that calls
    # a custom op (pytorch/pytorch#177442; seen here in about 1 run in 4): the demo compiles once anyway
    functorch_config.enable_autograd_cache = False
    torch._dynamo.reset()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, backend=backend)


def demo_rank(rank: int, world_size: int, opts: dict) -> dict:
    """The demo on one rank: every requested policy in turn, from the same seed."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ._common import rank_device, setup_ops

    ops = setup_ops()
    device = rank_device(rank)
    mesh = init_device_mesh(device.type, (world_size,))
    policies = ["handle", "stack"] if opts["policy"] == "both" else [opts["policy"]]
    runs = []
    for policy in policies:
        progress = Progress(opts["steps"], f"{policy:>6}") if rank == 0 and opts.get("progress", True) else None
        runs.append(_train(policy, opts, rank, world_size, device, mesh, progress))
    return dict(rank=rank, world_size=world_size, ops=ops, device=str(device), torch=torch.__version__, runs=runs)


# ---------------------------------------------------------------- report


def _merge_ranks(results: list[dict]) -> list[dict]:
    """Per policy: rank 0's losses and parity, the caches as the max over ranks."""
    merged = []
    for index, run0 in enumerate(results[0]["runs"]):
        rows = []
        for step, row0 in enumerate(run0["rows"]):
            row = dict(row0)
            for key in ("new_fwd", "new_bytes_fwd", "live_fwd", "bytes_fwd", "live_bwd", "bytes_bwd", "live_eval", "bytes_eval",
                        "peak_entries", "peak_bytes", "seconds", "train_seconds"):
                row[key] = max(r["runs"][index]["rows"][step][key] for r in results)
            row["parity"] = abs(row["eval_cp"] - row["eval_one"])
            rows.append(row)
        merged.append(dict(policy=run0["policy"], rows=rows, grad_diff=run0["grad_diff"],
                           seconds=max(r["runs"][index]["seconds"] for r in results)))
    return merged


def _step_table(run: dict) -> str:
    headers = ["step", "train loss", "eval CP", "eval 1-proc", "|diff|",
               "held fwd->bwd", "after fwd", "after bwd", "after eval", "peak"]

    def cell(n, b):
        return f"{n} / {fmt_bytes(b)}"

    rows = [[r["step"], f"{r['train_loss']:.5f}", f"{r['eval_cp']:.6f}", f"{r['eval_one']:.6f}",
             f"{r['parity']:.1e}", cell(r["new_fwd"], r["new_bytes_fwd"]), cell(r["live_fwd"], r["bytes_fwd"]), cell(r["live_bwd"], r["bytes_bwd"]),
             cell(r["live_eval"], r["bytes_eval"]), cell(r["peak_entries"], r["peak_bytes"])]
            for r in run["rows"]]
    return table(headers, rows)


def _summary(run: dict) -> dict:
    rows = run["rows"]
    return dict(
        policy=run["policy"],
        final_loss=rows[-1]["train_loss"] if rows else float("nan"),
        first_loss=rows[0]["train_loss"] if rows else float("nan"),
        max_parity=max((r["parity"] for r in rows), default=0.0),
        grad_diff=run["grad_diff"],
        max_fwd=max((r["live_fwd"] for r in rows), default=0),
        max_fwd_bytes=max((r["bytes_fwd"] for r in rows), default=0),
        held=max((r["new_fwd"] for r in rows), default=0),
        held_bytes=max((r["new_bytes_fwd"] for r in rows), default=0),
        max_bwd=max((r["live_bwd"] for r in rows), default=0),
        last_eval=rows[-1]["live_eval"] if rows else 0,
        last_eval_bytes=rows[-1]["bytes_eval"] if rows else 0,
        max_peak=max((r["peak_entries"] for r in rows), default=0),
        max_peak_bytes=max((r["peak_bytes"] for r in rows), default=0),
        seconds=run["seconds"],
        first_step_seconds=rows[0]["train_seconds"] if rows else float("nan"),
        median_step_seconds=statistics.median(r["train_seconds"] for r in rows[1:]) if len(rows) > 1 else float("nan"),
    )


def _verdict(summaries: list[dict], opts: dict, world_size: int) -> str:
    from ._shapes import torch_npu_entry_bytes

    by = {s["policy"]: s for s in summaries}
    layers, mode = opts["layers"], opts["checkpoint"]
    parts = []
    ok = all(s["max_parity"] <= PARITY_TOL for s in summaries)
    worst = max(s["max_parity"] for s in summaries)
    worst_grad = max(s["grad_diff"] for s in summaries)
    parts.append(
        f"Over {opts['steps']} steps on {world_size} ranks ({layers} layers, checkpoint={mode}, "
        f"dropout={opts['dropout']}), the dropout-free evaluation under CP "
        f"{'matched' if ok else 'did NOT match'} the one-process model on the same weights "
        f"(worst |diff| {worst:.1e}, tolerance {PARITY_TOL:.0e}; before training, dropout-free gradients "
        f"differed by at most {worst_grad:.1e})."
    )
    if "handle" in by:
        h = by["handle"]
        parts.append(
            f"The handle policy held {h['held']} step caches between forward and backward "
            f"({fmt_bytes(h['held_bytes'])}), {h['max_bwd']} after backward and {h['last_eval']} after "
            f"the no-grad evaluation (at most {h['max_peak']} alive at once, the recompute's own)."
        )
    if "stack" in by:
        s = by["stack"]
        parts.append(
            f"The stack policy held {s['held']} entries ({fmt_bytes(s['held_bytes'])}) from each forward "
            f"to its backward, and ended with {s['last_eval']} entries alive: each no-grad evaluation "
            f"forward pushed one entry per layer that no backward pops, so they pile up until CP is "
            f"disabled."
        )
    local = opts["seq_len"] // world_size
    npu = torch_npu_entry_bytes(opts["batch"], opts["heads"], local, opts["dim"] // opts["heads"], 4, world_size)
    per_step = layers  # one entry per layer, with or without checkpointing (recompute skips its push)
    parts.append(
        f"torch_npu's original entry (merged output, LSE and per-ring-step max/sum clones) would hold "
        f"{fmt_bytes(npu['total'])} per layer for these shapes, {fmt_bytes(per_step * npu['total'])} for "
        f"{layers} layers between forward and backward, where this store's entries hold "
        f"{'only seeds and offsets' if opts['dropout'] > 0 else 'only seed/offset placeholders'}."
    )
    if "handle" in by and "stack" in by:
        same = abs(by["handle"]["final_loss"] - by["stack"]["final_loss"]) <= 1e-6
        parts.append(
            f"Both policies trained {'to the same loss' if same else 'to different losses'} "
            f"({by['handle']['final_loss']:.6f} vs {by['stack']['final_loss']:.6f}): the policies differ "
            f"in what stays alive, not in what is computed."
        )
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    opts = dict(
        steps=args.steps, seq_len=args.seq_len, layers=args.layers, policy=args.policy,
        checkpoint=args.checkpoint, dropout=args.dropout, seed=args.seed, batch=args.batch,
        dim=args.dim, heads=args.heads, kv_heads=args.kv_heads, lr=args.lr,
        compile=args.compile, compile_backend=args.compile_backend,
    )
    if args.seq_len % (2 * args.ranks):
        print(f"note: --seq-len {args.seq_len} is not divisible by 2*ranks = {2 * args.ranks}; "
              "torch shards without load balancing only when it divides by ranks")
    started = time.perf_counter()
    results = launch(demo_rank, args.ranks, opts, timeout=max(600.0, 20.0 * args.steps))
    if results is None:  # a torchrun rank other than 0
        return 0
    world_size = results[0]["world_size"]
    runs = _merge_ranks(results)
    info = results[0]
    print(f"\ncp_cache demo: {world_size} ranks on {info['device']} ({info['ops']} attention ops, "
          f"torch {info['torch']}{', torchrun' if under_torchrun() else ', spawned, gloo on loopback'})")
    print(f"TinyDecoder: {args.layers} layers, dim {args.dim}, {args.heads} heads / {args.kv_heads} K/V heads, "
          f"batch {args.batch} x {args.seq_len} tokens (one fixed batch), checkpoint={args.checkpoint}, "
          f"dropout={args.dropout}, seed={args.seed}, "
          + (f"blocks compiled (torch.compile, backend {args.compile_backend})" if args.compile else "eager"))
    print("Columns: train loss = CP loss with dropout (mean over ranks); eval CP / eval 1-proc = the same "
          "weights after the step,\nevaluated with dropout off under CP and on one process over the whole "
          "sequence; |diff| = their difference (parity);\nheld fwd->bwd = step caches the training forward left "
          "alive for its backward (count / bytes, max over ranks);\nafter fwd / bwd / eval = step caches alive "
          "on a rank after the training forward, after its backward, after the no-grad\nevaluation; "
          "peak = most alive at once during the step.")
    for run_ in runs:
        print(f"\npolicy = {run_['policy']}  ({run_['seconds']:.1f} s)")
        print(_step_table(run_))
    summaries = [_summary(r) for r in runs]
    mode = f"compiled ({args.compile_backend})" if args.compile else "eager"
    for s in summaries:
        print(f"{s['policy']}: training step ({mode}, forward + backward + optimizer, max over ranks): first "
              f"{s['first_step_seconds']:.3f} s{' (compiles)' if args.compile else ''}, then median "
              f"{s['median_step_seconds']:.3f} s")
    print("\nside by side")
    headers = ["policy", "loss first -> last", "max |diff|", "max grad diff", "held fwd->bwd", "max after fwd",
               "max after bwd", "alive at end", "max peak", "seconds"]
    print(table(headers, [
        [s["policy"], f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}", f"{s['max_parity']:.1e}",
         f"{s['grad_diff']:.1e}", f"{s['held']} / {fmt_bytes(s['held_bytes'])}", f"{s['max_fwd']} / {fmt_bytes(s['max_fwd_bytes'])}", s["max_bwd"],
         f"{s['last_eval']} / {fmt_bytes(s['last_eval_bytes'])}",
         f"{s['max_peak']} / {fmt_bytes(s['max_peak_bytes'])}", f"{s['seconds']:.1f}"]
        for s in summaries
    ]))
    print("\nverdict: " + _verdict(summaries, opts, world_size))
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(options=opts, world_size=world_size, runs=runs,
                                             summaries=summaries, parity_tolerance=PARITY_TOL), indent=2))
        print(f"written: {args.json}")
    ok = all(s["max_parity"] <= PARITY_TOL for s in summaries)
    return 0 if ok else 1
