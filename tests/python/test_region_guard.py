"""The CP region refuses what it would compute wrong, on every rank, and stays usable: q/k/v taken along the heads
or the batch dim, K/V left out of the buffers, buffers whose sequence lengths differ, an SDPA mask made for the
local shard, flex_attention on the shards (torch's FLEX wrapper, which all-gathers K/V, keeps working), a
transformers model whose attention is "eager", an attention module that never reaches cp_cache, and a model with a
token mixer no kind serves (handed to the region, or starting inside it). After each refusal nothing is alive in
the store and the next valid call on the same process group equals one process (float64 truth; the bound is a
multiple of the float32 one-process error). One spawned rank group per world size (gloo, W = 2 and 4)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import cp_cache
from cp_cache.testing.hybrid_models import make_hybrid_model
from cp_cache.testing.multiprocess import capture, run_ranks
from cp_cache.testing.reference import error_bound, rel_err

WORLDS = (2, 4)
HEADS, DIM = 2, 8


def _inputs(seq: int, batch: int = 1):
    g = torch.Generator().manual_seed(seq)
    return [torch.randn(batch, HEADS, seq, DIM, generator=g) for _ in range(3)]


def _valid_call(mesh) -> tuple[float, float]:
    """Causal SDPA on q/k/v sharded as buffers (head-tail): (error of this rank's rows, bound)."""
    from cp_cache.documents import sequence_positions
    world, rank, seq = mesh.size(), mesh.get_local_rank(), 16 * mesh.size()
    full = _inputs(seq)
    truth = F.scaled_dot_product_attention(*(t.double() for t in full), is_causal=True)
    one_process = F.scaled_dot_product_attention(*full, is_causal=True)
    q, k, v = (t.clone() for t in full)
    with cp_cache.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    held = sequence_positions(rank, world, seq // world, True)
    return rel_err(out.double(), truth[:, :, held]), error_bound(rel_err(one_process.double(), truth))


def _sdpa_on(mesh, tensors, seq_dims, qkv=lambda ts: ts):
    def run():
        with cp_cache.context_parallel(mesh, buffers=tensors, buffer_seq_dims=seq_dims):
            F.scaled_dot_product_attention(*qkv(tensors), is_causal=True)
    return run


def _region_inputs(mesh) -> dict:
    world, seq = mesh.size(), 16 * mesh.size()
    q, k, v = _inputs(seq)
    heads = [t.clone() for t in _inputs(seq)]
    heads = [torch.cat([t] * world, dim=1) for t in heads]  # N = 2W heads: shardable on the heads dim
    batch = _inputs(16, batch=2 * world)  # B = 2W: shardable on the batch dim
    return {
        "heads_dim": _sdpa_on(mesh, heads, [1, 1, 1]),
        "batch_dim": _sdpa_on(mesh, batch, [0, 0, 0]),
        "kv_outside_buffers": _sdpa_on(mesh, [q], [2], lambda ts: (ts[0], k, v)),
        "buffers_disagree": _sdpa_on(mesh, [q, k[:, :, : seq // 2].clone()], [2, 2], lambda ts: (ts[0], ts[0], ts[0])),
        "sdpa_local_mask": _sdpa_local_mask(mesh),
    }


def _sdpa_local_mask(mesh):
    seq = 16 * mesh.size()
    q, k, v = _inputs(seq)

    def run():
        with cp_cache.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            local = q.size(2)
            mask = torch.ones(local, local, dtype=torch.bool).tril()[None, None]
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


class FlexAttention(torch.nn.Module):
    def __init__(self, block_mask):
        super().__init__()
        self.block_mask = block_mask

    def forward(self, q, k, v):
        from torch.nn.attention.flex_attention import flex_attention
        return flex_attention(q, k, v, block_mask=self.block_mask)


def _flex_cases(mesh) -> dict:
    """Contiguous shards (no load balancing), S = 128 W: a block mask for the local length on the shards is refused;
    torch's FLEX wrapper (K/V all-gathered, a block mask for the local queries over all keys) equals one process."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel, _cp_options
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask
    world, rank, seq = mesh.size(), mesh.get_local_rank(), 128 * mesh.size()
    local = seq // world
    full = _inputs(seq)
    causal = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, local, local, device="cpu")
    offset = rank * local
    wrapped = create_block_mask(lambda b, h, i, j: j <= i + offset, 1, 1, local, seq, device="cpu")
    module = parallelize_module(FlexAttention(wrapped), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    res, before = {}, _cp_options.enable_load_balance
    _cp_options.enable_load_balance = False
    try:
        q, k, v = (t.clone() for t in full)
        with cp_cache.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            res["flex_local"] = capture(lambda: FlexAttention(causal)(q, k, v))
            out = module(q, k, v)
    finally:
        _cp_options.enable_load_balance = before
    truth = F.scaled_dot_product_attention(*(t.double() for t in full), is_causal=True)[:, :, offset:offset + local]
    one_process = F.scaled_dot_product_attention(*full, is_causal=True)[:, :, offset:offset + local]
    res["flex_wrapper"] = (rel_err(out.double(), truth), error_bound(rel_err(one_process.double(), truth)))
    return res


class ToyAttention(torch.nn.Module):
    """An attention module of its own (a transformers-style config, but attention computed in place)."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(_attn_implementation="cp_cache")
        self.proj = torch.nn.Linear(DIM, 3 * DIM)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def _model_cases(mesh) -> dict:
    import transformers as tf
    from cp_cache.integrations.transformers import register
    register()
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, use_cache=False)
    ids, positions = torch.randint(0, 64, (1, 16 * mesh.size())), torch.arange(16 * mesh.size())[None]

    def run_model(network, **region):
        def run():
            with cp_cache.context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1], **region):
                network(input_ids=ids, position_ids=positions).logits.sum().backward()
        return run

    eager = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**common), attn_implementation="eager")
    hybrid = make_hybrid_model("minimax", "cp_cache")  # lightning attention, which no kind serves
    x = torch.randn(1, 16 * mesh.size(), DIM)
    toy = ToyAttention()

    def run_toy():
        with cp_cache.context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            toy(x)
    return {"eager_attention": run_model(eager), "hybrid_starting": run_model(hybrid),
            "hybrid_given": run_model(hybrid, model=hybrid), "own_attention": run_toy}


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    res = {}
    for name, run in {**_region_inputs(mesh), **_model_cases(mesh)}.items():
        res[name] = capture(run)
        res[f"{name}/live"] = cp_cache.stats()["live_entries"]
        res[f"{name}/next call"] = _valid_call(mesh)
    res.update(_flex_cases(mesh))
    res["flex/next call"] = _valid_call(mesh)
    return res


_RESULTS: dict[int, list] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank, world, timeout=600.0)
    return _RESULTS[world]


# each refusal: its error type and the words its message must hold
REFUSALS = {
    "heads_dim": ("ValueError", ("fits none of the CP region's buffers", "buffers[0]: dim 1", "another dimension")),
    "batch_dim": ("ValueError", ("fits none of the CP region's buffers", "buffers[0]: dim 0")),
    "kv_outside_buffers": ("ValueError", ("key has", "whole sequence", "buffers[0]: dim 2")),
    "buffers_disagree": ("ValueError", ("sequence lengths differ", "buffers[1]", "dim 2")),
    "sdpa_local_mask": ("ValueError", ("attn_mask of shape", "this rank's shard", "attn_implementation='cp_cache'")),
    "eager_attention": ("NotImplementedError", ("LlamaForCausalLM layer 0", "attn_implementation='eager'",
                                                "model.layers.0.self_attn")),
    "hybrid_starting": ("NotImplementedError", ("MiniMaxForCausalLM layer 0", "'linear_attention'",
                                                "MiniMaxLightningAttention", "model.layers.0.self_attn")),
    "hybrid_given": ("NotImplementedError", ("MiniMaxForCausalLM layer 0", "'linear_attention'")),
    "own_attention": ("NotImplementedError", ("ToyAttention", "without reaching cp_cache's attention")),
    "flex_local": ("NotImplementedError", ("flex_attention", "_ContextParallel", "scaled_dot_product_attention")),
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refused_on_every_rank_and_the_group_goes_on(world, name):
    kind, words = REFUSALS[name]
    results = _results(world)
    for rank, res in enumerate(results):
        got_kind, message = res[name]
        assert got_kind == kind and all(w in message for w in words), (rank, got_kind, message)
        next_call = res["flex/next call" if name.startswith("flex") else f"{name}/next call"]
        assert next_call[0] <= next_call[1], (rank, next_call)
        if not name.startswith("flex"):
            assert res[f"{name}/live"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_torch_flex_wrapper_keeps_working(world):
    for rank, res in enumerate(_results(world)):
        error, bound = res["flex_wrapper"]
        assert error <= bound, (rank, error, bound)


def test_outside_a_region_nothing_is_refused():
    """The same model, attention and flex run as they are outside a CP region, with cp_cache enabled."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    cp_cache.enable()
    try:
        ToyAttention()(torch.randn(1, 8, DIM))
        q, k, v = _inputs(128)
        flex_attention(q, k, v, block_mask=create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 128, 128, device="cpu"))
    finally:
        cp_cache.disable()
