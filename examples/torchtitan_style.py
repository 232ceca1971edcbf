"""What a torchtitan user does, with cp_cache: a Llama-style Transformer whose attention calls
F.scaled_dot_product_attention, a named device mesh ("dp", "cp"), and each training step under a CP context made
from the step's inputs, labels and the model's RoPE table (torchtitan's create_context_parallel_ctx: buffers
[inputs, labels, freqs_cis] on sequence dims [1, 1, 0]), here cp_cache.context_parallel with the same arguments.
torchtitan itself is not needed (its release pins datasets below the version TRL needs, so it is not installed
here): the model below follows torchtitan's llama3 (RMSNorm, complex RoPE, SwiGLU). Two steps' losses and the
gradients are checked against one process on the whole sequence (exit status 1 if they differ).

    torchrun --nproc-per-node 2 examples/torchtitan_style.py [cpu|cuda|npu]    (default: the device found)
"""
import copy, os, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
try:
    import torch_npu                                     # Ascend: torch_npu first, then cp_cache
except ImportError:
    pass
import cp_cache

DIM, HEADS, LAYERS, VOCAB, SEQ = 64, 4, 2, 128, 512


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.wqkv, self.wo = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.w13, self.w2 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x, freqs_cis):
        q, k, v = self.wqkv(self.attention_norm(x)).unflatten(-1, (3, HEADS, DIM // HEADS)).unbind(2)  # [B, S, N, D]
        q, k = (torch.view_as_real(torch.view_as_complex(t.float().unflatten(-1, (-1, 2))) * freqs_cis[:, None])
                .flatten(-2).type_as(x) for t in (q, k))        # RoPE at each row's global position
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        x = x + self.wo(out.transpose(1, 2).flatten(-2))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings, self.norm = nn.Embedding(VOCAB, DIM), nn.RMSNorm(DIM)
        self.layers, self.output = nn.ModuleList(Block() for _ in range(LAYERS)), nn.Linear(DIM, VOCAB, bias=False)
        angles = torch.outer(torch.arange(SEQ), 10000.0 ** (-torch.arange(0, DIM // HEADS, 2) / (DIM // HEADS)))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.freqs_cis)
        return self.output(self.norm(x))


device = sys.argv[1] if len(sys.argv) > 1 else ("npu" if hasattr(torch, "npu") and torch.npu.is_available()
                                                else "cuda" if torch.cuda.is_available() else "cpu")
dist.init_process_group({"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device])
if device != "cpu":
    getattr(torch, device).set_device(int(os.environ["LOCAL_RANK"]))
cp = dist.get_world_size()                               # every rank in the CP dimension here; dp = world / cp
world_mesh = init_device_mesh(device, (dist.get_world_size() // cp, cp), mesh_dim_names=("dp", "cp"))
torch.manual_seed(0)                                     # the same weights and batches on every rank
model = Transformer().to(device)
reference = copy.deepcopy(model)                         # one process on the whole sequence
optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]

for step in range(2):
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), device=device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    expected = F.cross_entropy(reference(inputs).flatten(0, 1), labels.flatten())
    expected.backward()
    with cp_cache.context_parallel(world_mesh["cp"], buffers=[inputs, labels, model.freqs_cis],
                                   buffer_seq_dims=[1, 1, 0], no_restore_buffers={inputs, labels},
                                   model=model):    # model: every layer that mixes tokens checked on entry
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())   # this rank's tokens
        loss.backward()
    for p in model.parameters():                         # torchtitan's FSDP averages over dp and cp: the same here
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    dist.all_reduce(loss := loss.detach())
    loss /= dist.get_world_size()                        # equal token counts per rank: the mean of the means
    grad_error = max(((p.grad - r.grad).norm() / r.grad.norm()).item()
                     for p, r in zip(model.parameters(), reference.parameters()))
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} ({device}), step {step}: loss {loss.item():.6f}, "
          f"one process {expected.item():.6f}; gradients' relative error {grad_error:.1e}")
    if abs(loss.item() - expected.item()) > 1e-4 or grad_error > 1e-3:
        sys.exit(1)
dist.destroy_process_group()
