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

* eagerly, the op's kernel runs the ring now (the same code as ever);
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
(``packed.read_documents``), the fakes only their shapes, so the plan a graph records holds
no document values and each compiled call runs with its own lengths. An attention sink
travels as a tensor too (this rank's heads): ``ring_forward`` merges it once into the
strategy's result (``algorithms/sinks.WithSink`` around the strategy) and returns the LSE with
it, so the backward's statistics include it; ``ring_backward`` returns its gradient over this
rank's rows.
Whatever the ops refuse before their first exchange (a seed that is no live handle, a
backward that does not match its forward) they refuse together with the other ranks
(``agreement.refusal_shared``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import Tensor

from .. import step_cache
from ..algorithms import strategy_for
from ..arguments import describe
from ..engine import agreement
from ..kernels import get_kernel
from ..plan import CallPlan
from .call_log import CALL_LOG
from .packed import read_documents

__all__ = ["ring_forward", "ring_backward", "group_names", "check_seed"]


def group_names(groups) -> str:
    return ",".join(g.group_name for g in groups)


def _groups(names: str) -> list:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return [_resolve_process_group(name) for name in names.split(",")]


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
    started = time.perf_counter()
    process_groups = _groups(groups)
    with agreement.refusal_shared("forward", lambda: agreement.first_agreement(process_groups)):
        call = read_documents(CallPlan.decode(plan), actual_seq_qlen, actual_seq_kvlen, query.size(0))
        _check_sink(call, sink)
    result = strategy_for(call, sink).forward(call, query, key, value, groups=process_groups,
                                              kernel=get_kernel(call.kernel), mask=mask_rows)
    ring_seconds = time.perf_counter() - started
    seed = step_cache.seed_slot(policy, call, result.steps)
    CALL_LOG.record("forward", result, started, ring_seconds, fused_merge=call.fused_merge)
    return result.out, result.lse, seed


def _check_sink(call: CallPlan, sink: Optional[Tensor]) -> None:
    if (sink is not None) != call.sink or (sink is not None and tuple(sink.shape) != (call.head_num,)):
        raise ValueError(f"cp_cache: the plan says sink={call.sink} for {call.head_num} local heads, the op got "
                         f"sink={describe(sink)}")


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
    """(dq, dk, dv, dsink) of the local shards, from the forward's step cache found through ``seed``;
    ``plan``: the one the grad op's arguments give (with the documents of ``actual_seq_qlen/kvlen``),
    checked against the forward's. ``out``/``lse``: the forward's results (with the sink merged in);
    dsink: this rank's rows' share of the sink's gradient, a float32 0-d zero without a sink."""
    started = time.perf_counter()
    process_groups = _groups(groups)
    with agreement.refusal_shared("backward", lambda: agreement.first_agreement(process_groups)):
        called = read_documents(CallPlan.decode(plan), actual_seq_qlen, actual_seq_kvlen, query.size(0))
        _check_sink(called, sink)
        cache = step_cache.claim(seed, policy)
        recorded = step_cache.plan_of(cache)
        mismatch = recorded.backward_mismatch(called)
        if mismatch:
            raise RuntimeError(f"cp_cache: {mismatch} (cache {cache.id})")
        steps = step_cache.steps_of(cache)
        del cache
    ring_started = time.perf_counter()
    result = strategy_for(recorded, sink).backward(recorded, dy, query, key, value, out, lse, steps,
                                                   groups=process_groups, kernel=get_kernel(recorded.kernel),
                                                   mask=mask_rows)
    CALL_LOG.record("backward", result, started, time.perf_counter() - ring_started)
    # without a sink: a float32 0-d zero, as the op's meta
    dsink = torch.zeros((), dtype=torch.float32, device=query.device) if result.dsink is None else result.dsink
    return result.dq.contiguous(), result.dk.contiguous(), result.dv.contiguous(), dsink


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
