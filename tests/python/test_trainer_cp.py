"""Hugging Face's Trainer under cp_cache: ContextParallelTrainer(cp_size=2) on 2 spawned CPU ranks
(DDP over gloo, the emulator's op) trains tiny models for 2 AdamW steps with the loss and the
gradients of one process running plain ``Trainer`` with "eager" attention, within error_bound of
that float32 run's own error against float64: Llama, Gemma-3 (a sliding window), gpt-oss (sinks and
a window) and a packed Llama batch (DataCollatorWithFlattening's cu_seq_lens, laid out as packed
documents by the mixin), and under ``bf16=True`` (CPU autocast; the reference under the same
autocast) a packed Gemma-3 batch and a Llama one. With attention
dropout and gradient checkpointing on, the gradients of the Trainer's loss pass a directional-
derivative check and no step cache is left alive after the steps. One rank group serves every
case; the single-process runs share another (one process)."""

from __future__ import annotations

import os

import pytest
import torch

import transformers_cases as tc
from cp_cache.testing.multiprocess import capture, run_ranks
from cp_cache.testing.reference import directional_derivative_check

WORLD = 2
CASES = [tc.Case("llama", "llama"), tc.Case("gemma3", "gemma3"), tc.Case("gpt_oss", "gpt_oss"),
         tc.Case("packed", "llama", packed=True),
         # TrainingArguments(bf16=True): CPU autocast; the packed batch runs as packed documents
         tc.Case("packed_gemma3_bf16", "gemma3", packed=True, autocast=True),
         tc.Case("llama_bf16", "llama", autocast=True)]
DROPOUT = 0.1
LAYERS = 2


def _features(case: tc.Case) -> list[dict]:
    """The dataset: the batches of transformers_cases, in order (sequential sampling), as features."""
    if case.packed:
        g = [torch.Generator().manual_seed(100 + step) for step in range(tc.STEPS)]
        return [{"input_ids": torch.randint(0, tc.VOCAB, (n,), generator=g[step]).tolist()}
                for step in range(tc.STEPS) for n in tc.DOCUMENTS]
    rows = [row for step in range(tc.STEPS) for row in tc.make_batch(case, step)["input_ids"]]
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def _arguments(case: tc.Case, bf16=None, **extra):
    from transformers import TrainingArguments

    batch = len(tc.DOCUMENTS) if case.packed else 2
    return TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cp_cache-trainer"), use_cpu=True,
        bf16=case.autocast if bf16 is None else bf16,
        per_device_train_batch_size=batch, max_steps=tc.STEPS, learning_rate=1e-2, lr_scheduler_type="constant",
        max_grad_norm=0.0, train_sampling_strategy="sequential", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, ddp_backend="gloo", dataloader_num_workers=0, **extra)


def _collator(case: tc.Case):
    from transformers import DataCollatorWithFlattening, default_data_collator

    return DataCollatorWithFlattening(return_flash_attn_kwargs=True) if case.packed else default_data_collator


def _recording(base):
    """``base`` (a Trainer class) recording each step's loss (the mean over ranks) and gradients
    (after DDP's average: the whole batch's)."""
    import torch.distributed as dist

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.losses, self.grads = [], []

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            value = loss.detach().double().clone()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(value)
                value /= dist.get_world_size()
            self.losses.append(float(value))
            self.grads.append([p.grad.detach().double().clone() for p in self.model.parameters()])
            return loss

    return Recording


def _train(trainer_class, case: tc.Case, model, bf16=None, **extra) -> dict:
    trainer = _recording(trainer_class)(model=model, args=_arguments(case, bf16), train_dataset=_features(case),
                                        data_collator=_collator(case), **extra)
    trainer.train()
    return {"loss": trainer.losses, "grads": trainer.grads}


def _distributed_env(rank: int, world: int) -> None:
    """What torchrun would set: accelerate reads the process layout from the environment."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


# ---------------------------------------------------------------- the single process


def _single(rank: int, world: int) -> dict:
    from transformers import Trainer

    _distributed_env(rank, world)
    out = {}
    for case in CASES:
        ref = _train(Trainer, case, tc.make_model(case))
        truth = _train(Trainer, case, tc.make_model(case).double(), bf16=False)
        out[case.name] = {"ref_loss": ref["loss"], "ref_grads": ref["grads"], "truth_loss": truth["loss"],
                          "truth_grads": truth["grads"]}
    return out


# ---------------------------------------------------------------- the CP ranks


def _dropout_check(case: tc.Case) -> dict:
    """Attention dropout and (non-reentrant) gradient checkpointing through the Trainer: train the
    steps, then check the gradient of the Trainer's own loss under its CP context along random
    directions (the RNG reset per forward: the same dropout masks)."""
    import torch.distributed as dist

    from cp_cache import stats
    from cp_cache.integrations.trainer import ContextParallelTrainer

    model = tc.make_model(case, "cp_cache")
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = DROPOUT
    args = _arguments(case, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = ContextParallelTrainer(model=model, args=args, train_dataset=_features(case),
                                     data_collator=_collator(case), cp_size=WORLD)
    trainer.train()
    live_after_training = stats()["live_entries"]
    batch = tc.make_batch(case, 0)
    features = {"input_ids": batch["input_ids"], "labels": batch["input_ids"].clone()}
    count = int((batch["shift_labels"] != -100).sum())
    model = trainer.model.train()

    def loss():
        torch.manual_seed(7)
        return trainer.compute_loss(model, inputs, num_items_in_batch=count)

    def total(x: float) -> float:
        value = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(value)
        return float(value)

    context, inputs = trainer._prepare_context_parallel_inputs(model, features)
    with context():  # forward, backward and the checkpoints' recompute inside the region
        checks = directional_derivative_check(loss, list(model.parameters()), directions=2, eps=5e-2, reduce=total)
    return {"checks": checks, "live_after_training": live_after_training, "live": stats()["live_entries"],
            "checkpointing": model.is_gradient_checkpointing}


def _cp(rank: int, world: int) -> dict:
    from cp_cache import call_stats, stats
    from cp_cache.integrations.trainer import ContextParallelTrainer
    from cp_cache.integrations.transformers import register
    from cp_cache.testing import install_npu_emulator

    _distributed_env(rank, world)
    install_npu_emulator()
    register()
    from cp_cache.integrations.transformers import _document_mask

    out = {}
    for case in CASES:
        calls, masks = call_stats()["forward"]["calls"], _document_mask.cache_info()
        out[case.name] = _train(ContextParallelTrainer, case, tc.make_model(case, "cp_cache"), cp_size=world)
        now = _document_mask.cache_info()
        out[case.name].update(live=stats()["live_entries"], calls=call_stats()["forward"]["calls"] - calls,
                              dense_masks=now.hits + now.misses - masks.hits - masks.misses)
    out["dropout"] = _dropout_check(tc.Case("llama", "llama"))
    shared = _arguments(tc.Case("llama", "llama"))  # two trainers on one accelerator state: one mesh
    out["meshes"] = [ContextParallelTrainer(model=tc.make_model(tc.Case("llama", "llama"), "cp_cache"), args=shared,
                                            cp_size=world).cp_mesh.size() for _ in range(2)]
    plain = tc.make_model(tc.Case("llama", "llama"))
    out["refusal"] = capture(lambda: _train(ContextParallelTrainer, tc.Case("llama", "llama"), plain, cp_size=world))
    return out


_RESULTS: dict = {}


def _results(kind: str):
    if kind not in _RESULTS:
        _RESULTS[kind] = run_ranks(_single, 1, timeout=600.0)[0] if kind == "single" else run_ranks(
            _cp, WORLD, timeout=600.0)
    return _RESULTS[kind]


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trainer_matches_one_process(case):
    single = _results("single")[case.name]
    assert single["ref_loss"][-1] != single["ref_loss"][0]  # the optimizer stepped
    for rank, res in enumerate(_results("cp")):
        cp = res[case.name]
        assert len(cp["loss"]) == tc.STEPS and cp["live"] == 0, (rank, cp["loss"], cp["live"])
        assert cp["calls"] == LAYERS * tc.STEPS, (case.name, rank, cp["calls"])  # every layer's attention under CP
        assert cp["dense_masks"] == 0, (case.name, rank, cp["dense_masks"])  # packed: documents, no [S, S] mask
        rows = tc.errors(cp, single)
        for row in rows:
            assert row["loss"] <= row["loss_bound"], (case.name, rank, row)
            assert row["grad"] <= row["grad_bound"], (case.name, rank, row)
    print(f"{case.name}: " + "; ".join(f"step {i}: loss {r['loss']:.2e} <= {r['loss_bound']:.2e}, grad "
                                       f"{r['grad']:.2e} <= {r['grad_bound']:.2e}" for i, r in enumerate(rows)))


def test_dropout_and_checkpointing_gradients():
    for rank, res in enumerate(_results("cp")):
        r = res["dropout"]
        assert r["checkpointing"] and r["live_after_training"] == 0 and r["live"] == 0, (rank, r)
        assert all(err <= bound for err, bound in r["checks"]), (rank, r["checks"])
        assert min(bound for _, bound in r["checks"]) < 0.1, r["checks"]  # resolves a 10 % wrong slope
    print("dropout + checkpointing (error, bound):", _results("cp")[0]["dropout"]["checks"])


def test_a_model_without_cp_cache_attention_is_refused():
    for res in _results("cp"):
        assert res["meshes"] == [WORLD, WORLD], res["meshes"]
        kind, message = res["refusal"]
        assert kind == "ValueError" and "attn_implementation='cp_cache'" in message, (kind, message)


def test_cp_size_is_checked():
    from cp_cache.integrations.trainer import ContextParallelTrainer

    kind, message = capture(lambda: ContextParallelTrainer(model=torch.nn.Linear(2, 2), cp_size=0))
    assert kind == "ValueError" and "cp_size=0" in message, (kind, message)
