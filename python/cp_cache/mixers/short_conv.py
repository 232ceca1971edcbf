"""Short causal convolutions under CP (LFM2's conv layers, the conv in front of Gated DeltaNet and Mamba): each
chunk takes its K-1 left tokens from the chunk before it in sequence order (``sequence.left_context``, same
document only), and a document that starts inside a chunk sees nothing of the one before it."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import region, sequence
from .kinds import SERVERS
from .sequence import ShardedSequence, document_ends, left_context, lengths_of, piece_starts
from .serving import FunctionServer

__all__ = ["causal_conv_under_cp", "causal_conv_documents", "activation", "served_conv"]


def activation(name: Optional[str]):
    if name is None:
        return None
    if name in ("silu", "swish"):
        return F.silu
    from transformers.activations import ACT2FN  # the models' own table, for the rarer names
    return ACT2FN[name]


def causal_conv_under_cp(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq: ShardedSequence,
                         act: Optional[str] = None) -> Tensor:
    """Depthwise causal conv of the local ``x`` [B, C, L] with ``weight`` [C, K], exact under CP."""
    dtype, x = x.dtype, x.to(weight.dtype)
    width = weight.size(-1) - 1
    contexts = left_context(seq, x, width) if width else [None] * len(seq.mine)
    outs = []
    for chunk, context in zip(seq.mine, contexts):
        part = x[..., chunk.local:chunk.local + chunk.length]
        outs.append(_conv(part if context is None else torch.cat([context, part], dim=-1), weight, width,
                          piece_starts(chunk.pieces)))
    return _finish(torch.cat(outs, dim=-1), bias, act, dtype)


def causal_conv_documents(x: Tensor, weight: Tensor, bias: Optional[Tensor], lengths: tuple[int, ...],
                          act: Optional[str] = None) -> Tensor:
    """One process: ``x`` [B, C, L] holding documents of ``lengths``, none seeing another."""
    dtype, x = x.dtype, x.to(weight.dtype)
    width = weight.size(-1) - 1
    return _finish(_conv(F.pad(x, (width, 0)), weight, width, piece_starts(lengths)), bias, act, dtype)


def _conv(extended: Tensor, weight: Tensor, width: int, starts: tuple[int, ...]) -> Tensor:
    """``extended`` [B, C, width + n]: n tokens after their left context; tap j of token t is dropped where a
    document starts in (t - j, t]."""
    n = extended.size(-1) - width
    out = extended[..., width:] * weight[:, width, None]
    for j in range(1, width + 1):
        tap = extended[..., width - j:width - j + n] * weight[:, width - j, None]
        out = out + (tap.masked_fill(_drops(n, j, starts, extended.device), 0) if starts else tap)
    return out


@functools.lru_cache(maxsize=256)
def _drops(n: int, shift: int, starts: tuple[int, ...], device) -> Tensor:
    start = torch.full((n,), -shift, dtype=torch.int64)  # the first piece reads its left context
    for s in starts:
        start[s:] = s
    return (torch.arange(n) - shift < start).to(device)


def _finish(out: Tensor, bias: Optional[Tensor], act: Optional[str], dtype: torch.dtype) -> Tensor:
    if bias is not None:
        out = out + bias[:, None]
    fn = activation(act)
    return (out if fn is None else fn(out)).to(dtype)


def served_conv(original):
    """cp_cache's ``causal_conv1d_fn(hidden_states [B, C, L], weight [C, K], bias, activation, **kwargs)``."""

    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        ends = document_ends(kwargs.get("cu_seq_lens_q"))
        seq = sequence.current(hidden_states.size(-1), ends)
        if seq is not None:
            if kwargs.get("seq_idx") is not None and ends is None and region.active().documents is None:
                raise NotImplementedError("cp_cache: a short convolution under context parallelism with documents "
                                          "given as seq_idx alone: pass the batch's cu_seq_lens_q, or its documents "
                                          "to cp_cache.context_parallel(..., documents=)")
            return causal_conv_under_cp(hidden_states, weight, bias, seq, activation)
        region.refuse_without_region("a short convolution")
        if ends is not None and len(ends) > 1:
            return causal_conv_documents(hidden_states, weight, bias, lengths_of(ends), activation)
        return original(hidden_states, weight, bias, activation=activation, **kwargs)

    return causal_conv1d_fn


SERVERS["short_conv"] = FunctionServer({"causal_conv1d_fn": served_conv})
