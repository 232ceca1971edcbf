"""A small decoder-style model whose attention calls ``F.scaled_dot_product_attention``,
for tests, the demo and the benchmarks.

Under ``cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], ...)``
every buffer is sharded on the sequence dimension (head-tail when load
balancing), so positions travel with their tokens and the model needs nothing
CP-specific.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint_utils
from torch import Tensor, nn

CHECKPOINT_MODES = ("none", "non_reentrant", "reentrant", "selective_save_attention", "selective_recompute_all")


@dataclass
class ModelConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    kv_heads: int = 4
    layers: int = 2
    max_seq: int = 256
    dropout: float = 0.0  # attention dropout (SDPA dropout_p) while training


class ScaledDotProductAttention(nn.Module):
    """``F.scaled_dot_product_attention`` as a module: what torch's module-wrapper CP path
    (``parallelize_module`` with ``_ContextParallel``) hooks to shard its inputs."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, enable_gqa: bool) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.dim % config.heads or config.heads % config.kv_heads:
            raise ValueError(
                f"dim={config.dim} must divide by heads={config.heads}, and heads by kv_heads={config.kv_heads}"
            )
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.dim // config.heads
        self.q = nn.Linear(config.dim, config.dim, bias=False)
        self.kv = nn.Linear(config.dim, 2 * self.kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        self.dropout = config.dropout
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        q = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(batch, seq, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.sdpa(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                      enable_gqa=self.kv_heads != self.heads)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim)
        self.attention = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 2 * config.dim), nn.GELU(), nn.Linear(2 * config.dim, config.dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _selective_policy(save_attention: bool):
    attention_ops = {torch.ops.npu.npu_fusion_attention_v3.default} if hasattr(torch.ops.npu, "npu_fusion_attention_v3") else set()

    def policy(ctx, op, *args, **kwargs):
        if save_attention and op in attention_ops:
            return checkpoint_utils.CheckpointPolicy.MUST_SAVE
        return checkpoint_utils.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class TinyDecoder(nn.Module):
    """Token + position embeddings, ``layers`` pre-norm blocks, a tied output head."""

    def __init__(self, config: ModelConfig, checkpoint: str = "none"):
        super().__init__()
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint={checkpoint!r}; use one of {CHECKPOINT_MODES}")
        self.config = config
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.position = nn.Embedding(config.max_seq, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)

    def _run_block(self, block: Block, x: Tensor) -> Tensor:
        mode = self.checkpoint
        if mode == "none" or not torch.is_grad_enabled():
            return block(x)
        if mode in ("non_reentrant", "reentrant"):
            return checkpoint_utils.checkpoint(block, x, use_reentrant=(mode == "reentrant"))
        policy = _selective_policy(save_attention=(mode == "selective_save_attention"))
        return checkpoint_utils.checkpoint(
            block, x, use_reentrant=False,
            context_fn=lambda: checkpoint_utils.create_selective_checkpoint_contexts(policy),
        )

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = self._run_block(block, x)
        return self.norm(x) @ self.embed.weight.t()


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def make_batch(batch: int, seq: int, vocab: int, *, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, labels, positions), each [batch, seq] int64; labels are the next tokens."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    positions = torch.arange(seq).expand(batch, seq).contiguous()
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous(), positions
