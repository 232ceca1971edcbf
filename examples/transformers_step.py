"""A training step of a Hugging Face transformers model (attn_implementation="cp_cache") on a packed batch under
cp_cache.context_parallel; its loss and gradients checked against one process with "eager" attention on the whole
batch (exit status 1 if they differ). A tiny Llama made from a config, documents drawn in memory.

    torchrun --nproc-per-node 2 examples/transformers_step.py [cpu|cuda|npu]    (default: the device found)
"""
import copy, os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM
try:
    import torch_npu                                     # Ascend: torch_npu first, then cp_cache
except ImportError:
    pass
import cp_cache
from cp_cache.integrations.transformers import register

device = sys.argv[1] if len(sys.argv) > 1 else ("npu" if hasattr(torch, "npu") and torch.npu.is_available()
                                                else "cuda" if torch.cuda.is_available() else "cpu")
dist.init_process_group({"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device])
if device != "cpu":
    getattr(torch, device).set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh(device, (dist.get_world_size(),))
register()                                               # attn_implementation="cp_cache"
torch.manual_seed(0)                                     # the same weights and batch on every rank
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)
model = LlamaForCausalLM._from_config(config, attn_implementation="cp_cache").to(device)
reference = copy.deepcopy(model)
reference.set_attn_implementation("eager")               # one process, the whole batch: what CP must equal
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

documents = [{"input_ids": torch.randint(0, 128, (n,)).tolist()} for n in (40, 100, 116)]
batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(documents)  # [1, 256] + cu_seq_lens
batch = {name: t.to(device) if torch.is_tensor(t) else t for name, t in batch.items()}
input_ids, position_ids, cu_seq_lens = batch["input_ids"], batch["position_ids"], batch["cu_seq_lens_q"]
# shift the labels BEFORE sharding: a token's next one may sit on another rank afterwards
labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
num_items = (labels != -100).sum()                       # the global count: the ranks' losses add up to the mean

expected = reference(input_ids=input_ids, position_ids=position_ids, labels=labels, shift_labels=labels).loss
expected.backward()
with cp_cache.context_parallel(mesh, buffers=[input_ids, position_ids, labels], buffer_seq_dims=[1, 1, 1],
                               documents=cu_seq_lens, model=model):  # buffers laid out by the documents
    loss = model(input_ids=input_ids, position_ids=position_ids, labels=labels, shift_labels=labels,
                 num_items_in_batch=num_items, cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens).loss
    loss.backward()                                      # inside the region
for p in model.parameters():                             # each rank holds its share: sum over the CP ranks
    dist.all_reduce(p.grad)
dist.all_reduce(loss := loss.detach())                   # the loss of the whole batch
grad_error = max(((p.grad - r.grad).norm() / r.grad.norm()).item()
                 for p, r in zip(model.parameters(), reference.parameters()))
optimizer.step()
optimizer.zero_grad()
print(f"rank {dist.get_rank()} of {dist.get_world_size()} ({device}): loss {loss.item():.6f}, one process "
      f"{expected.item():.6f}; gradients' relative error {grad_error:.1e}")
dist.destroy_process_group()
sys.exit(0 if abs(loss.item() - expected.item()) < 1e-4 and grad_error < 1e-3 else 1)
