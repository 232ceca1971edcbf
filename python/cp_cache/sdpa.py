"""Where the NPU op does not exist, ``cp_cache.enable()`` routes ``F.scaled_dot_product_attention`` here: inside a
CP region a call on the DTensors torch's CP wrapper made runs cp_cache's own op (``op.py``); anything else is SDPA.
The function is named ``scaled_dot_product_attention``: torch's ``context_parallel()`` patches SDPA with
``setattr(F, fn.__name__, wrapper)``, so any other name would let attention run locally per rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from .npu_ops import autocast_inputs, causal_mask, describe, sdpa_arguments
from .op import forward_op
from .mixers.region import check_mask_fits, in_cp

__all__ = ["scaled_dot_product_attention", "install", "uninstall"]

_ORIGINAL = F.scaled_dot_product_attention


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    if not (isinstance(query, DTensor) and Shard(2) in query.placements and in_cp()):
        return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    if query.size(1) != key.size(1) and not enable_gqa:
        raise ValueError(f"scaled_dot_product_attention: query has {query.size(1)} heads and key {key.size(1)}; "
                         "pass enable_gqa=True for grouped-query attention")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal=True, not both")
    if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.dim() != 4):
        raise ValueError(f"scaled_dot_product_attention under context parallelism takes a bool attn_mask (True = "
                         f"attend) as [B or 1, N or 1, S, S], sharded with the queries (a buffer of the CP region, "
                         f"seq dim 2: torch's wrapper shards it so); got attn_mask={describe(attn_mask)}")
    check_mask_fits(attn_mask, key.size(2), "scaled_dot_product_attention")  # q/k/v: the handler checks them
    kwargs = sdpa_arguments(query, key, attn_mask, dropout_p, is_causal, scale)
    query, key, value = autocast_inputs(query, key, value)  # as SDPA's own autocast casts them
    return forward_op(query, key, value, query.size(1), "BNSD", **kwargs)[0]


def install() -> None:
    """Idempotent."""
    global _ORIGINAL
    # causal masks built now: a model compiled before any eager call would trace the build (a lock: a graph break)
    causal_mask("cpu")
    if torch.cuda.is_available():
        causal_mask(torch.device("cuda", torch.cuda.current_device()))
    if F.scaled_dot_product_attention is not scaled_dot_product_attention:
        _ORIGINAL = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention


def uninstall() -> None:
    """Unless someone replaced this route since."""
    if F.scaled_dot_product_attention is scaled_dot_product_attention:
        F.scaled_dot_product_attention = _ORIGINAL
