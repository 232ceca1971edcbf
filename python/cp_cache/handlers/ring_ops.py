"""The handlers' ring as two custom ops, ``cp_cache::ring_forward`` and ``cp_cache::ring_backward``:
what makes a compiled model run the ring.

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
graph: the process group by name, the call's configuration as JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import fields
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _C
from .. import layout as L
from ..config import STACK_POLICY
from ..kernels import get_kernel
from ..ring import RingConfig, ring_attention_backward, ring_attention_forward
from ..ring_plan import MaskSpec
from . import step_records as records
from .arguments import describe
from .calls import CALL_LOG

__all__ = ["ring_forward", "ring_backward", "encode_forward_call", "encode_backward_call"]

# ---------------------------------------------------------------- the call, as a graph constant


def flat_fields(obj) -> dict[str, Any]:
    """A flat dataclass's fields as a dict (``dataclasses.asdict`` deep-copies: 10x slower per call)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def encode_forward_call(config: RingConfig, kernel: str, fused_merge: bool) -> str:
    return json.dumps(dict(ring=flat_fields(config), kernel=kernel, fused_merge=fused_merge), sort_keys=True)


def encode_backward_call(called: dict[str, Any], policy: str, load_balance: bool) -> str:
    """``called``: what the grad op was called with (layout, head_num, scale, keep_prob and the
    mask's fields), checked against the forward's record; ``load_balance``: the layout the
    given mask's rows were picked for."""
    return json.dumps(dict(called=called, policy=policy, load_balance=load_balance))


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# ---------------------------------------------------------------- forward


# nondeterministic_seeded: the kernels draw dropout seeds from the default generator, so when a
# compiled backward recomputes this op (activation checkpointing inside the compiled region)
# torch replays the forward's generator state around the recompute, as for its own dropout
@torch.library.custom_op("cp_cache::ring_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def ring_forward(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], group_name: str,
                 call: str) -> tuple[Tensor, Tensor, Tensor]:
    """Ring attention of the local shards: (out, float32 LSE [B, N, S], seed slot). The seed
    slot is the step cache's handle (handle policy) or its pairing key after the push (stack)."""
    started = time.perf_counter()
    c = json.loads(call)
    config = RingConfig(**c["ring"])
    kernel = get_kernel(c["kernel"])
    ring_started = time.perf_counter()
    result = ring_attention_forward(query, key, value, config, group=_group(group_name), kernel=kernel,
                                    mask_rows=mask_rows, fused_merge=c["fused_merge"])
    ring_seconds = time.perf_counter() - ring_started
    seed = _seed_slot(config, kernel.name, result.steps)
    CALL_LOG.record("forward", result, started, ring_seconds, fused_merge=c["fused_merge"])
    return result.out, result.lse, seed


@ring_forward.register_fake
def _ring_forward_fake(query, key, value, mask_rows, group_name, call):
    ring = json.loads(call)["ring"]
    d = L.dims(query, ring["layout"], ring["head_num"])
    return (
        query.new_empty(query.shape),
        query.new_empty((d.batch, d.heads, d.seq), dtype=torch.float32),
        # the handle / pairing key: CPU int64 [1] (meta when tracing with meta tensors)
        torch.empty(1, dtype=torch.int64, device="meta" if query.is_meta else "cpu"),
    )


def _seed_slot(config: RingConfig, kernel_name: str, steps) -> Tensor:
    """The seed output: the cache's handle, or (stack policy) its pairing key after the push."""
    cache = records.cache_from_forward(config, kernel_name, steps)
    if config.policy != STACK_POLICY:
        return _C.default_store().attach(cache)
    cache.pairing_key = records.pairing_key(config, kernel_name, steps)
    _C.default_store().push(cache)  # skipped (and the cache dropped) in a recompute
    return torch.tensor([cache.pairing_key], dtype=torch.int64)


# ---------------------------------------------------------------- backward


@torch.library.custom_op("cp_cache::ring_backward", mutates_args=())
def ring_backward(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                  mask_rows: Optional[Tensor], group_name: str, call: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the local shards, from the forward's step cache found through ``seed``."""
    started = time.perf_counter()
    c = json.loads(call)
    cache = _claim_cache(seed, c["policy"])
    config, kernel_name = records.config_from_cache(cache)
    _check_matches_forward(c["called"], config, cache.id)
    group = _group(group_name)
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if size != config.world_size or rank != config.rank:
        raise RuntimeError(
            f"cp_cache: backward runs on rank {rank} of {size} but its forward ran on rank "
            f"{config.rank} of {config.world_size}"
        )
    if config.given_mask and config.load_balance != c["load_balance"]:
        raise RuntimeError(
            f"cp_cache: the forward (cache {cache.id}) ran with load balancing "
            f"{'on' if config.load_balance else 'off'} and the backward picked the mask's rows with it "
            f"{'on' if c['load_balance'] else 'off'}; keep torch's _cp_options.enable_load_balance "
            "unchanged between a forward with a given mask and its backward"
        )
    steps = records.steps_from_cache(cache, config)
    del cache
    ring_started = time.perf_counter()
    result = ring_attention_backward(dy, query, key, value, out, lse, steps, config, group=group,
                                     kernel=get_kernel(kernel_name), mask_rows=mask_rows)
    ring_seconds = time.perf_counter() - ring_started
    CALL_LOG.record("backward", result, started, ring_seconds)
    return result.dq.contiguous(), result.dk.contiguous(), result.dv.contiguous()


@ring_backward.register_fake
def _ring_backward_fake(dy, query, key, value, out, lse, seed, mask_rows, group_name, call):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _claim_cache(seed: Tensor, policy: str):
    """The forward's cache from the seed slot: resolve a handle, or pop the stack."""
    store = _C.default_store()
    if store.is_handle(seed):
        cache = store.resolve(seed)
        if _C.in_graph_task() and not _C.current_graph_task_keeps_graph():
            store.release(seed)  # this graph's backward runs once: free the cache now
        return cache
    if policy == STACK_POLICY:
        return store.pop(int(seed.reshape(-1)[0]))
    return store.resolve(seed)  # raises, naming what was passed and the likely cause


def _check_matches_forward(called: dict[str, Any], config: RingConfig, cache_id: int) -> None:
    called = dict(called, mask=MaskSpec(**called["mask"]))
    recorded = dict(layout=config.layout, head_num=config.head_num, scale=config.scale,
                    keep_prob=config.keep_prob, mask=config.mask)
    if called != recorded:
        raise RuntimeError(
            f"cp_cache: backward called with {called} but its forward (cache {cache_id}) ran with {recorded}"
        )


def check_seed(seed: Any) -> None:
    """The seed argument's type, checked where the handler runs (eagerly or while tracing)."""
    from torch.distributed.tensor import DTensor

    if isinstance(seed, DTensor):
        raise RuntimeError(
            "cp_cache: the seed argument of npu_fusion_attention_grad_v3 is a DTensor; it must be "
            "the seed output of the CP attention forward (a plain int64 tensor)"
        )
    if not isinstance(seed, Tensor):
        raise RuntimeError(
            f"cp_cache: npu_fusion_attention_grad_v3 got seed={describe(seed)}; it needs the seed "
            "output of the CP attention forward"
        )

