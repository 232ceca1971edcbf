"""The DTensor handlers of ``npu_fusion_attention_v3`` and its grad, bound to one CPConfig.

Each handler reads top-down: bind the op's arguments and prepare the call (its one
``CallPlan``: ``call.py``), run the plan's strategy on the local shards through the custom op
(``ops.py``: now when eager, in the compiled graph when traced), wrap the results as
DTensors. The forward's step cache goes out in the ``seed`` slot (a handle whose storage owns
it, or, under the stack policy, the cache's pairing key) and autograd hands it back to the
grad op's ``seed``.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..config import CPConfig
from ..npu_ops import lse_from_stats
from . import ops
from ..arguments import bind_arguments
from .call import prepare, refusal_shared
from .calls import CallLog
from .checks import local_tensor, sharded_like

__all__ = ["AttentionHandlers"]


def _slot_tensor(value: int, like: Tensor) -> Tensor:
    """An int64 [1] output slot, on the CPU (on meta when ``like`` is: tracing with meta tensors)."""
    return torch.tensor([value], dtype=torch.int64, device="meta" if like.is_meta else "cpu")


class AttentionHandlers:
    """The forward and backward handlers of one ``cp_cache.enable()``, and the table that
    maps the ops to them (the same bound methods every time, so a table can be checked)."""

    def __init__(self, config: CPConfig, call_log: CallLog):
        self.config = config
        self.call_log = call_log
        self.forward_handler = self.forward
        self.backward_handler = self.backward

    def table(self) -> dict:
        """{op overload: handler} for the ops that exist in this process (real or emulated)."""
        table = {}
        for name, handler in (("npu_fusion_attention_v3", self.forward_handler),
                              ("npu_fusion_attention_grad_v3", self.backward_handler)):
            try:
                table[getattr(torch.ops.npu, name).default] = handler
            except (AttributeError, RuntimeError):
                pass
        return table

    # Where torch.compile cannot trace a call (Dynamo breaks the graph at the op), the op runs
    # eagerly and so does its handler: Dynamo must not trace the handler's own frames into
    # graphs of their own.
    @torch._dynamo.disable
    def forward(self, op_call, args, kwargs):
        """Handler of ``npu_fusion_attention_v3`` for DTensor inputs."""
        started = time.perf_counter()
        with refusal_shared("forward", op_call, args, kwargs):
            call = prepare(bind_arguments(op_call._schema, args, kwargs), self.config)
        q, k, v = call.local("query", "key", "value")
        out, lse, seed = ops.ring_forward(q, k, v, call.mask, call.groups, call.plan.encode(), self.config.policy,
                                          *call.lengths)
        outputs = (
            *call.wrap_forward(out, lse),
            torch.empty(0, dtype=q.dtype, device=q.device),
            seed,
            _slot_tensor(call.plan.world_size, q),
        )
        self.call_log.set_handler_seconds("forward", started)
        return outputs

    @torch._dynamo.disable
    def backward(self, op_call, args, kwargs):
        """Handler of ``npu_fusion_attention_grad_v3`` for DTensor inputs."""
        started = time.perf_counter()
        with refusal_shared("backward", op_call, args, kwargs):
            a = bind_arguments(op_call._schema, args, kwargs)
            ops.check_seed(a["seed"])
            call = prepare(a, self.config, backward=True)
            for name in ("dy", "attention_in"):
                a[name] = sharded_like(a[name], name, call.sharding.mesh, call.sharding.placements)
            lse = lse_from_stats(*(local_tensor(a[n], n) for n in ("softmax_max", "softmax_sum")))
        dy, q, k, v, out = call.local("dy", "query", "key", "value", "attention_in")
        dq, dk, dv = ops.ring_backward(dy, q, k, v, out, lse, a["seed"], call.mask, call.groups, call.plan.encode(),
                                       self.config.policy, *call.lengths)
        outputs = (
            *call.wrap_grads(dq, dk, dv),
            torch.empty(0, dtype=q.dtype, device=q.device),  # dpse: no pse
            torch.zeros((), dtype=torch.float32, device=q.device),  # dsink: no sink (0-d, as the op's meta)
        )
        self.call_log.set_handler_seconds("backward", started)
        return outputs
