"""F.scaled_dot_product_attention on q, k, v sharded in place by cp_cache.context_parallel, and the full output
and gradients gathered back with cp_cache.unshard_sequence; checked against one process (exit status 1 if not).

    torchrun --nproc-per-node 2 examples/sdpa_full_gradients.py [cpu|cuda|npu]    (default: the device found)
"""
import os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
try:
    import torch_npu                                     # Ascend: torch_npu first, then cp_cache
except ImportError:
    pass
import cp_cache

device = sys.argv[1] if len(sys.argv) > 1 else ("npu" if hasattr(torch, "npu") and torch.npu.is_available()
                                                else "cuda" if torch.cuda.is_available() else "cpu")
dist.init_process_group({"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device])
if device != "cpu":
    getattr(torch, device).set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh(device, (dist.get_world_size(),))
torch.manual_seed(0)                                     # the same tensors on every rank
q, k, v = (torch.randn(2, 8, 1024, 32, device=device) for _ in range(3))    # [batch, heads, sequence, head dim]
full = [t.clone().requires_grad_() for t in (q, k, v)]   # one process on the whole sequence: the reference
expected_out = F.scaled_dot_product_attention(*full, is_causal=True)
expected_out.square().sum().backward()


def gather(local):                                       # this rank's rows of dim 2 -> the whole sequence, in order
    return cp_cache.unshard_sequence(DTensor.from_local(local, mesh, [Shard(2)]), 2)


with cp_cache.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):  # sharded in place
    for t in (q, k, v):
        t.requires_grad_()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # this rank's rows of the output
    out.square().sum().backward()                        # the ranks' losses add up to the whole sequence's
    out, grads = gather(out.detach()), [gather(t.grad) for t in (q, k, v)]   # shard-shaped .grad -> full
    for t in (q, k, v):
        t.requires_grad_(False)                          # the buffers get their full values back on exit
error = max(((a - b).norm() / b.norm()).item()
            for a, b in zip([out, *grads], [expected_out, *(t.grad for t in full)]))
print(f"rank {dist.get_rank()} of {dist.get_world_size()} ({device}): output and dq, dk, dv vs one process, "
      f"relative error {error:.1e}")
dist.destroy_process_group()
sys.exit(0 if error < 1e-3 else 1)
