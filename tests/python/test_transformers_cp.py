"""cp_cache.integrations.transformers: tiny Llama, Qwen3, Gemma-3 (sliding window 3, smaller
than a head-tail chunk), gpt-oss (attention sinks on every layer, sliding window 5 on the first),
DeepSeek-V3 (MLA: q/k head dim 12, v head dim 6) and packed batches (DataCollatorWithFlattening's
cu_seq_lens: buffers laid out by cp_cache's document placement through
context_parallel(documents=): packed documents (TND) with no [S, S] mask, with Gemma-3's window
and gpt-oss's sinks and window; head-tail buffers: the documents as an explicit [S, S] mask;
contiguous buffers: the packed layout, with Gemma-3's window and DeepSeek-V3's MLA) train 2 AdamW steps with
attn_implementation="cp_cache" under cp_cache.context_parallel at W = 2 and 4 (gloo, one
spawned rank group per world size) with the loss and the gradients of one process with "eager",
in float32, within error_bound of the eager float32 model's own error against float64; Llama
compiled (dynamic=True) at three sequence lengths at W = 2. Outside a CP region the same models
equal "eager" (KV-cache decoding included); each refusal raises naming what it refuses.

Packed gpt-oss has no eager reference: transformers 5.24's gpt-oss builds its eager masks
without the position ids, so its eager attention crosses the documents of a packed batch (flash
attention and cp_cache follow cu_seq_lens). Its CP run is held against "cp_cache" in one process
instead (float32 and float64), whose sinks, documents and windows the other cases hold against
eager.
"""

from __future__ import annotations

import torch
import pytest

import cp_cache
from cp_cache.integrations.transformers import NAME, attention_forward, register
from cp_cache.testing import install_npu_emulator
from cp_cache.testing.multiprocess import capture, run_ranks
from cp_cache.testing.reference import error_bound, rel_err

import transformers_cases as tc

WORLDS = (2, 4)
CASES = [
    tc.Case("llama", "llama"),
    tc.Case("qwen3", "qwen3"),
    tc.Case("gemma3", "gemma3"),
    tc.Case("packed", "llama", packed=True),
    tc.Case("packed_documents", "llama", packed=True, documents=True),
    tc.Case("packed_contiguous", "llama", packed=True, load_balance=False),
    tc.Case("packed_gemma3", "gemma3", packed=True, documents=True),
    tc.Case("packed_gemma3_mask", "gemma3", packed=True),
    tc.Case("packed_gemma3_contiguous", "gemma3", packed=True, load_balance=False),
    tc.Case("gpt_oss", "gpt_oss"),
    tc.Case("packed_gpt_oss", "gpt_oss", packed=True, documents=True, reference="cp_cache"),
    tc.Case("deepseek_v3", "deepseek_v3"),
    tc.Case("packed_deepseek_v3", "deepseek_v3", packed=True, load_balance=False),
    # bfloat16 autocast: RoPE leaves q/k float32 beside a bfloat16 v (one dtype before the op)
    tc.Case("qwen3_bf16", "qwen3", autocast=True),
    tc.Case("packed_mask_bf16", "llama", packed=True, autocast=True),
    tc.Case("packed_gemma3_bf16", "gemma3", packed=True, documents=True, autocast=True),
]
# W = 2 only (a compile per rank is the suite's slowest part): a new sequence length every step
COMPILED = tc.Case("llama_compiled", "llama", lengths=(32, 48, 64), compiled=True)
CASES_AT = {2: CASES + [COMPILED], 4: CASES}


@pytest.fixture(scope="module", autouse=True)
def emulator():
    install_npu_emulator()
    register()
    yield


@pytest.fixture(autouse=True)
def no_live_caches():
    yield
    assert cp_cache.stats()["live_entries"] == 0


# ---------------------------------------------------------------- rank side


def _cp_refusals(mesh) -> dict:
    """Refusals under CP, on every rank: position_ids left out of the buffers (contiguous shards:
    rank 0's own positions happen to be right, the others' are not), and a region entered through
    torch's context_parallel() alone."""
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    case = tc.Case("llama", "llama")
    model = tc.make_model(case, NAME)
    res = {}
    ids = tc.make_batch(case, 0)["input_ids"]
    before, _cp_options.enable_load_balance = _cp_options.enable_load_balance, False
    try:
        with cp_cache.context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
            res["positions_not_sharded"] = capture(lambda: model(input_ids=ids))
    finally:
        _cp_options.enable_load_balance = before
    ids = tc.make_batch(case, 0)["input_ids"]
    cp_cache.enable()
    try:
        with torch_context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
            res["torch_region"] = capture(lambda: model(input_ids=ids))
    finally:
        cp_cache.disable()
    packed = tc.Case("packed", "llama", packed=True)
    for name, change in (("documents_missing", ("cu_seq_lens_q", "cu_seq_lens_k")),
                         ("documents_differ", ())):
        batch = tc.make_batch(packed, 0)
        cu = batch["cu_seq_lens_q"]
        region = cu if not change else cu.clone()
        if not change:  # the region's documents are not the batch's
            region = torch.tensor([0, int(cu[1]) + 1, *cu[2:].tolist()], dtype=cu.dtype)
        kwargs = {k: v for k, v in batch.items() if k not in change and k not in ("shift_labels", "num_items_in_batch")}
        buffers = [kwargs["input_ids"], kwargs["position_ids"]]
        with cp_cache.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1], documents=region):
            res[name] = capture(lambda: model(**kwargs))
    ids = tc.make_batch(packed, 0)["input_ids"]
    res["documents_length"] = capture(lambda: cp_cache.context_parallel(
        mesh, buffers=[ids], buffer_seq_dims=[1], documents=[0, 5, 40]).__enter__())
    res["live"] = cp_cache.stats()["live_entries"]
    return res


def _rank(rank: int, world: int, cases: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    install_npu_emulator()
    register()
    mesh = init_device_mesh("cpu", (world,))
    res = {"train": {case.name: tc.train_cp(case, mesh) for case in cases}}
    res["refusals"] = _cp_refusals(mesh)
    return res


_RESULTS: dict[int, list[dict]] = {}
_SINGLE: dict[str, dict] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank, world, CASES_AT[world], timeout=600.0)
    return _RESULTS[world]


def _single(case: tc.Case) -> dict:
    if case.name not in _SINGLE:
        _SINGLE[case.name] = tc.train_single(case)
    return _SINGLE[case.name]


# ---------------------------------------------------------------- training under CP


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_training_matches_eager(world, case):
    rows = tc.check_training(_results(world), case, _single(case))
    print(f"{case.name} W={world}: " + "; ".join(
        f"step {i}: loss {r['loss']:.2e} <= {r['loss_bound']:.2e}, grad {r['grad']:.2e} <= {r['grad_bound']:.2e}"
        for i, r in enumerate(rows)))


def test_compiled_training_at_varying_lengths():
    """Llama compiled whole (dynamic=True, aot_eager) under CP at W = 2, sequence lengths 32, 48
    and 64 in three AdamW steps: one graph, no graph break, the loss and the gradients of the
    eager single process (check_training asserts the graph count)."""
    rows = tc.check_training(_results(2), COMPILED, _single(COMPILED))
    print("; ".join(f"S={s}: loss {r['loss']:.2e} <= {r['loss_bound']:.2e}, grad {r['grad']:.2e} <= "
                    f"{r['grad_bound']:.2e}" for s, r in zip(COMPILED.lengths, rows)))


@pytest.mark.parametrize("world", WORLDS)
def test_refusals_under_cp_reach_every_rank(world):
    for r, res in enumerate(_results(world)):
        kind, message = res["refusals"]["positions_not_sharded"]
        assert kind in ("ValueError", "RuntimeError") and "position_ids" in message, (r, kind, message)
        kind, message = res["refusals"]["torch_region"]
        assert kind == "RuntimeError" and "cp_cache.context_parallel" in message, (r, kind, message)
        kind, message = res["refusals"]["documents_missing"]
        assert kind == "ValueError" and "cu_seq_lens_q/k" in message and "documents=" in message, (r, message)
        kind, message = res["refusals"]["documents_differ"]
        assert kind == "ValueError" and "cu_seq_lens_q=" in message and "documents=" in message, (r, message)
        kind, message = res["refusals"]["documents_length"]  # the documents end at 40, the buffer has 32 tokens
        assert kind == "ValueError" and "40" in message and "32" in message, (r, message)
        assert res["refusals"]["live"] == 0


# ---------------------------------------------------------------- outside CP


@pytest.mark.parametrize("case", [c for c in CASES if c.reference == "eager"], ids=lambda c: c.name)
def test_outside_cp_equals_eager(case):
    tc.check_outside_cp(case)


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_kv_cache_decoding_equals_eager(model):
    """Prefill 12 tokens, then 4 one-token steps over the KV cache (Gemma-3: its sliding layers'
    cache keeps the window only): the logits of "cp_cache" and "eager" agree."""
    case = tc.Case(model, model)
    ids = tc.make_batch(case, 0)["input_ids"][:, :16]
    logits = {}
    for impl in (NAME, "eager", "truth"):
        m = tc.make_model(case, NAME if impl == NAME else "eager").eval()
        if impl == "truth":
            m = m.double()
        with torch.no_grad():
            out = m(input_ids=ids[:, :12], use_cache=True)
            steps = [out.logits[:, -1]]
            for t in range(12, 16):
                out = m(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True)
                steps.append(out.logits[:, -1])
        logits[impl] = torch.stack(steps).double()
    bound = error_bound(rel_err(logits["eager"], logits["truth"]))
    assert rel_err(logits[NAME], logits["truth"]) <= bound


def test_all_true_padding_mask_is_dropped():
    case = tc.Case("llama", "llama")
    ids = tc.make_batch(case, 0)["input_ids"]
    m = tc.make_model(case, NAME).eval()
    with torch.no_grad():
        plain = m(input_ids=ids).logits
        masked = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(plain, masked)


# ---------------------------------------------------------------- refusals


class _Layer(torch.nn.Module):
    is_causal = True


def _qkv(batch: int = 1, seq: int = 8, heads: int = 2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, seq, 4, generator=g) for _ in range(3)]


def _refusal(**kwargs) -> tuple[str, str]:
    q, k, v = _qkv(kwargs.pop("batch", 1))
    mask = kwargs.pop("attention_mask", None)
    return capture(lambda: attention_forward(_Layer(), q, k, v, mask, **kwargs))


CU = torch.tensor([0, 3, 8], dtype=torch.int32)
REFUSALS = {
    "padding": (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])), "NotImplementedError", "attention_mask"),
    "custom_4d_mask": (dict(attention_mask=torch.zeros(1, 1, 8, 8)), "NotImplementedError", "attention_mask"),
    "softcap": (dict(softcap=30.0), "NotImplementedError", "softcap"),
    "position_bias": (dict(position_bias=torch.zeros(1, 2, 8, 8)), "NotImplementedError", "position_bias"),
    "output_attentions": (dict(output_attentions=True), "NotImplementedError", "output_attentions"),
    "bidirectional_window": (dict(sliding_window=3, is_causal=False), "NotImplementedError", "sliding_window"),
    "window_zero": (dict(sliding_window=0), "ValueError", "sliding_window"),
    "dropout_one": (dict(dropout=1.0), "ValueError", "dropout"),
    "sinks_shape": (dict(s_aux=torch.zeros(3)), "ValueError", "s_aux"),
    "restarted_positions": (dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])), "ValueError", "position_ids"),
    "positions_of_other_documents": (dict(position_ids=torch.arange(8)[None], cu_seq_lens_q=CU, cu_seq_lens_k=CU),
                                     "ValueError", "position_ids"),
    "documents_differ": (dict(cu_seq_lens_q=CU, cu_seq_lens_k=torch.tensor([0, 4, 8])), "NotImplementedError",
                         "cu_seq_lens_k"),
    "documents_short": (dict(cu_seq_lens_q=CU[:2], cu_seq_lens_k=CU[:2]), "ValueError", "cu_seq_lens_q"),
    "documents_half": (dict(cu_seq_lens_q=CU), "ValueError", "cu_seq_lens_k"),
    "documents_batch": (dict(batch=2, cu_seq_lens_q=CU, cu_seq_lens_k=CU), "NotImplementedError", "batch size 1"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusal_names_what_it_refuses(name):
    kwargs, kind, word = REFUSALS[name]
    got_kind, message = _refusal(**dict(kwargs))
    assert (got_kind, word in message) == (kind, True), (got_kind, message)


def test_refusal_in_a_model():
    """A packed batch without its cu_seq_lens: eager masks the documents (from position_ids),
    the op could not: refused, not silently attended across documents."""
    case = tc.Case("packed", "llama", packed=True)
    batch = tc.make_batch(case, 0)
    m = tc.make_model(case, NAME)
    kind, message = capture(lambda: m(input_ids=batch["input_ids"], position_ids=batch["position_ids"]))
    assert kind == "ValueError" and "cu_seq_lens_q/k" in message, (kind, message)


def test_compiled_position_check():
    """Compiled, the position check is an assertion inside the graph (no host read while
    tracing): right positions pass, wrong ones fail when the graph runs."""
    import torch._dynamo

    q, k, v = _qkv()
    call = torch.compile(lambda pos: attention_forward(_Layer(), q, k, v, None, position_ids=pos)[0],
                         backend="aot_eager", fullgraph=True)
    try:
        out = call(torch.arange(8)[None])
        assert torch.equal(out, attention_forward(_Layer(), q, k, v, None)[0])
        kind, message = capture(lambda: call(torch.arange(8)[None] + 1))
    finally:
        torch._dynamo.reset()
    assert kind == "RuntimeError" and "position_ids" in message, (kind, message)


def test_import_cp_cache_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, cp_cache, cp_cache.integrations.transformers; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dropout_is_keep_prob():
    """dropout p reaches the op as keep_prob = 1 - p (the same draw: the same output), and drops."""
    from cp_cache.npu_ops import causal_mask

    q, k, v = _qkv()
    torch.manual_seed(5)
    out = attention_forward(_Layer(), q, k, v, None, dropout=0.3)[0]
    torch.manual_seed(5)
    op = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", atten_mask=causal_mask("cpu"), sparse_mode=3,
                                               scale=0.5, keep_prob=0.7)[0]
    plain = attention_forward(_Layer(), q, k, v, None)[0]
    assert torch.equal(out, op.transpose(1, 2))
    assert not torch.equal(out, plain)
