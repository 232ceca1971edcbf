"""TRL's SFTTrainer with packing (best-fit decreasing, padding-free) under cp_cache: the mixin in front of SFTTrainer
and a CP size are the two lines a TRL user adds. The first step's logged loss and gradient norm are checked against
one process with "eager" attention on the same pack (exit status 1 if they differ). A tiny Qwen3 (a sliding and a
full layer) made from a config, a word-level tokenizer and a dataset made in memory: nothing downloaded.

    torchrun --nproc-per-node 2 examples/trl_sft.py [cpu|cuda|npu]    (default: the device found)
"""
import copy, os, sys
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from trl import SFTConfig, SFTTrainer
try:
    import torch_npu                                     # Ascend: torch_npu first, then cp_cache
except ImportError:
    pass
from cp_cache.integrations.trainer import ContextParallelMixin
from cp_cache.integrations.transformers import register


class CPSFTTrainer(ContextParallelMixin, SFTTrainer):   # 1: the mixin in front of SFTTrainer
    pass


device = sys.argv[1] if len(sys.argv) > 1 else ("npu" if hasattr(torch, "npu") and torch.npu.is_available()
                                                else "cuda" if torch.cuda.is_available() else "cpu")
world = int(os.environ["WORLD_SIZE"])
register()                                               # attn_implementation="cp_cache", before the model is made
vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, 96)}}
word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>",
                                    unk_token="<unk>")
torch.manual_seed(0)                                     # the same weights and data on every rank
config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=24,
                     max_window_layers=0, layer_types=["sliding_attention", "full_attention"], use_cache=False,
                     pad_token_id=0, eos_token_id=1, bos_token_id=None)
model = Qwen3ForCausalLM._from_config(config, attn_implementation="cp_cache")
reference = copy.deepcopy(model)
reference.set_attn_implementation("eager")
lengths = torch.randint(5, 70, (12,)).tolist()           # documents of 5 to 70 tokens, packed to 160
dataset = Dataset.from_dict({"input_ids": [torch.randint(3, 96, (n,)).tolist() for n in lengths]})

args = SFTConfig(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cp_cache-example"), packing=True,
                 max_length=160, per_device_train_batch_size=1, max_steps=1, bf16=False, use_cpu=device == "cpu",
                 ddp_backend={"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device], logging_steps=1, report_to=[],
                 save_strategy="no", disable_tqdm=True, seed=0, data_seed=0)
trainer = CPSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                       cp_size=world)                    # 2: the CP size (all the ranks here)
batch = next(iter(trainer.get_train_dataloader()))       # the pack the first step trains on (the same on every rank)
trainer.train()
logged = trainer.state.log_history[0]

inputs = {name: batch[name] for name in ("input_ids", "labels", "position_ids")}
expected = reference.to(trainer.args.device)(**inputs).loss   # one process, the whole pack
expected.backward()
expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
print(f"rank {trainer.args.process_index} of {world} ({device}): {batch['input_ids'].size(1)} tokens in "
      f"{len(batch['cu_seq_lens_q']) - 1} documents; loss {logged['loss']:.6f}, one process {expected.item():.6f}; "
      f"gradient norm {logged['grad_norm']:.6f}, one process {expected_norm:.6f}")
ok = abs(logged["loss"] - expected.item()) < 1e-4 and abs(logged["grad_norm"] - expected_norm) < 1e-4 * expected_norm
sys.exit(0 if ok else 1)
