"""``torch.ops.cp_cache.fusion_attention`` and its grad: the NPU v3 ops' schemas and derivative under another
name for machines without them (CPU, CUDA), called by the SDPA front end and the transformers integration. In a CP
region DTensor hands a call to the handlers (step kernel by default "torch"); on plain tensors it runs on one rank."""

from __future__ import annotations

import torch

from . import layout as L
from .config import CPConfig
from .npu_ops import FORWARD_V3, GRAD_V3, bind_arguments, define_attention_ops, lse_from_stats, stats_views_from_lse

__all__ = ["FORWARD", "GRAD", "forward_op", "grad_op"]

FORWARD = FORWARD_V3.replace("npu_fusion_attention_v3(", "fusion_attention(", 1)
GRAD = GRAD_V3.replace("npu_fusion_attention_grad_v3(", "fusion_attention_grad(", 1)
_SCHEMAS = {name: torch._C.parse_schema(s) for name, s in (("forward", FORWARD), ("grad", GRAD))}


def _call(a: dict, backward: bool = False):
    from .dispatch import active_config  # the enabled configuration, else the defaults
    from .handlers.spec import read_local  # at the first call: DTensor and dynamo stay unloaded till then
    config = (active_config() or CPConfig()).for_own_op()
    return config, read_local(a, config, backward=backward)


def _forward(*args, **kwargs):
    from .handlers.attention import forward_local
    a = bind_arguments(_SCHEMAS["forward"], args, kwargs)
    config, call = _call(a)
    q, k, v = a["query"], a["key"], a["value"]
    out, lse, seed = forward_local(q, k, v, call.mask, [], call.plan, config.policy, *call.lengths, call.sink)
    return out, *stats_views_from_lse(lse), q.new_empty(0), seed, torch.ones(1, dtype=torch.int64)


def _grad(*args, **kwargs):
    from .handlers.attention import backward_local
    a = bind_arguments(_SCHEMAS["grad"], args, kwargs)
    config, call = _call(a, backward=True)
    lse = lse_from_stats(a["softmax_max"], a["softmax_sum"])
    dq, dk, dv, dsink = backward_local(a["dy"], a["query"], a["key"], a["value"], a["attention_in"], lse, a["seed"],
                                       call.mask, [], call.plan, config.policy, *call.lengths, call.sink)
    return dq, dk, dv, a["query"].new_empty(0), dsink


def _forward_fake(*args, **kwargs):
    a = bind_arguments(_SCHEMAS["forward"], args, kwargs)
    q, layout, heads = a["query"], a["input_layout"], a["head_num"]
    stats = (*L.lse_shape(q, layout, heads), 8)
    seed = torch.empty(1, dtype=torch.int64, device="meta" if q.is_meta else "cpu")
    return (q.new_empty(L.output_shape(q, a["key"], a["value"], layout, heads)),
            q.new_empty(stats, dtype=torch.float32), q.new_empty(stats, dtype=torch.float32), q.new_empty(0), seed,
            torch.empty_like(seed))


def _grad_fake(*args, **kwargs):
    a = bind_arguments(_SCHEMAS["grad"], args, kwargs)
    q, sink = a["query"], a["sink"]
    dsink = q.new_empty((), dtype=torch.float32) if sink is None else sink.new_empty(sink.shape)
    return q.new_empty(q.shape), a["key"].new_empty(a["key"].shape), a["value"].new_empty(a["value"].shape), \
        q.new_empty(0), dsink


_LIB = torch.library.Library("cp_cache", "FRAGMENT")  # noqa: TOR901
define_attention_ops(_LIB, FORWARD, GRAD, (_forward, _grad), (_forward_fake, _grad_fake), "CompositeExplicitAutograd")
forward_op = torch.ops.cp_cache.fusion_attention.default
grad_op = torch.ops.cp_cache.fusion_attention_grad.default
