"""The float32 rounding of ``python -m cp_cache demo``'s model, measured in the test's own process
(test_cli.py, test_compile.py): the demo's initial model and batch, built as the demo builds them
(seed, config, small embeddings), its loss and gradients in float32 against float64. The demo's
reported differences (CP against one process) are bounded by a multiple of it.
"""

from __future__ import annotations

import torch

from cp_cache.testing.models import ModelConfig, TinyDecoder, make_batch
from cp_cache.testing.reference import float32_model_error


def demo_rounding(*, seq_len: int, layers: int, dim: int, heads: int = 4, kv_heads: int = 2, batch: int = 2,
                  seed: int = 0) -> dict:
    """``float32_model_error`` of the demo's model at its first step (dropout off)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config = ModelConfig(vocab=64, dim=dim, heads=heads, kv_heads=kv_heads, layers=layers, max_seq=seq_len)
        model = TinyDecoder(config)
        with torch.no_grad():  # as the demo: small embeddings (the head is tied)
            model.embed.weight.normal_(0.0, 0.02)
            model.position.weight.normal_(0.0, 0.02)
    tokens, labels, positions = make_batch(batch, seq_len, config.vocab, seed=seed)
    return float32_model_error(model, tokens, labels, positions)
