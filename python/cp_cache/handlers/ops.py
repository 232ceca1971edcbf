"""The handlers' local work as two custom ops, ``cp_cache::ring_forward`` and
``cp_cache::ring_backward``: what makes a compiled model run the ring (or Ulysses, hybrid,
the packed-documents ring: whatever the call's configuration says).

DTensor calls the handlers whenever an NPU attention op meets DTensors: eagerly, and
while ``torch.compile`` traces with fake tensors (Dynamo's shape propagation, then
AOTAutograd's trace, which records the operations the handler runs on the local
tensors). A handler that ran the ring itself would, under tracing, run it on fake
tensors (it cannot: the store, the collectives and the skipped steps need real
data) and the compiled graph would not contain it. So the handlers do their checks
and the DTensor wrapping in Python and hand the local work to these ops:

* eagerly, the handlers call the ops' Python body (``forward_local`` / ``backward_local``)
  directly, through ``run_forward`` / ``run_backward``: the op's dispatch only serves a tracer;
* under fake tensors, its fake kernel returns outputs of the right shapes, dtypes and
  devices: no ring, no store, no collective, no real tensor;
* the traced graph records the op, so the compiled forward runs the ring and creates
  the step cache, and its handle (the ``seed`` output) leaves the compiled forward
  as a tensor saved for backward, which the compiled backward passes to
  ``ring_backward``: the cache lives exactly as long as in eager.

What the kernels need besides tensors travels as strings, constants of a traced
graph: the CP process groups by name (outer first), the call's plan
(``CallPlan.encode()``) and the step-cache policy. Packed documents given as tensors
travel as tensors (``actual_seq_qlen/kvlen``): the kernels read their values
(``documents.read_documents``), the fakes only their shapes, so the plan a graph records holds
no document values and each compiled call runs with its own lengths. An attention sink
travels as a tensor too (this rank's heads): ``ring_forward`` merges it once into the
strategy's result (``algorithms/sinks.WithSink`` around the strategy) and returns the LSE with
it, so the backward's statistics include it; ``ring_backward`` returns its gradient over this
rank's rows.
Each op reads the call once, top-down: decode the plan, check this rank's inputs (the
documents' values, the sink, the strategy's own checks; backward: the seed's step cache and its
recorded plan, which the backward runs, against the grad op's arguments), start the ranks'
agreement once (``engine/agreement.start_agreement``: a refusal here is every rank's), run the
strategy (which waits for the agreement before its first exchange), record the call
(``CallLog``, read by ``cp_cache.call_stats()``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from .. import step_cache
from ..algorithms import strategy_for
from ..documents import read_documents
from ..engine.agreement import CHECK_ERRORS, agree_on_refusal, start_agreement
from ..kernels import KERNEL_BY_NAME
from ..npu_ops import autocast_off, describe
from ..plan import CallPlan

__all__ = ["run_forward", "run_backward", "ring_forward", "ring_backward", "check_seed", "CallRecord", "CallLog",
           "CALL_LOG"]


def _groups(names: str) -> list:
    """The process groups named in ``names`` (comma-separated, outer first: ``_group_names``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return [_resolve_process_group(name) for name in names.split(",")]


def _traced(tensors) -> bool:
    """Whether these tensors' operations are traced or only propagate shapes (fake, functional or
    meta tensors, or a dispatch mode such as make_fx's proxy mode): then the local work runs as
    the custom op, which a trace records and whose fake kernel gives the shapes; eagerly it runs
    now, without the op's dispatch."""
    if _current_dispatch_mode() is not None:
        return True
    for t in tensors:  # a loop, not a generator: this runs on every call
        if t is not None and (type(t) is not Tensor or t.is_meta):
            return True
    return False


def run_forward(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], process_groups: list,
                call: CallPlan, policy: str, actual_seq_qlen: Optional[Tensor] = None,
                actual_seq_kvlen: Optional[Tensor] = None, sink: Optional[Tensor] = None):
    """The forward's local work: ``forward_local`` now, or ``ring_forward`` where traced."""
    tensors = (query, key, value, mask_rows, actual_seq_qlen, actual_seq_kvlen, sink)
    if not _traced(tensors):
        return forward_local(query, key, value, mask_rows, process_groups, call, policy, actual_seq_qlen,
                             actual_seq_kvlen, sink)
    return ring_forward(query, key, value, mask_rows, _group_names(process_groups), call.encode(), policy,
                        actual_seq_qlen, actual_seq_kvlen, sink)


def run_backward(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                 mask_rows: Optional[Tensor], process_groups: list, called: CallPlan, policy: str,
                 actual_seq_qlen: Optional[Tensor] = None, actual_seq_kvlen: Optional[Tensor] = None,
                 sink: Optional[Tensor] = None):
    """The backward's local work: ``backward_local`` now, or ``ring_backward`` where traced."""
    tensors = (dy, query, key, value, out, lse, seed, mask_rows, actual_seq_qlen, actual_seq_kvlen, sink)
    if not _traced(tensors):
        return backward_local(dy, query, key, value, out, lse, seed, mask_rows, process_groups, called, policy,
                              actual_seq_qlen, actual_seq_kvlen, sink)
    return ring_backward(dy, query, key, value, out, lse, seed, mask_rows, _group_names(process_groups),
                         called.encode(), policy, actual_seq_qlen, actual_seq_kvlen, sink)


def _group_names(process_groups: list) -> str:
    return ",".join(g.group_name for g in process_groups)


# ---------------------------------------------------------------- forward


# nondeterministic_seeded: the kernels draw dropout seeds from the default generator, so when a
# compiled backward recomputes this op (activation checkpointing inside the compiled region)
# torch replays the forward's generator state around the recompute, as for its own dropout
@torch.library.custom_op("cp_cache::ring_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def ring_forward(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], groups: str,
                 plan: str, policy: str, actual_seq_qlen: Optional[Tensor] = None,
                 actual_seq_kvlen: Optional[Tensor] = None,
                 sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """CP attention of the local shards: (out, float32 LSE [B, N, S] (TND: [T, N]), seed slot).
    The seed slot is the step cache's handle (handle policy) or its pairing key after the push
    (stack). ``mask_rows``: the given mask's rows of this rank (ring) or the whole mask (Ulysses).
    ``actual_seq_qlen/kvlen``: packed documents' lengths, read and checked here (``read_documents``).
    ``sink``: the attention sinks of this rank's heads [N], merged once into the result."""
    return forward_local(query, key, value, mask_rows, _groups(groups), CallPlan.decode(plan), policy,
                         actual_seq_qlen, actual_seq_kvlen, sink)


def forward_local(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], process_groups: list,
                  call: CallPlan, policy: str, actual_seq_qlen: Optional[Tensor] = None,
                  actual_seq_kvlen: Optional[Tensor] = None,
                  sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """What ``ring_forward`` runs, on its groups and plan as objects (without the caller's
    autocast: the kernels and merges run in the dtypes they choose)."""
    with autocast_off(query.device.type):
        return _forward_local(query, key, value, mask_rows, process_groups, call, policy, actual_seq_qlen,
                              actual_seq_kvlen, sink)


def _forward_local(query, key, value, mask_rows, process_groups, call, policy, actual_seq_qlen, actual_seq_kvlen,
                   sink):
    started = time.perf_counter()
    call, result = _forward(query, key, value, mask_rows, process_groups, call, actual_seq_qlen, actual_seq_kvlen,
                            sink)
    ring_seconds = time.perf_counter() - started
    seed = step_cache.seed_slot(policy, call, result.steps)
    CALL_LOG.record("forward", result, started, ring_seconds, fused_merge=call.fused_merge)
    return result.out, result.lse, seed


def _forward(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], process_groups: list,
             call: CallPlan, actual_seq_qlen: Optional[Tensor], actual_seq_kvlen: Optional[Tensor],
             sink: Optional[Tensor]):
    """A forward of any strategy: this rank's checks, the ranks' agreement started once, the run;
    (the plan it ran, with the documents read; the result)."""
    try:
        if actual_seq_qlen is not None or actual_seq_kvlen is not None:
            call = read_documents(call, actual_seq_qlen, actual_seq_kvlen, query.size(0))
        call.check_sink(sink)
        strategy = strategy_for(call, sink)
        checked = strategy.check_forward(call, query, key, value, mask_rows)
    except CHECK_ERRORS as error:  # every rank raises: the ranks' error, or where they agree each its own
        agree_on_refusal("forward", process_groups, error, call, query, key, value, kernel=call.kernel,
                         mask_rows=mask_rows)
        raise
    agreement = start_agreement("forward", call, query, key, value, groups=process_groups, kernel=call.kernel,
                                mask_rows=mask_rows)
    result = strategy.forward(call, query, key, value, groups=process_groups, kernel=KERNEL_BY_NAME[call.kernel],
                              mask=mask_rows, checked=checked, agreement=agreement)
    return call, result


@ring_forward.register_fake
def _ring_forward_fake(query, key, value, mask_rows, groups, plan, policy, actual_seq_qlen=None,
                       actual_seq_kvlen=None, sink=None):
    call = CallPlan.decode(plan)
    out, lse = strategy_for(call).fake(call, query, key, value)
    # the handle / pairing key: CPU int64 [1] (meta when tracing with meta tensors)
    return out, lse, torch.empty(1, dtype=torch.int64, device="meta" if query.is_meta else "cpu")


# ---------------------------------------------------------------- backward


@torch.library.custom_op("cp_cache::ring_backward", mutates_args=())
def ring_backward(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                  mask_rows: Optional[Tensor], groups: str, plan: str, policy: str,
                  actual_seq_qlen: Optional[Tensor] = None, actual_seq_kvlen: Optional[Tensor] = None,
                  sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsink) of the local shards, from the forward's step cache found through ``seed``:
    the backward runs the plan the forward recorded there; ``plan``, what the grad op's arguments
    give (with the documents of ``actual_seq_qlen/kvlen``), is checked against it. ``out``/``lse``:
    the forward's results (with the sink merged in); dsink: this rank's rows' share of the sink's
    gradient, a float32 0-d zero without a sink."""
    return backward_local(dy, query, key, value, out, lse, seed, mask_rows, _groups(groups), CallPlan.decode(plan),
                          policy, actual_seq_qlen, actual_seq_kvlen, sink)


def backward_local(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                   mask_rows: Optional[Tensor], process_groups: list, called: CallPlan, policy: str,
                   actual_seq_qlen: Optional[Tensor] = None, actual_seq_kvlen: Optional[Tensor] = None,
                   sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What ``ring_backward`` runs, on its groups and plan as objects (without the caller's autocast)."""
    with autocast_off(query.device.type):
        return _backward_local(dy, query, key, value, out, lse, seed, mask_rows, process_groups, called, policy,
                               actual_seq_qlen, actual_seq_kvlen, sink)


def _backward_local(dy, query, key, value, out, lse, seed, mask_rows, process_groups, called, policy,
                    actual_seq_qlen, actual_seq_kvlen, sink):
    started = time.perf_counter()
    recorded, steps = None, []
    try:
        if actual_seq_qlen is not None or actual_seq_kvlen is not None:
            called = read_documents(called, actual_seq_qlen, actual_seq_kvlen, query.size(0))
        called.check_sink(sink)
        recorded, steps, cache_id = _recorded(seed, policy)
        mismatch = recorded.backward_mismatch(called)
        if mismatch:
            raise RuntimeError(f"cp_cache: {mismatch} (cache {cache_id})")
        strategy = strategy_for(recorded, sink)
        checked = strategy.check_backward(recorded, dy, query, key, value, out, lse, steps, mask_rows)
    except CHECK_ERRORS as error:  # every rank raises: the ranks' error, or where they agree each its own
        agree_on_refusal("backward", process_groups, error, recorded, query, key, value,
                         kernel="" if recorded is None else recorded.kernel, mask_rows=mask_rows, steps=len(steps))
        raise
    agreement = start_agreement("backward", recorded, query, key, value, groups=process_groups,
                                kernel=recorded.kernel, mask_rows=mask_rows, steps=len(steps))
    ring_started = time.perf_counter()
    result = strategy.backward(recorded, dy, query, key, value, out, lse, steps, groups=process_groups,
                               kernel=KERNEL_BY_NAME[recorded.kernel], mask=mask_rows, checked=checked,
                               agreement=agreement)
    CALL_LOG.record("backward", result, started, time.perf_counter() - ring_started)
    # without a sink: a float32 0-d zero, as the op's meta
    dsink = torch.zeros((), dtype=torch.float32, device=query.device) if result.dsink is None else result.dsink
    return result.dq.contiguous(), result.dk.contiguous(), result.dv.contiguous(), dsink


def _recorded(seed: Tensor, policy: str) -> tuple[CallPlan, list, int]:
    """(the plan, the step records, the id) of the forward's step cache that ``seed`` names; no
    reference to the cache outlives this call (a handle held by hand keeps it alive, nothing else)."""
    cache = step_cache.claim(seed, policy)
    return step_cache.plan_of(cache), step_cache.steps_of(cache), cache.id


@ring_backward.register_fake
def _ring_backward_fake(dy, query, key, value, out, lse, seed, mask_rows, groups, plan, policy, actual_seq_qlen=None,
                        actual_seq_kvlen=None, sink=None):
    dsink = query.new_empty((), dtype=torch.float32) if sink is None else sink.new_empty(sink.shape)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dsink


def check_seed(seed: Any) -> None:
    """The seed argument's type, checked where the handler runs (eagerly or while tracing). A
    DTensor seed never reaches it: that backward's forward was served elsewhere, and so is it
    (``AttentionHandlers._runs``)."""
    if not isinstance(seed, Tensor):
        raise RuntimeError(
            f"cp_cache: npu_fusion_attention_grad_v3 got seed={describe(seed)}; it needs the seed "
            "output of the CP attention forward"
        )


# ---------------------------------------------------------------- what each call cost


@dataclass
class CallRecord:
    """What the last call of one direction cost on this process."""

    bytes_sent: int = 0
    bytes_received: int = 0
    # the least this rank must send / receive for the call's mask (the K/V rows other ranks'
    # queries may attend to; backward: those again and their float32 dK/dV partials back);
    # None where no ring ran alone (Ulysses, hybrid: their all-to-alls have no such bound)
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
        """The share of the ring's time spent waiting for communication."""
        busy = self.compute_seconds + self.wait_seconds
        return self.wait_seconds / busy if busy > 0 else 0.0


def _kept_bytes(steps) -> int:
    kept = 0
    for step in steps:  # a loop, not a generator: this runs on every call
        if step.kept:
            kept += sum([t.nbytes for t in step.kept])
    return kept


class CallLog:
    """The last forward and backward call's record, and how many calls each direction had."""

    DIRECTIONS = ("forward", "backward")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records = {d: CallRecord() for d in self.DIRECTIONS}

    def record(self, direction: str, result, started: float, ring_seconds: float, *,
               fused_merge: bool = False) -> None:
        """Record a call of ``direction`` that began at ``started`` (time.perf_counter());
        ``result``: the strategy's ForwardResult / BackwardResult."""
        handler_seconds = time.perf_counter() - started
        with self._lock:
            record = self._records[direction]
            record.bytes_sent = result.bytes_sent
            record.bytes_received = result.bytes_received
            record.bytes_lower_bound = result.bytes_lower_bound
            record.bytes_received_lower_bound = result.bytes_received_lower_bound
            record.handler_seconds = handler_seconds
            record.ring_seconds = ring_seconds
            record.compute_seconds = result.compute_seconds
            record.wait_seconds = result.wait_seconds
            record.fused_merge = fused_merge
            record.kept_bytes = _kept_bytes(getattr(result, "steps", ()))
            record.calls += 1

    def set_handler_seconds(self, direction: str, started: float) -> None:
        """The whole handler's time of the last ``direction`` call, recorded by the ring op
        inside it (a compiled graph runs the op without the handler: its own time stays)."""
        with self._lock:
            self._records[direction].handler_seconds = time.perf_counter() - started

    def snapshot(self) -> dict[str, dict]:
        """{"forward": {...}, "backward": {...}} with bytes_sent, bytes_received, their lower bounds
        (bytes_lower_bound, bytes_received_lower_bound), handler_seconds, ring_seconds,
        overhead_seconds, compute_seconds, wait_seconds, exposed_fraction, fused_merge,
        kept_bytes and calls of each direction."""
        with self._lock:
            return {
                d: dict(asdict(r), overhead_seconds=r.overhead_seconds, exposed_fraction=r.exposed_fraction)
                for d, r in self._records.items()
            }


# The process's call log: the ring ops record into it (a compiled graph runs them with no
# handler around), the handlers and ``cp_cache.call_stats()`` read the same one.
CALL_LOG = CallLog()
