"""Hybrid models through the real clients: a tiny Qwen3.5 (Gated DeltaNet and its conv beside attention) and a tiny
LFM2 (short convolutions beside attention), attn_implementation="cp_cache", trained on packed documents under CP by
Hugging Face's Trainer with ``ContextParallelMixin`` (DataCollatorWithFlattening, gradient checkpointing on: the
mixers recomputed in the backward) and by TRL's SFTTrainer with packing (best-fit decreasing, TRL's default
bf16=True), at W = 2 (and 4 for one TRL case). The reference is the same trainer in one process on a model that
runs each document of a pack on its own ("eager" attention, transformers' own mixers: no packed path is needed),
in float32 (or under the same autocast) and float64; the logged losses and the parameters' change over the SGD
steps must be within error_bound of the float32 run's own error against float64. No step cache stays alive."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import test_trl_sft as trl_cases
from cp_cache.testing.hybrid_models import make_config
from cp_cache.testing.multiprocess import run_ranks

STEPS = 2


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # qwen3_5 | lfm2
    client: str  # trainer | trl
    bf16: bool = False
    checkpointing: bool = False
    worlds: tuple[int, ...] = (2,)

    @property
    def name(self) -> str:
        return f"{self.client}-{self.family}{'-bf16' if self.bf16 else ''}{'-recompute' if self.checkpointing else ''}"


CASES = (Case("qwen3_5", "trainer", checkpointing=True), Case("lfm2", "trainer", checkpointing=True),
         Case("qwen3_5", "trl", bf16=True, worlds=(2, 4)), Case("lfm2", "trl", bf16=True))
AT = [(case, world) for case in CASES for world in case.worlds]


def _per_document(backbone) -> None:
    """The decoder (``model.model``, which TRL's fused head calls too) runs each document of a packed batch (its
    cu_seq_lens_q) on its own."""
    from transformers.modeling_outputs import BaseModelOutputWithPast
    base = type(backbone)

    def forward(self, input_ids=None, position_ids=None, cu_seq_lens_q=None, **kwargs):
        ends = [0, input_ids.size(1)] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
        hidden = [base.forward(self, input_ids=input_ids[:, a:b], position_ids=position_ids[:, a:b]).last_hidden_state
                  for a, b in zip(ends, ends[1:])]
        return BaseModelOutputWithPast(last_hidden_state=torch.cat(hidden, dim=1))

    backbone.__class__ = type(f"PerDocument{base.__name__}", (base,), {"forward": forward})


def _model(case: Case, attention: str, dtype=torch.float32, per_document: bool = False):
    import transformers
    config = make_config(case.family)
    config.vocab_size, config.pad_token_id, config.eos_token_id, config.bos_token_id = trl_cases.VOCAB, 0, 1, None
    config.max_position_embeddings = 256
    cls = getattr(transformers, {"qwen3_5": "Qwen3_5ForCausalLM", "lfm2": "Lfm2ForCausalLM"}[case.family])
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.set_attn_implementation(attention)
    if per_document:
        _per_document(model.model)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(dtype)


def _trainer_arguments(case: Case, bf16: bool):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cp_cache-hybrid"), use_cpu=True, bf16=bf16,
        per_device_train_batch_size=4, max_steps=STEPS, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
        max_grad_norm=0.0, train_sampling_strategy="sequential", report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0)


def _train(trainer_class, case: Case, model, bf16: bool, **extra) -> dict:
    from transformers import DataCollatorWithFlattening
    before = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    if case.client == "trl":
        args = dataclasses.replace(trl_cases._sft_config(trl_cases.Case(case.name, "qwen3"), bf16), max_steps=STEPS)
        trainer = trainer_class(model=model, args=args, train_dataset=trl_cases._dataset(),
                                processing_class=trl_cases._tokenizer(), **extra)
    else:
        features = [{"input_ids": row} for row in trl_cases._dataset()["input_ids"]]
        trainer = trainer_class(model=model, args=_trainer_arguments(case, bf16), train_dataset=features,
                                data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True), **extra)
    trainer.train()
    after = torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()])
    return {"loss": [e["loss"] for e in trainer.state.log_history if "loss" in e], "update": after - before}


def _trainer_classes(case: Case):
    from transformers import Trainer
    from trl import SFTTrainer
    return SFTTrainer if case.client == "trl" else Trainer


def _single(rank: int, world: int) -> dict:
    trl_cases._distributed_env(rank, world)
    out = {}
    for case in CASES:
        base = _trainer_classes(case)
        out[case.name] = {
            "ref": _train(base, case, _model(case, "eager", per_document=True), case.bf16),
            "truth": _train(base, case, _model(case, "eager", torch.float64, per_document=True), False)}
    return out


def _cp(rank: int, world: int) -> dict:
    from cp_cache import stats
    from cp_cache.integrations.trainer import ContextParallelMixin
    from cp_cache.integrations.transformers import register
    trl_cases._distributed_env(rank, world)
    register()
    out = {}
    for case in (c for c in CASES if world in c.worlds):
        cp_class = type("CP" + _trainer_classes(case).__name__, (ContextParallelMixin, _trainer_classes(case)), {})
        out[case.name] = _train(cp_class, case, _model(case, "cp_cache"), case.bf16, cp_size=world)
        out[case.name]["live"] = stats()["live_entries"]
    return out


_RESULTS: dict = {}


def _results(kind) -> list:
    if kind not in _RESULTS:
        _RESULTS[kind] = run_ranks(_single, 1, timeout=900.0) if kind == "single" else run_ranks(
            _cp, kind, timeout=900.0)
    return _RESULTS[kind]


@pytest.mark.parametrize("case, world", AT, ids=[f"{c.name}-W{w}" for c, w in AT])
def test_hybrid_model_trains_as_one_process_per_document(case, world):
    single = _results("single")[0][case.name]
    assert len(single["truth"]["loss"]) == STEPS and single["ref"]["loss"][0] != single["ref"]["loss"][-1]
    for rank, res in enumerate(_results(world)):
        cp = res[case.name]
        assert len(cp["loss"]) == STEPS and cp["live"] == 0, (case.name, rank, cp["loss"], cp["live"])
        errors = trl_cases._errors(cp, single)
        assert errors["loss"] <= errors["loss_bound"], (case.name, world, rank, errors)
        assert errors["param"] <= errors["param_bound"], (case.name, world, rank, errors)
    print(f"{case.name} W={world}: " + ", ".join(f"{k} {v:.2e}" for k, v in trl_cases._errors(
        _results(world)[0][case.name], single).items()))
