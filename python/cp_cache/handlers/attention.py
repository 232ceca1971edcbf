"""The DTensor handlers of ``npu_fusion_attention_v3`` and its grad, bound to one CPConfig.

Each handler reads top-down: bind the op's arguments once, decide whether the call is
cp_cache's, read it (its ``CallSpec`` and ``CallPlan``: ``spec.py``), run the plan's strategy on
the local shards through the custom op (``ops.py``: now when eager, in the compiled graph when
traced), wrap the results as DTensors. The forward's step cache goes out in the ``seed`` slot (a handle whose storage owns
it, or, under the stack policy, the cache's pairing key) and autograd hands it back to the
grad op's ``seed``.

The handlers stay in DTensor's handler table while cp_cache is enabled, and decide per call
whether it is theirs (``_runs``): a call that is not context parallel goes on to what serves it
without cp_cache (``_pass_on``): the table entry cp_cache displaced (torch_npu's handlers), or
DTensor's own sharding propagation. Nothing is written to the table per call, so calls on other
threads see the table as it is.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..config import CPConfig
from ..engine.agreement import CHECK_ERRORS
from ..npu_ops import bind_arguments, lse_from_stats
from . import ops
from .ops import CallLog
from .spec import local_tensor, read_call, sequence_sharded, share_refusal, sharded_like, sink_grad_like

__all__ = ["AttentionHandlers", "Registration", "dtensor_default"]



class Registration(Protocol):
    """Where the handlers are registered (``cp_cache.dispatch``): whether a CP region is
    active, and what the handlers displaced from the table there."""

    def in_cp(self) -> bool: ...

    def displaced(self, op: Any) -> Optional[Callable]: ...


def _slot_tensor(value: int, like: Tensor) -> Tensor:
    """An int64 [1] output slot, on the CPU (on meta when ``like`` is: tracing with meta tensors)."""
    return torch.tensor([value], dtype=torch.int64, device="meta" if like.is_meta else "cpu")


class AttentionHandlers:
    """The forward and backward handlers of one ``cp_cache.enable()``, and the table that
    maps the ops to them (the same bound methods every time, so a table can be checked)."""

    def __init__(self, config: CPConfig, call_log: CallLog):
        self.config = config
        self.call_log = call_log
        self.registration: Optional[Registration] = None  # set by cp_cache.dispatch; None: every CP call
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

    def _runs(self, a: dict, backward: bool) -> bool:
        """Whether the call of the bound arguments ``a`` is cp_cache's. Its query must be sharded on
        the sequence (a CP mesh dimension) over ranks of their own (not LocalTensor's ranks
        simulated in one process: the ring exchanges between processes). A forward then runs only
        inside a CP region (outside one the call is served as without cp_cache, even where that is
        DTensor's "no sharding strategy" error); a backward runs where its forward ran: cp_cache's
        forward gives a plain seed, one served elsewhere a DTensor."""
        query = a["query"]
        if not isinstance(query, DTensor) or _simulated_ranks(query) or not sequence_sharded(query, a["input_layout"]):
            return False
        if backward:
            return not isinstance(a["seed"], DTensor)
        return self.registration is None or self.registration.in_cp()

    def _pass_on(self, op_call, args, kwargs):
        """Serve a call that is not cp_cache's as it is served without cp_cache."""
        entry = None if self.registration is None else self.registration.displaced(op_call)
        if entry is not None:
            return entry(op_call, args, kwargs)
        return dtensor_default(op_call, args, kwargs)

    # Where torch.compile cannot trace a call (Dynamo breaks the graph at the op), the op runs
    # eagerly and so does its handler: Dynamo must not trace the handler's own frames into
    # graphs of their own.
    @torch._dynamo.disable
    def forward(self, op_call, args, kwargs):
        """Handler of ``npu_fusion_attention_v3`` for DTensor inputs."""
        started = time.perf_counter()
        a = bind_arguments(op_call._schema, args, kwargs)
        if not self._runs(a, backward=False):
            return self._pass_on(op_call, args, kwargs)
        try:
            call = read_call(a, self.config)
        except CHECK_ERRORS as error:
            share_refusal("forward", a, error)
            raise
        q, k, v = call.local("query", "key", "value")
        out, lse, seed = ops.run_forward(q, k, v, call.mask, call.groups, call.plan, self.config.policy,
                                         *call.lengths, call.sink)
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
        a = bind_arguments(op_call._schema, args, kwargs)
        if not self._runs(a, backward=True):
            return self._pass_on(op_call, args, kwargs)
        try:
            ops.check_seed(a["seed"])
            call = read_call(a, self.config, backward=True)
            for name in ("dy", "attention_in"):
                a[name] = sharded_like(a[name], name, call.sharding.mesh, call.sharding.placements)
            lse = lse_from_stats(local_tensor(a["softmax_max"], "softmax_max"),
                                 local_tensor(a["softmax_sum"], "softmax_sum"))
        except CHECK_ERRORS as error:
            share_refusal("backward", a, error)
            raise
        dy, q, k, v, out = call.local("dy", "query", "key", "value", "attention_in")
        dq, dk, dv, dsink = ops.run_backward(dy, q, k, v, out, lse, a["seed"], call.mask, call.groups, call.plan,
                                             self.config.policy, *call.lengths, call.sink)
        outputs = (
            *call.wrap_grads(dq, dk, dv),
            torch.empty(0, dtype=q.dtype, device=q.device),  # dpse: no pse
            # without a sink: a float32 0-d zero, as the op's meta
            sink_grad_like(a["sink"], dsink, call.sharding.cp_dims),
        )
        self.call_log.set_handler_seconds("backward", started)
        return outputs


# ---------------------------------------------------------------- calls that are not cp_cache's


def dtensor_default(op_call, args, kwargs):
    """DTensor's own dispatch of a call, as when no handler is registered for the op: sharding
    propagation (NotImplementedError when the op has no sharding strategy), redistribution, the
    local op, the wrapped results. torch's C++ dispatcher reads the handler table before this
    path and has no way to skip it for one call, so its Python steps run here (the attention ops
    are neither in-place nor views: no aliasing to correct)."""
    from torch.distributed.tensor._op_schema import OutputSharding

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    sharding = dispatcher._propagate_op_sharding_dispatch_slow_path(op_call, args, kwargs, op_info, True)
    if not isinstance(sharding, OutputSharding):
        return sharding  # decomposed: the result itself
    op_info.output_sharding = sharding
    local_results = dispatcher._dispatch_get_local_results_slow_path(op_call, args, op_info)
    return dispatcher.wrap(local_results, sharding.output_spec)


def _simulated_ranks(query: DTensor) -> bool:
    """Whether the ranks are simulated in this process (LocalTensor mode: the local tensor holds
    every rank's shard, ranks and sizes are symbolic)."""
    local = query._local_tensor
    if type(local) is Tensor:  # the usual case, without the import below
        return False
    from torch.distributed._local_tensor import LocalTensor  # loaded with DTensor

    return isinstance(local, LocalTensor)

