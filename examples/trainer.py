"""transformers' Trainer under cp_cache: ContextParallelTrainer (ContextParallelMixin in front of Trainer) runs every
step under cp_cache.context_parallel, a packed batch as packed documents. Its first step's logged loss and gradient
norm are checked against one process with "eager" attention on the whole batch (exit status 1 if they differ).
A tiny Llama made from a config, documents drawn in memory.

    torchrun --nproc-per-node 2 examples/trainer.py [cpu|cuda|npu]    (default: the device found)
"""
import copy, os, sys
import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, TrainingArguments
try:
    import torch_npu                                     # Ascend: torch_npu first, then cp_cache
except ImportError:
    pass
from cp_cache.integrations.trainer import ContextParallelTrainer
from cp_cache.integrations.transformers import register

device = sys.argv[1] if len(sys.argv) > 1 else ("npu" if hasattr(torch, "npu") and torch.npu.is_available()
                                                else "cuda" if torch.cuda.is_available() else "cpu")
world = int(os.environ["WORLD_SIZE"])
register()                                               # attn_implementation="cp_cache", before the model is made
torch.manual_seed(0)                                     # the same weights and data on every rank
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)
model = LlamaForCausalLM._from_config(config, attn_implementation="cp_cache")
reference = copy.deepcopy(model)
reference.set_attn_implementation("eager")
documents = [{"input_ids": torch.randint(0, 128, (n,)).tolist()} for n in (40, 100, 116, 61)]
collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)   # packed: cu_seq_lens_q/k, position_ids

args = TrainingArguments(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cp_cache-example"),
                         use_cpu=device == "cpu", ddp_backend={"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device],
                         per_device_train_batch_size=len(documents), max_steps=1, learning_rate=1e-3,
                         train_sampling_strategy="sequential", logging_steps=1, report_to=[], save_strategy="no",
                         activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False},
                         disable_tqdm=True)
trainer = ContextParallelTrainer(model=model, args=args, train_dataset=documents, data_collator=collator,
                                 cp_size=world)          # all the ranks in one CP group: dp = world / cp_size
trainer.train()
logged = trainer.state.log_history[0]

batch = {name: t.to(trainer.args.device) for name, t in collator(documents).items() if torch.is_tensor(t)}
expected = reference.to(trainer.args.device)(**batch).loss   # one process, the whole batch
expected.backward()
expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
print(f"rank {trainer.args.process_index} of {world} ({device}): loss {logged['loss']:.6f}, one process "
      f"{expected.item():.6f}; gradient norm {logged['grad_norm']:.6f}, one process {expected_norm:.6f}")
ok = abs(logged["loss"] - expected.item()) < 1e-4 and abs(logged["grad_norm"] - expected_norm) < 1e-4 * expected_norm
sys.exit(0 if ok else 1)
