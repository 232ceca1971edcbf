"""Tiny transformers models trained with attn_implementation="cp_cache" under
cp_cache.context_parallel (rank side) and with "eager" in one process (the reference), for
test_transformers_cp.py.

A case: a random-init model (hidden 32, 2 layers, vocab 128), a batch of S = 32 tokens
(B = 2; packed cases: B = 1, documents from DataCollatorWithFlattening), 2 AdamW steps,
float32 (the reference also in float64), or under bfloat16 autocast (``autocast``: the reference
under the same autocast, the float64 truth without). Labels are shifted on the full sequence, before
sharding; the loss is each rank's sum over its tokens / the global count (num_items_in_batch),
so the ranks' losses and gradients sum to the single process's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import cp_cache
from cp_cache.testing.reference import error_bound, rel_err

SEQ = 32
VOCAB = 128
STEPS = 2
DOCUMENTS = (6, 14, 12)  # packed cases: document lengths, summing to SEQ
_MOE = ("gpt_oss", "deepseek_v3")


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # llama | qwen3 | gemma3 | gpt_oss | deepseek_v3
    packed: bool = False
    load_balance: bool = True  # head-tail buffers (torch's default); False: contiguous
    documents: bool = False  # packed: buffers laid out by cp_cache's placement (context_parallel(documents=))
    reference: str = "eager"  # the single process's attention implementation
    lengths: tuple[int, ...] = (SEQ,) * STEPS  # each step's sequence length (not packed)
    compiled: bool = False  # CP side: torch.compile(model, dynamic=True, backend="aot_eager")
    autocast: bool = False  # the forward under torch.autocast("cpu", torch.bfloat16), the reference's too

    def precision(self, dtype: torch.dtype = torch.float32):
        """The forward's autocast (bfloat16 where the case asks; the float64 truth never)."""
        enabled = self.autocast and dtype != torch.float64
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)

    @property
    def steps(self) -> int:
        return len(self.lengths)


def _config(model: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0, use_cache=False)
    if model == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(num_key_value_heads=2, **common)
    if model == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    if model == "gemma3":  # sliding window 3 < the 4-token chunks of head-tail at W = 4
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            num_key_value_heads=2, head_dim=8, sliding_window=3, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"], **common)
    if model == "gpt_oss":  # sinks on every layer, sliding window 5 on the first
        return tf.GptOssForCausalLM, tf.GptOssConfig(
            num_key_value_heads=2, head_dim=8, sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], **common)
    if model == "deepseek_v3":  # MLA: q/k head dim 8 + 4, v head dim 6
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, **common)
    raise ValueError(f"model={model!r}")


def make_model(case: Case, attn_implementation: str = "eager"):
    """The case's model (the same random init everywhere), in training mode, float32."""
    cls, config = _config(case.model)
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if case.model in _MOE else {}  # grouped_mm has no float64
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32, **extra)
    if attn_implementation != "eager":
        model.set_attn_implementation(attn_implementation)
    return model.train()


def make_batch(case: Case, step: int) -> dict:
    """input_ids, position_ids, shift_labels (shifted on the full sequence), num_items_in_batch
    and, packed, cu_seq_lens_q/k as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(100 + step)
    seq = case.lengths[step]
    if case.packed:
        features = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in DOCUMENTS]
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
        batch = {k: batch[k] for k in ("input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k")}
    else:
        ids = torch.randint(0, VOCAB, (2, seq), generator=g)
        batch = {"input_ids": ids, "position_ids": torch.arange(seq).expand(2, seq).contiguous(),
                 "labels": ids.clone()}
    labels = batch.pop("labels")
    batch["shift_labels"] = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    batch["num_items_in_batch"] = int((batch["shift_labels"] != -100).sum())
    return batch


def _loss(model, batch: dict):
    return model(**batch, labels=batch["shift_labels"]).loss


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().double().clone() for p in model.parameters()]


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_single(case: Case) -> dict:
    """The single process (``case.reference``, "eager" unless said otherwise): float32 (the
    reference) and float64 (the truth), per step."""
    out = {"ref_loss": [], "truth_loss": [], "ref_grads": [], "truth_grads": []}
    ref = make_model(case, case.reference)
    truth = copy.deepcopy(ref).double()
    opts = [_optimizer(ref), _optimizer(truth)]
    for step in range(case.steps):
        batch = make_batch(case, step)
        for model, tag in ((ref, "ref"), (truth, "truth")):
            with case.precision(next(model.parameters()).dtype):
                loss = _loss(model, batch)
            loss.backward()
            out[f"{tag}_loss"].append(float(loss.detach()))
            out[f"{tag}_grads"].append(_grads(model))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return out


def train_cp(case: Case, mesh) -> dict:
    """Rank side: the same steps with "cp_cache" under cp_cache.context_parallel; the loss and
    the gradients all-reduced (summed) over the ranks; the live step caches after each step;
    compiled, Dynamo's graph count after each step and its graph breaks."""
    import torch._dynamo
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    model = make_model(case, "cp_cache")
    opt = _optimizer(model)
    run = model
    if case.compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        run = torch.compile(model, dynamic=True, backend="aot_eager")
    from cp_cache.integrations.transformers import _document_mask

    out = {"loss": [], "grads": [], "live": [], "calls": [], "graphs": [], "dense_masks": []}
    for step in range(case.steps):
        batch = make_batch(case, step)
        buffers = [batch["input_ids"], batch["position_ids"], batch["shift_labels"]]
        calls = cp_cache.call_stats()["forward"]["calls"]
        masks = _document_mask.cache_info()
        before, _cp_options.enable_load_balance = _cp_options.enable_load_balance, case.load_balance
        try:
            documents = batch["cu_seq_lens_q"] if case.documents else None
            with cp_cache.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], documents=documents):
                with case.precision():
                    loss = _loss(run, batch)
                loss.backward()
        finally:
            _cp_options.enable_load_balance = before
        out["graphs"].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        out["calls"].append(cp_cache.call_stats()["forward"]["calls"] - calls)
        now = _document_mask.cache_info()
        out["dense_masks"].append(now.hits + now.misses - masks.hits - masks.misses)
        loss = loss.detach()
        dist.all_reduce(loss)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        out["loss"].append(float(loss))
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad()
        out["live"].append(cp_cache.stats()["live_entries"])
    if case.compiled:
        out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        torch._dynamo.reset()
    return out


def errors(cp: dict, single: dict, autocast: bool = False) -> list[dict]:
    """Per step: the CP run's and the float32 reference's loss and gradient errors against the
    float64 truth, and their bounds (error_bound of the reference's worst error so far: the
    steps compound the rounding; under bf16 ``autocast`` its worst over the run: one step's
    bf16 error is a draw, small by chance on some machines)."""
    rows = []
    for step in range(len(cp["loss"])):
        truth, upto = single["truth_loss"][step], len(cp["loss"]) if autocast else step + 1
        ref_loss = max(abs(a - b) for a, b in zip(single["ref_loss"][:upto], single["truth_loss"][:upto]))
        ref_grad = max(max(rel_err(a, b) for a, b in zip(r, t))
                       for r, t in zip(single["ref_grads"][:upto], single["truth_grads"][:upto]))
        rows.append(dict(
            loss=abs(cp["loss"][step] - truth), loss_bound=error_bound(ref_loss, scale=abs(truth)),
            grad=max(rel_err(a, b) for a, b in zip(cp["grads"][step], single["truth_grads"][step])),
            grad_bound=error_bound(ref_grad), ref_loss=ref_loss, ref_grad=ref_grad))
    return rows


# ---------------------------------------------------------------- the checks, parent side


def check_training(per_rank: list[dict], case: Case, single: dict) -> list[dict]:
    """Every rank: the loss and the gradients of each step within their bounds, every layer's
    attention through the CP handlers (one forward call per layer and step), no step cache
    left alive; the ranks agree. Returns the error rows (rank 0)."""
    layers = 2
    for r, res in enumerate(per_rank):
        cp = res["train"][case.name]
        for step, row in enumerate(errors(cp, single, case.autocast)):
            assert row["loss"] <= row["loss_bound"], (case.name, r, step, row)
            assert row["grad"] <= row["grad_bound"], (case.name, r, step, row)
        assert cp["calls"] == [layers] * case.steps, (case.name, r, cp["calls"])
        assert cp["live"] == [0] * case.steps, (case.name, r, cp["live"])
        if case.documents or (case.packed and not case.load_balance):  # TND: no [S, S] mask built
            assert cp["dense_masks"] == [0] * case.steps, (case.name, r, cp["dense_masks"])
        elif case.packed and case.load_balance:  # head-tail buffers: the documents as an [S, S] mask
            assert all(cp["dense_masks"]), (case.name, r, cp["dense_masks"])
        if case.compiled:  # one graph for the whole model, whatever the length, and no break
            assert (cp["graphs"], cp["graph_breaks"]) == ([1] * case.steps, 0), (case.name, r, cp)
        assert cp["loss"] == per_rank[0]["train"][case.name]["loss"], (case.name, r)
    assert single["ref_loss"][-1] != single["ref_loss"][0]  # the optimizer stepped
    return errors(per_rank[0]["train"][case.name], single, case.autocast)


def check_outside_cp(case: Case) -> None:
    """One process, no CP region: "cp_cache" (the plain op) against "eager", loss and gradients
    of one step, bounded by the float32 eager model's own error against float64."""
    batch = make_batch(case, 0)
    runs = {}
    for tag, model in (("cp", make_model(case, "cp_cache")), ("ref", make_model(case)),
                       ("truth", make_model(case).double())):
        calls = cp_cache.call_stats()["forward"]["calls"]
        with case.precision(next(model.parameters()).dtype):
            loss = _loss(model, batch)
        loss.backward()
        assert cp_cache.call_stats()["forward"]["calls"] == calls  # no CP handler involved
        runs[tag] = (float(loss.detach()), _grads(model))
    truth_loss, truth_grads = runs["truth"]
    ref_loss = abs(runs["ref"][0] - truth_loss)
    ref_grad = max(rel_err(a, b) for a, b in zip(runs["ref"][1], truth_grads))
    assert abs(runs["cp"][0] - truth_loss) <= error_bound(ref_loss, scale=abs(truth_loss)), (case.name, runs)
    grad = max(rel_err(a, b) for a, b in zip(runs["cp"][1], truth_grads))
    assert grad <= error_bound(ref_grad), (case.name, grad, ref_grad)
    assert cp_cache.stats()["live_entries"] == 0
