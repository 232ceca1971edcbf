"""Causal attention through F.scaled_dot_product_attention, sharded over the launched ranks by cp_cache, its
gradients checked against one process on the whole sequence (exit status 1 if they differ).

    torchrun --nproc-per-node 2 examples/quickstart.py [cpu|cuda|npu]    (default: the device found)
"""
import os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
try:
    import torch_npu  # Ascend: torch_npu first, then cp_cache
except ImportError:
    pass
import cp_cache

device = sys.argv[1] if len(sys.argv) > 1 else ("npu" if hasattr(torch, "npu") and torch.npu.is_available()
                                                else "cuda" if torch.cuda.is_available() else "cpu")
dist.init_process_group({"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device])
if device != "cpu":
    getattr(torch, device).set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh(device, (dist.get_world_size(),))
torch.manual_seed(0)  # the same weights and batch on every rank
qkv, x = torch.nn.Linear(64, 3 * 64, device=device), torch.randn(2, 1024, 64, device=device)  # x: [B, S, dim]


def loss_of(x):  # the ranks' losses add up to the whole sequence's
    q, k, v = (t.unflatten(-1, (4, 16)).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()


loss_of(x).backward()  # one process on the whole sequence: the reference
expected = [p.grad.clone() for p in qkv.parameters()]
qkv.zero_grad()
with cp_cache.context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):  # inside, x is this rank's shard
    loss_of(x).backward()  # the backward inside the region too
error = 0.0
for p, e in zip(qkv.parameters(), expected):
    dist.all_reduce(p.grad)  # each rank holds its share: sum over the ranks
    error = max(error, ((p.grad - e).norm() / e.norm()).item())
print(f"rank {dist.get_rank()} of {dist.get_world_size()} ({device}): gradients vs one process, "
      f"relative error {error:.1e}")
dist.destroy_process_group()
sys.exit(0 if error < 1e-3 else 1)
