"""TRL's SFTTrainer with packing under cp_cache: ``class CPSFT(ContextParallelMixin, SFTTrainer)``
trains tiny random-init models on a pre-tokenized dataset of documents of 5-70 tokens packed to
``max_length`` 160 (best-fit decreasing: padding-free packs of any length with ``cu_seq_lens_q/k``,
``position_ids`` and ``seq_idx``; "wrapped": dense [B, 160] rows without documents, the head-tail
path) at W = 2 and 4 (gloo, one rank group per world size serving every case), with TRL's default
``bf16=True`` (CPU autocast: RoPE leaves q/k float32 beside a bfloat16 v) and in float32. Each case's
logged loss per step and its parameters after the steps (their change, all together: SGD, whose
update follows the gradient, where Adam's would magnify bfloat16's noise in tiny gradients) equal
one process's run of plain
``SFTTrainer`` (attention "eager"; gpt-oss: "cp_cache" outside CP, see test_transformers_cp.py) within
``error_bound`` of that float32 run's own error against a float64 run; every layer's call reached the
op as packed documents (TND) for bfd packs and no [S, S] mask was built; no step cache stays alive.
The tokenizer is made here (no hub)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import error_bound, rel_err

VOCAB = 96
MAX_LENGTH = 160
STEPS = 3
DOCUMENT_LENGTHS = (5, 70)  # drawn per document, seeded
DOCUMENTS = 24
LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str  # qwen3 | gemma3 | gpt_oss | llama
    strategy: str = "bfd"  # TRL's packing_strategy
    bf16: bool = True  # TRL's default: CPU autocast to bfloat16

    @property
    def reference(self) -> str:
        # transformers 5.24's gpt-oss builds its eager masks without the position ids: its eager
        # attention crosses the packed documents (test_transformers_cp.py holds "cp_cache" against eager)
        return "cp_cache" if self.model == "gpt_oss" else "eager"


CASES = (Case("qwen3_sliding_bf16", "qwen3"), Case("gemma3_fp32", "gemma3", bf16=False),
         Case("gpt_oss_sinks_bf16", "gpt_oss"), Case("llama_wrapped_bf16", "llama", strategy="wrapped"),
         Case("qwen3_wrapped_fp32", "qwen3", strategy="wrapped", bf16=False))
WORLDS = (2, 4)


# ---------------------------------------------------------------- what every process builds alike


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def _dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(11)
    low, high = DOCUMENT_LENGTHS
    lengths = torch.randint(low, high + 1, (DOCUMENTS,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]})


def _config(model: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
                  pad_token_id=0, eos_token_id=1, bos_token_id=None)
    layers = ["sliding_attention", "full_attention"]
    if model == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common)
    if model == "qwen3":  # a sliding layer (window 24) and a full one
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(head_dim=8, use_sliding_window=True, sliding_window=24,
                                                   max_window_layers=0, layer_types=layers, **common)
    if model == "gemma3":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(head_dim=8, sliding_window=12, query_pre_attn_scalar=8,
                                                         layer_types=layers, **common)
    if model == "gpt_oss":  # sinks on every layer, a sliding layer
        return tf.GptOssForCausalLM, tf.GptOssConfig(head_dim=8, sliding_window=16, num_local_experts=4,
                                                     num_experts_per_tok=2, layer_types=layers, **common)
    raise ValueError(f"model={model!r}")


def _model(case: Case, attention: str, dtype=torch.float32):
    cls, config = _config(case.model)
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if case.model == "gpt_oss" else {}
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32, **extra)
    model.set_attn_implementation(attention)
    return model.to(dtype)  # the same initial values in float64


def _sft_config(case: Case, bf16: bool):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cp_cache-trl"), use_cpu=True, bf16=bf16,
        packing=True, packing_strategy=case.strategy, max_length=MAX_LENGTH, per_device_train_batch_size=1,
        max_steps=STEPS, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, warmup_steps=0,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, ddp_backend="gloo",
        dataloader_num_workers=0, seed=0, data_seed=0, dataset_num_proc=None)


def _train(trainer_class, case: Case, model, bf16: bool, **extra) -> dict:
    before = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    trainer = trainer_class(model=model, args=_sft_config(case, bf16), train_dataset=_dataset(),
                            processing_class=_tokenizer(), **extra)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    after = torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()])
    return {"loss": losses, "update": after - before}


def _distributed_env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


# ---------------------------------------------------------------- one process


def _single(rank: int, world: int) -> dict:
    from trl import SFTTrainer

    from cp_cache.integrations.transformers import register
    from cp_cache.testing import install_npu_emulator

    _distributed_env(rank, world)
    install_npu_emulator()
    register()
    out = {}
    for case in CASES:
        ref = _train(SFTTrainer, case, _model(case, case.reference), case.bf16)
        truth = _train(SFTTrainer, case, _model(case, case.reference, torch.float64), False)
        out[case.name] = {"ref": ref, "truth": truth}
    return out


# ---------------------------------------------------------------- the CP ranks


def _cp(rank: int, world: int) -> dict:
    from trl import SFTTrainer

    from cp_cache import call_stats, stats
    from cp_cache.integrations import transformers as attention
    from cp_cache.integrations.trainer import ContextParallelMixin
    from cp_cache.testing import install_npu_emulator

    class CPSFT(ContextParallelMixin, SFTTrainer):
        pass

    _distributed_env(rank, world)
    install_npu_emulator()
    attention.register()
    layouts: list[str] = []
    op = torch.ops.npu.npu_fusion_attention_v3
    original = attention._op

    def recording_op():  # the layout of every call the integration makes under CP
        def call(q, k, v, head_num, layout, **kwargs):
            layouts.append(layout)
            return op(q, k, v, head_num, layout, **kwargs)
        return call

    attention._op = recording_op
    out = {}
    try:
        for case in CASES:
            calls, masks = call_stats()["forward"]["calls"], attention._document_mask.cache_info()
            del layouts[:]
            res = _train(CPSFT, case, _model(case, "cp_cache"), case.bf16, cp_size=world)
            now = attention._document_mask.cache_info()
            res.update(live=stats()["live_entries"], calls=call_stats()["forward"]["calls"] - calls,
                       layouts=sorted(set(layouts)), dense_masks=now.hits + now.misses - masks.hits - masks.misses)
            out[case.name] = res
    finally:
        attention._op = original
    return out


_RESULTS: dict = {}


def _results(kind) -> list:
    if kind not in _RESULTS:
        _RESULTS[kind] = run_ranks(_single, 1, timeout=900.0) if kind == "single" else run_ranks(
            _cp, kind, timeout=900.0)
    return _RESULTS[kind]


def _errors(cp: dict, single: dict) -> dict:
    """The CP run's and the float32 single process's errors against the float64 run: the worst
    logged loss over the steps (absolute) and the parameters' change over the steps (relative,
    all parameters together), with their bounds."""
    ref, truth = single["ref"], single["truth"]
    ref_loss = max(abs(a - b) for a, b in zip(ref["loss"], truth["loss"]))
    ref_param = rel_err(ref["update"], truth["update"])
    return dict(loss=max(abs(a - b) for a, b in zip(cp["loss"], truth["loss"])),
                loss_bound=error_bound(ref_loss, scale=max(abs(x) for x in truth["loss"])),
                param=rel_err(cp["update"], truth["update"]), param_bound=error_bound(ref_param),
                ref_loss=ref_loss, ref_param=ref_param)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sft_packing_matches_one_process(case, world):
    single = _results("single")[0][case.name]
    assert len(single["truth"]["loss"]) == STEPS and single["ref"]["loss"][0] != single["ref"]["loss"][-1]
    for rank, res in enumerate(_results(world)):
        cp = res[case.name]
        assert len(cp["loss"]) == STEPS and cp["live"] == 0, (case.name, rank, cp["loss"], cp["live"])
        assert cp["calls"] == 2 * LAYERS * STEPS, (case.name, rank, cp["calls"])  # every layer, and its recompute
        if case.strategy == "bfd":  # packed documents: TND, no [S, S] mask
            assert cp["layouts"] == ["TND"] and cp["dense_masks"] == 0, (case.name, rank, cp["layouts"])
        else:  # dense rows without documents: the head-tail path
            assert cp["layouts"] == ["BNSD"], (case.name, rank, cp["layouts"])
        errors = _errors(cp, single)
        assert errors["loss"] <= errors["loss_bound"], (case.name, world, rank, errors)
        assert errors["param"] <= errors["param_bound"], (case.name, world, rank, errors)
    print(f"{case.name} W={world}: " + ", ".join(f"{k} {v:.2e}" for k, v in _errors(
        _results(world)[0][case.name], single).items()))
