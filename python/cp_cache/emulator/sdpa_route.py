"""The SDPA route: ``F.scaled_dot_product_attention`` sent to ``npu_fusion_attention_v3`` on CPU,
the way torch_npu sends it on an NPU (BNSD, scale 1/sqrt(D) unless given, keep_prob =
1 - dropout_p, ``is_causal`` as the compressed mask with sparse_mode 2, a bool mask inverted).

The function is named ``scaled_dot_product_attention``: torch's ``context_parallel()``
patches SDPA with ``setattr(F, fn.__name__, wrapper)``, so any other name would let
attention silently run locally per rank.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..npu_ops import autocast_inputs, causal_mask, sdpa_arguments

__all__ = ["scaled_dot_product_attention", "install_route", "uninstall_route", "routed"]

logger = logging.getLogger("cp_cache")

_ORIGINAL_SDPA = None
_ROUTED = False


def _local_device(x: Any) -> Optional[torch.device]:
    """The device a tensor's data lives on; for a DTensor, that of its local shard.

    A DTensor is a wrapper subclass created with its local tensor's device, so
    ``.device`` answers for both without touching the data (no to_local(), no
    item()).
    """
    if not isinstance(x, torch.Tensor):
        return None
    return x.device


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` routed to ``torch.ops.npu.npu_fusion_attention_v3`` on CPU."""
    original = _ORIGINAL_SDPA if _ORIGINAL_SDPA is not None else torch._C._nn.scaled_dot_product_attention
    call_original = lambda: original(  # noqa: E731
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )
    devices = [_local_device(t) for t in (query, key, value)]
    if any(dev is None or dev.type != "cpu" for dev in devices):
        return call_original()
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return call_original()
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        logger.debug("npu emulator SDPA route: non-boolean attn_mask (%s), using the original SDPA", attn_mask.dtype)
        return call_original()
    if attn_mask is not None and is_causal:
        return call_original()  # torch raises for this combination
    if not (0.0 <= dropout_p < 1.0):
        return call_original()
    nq, nkv = query.size(1), key.size(1)
    if nq != nkv and not enable_gqa:
        return call_original()  # torch's own error
    kwargs = sdpa_arguments(query, key, attn_mask, dropout_p, is_causal, scale)
    query, key, value = autocast_inputs(query, key, value)  # aten's SDPA is cast before torch_npu's kernel
    out = torch.ops.npu.npu_fusion_attention_v3(query, key, value, nq, "BNSD", **kwargs)
    return out[0]


def install_route() -> None:
    global _ROUTED, _ORIGINAL_SDPA
    # built now, not at the first causal call: a model compiled before any eager call would
    # otherwise trace the mask's first build (a lock: a graph break kept for every later call)
    causal_mask("cpu")
    current = F.scaled_dot_product_attention
    if current is scaled_dot_product_attention:
        _ROUTED = True
        return
    _ORIGINAL_SDPA = current
    F.scaled_dot_product_attention = scaled_dot_product_attention
    _ROUTED = True


def uninstall_route() -> None:
    global _ROUTED
    if not _ROUTED:
        return
    if F.scaled_dot_product_attention is scaled_dot_product_attention:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
    else:
        logger.warning(
            "npu emulator: F.scaled_dot_product_attention was replaced by someone else after the emulator "
            "routed it; leaving it as it is"
        )
    _ROUTED = False



def routed() -> bool:
    """Whether SDPA is routed to the v3 op."""
    return _ROUTED
