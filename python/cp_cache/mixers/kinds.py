"""The kinds of sequence mixer a CP region must serve or refuse, known by their classes (DESIGN §20).

A kind is matched on the class names of a module's MRO, so subclasses keep their kind. Attention is its own
kind: served where it reaches cp_cache's attention (``attn_implementation`` "cp_cache" or "sdpa"). A kind that has
a CP form registers it in ``SERVERS``; every other kind is refused."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["Kind", "KINDS", "ATTENTION", "SERVED_ATTENTION", "SERVERS", "kind_of", "served_summary"]


@dataclass(frozen=True)
class Kind:
    name: str
    what: str  # for messages: "a Gated DeltaNet"
    pattern: str  # a regular expression matched (fullmatch) on the class names of the module's MRO

    def matches(self, module: torch.nn.Module) -> bool:
        return _matches(self.pattern, type(module))


KINDS = (  # the first match wins
    Kind("other", "a token mixer of its own (a per-token dynamic convolution, a token shift, n-gram embeddings, "
         "compressed or indexed keys)",
         r".*(DynamicShortConvolution|NGramEmbedding|Compressor|Indexer|IndexerScorer|CCAProjection)|"
         r"Rwkv(SelfAttention|FeedForward)"),
    Kind("gated_delta", "a Gated DeltaNet (linear attention with a recurrent state)", r".*GatedDeltaNet"),
    Kind("kimi_delta", "a Kimi Delta Attention (a gated delta rule with a decay per channel)",
         r".*DeltaAttention|Glm5Next\w*LinearAttention"),
    Kind("short_conv", "a short causal convolution", r".*(ShortConv|ShortConvolution)"),
    Kind("mamba2", "a Mamba-2 state-space mixer",
         r".*(Mamba2Mixer|BambaMixer|MambaLayer|FalconH1Mixer|Zamba2MambaMixer)"),
    Kind("mamba1", "a Mamba state-space mixer", r".*MambaMixer"),
    Kind("linear_attention", "a linear attention or recurrent mixer",
         r"(?!KimiLinearAttention$).*(LinearAttention|LightningAttention|Rglru|RecurrentBlock|Retention)|"
         r"xLSTM(Layer|Block|Backend)"),
)
ATTENTION = Kind("attention", "attention", r".*Attention")
SERVED_ATTENTION = ("cp_cache", "sdpa")  # transformers' attention implementations that reach cp_cache

# kind name -> how it is served under CP (set by the kind's own module)
SERVERS: dict[str, Callable] = {}


@functools.lru_cache(maxsize=4096)
def _matches(pattern: str, cls: type) -> bool:
    return any(re.fullmatch(pattern, c.__name__) for c in cls.__mro__)


def kind_of(module: torch.nn.Module) -> Optional[Kind]:
    """The module's mixer kind; ``ATTENTION`` for an attention module with a transformers config; else None,
    a recurrent ``torch.nn.RNNBase`` and a ``Conv1d`` wider than one token included as kinds of their own."""
    for kind in KINDS:
        if kind.matches(module):
            return kind
    if isinstance(module, torch.nn.RNNBase):
        return Kind("recurrent", f"a recurrent {type(module).__name__}", "")
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        return Kind("conv", f"a convolution along the sequence (kernel {module.kernel_size[0]})", "")
    if ATTENTION.matches(module) and hasattr(getattr(module, "config", None), "_attn_implementation"):
        return ATTENTION
    return None


def served_summary() -> str:
    names = {"gated_delta": "Gated DeltaNet", "short_conv": "short convolutions", "mamba2": "Mamba-2",
             "mamba1": "Mamba"}
    served = [names.get(name, name) for name in SERVERS]
    return ", ".join([f"attention (attn_implementation {' or '.join(map(repr, SERVED_ATTENTION))})", *served])
