"""Shared pieces of the lifetime tests (test_lifetime.py, test_soak.py): a small model
whose attention runs through the CP handlers, a forward with pluggable
checkpointing, gradient collection and store snapshots.

Everything here runs inside a rank process started by ``run_ranks`` (a gloo
world on loopback), so it must stay importable by name.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as ckpt

import cp_cache
from cp_cache.testing.models import ModelConfig, TinyDecoder, loss_fn, make_batch

SEQ = 16  # divisible by 2 * W for W in (1, 2): head-tail load balancing
BATCH = 2
CONFIG = ModelConfig(vocab=32, dim=16, heads=2, kv_heads=2, layers=2, max_seq=64)
DROPOUT = 0.25


class Env:
    """What a rank needs to run a case: its rank, the world size, the 1-D CPU mesh (``mesh``:
    that one, e.g. a one-rank mesh of a larger world; default: the whole world's)."""

    def __init__(self, rank: int, world: int, mesh=None):
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = rank, world
        self.mesh = init_device_mesh("cpu", (world,)) if mesh is None else mesh
        assert self.mesh.size() == world, (self.mesh.size(), world)


# ------------------------------------------------------------------ model and forward


def make_model(dropout: float = 0.0, seed: int = 0, config: ModelConfig = CONFIG) -> TinyDecoder:
    """The same weights on every rank and for every call with the same arguments."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TinyDecoder(ModelConfig(**{**config.__dict__, "dropout": dropout}))
    return model


def twin(model: TinyDecoder) -> TinyDecoder:
    return copy.deepcopy(model)


def batch(seed: int = 0, seq: int = SEQ, size: int = BATCH, vocab: int = CONFIG.vocab):
    return make_batch(size, seq, vocab, seed=seed)


# A body maps (blocks, x) -> x: it decides how each block runs (checkpointing).
Body = Callable[[torch.nn.ModuleList, torch.Tensor], torch.Tensor]


def plain_body(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def per_block(wrap) -> Body:
    """A body that runs block i as ``wrap(i, block, x)``."""

    def body(blocks, x):
        for i, block in enumerate(blocks):
            x = wrap(i, block, x)
        return x

    return body


def checkpoint_body(reentrant: bool, preserve_rng_state: bool = True, record: dict | None = None) -> Body:
    """Per-block torch.utils.checkpoint; ``record`` collects the RNG state each call of block i
    started with (the last one is the recompute's)."""

    def wrap(i, block, x):
        def fn(y):
            if record is not None:
                record.setdefault(i, []).append(torch.get_rng_state())
            return block(y)

        return ckpt.checkpoint(fn, x, use_reentrant=reentrant, preserve_rng_state=preserve_rng_state)

    return per_block(wrap)


def nested_body(outer_reentrant: bool) -> Body:
    """An outer checkpoint over all blocks, each block checkpointed again (non-reentrant) inside."""
    inner = checkpoint_body(reentrant=False)

    def body(blocks, x):
        return ckpt.checkpoint(lambda y: inner(blocks, y), x, use_reentrant=outer_reentrant)

    return body


def attention_op():
    return torch.ops.npu.npu_fusion_attention_v3.default


def selective_body(save_attention: bool) -> Body:
    """create_selective_checkpoint_contexts per block; the attention op saved or recomputed."""

    def policy(ctx, op, *args, **kwargs):
        if save_attention and op == attention_op():
            return ckpt.CheckpointPolicy.MUST_SAVE
        return ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    def wrap(i, block, x):
        return ckpt.checkpoint(
            block, x, use_reentrant=False,
            context_fn=lambda: ckpt.create_selective_checkpoint_contexts(policy),
        )

    return per_block(wrap)


def replay_body(original: dict, recompute: dict) -> Body:
    """No checkpointing; what a checkpoint with ``preserve_rng_state=False`` computes: block i's
    value is the original forward's (RNG state ``original[i]``: downstream layers saved
    activations of that forward), its derivative that of the recompute (``recompute[i]``),
    taken at the block's original input."""

    def wrap(i, block, x):
        torch.set_rng_state(original[i])
        with torch.no_grad():
            value = block(x)
        torch.set_rng_state(recompute[i])
        y = block(x)
        return y + (value - y).detach()

    return per_block(wrap)


def forward(model: TinyDecoder, tokens, positions, body: Body = plain_body):
    x = model.embed(tokens) + model.position(positions)
    x = body(model.blocks, x)
    return model.norm(x) @ model.embed.weight.t()


@contextlib.contextmanager
def sharded(env: Env, *datas):
    """Each (tokens, labels, positions) batch as this rank's shards, inside
    cp_cache.context_parallel: forwards *and* backwards must run inside (a checkpoint
    recomputes its forward during backward, and that forward needs CP too)."""
    buffers = [t.clone() for data in datas for t in data]
    with cp_cache.context_parallel(
        env.mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        yield [tuple(buffers[3 * i: 3 * i + 3]) for i in range(len(datas))]


def local_loss(model, shard, body: Body = plain_body):
    """The loss of this rank's shard (mean over its tokens)."""
    tokens, labels, positions = shard
    return loss_fn(forward(model, tokens, positions, body), labels)


def cp_grads(env: Env, model, data, body: Body = plain_body, seed: int | None = None) -> dict:
    """Forward and backward of one batch under CP (from RNG state ``seed`` when given);
    the rank-averaged gradients (the model's are reset)."""
    with sharded(env, data) as (shard,):
        if seed is not None:
            torch.manual_seed(seed)
        local_loss(model, shard, body).backward()
    return grads(env, model)


# ------------------------------------------------------------------ gradients and stats


def grads(env: Env, model, reset: bool = True) -> dict:
    """The model's gradients averaged over ranks (= the dense gradient of the global mean loss)."""
    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if env.world > 1:
            dist.all_reduce(g)
            g /= env.world
        out[name] = g
        if reset:
            p.grad = None
    return out


def dense_grads(model, data, body: Body = plain_body) -> dict:
    """Single-process gradients of the global mean loss (no CP), on a copy of the model."""
    ref = twin(model)
    tokens, labels, positions = data
    loss_fn(forward(ref, tokens, positions, body), labels).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def add(a: dict | None, b: dict) -> dict:
    return dict(b) if a is None else {k: a[k] + b[k] for k in a}


def rel_err(got: dict, ref: dict) -> float:
    worst = 0.0
    for name, r in ref.items():
        diff = (got[name].detach() - r.detach()).abs().max()
        worst = max(worst, float(diff / r.detach().abs().max().clamp_min(1e-12)))
    return worst


def snap() -> dict:
    s = cp_cache.stats()
    return {k: int(s[k]) for k in ("live_entries", "live_bytes", "stack_depth")}
