"""The DTensor handlers of ``npu_fusion_attention_v3`` and its grad, and the custom ops that run their local work.

The local work runs eagerly as ``forward_local`` / ``backward_local``, and as the ops ``cp_cache::ring_forward`` /
``ring_backward`` where traced, so the graph records them. Each starts the ranks' agreement once (a refusal is
every rank's). The step cache leaves in the ``seed`` slot; autograd hands it to the grad op."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from .. import layout as L
from .. import step_cache
from ..mixers import region
from ..algorithms import HYBRID, PACKED, PACKED_ULYSSES, RING, ULYSSES, WithCapacity, WithSink
from ..config import CPConfig
from ..documents import read_documents
from ..engine.agreement import CHECK_ERRORS, agree_on_refusal, start_agreement
from ..kernels import KERNELS, get_kernel
from ..npu_ops import autocast_off, bind_arguments, describe, lse_from_stats
from ..plan import CallPlan
from .spec import local_tensor, read_call, sequence_sharded, share_refusal, sharded_like, sink_grad_like

__all__ = ["AttentionHandlers", "Registration", "dtensor_default", "strategy_for", "run_forward", "run_backward",
           "ring_forward", "ring_backward", "forward_local", "backward_local", "check_seed", "CallRecord", "CallLog",
           "CALL_LOG"]


class Registration(Protocol):
    """Where the handlers are registered (``cp_cache.dispatch``): CP regions entered, table entries displaced."""
    depth: int

    def displaced(self, op: Any) -> Optional[Callable]: ...


def strategy_for(plan: CallPlan, sink: Optional[Tensor] = None):
    """The strategy that runs ``plan``; with ``sink`` (this rank's heads), inside ``WithSink``."""
    if plan.layout != L.TND:
        strategy = {"ulysses": ULYSSES, "hybrid": HYBRID}.get(plan.algorithm, RING)
    elif plan.algorithm in ("ulysses", "hybrid"):
        strategy = PACKED_ULYSSES
    else:
        strategy = PACKED if plan.capacity is None else WithCapacity(PACKED)
    return strategy if sink is None else WithSink(strategy, sink)


class AttentionHandlers:
    """The handlers of one ``cp_cache.enable()``; the same bound methods every time, so a table can be checked."""
    def __init__(self, config: CPConfig, call_log: "CallLog"):
        self.config = config
        # cp_cache's own op runs torch's fused kernels unless a kernel is configured
        self.configs = {"npu": config, "cp_cache": config.for_own_op()}
        self.call_log = call_log
        self.registration: Optional[Registration] = None  # set by cp_cache.dispatch; None: every CP call
        self.forward_handler = self.forward
        self.backward_handler = self.backward

    def table(self) -> dict:
        """For the ops that exist in this process: the NPU ops (real or emulated) and ``cp_cache.op``'s."""
        table = {}
        for namespace, forward, grad in (("npu", "npu_fusion_attention_v3", "npu_fusion_attention_grad_v3"),
                                         ("cp_cache", "fusion_attention", "fusion_attention_grad")):
            try:
                ops = getattr(torch.ops, namespace)
                table[getattr(ops, forward).default] = self.forward_handler
                table[getattr(ops, grad).default] = self.backward_handler
            except (AttributeError, RuntimeError):
                pass
        return table

    def _runs(self, a: dict, backward: bool) -> bool:
        """A backward is ours where cp_cache ran its forward: then the seed is plain, not a DTensor."""
        query = a["query"]
        if not isinstance(query, DTensor) or _simulated_ranks(query) or not sequence_sharded(query, a["input_layout"]):
            return False
        if backward:
            return not isinstance(a["seed"], DTensor)
        return self.registration is None or self.registration.depth > 0

    def _pass_on(self, op_call, args, kwargs):
        """Serve a call that is not cp_cache's as it is served without cp_cache."""
        entry = None if self.registration is None else self.registration.displaced(op_call)
        return (dtensor_default if entry is None else entry)(op_call, args, kwargs)

    # where Dynamo cannot trace a call it breaks the graph and the handler runs eagerly: no graphs of its frames
    @torch._dynamo.disable
    def forward(self, op_call, args, kwargs):
        started = time.perf_counter()
        a = bind_arguments(op_call._schema, args, kwargs)
        if not self._runs(a, backward=False):
            return self._pass_on(op_call, args, kwargs)
        region.count_attention_call()
        try:
            qkv = {n: a[n] for n in ("query", "key", "value")}
            region.check_sequence_fits(qkv, L.seq_dim(a["input_layout"]), f"the CP attention call ({op_call})")
            call = read_call(a, self.configs[op_call.namespace])
        except CHECK_ERRORS as error:
            share_refusal("forward", a, error)
            raise
        q, k, v = call.local("query", "key", "value")
        out, lse, seed = run_forward(q, k, v, call.mask, call.sharding.groups, call.plan, self.config.policy,
                                     *call.lengths, call.sink)
        slot = torch.tensor([call.plan.world_size], dtype=torch.int64, device="meta" if q.is_meta else "cpu")
        outputs = (*call.wrap_forward(out, lse), torch.empty(0, dtype=q.dtype, device=q.device), seed, slot)
        self.call_log.set_handler_seconds("forward", started)
        return outputs

    @torch._dynamo.disable
    def backward(self, op_call, args, kwargs):
        started = time.perf_counter()
        a = bind_arguments(op_call._schema, args, kwargs)
        if not self._runs(a, backward=True):
            return self._pass_on(op_call, args, kwargs)
        try:
            if not isinstance(a["seed"], Tensor):
                check_seed(a["seed"])  # raises, naming it
            call = read_call(a, self.configs[op_call.namespace], backward=True)
            for name in ("dy", "attention_in"):
                a[name] = sharded_like(a[name], name, call.sharding.mesh, call.sharding.placements)
            lse = lse_from_stats(local_tensor(a["softmax_max"], "softmax_max"),
                                 local_tensor(a["softmax_sum"], "softmax_sum"))
        except CHECK_ERRORS as error:
            share_refusal("backward", a, error)
            raise
        dy, q, k, v, out = call.local("dy", "query", "key", "value", "attention_in")
        dq, dk, dv, dsink = run_backward(dy, q, k, v, out, lse, a["seed"], call.mask, call.sharding.groups,
                                         call.plan, self.config.policy, *call.lengths, call.sink)
        outputs = (*call.wrap_grads(dq, dk, dv), torch.empty(0, dtype=q.dtype, device=q.device),  # dpse
                   sink_grad_like(a["sink"], dsink, call.sharding.cp_dims))
        self.call_log.set_handler_seconds("backward", started)
        return outputs


def dtensor_default(op_call, args, kwargs):
    """DTensor's dispatch as without a handler (its C++ dispatcher cannot skip the table for one call)."""
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
    local = query._local_tensor
    if type(local) is Tensor:  # the usual case, without the import below
        return False
    from torch.distributed._local_tensor import LocalTensor  # loaded with DTensor
    return isinstance(local, LocalTensor)


def _groups(names: str) -> list:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return [_resolve_process_group(name) for name in names.split(",")]


def _group_names(process_groups: list) -> str:
    return ",".join(g.group_name for g in process_groups)


def _traced(tensors) -> bool:
    """Traced or shapes only (fake, functional, meta, or a dispatch mode): the work runs as the custom op."""
    if _current_dispatch_mode() is not None:
        return True
    for t in tensors:  # a loop, not a generator: this runs on every call
        if t is not None and (type(t) is not Tensor or t.is_meta):
            return True
    return False


def run_forward(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], process_groups: list,
                call: CallPlan, policy: str, actual_seq_qlen: Optional[Tensor] = None,
                actual_seq_kvlen: Optional[Tensor] = None, sink: Optional[Tensor] = None):
    if not _traced((query, key, value, mask_rows, actual_seq_qlen, actual_seq_kvlen, sink)):
        return forward_local(query, key, value, mask_rows, process_groups, call, policy, actual_seq_qlen,
                             actual_seq_kvlen, sink)
    return ring_forward(query, key, value, mask_rows, _group_names(process_groups), call.encode(), policy,
                        actual_seq_qlen, actual_seq_kvlen, sink)


def run_backward(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                 mask_rows: Optional[Tensor], process_groups: list, called: CallPlan, policy: str,
                 actual_seq_qlen: Optional[Tensor] = None, actual_seq_kvlen: Optional[Tensor] = None,
                 sink: Optional[Tensor] = None):
    if not _traced((dy, query, key, value, out, lse, seed, mask_rows, actual_seq_qlen, actual_seq_kvlen, sink)):
        return backward_local(dy, query, key, value, out, lse, seed, mask_rows, process_groups, called, policy,
                              actual_seq_qlen, actual_seq_kvlen, sink)
    return ring_backward(dy, query, key, value, out, lse, seed, mask_rows, _group_names(process_groups),
                         called.encode(), policy, actual_seq_qlen, actual_seq_kvlen, sink)


# nondeterministic_seeded: a compiled recompute (checkpointing) replays the generator state the kernels' dropout drew
@torch.library.custom_op("cp_cache::ring_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def ring_forward(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], groups: str,
                 plan: str, policy: str, actual_seq_qlen: Optional[Tensor] = None,
                 actual_seq_kvlen: Optional[Tensor] = None,
                 sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(out, float32 LSE [B, N, S] (TND: [T, N]), seed slot: the step cache's handle or stack pairing key)."""
    call = CallPlan.decode(plan)
    # a compiled graph holds the layout it was traced with: refuse one run under the other
    if call.world_size > 1 and (call.mask.positional or call.packed) and call.load_balance != L.load_balance_enabled():
        raise RuntimeError(f"cp_cache: this compiled graph was traced with torch's CP load balancing "
                           f"{'on' if call.load_balance else 'off'} and runs with it "
                           f"{'off' if call.load_balance else 'on'}: the buffers lie otherwise than it assumes; "
                           "recompile after changing it (torch._dynamo.reset())")
    return forward_local(query, key, value, mask_rows, _groups(groups), call, policy, actual_seq_qlen,
                         actual_seq_kvlen, sink)


def _with_call_inputs(call: CallPlan, query: Tensor, actual_seq_qlen: Optional[Tensor],
                      actual_seq_kvlen: Optional[Tensor], sink: Optional[Tensor]) -> CallPlan:
    """The plan with this call's documents read, checked against the sink the op got."""
    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        call = read_documents(call, actual_seq_qlen, actual_seq_kvlen, query.size(0))
    if (sink is not None) != call.sink or (sink is not None and tuple(sink.shape) != (call.head_num,)):
        raise ValueError(f"cp_cache: the plan says sink={call.sink} for {call.head_num} local heads, the op got "
                         f"sink={describe(sink)}")
    return call


def forward_local(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], process_groups: list,
                  call: CallPlan, policy: str, actual_seq_qlen: Optional[Tensor] = None,
                  actual_seq_kvlen: Optional[Tensor] = None,
                  sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``ring_forward`` on groups and plan as objects, without the caller's autocast."""
    started = time.perf_counter()
    try:
        call = _with_call_inputs(call, query, actual_seq_qlen, actual_seq_kvlen, sink)
        strategy = strategy_for(call, sink)
        checked = strategy.check_forward(call, query, key, value, mask_rows)
    except CHECK_ERRORS as error:  # every rank raises: the ranks' error, or where they agree each its own
        agree_on_refusal("forward", process_groups, error, call, query, key, value, kernel=call.kernel,
                         mask_rows=mask_rows)
        raise
    kernel = KERNELS.get(call.kernel) or get_kernel(call.kernel)  # get_kernel names what is registered
    with autocast_off(query.device.type):
        agreement = start_agreement("forward", call, query, key, value, groups=process_groups, kernel=call.kernel,
                                    mask_rows=mask_rows)
        result = strategy.forward(call, query, key, value, groups=process_groups, kernel=kernel, mask=mask_rows,
                                  checked=checked, agreement=agreement)
        ring_seconds = time.perf_counter() - started
        seed = step_cache.seed_slot(policy, call, result.steps)
    CALL_LOG.record("forward", result, started, ring_seconds, fused_merge=call.fused_merge)
    return result.out.contiguous(), result.lse.contiguous(), seed  # as the op's fake: a kernel's may be views


@ring_forward.register_fake
def _ring_forward_fake(query, key, value, mask_rows, groups, plan, policy, actual_seq_qlen=None,
                       actual_seq_kvlen=None, sink=None):
    call = CallPlan.decode(plan)
    out, lse = strategy_for(call).fake(call, query, key, value)
    return out, lse, torch.empty(1, dtype=torch.int64, device="meta" if query.is_meta else "cpu")


@torch.library.custom_op("cp_cache::ring_backward", mutates_args=())
def ring_backward(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                  mask_rows: Optional[Tensor], groups: str, plan: str, policy: str,
                  actual_seq_qlen: Optional[Tensor] = None, actual_seq_kvlen: Optional[Tensor] = None,
                  sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs the plan ``seed``'s step cache recorded, checked against ``plan``; dsink: this rank's rows' share."""
    return backward_local(dy, query, key, value, out, lse, seed, mask_rows, _groups(groups), CallPlan.decode(plan),
                          policy, actual_seq_qlen, actual_seq_kvlen, sink)


def backward_local(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                   mask_rows: Optional[Tensor], process_groups: list, called: CallPlan, policy: str,
                   actual_seq_qlen: Optional[Tensor] = None, actual_seq_kvlen: Optional[Tensor] = None,
                   sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ring_backward`` on groups and plan as objects, without the caller's autocast."""
    started = time.perf_counter()
    recorded, steps = None, []
    try:
        called = _with_call_inputs(called, query, actual_seq_qlen, actual_seq_kvlen, sink)
        text, steps, cache_id = step_cache.claim(seed, policy)  # no reference to the cache outlives this call
        recorded = CallPlan.decode(text)
        mismatch = recorded.backward_mismatch(called)
        if mismatch:
            raise RuntimeError(f"cp_cache: {mismatch} (cache {cache_id})")
        strategy = strategy_for(recorded, sink)
        checked = strategy.check_backward(recorded, dy, query, key, value, out, lse, steps, mask_rows)
    except CHECK_ERRORS as error:  # every rank raises: the ranks' error, or where they agree each its own
        agree_on_refusal("backward", process_groups, error, recorded, query, key, value,
                         kernel="" if recorded is None else recorded.kernel, mask_rows=mask_rows, steps=len(steps))
        raise
    kernel = KERNELS.get(recorded.kernel) or get_kernel(recorded.kernel)
    with autocast_off(query.device.type):
        agreement = start_agreement("backward", recorded, query, key, value, groups=process_groups,
                                    kernel=recorded.kernel, mask_rows=mask_rows, steps=len(steps))
        ring_started = time.perf_counter()
        result = strategy.backward(recorded, dy, query, key, value, out, lse, steps, groups=process_groups,
                                   kernel=kernel, mask=mask_rows, checked=checked, agreement=agreement)
        dsink = torch.zeros((), dtype=torch.float32, device=query.device) if result.dsink is None else result.dsink
    CALL_LOG.record("backward", result, started, time.perf_counter() - ring_started)
    return result.dq.contiguous(), result.dk.contiguous(), result.dv.contiguous(), dsink


@ring_backward.register_fake
def _ring_backward_fake(dy, query, key, value, out, lse, seed, mask_rows, groups, plan, policy, actual_seq_qlen=None,
                        actual_seq_kvlen=None, sink=None):
    dsink = query.new_empty((), dtype=torch.float32) if sink is None else sink.new_empty(sink.shape)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dsink


def check_seed(seed: Any) -> None:
    """A DTensor seed never gets here (``AttentionHandlers._runs``)."""
    if not isinstance(seed, Tensor):
        raise RuntimeError(f"cp_cache: npu_fusion_attention_grad_v3 got seed={describe(seed)}; it needs the seed "
                           "output of the CP attention forward")


@dataclass
class CallRecord:
    """What the last call of one direction cost on this process."""
    bytes_sent: int = 0
    bytes_received: int = 0
    # the least this rank must send / receive for the call's mask; None where no ring ran alone
    bytes_lower_bound: Optional[int] = None
    bytes_received_lower_bound: Optional[int] = None
    handler_seconds: float = 0.0  # whole handler, ring included
    ring_seconds: float = 0.0  # kernels and communication
    compute_seconds: float = 0.0  # inside the ring: kernels, merges, accumulation
    wait_seconds: float = 0.0  # inside the ring: blocked on receives (communication not hidden)
    fused_merge: bool = False  # forward: steps merged by npu_ring_attention_update
    kept_bytes: int = 0  # forward, keep_kv: the K/V rows received and kept in the step cache
    calls: int = 0

    @property
    def overhead_seconds(self) -> float:
        return self.handler_seconds - self.ring_seconds

    @property
    def exposed_fraction(self) -> float:
        busy = self.compute_seconds + self.wait_seconds
        return self.wait_seconds / busy if busy > 0 else 0.0


class CallLog:
    """The last forward and backward call's record, and how many calls each direction had."""
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records = {"forward": CallRecord(), "backward": CallRecord()}

    def record(self, direction: str, result, started: float, ring_seconds: float, *,
               fused_merge: bool = False) -> None:
        """``started``: perf_counter at the call's start; ``result``: the strategy's."""
        handler_seconds = time.perf_counter() - started
        kept = 0
        for step in getattr(result, "steps", ()):  # a loop, not a generator: this runs on every call
            for t in step.kept:
                kept += t.nbytes
        with self._lock:
            record = self._records[direction]
            record.bytes_sent, record.bytes_received = result.bytes_sent, result.bytes_received
            record.bytes_lower_bound = result.bytes_lower_bound
            record.bytes_received_lower_bound = result.bytes_received_lower_bound
            record.handler_seconds, record.ring_seconds = handler_seconds, ring_seconds
            record.compute_seconds, record.wait_seconds = result.compute_seconds, result.wait_seconds
            record.fused_merge, record.kept_bytes = fused_merge, kept
            record.calls += 1

    def set_handler_seconds(self, direction: str, started: float) -> None:
        """The whole handler's time of the last call (a compiled graph runs the op without it)."""
        with self._lock:
            self._records[direction].handler_seconds = time.perf_counter() - started

    def snapshot(self) -> dict[str, dict]:
        """Each direction's record fields with overhead_seconds and exposed_fraction."""
        with self._lock:
            return {d: dict(asdict(r), overhead_seconds=r.overhead_seconds, exposed_fraction=r.exposed_fraction)
                    for d, r in self._records.items()}


# the ring ops record here (a compiled graph runs them with no handler); ``cp_cache.call_stats()`` reads it
CALL_LOG = CallLog()
