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
graph: the CP process groups by name (outer first), the call's configuration as JSON.
Whatever the ops refuse before their first exchange (a seed that is no live handle, a
backward that does not match its forward) they refuse together with the other ranks
(``agreement.refusal_shared``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import fields
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _C, agreement
from .. import layout as L
from ..config import STACK_POLICY
from ..kernels import get_kernel
from ..ring import RingConfig, ring_attention_backward, ring_attention_forward
from ..ring_plan import MaskSpec
from ..ulysses import ulysses_attention_backward, ulysses_attention_forward, ulysses_degree
from ..varlen import TND, varlen_ring_backward, varlen_ring_forward
from . import step_records as records
from .arguments import describe
from .calls import CALL_LOG

__all__ = ["ring_forward", "ring_backward", "encode_forward_call", "encode_backward_call", "flat_fields",
           "check_seed"]

# ---------------------------------------------------------------- the call, as a graph constant


def flat_fields(obj) -> dict[str, Any]:
    """A flat dataclass's fields as a dict (``dataclasses.asdict`` deep-copies: 10x slower per call)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def encode_forward_call(config: RingConfig, kernel: str, fused_merge: bool) -> str:
    return json.dumps(dict(ring=flat_fields(config), kernel=kernel, fused_merge=fused_merge), sort_keys=True)


def encode_backward_call(called: dict[str, Any], policy: str, cp_sizes: list[int], cp_rank: int,
                         load_balance: bool) -> str:
    """``called``: what the grad op was called with (layout, local head_num, scale, keep_prob,
    the mask's fields or the documents; the algorithm with a given mask), checked against the
    forward's record; ``cp_sizes``/``cp_rank``: the mesh's CP dimensions and this rank's chunk;
    ``load_balance``: the layout the given mask's rows were picked for."""
    return json.dumps(dict(called=called, policy=policy, cp_sizes=cp_sizes, cp_rank=cp_rank,
                           load_balance=load_balance))


def group_names(groups) -> str:
    return ",".join(g.group_name for g in groups)


def _groups(names: str) -> list:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return [_resolve_process_group(name) for name in names.split(",")]


def _first_agreement(groups: list):
    """(group, size) where a call's first agreement happens: the ring's group, or Ulysses'
    (the inner CP dimension's)."""
    return groups[-1], torch.distributed.get_world_size(groups[-1])


# ---------------------------------------------------------------- forward


def _run_forward(q, k, v, config: RingConfig, groups: list, kernel, mask_rows, fused_merge: bool):
    if config.layout == TND:
        return varlen_ring_forward(q, k, v, config, group=groups[0], kernel=kernel, fused_merge=fused_merge)
    if config.algorithm in ("ulysses", "hybrid"):
        ring_group = groups[0] if config.algorithm == "hybrid" else None
        return ulysses_attention_forward(q, k, v, config, group=groups[-1], ring_group=ring_group, kernel=kernel,
                                         fused_merge=fused_merge, mask=mask_rows)
    return ring_attention_forward(q, k, v, config, group=groups[0], kernel=kernel, mask_rows=mask_rows,
                                  fused_merge=fused_merge)


# nondeterministic_seeded: the kernels draw dropout seeds from the default generator, so when a
# compiled backward recomputes this op (activation checkpointing inside the compiled region)
# torch replays the forward's generator state around the recompute, as for its own dropout
@torch.library.custom_op("cp_cache::ring_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def ring_forward(query: Tensor, key: Tensor, value: Tensor, mask_rows: Optional[Tensor], groups: str,
                 call: str) -> tuple[Tensor, Tensor, Tensor]:
    """CP attention of the local shards: (out, float32 LSE [B, N, S] (TND: [T, N]), seed slot).
    The seed slot is the step cache's handle (handle policy) or its pairing key after the push
    (stack). ``mask_rows``: the given mask's rows of this rank (ring) or the whole mask (Ulysses)."""
    started = time.perf_counter()
    c = json.loads(call)
    config = RingConfig(**c["ring"])
    kernel = get_kernel(c["kernel"])
    ring_started = time.perf_counter()
    result = _run_forward(query, key, value, config, _groups(groups), kernel, mask_rows, c["fused_merge"])
    ring_seconds = time.perf_counter() - ring_started
    seed = _seed_slot(config, kernel.name, result.steps)
    CALL_LOG.record("forward", result, started, ring_seconds, fused_merge=c["fused_merge"])
    return result.out, result.lse, seed


@ring_forward.register_fake
def _ring_forward_fake(query, key, value, mask_rows, groups, call):
    ring = json.loads(call)["ring"]
    if ring["layout"] == TND:
        lse_shape = (query.size(0), ring["head_num"])
    else:
        d = L.dims(query, ring["layout"], ring["head_num"])
        lse_shape = (d.batch, d.heads, d.seq)
    return (
        query.new_empty(query.shape),
        query.new_empty(lse_shape, dtype=torch.float32),
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


def _run_backward(dy, q, k, v, out, lse, steps, config: RingConfig, groups: list, kernel, mask_rows):
    if config.layout == TND:
        return varlen_ring_backward(dy, q, k, v, out, lse, steps, config, group=groups[0], kernel=kernel)
    if config.algorithm in ("ulysses", "hybrid"):
        ring_group = groups[0] if config.algorithm == "hybrid" else None
        return ulysses_attention_backward(dy, q, k, v, out, lse, steps, config, group=groups[-1],
                                          ring_group=ring_group, kernel=kernel, mask=mask_rows)
    return ring_attention_backward(dy, q, k, v, out, lse, steps, config, group=groups[0], kernel=kernel,
                                   mask_rows=mask_rows)


@torch.library.custom_op("cp_cache::ring_backward", mutates_args=())
def ring_backward(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                  mask_rows: Optional[Tensor], groups: str, call: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the local shards, from the forward's step cache found through ``seed``."""
    started = time.perf_counter()
    c = json.loads(call)
    process_groups = _groups(groups)
    with agreement.refusal_shared("backward", lambda: _first_agreement(process_groups)):
        cache = _claim_cache(seed, c["policy"])
        config, kernel_name = records.config_from_cache(cache)
        _check_matches_forward(c, config, cache.id)
        steps = records.steps_from_cache(cache, config)
        del cache
    ring_started = time.perf_counter()
    result = _run_backward(dy, query, key, value, out, lse, steps, config, process_groups, get_kernel(kernel_name),
                           mask_rows)
    ring_seconds = time.perf_counter() - ring_started
    CALL_LOG.record("backward", result, started, ring_seconds)
    return result.dq.contiguous(), result.dk.contiguous(), result.dv.contiguous()


@ring_backward.register_fake
def _ring_backward_fake(dy, query, key, value, out, lse, seed, mask_rows, groups, call):
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


def _check_matches_forward(c: dict[str, Any], config: RingConfig, cache_id: int) -> None:
    """The grad op's arguments and mesh against what its forward recorded."""
    called = {key: MaskSpec(**value) if key == "mask" else value for key, value in c["called"].items()}
    recorded = {key: config.mask if key == "mask" else getattr(config, key) for key in called}
    if called != recorded:
        raise RuntimeError(
            f"cp_cache: backward called with {called} but its forward (cache {cache_id}) ran with {recorded}"
        )
    size = math.prod(c["cp_sizes"])
    if (size, c["cp_rank"], ulysses_degree(config.algorithm, c["cp_sizes"])) != (
            config.world_size, config.rank, config.ulysses_size):
        raise RuntimeError(
            f"cp_cache: backward runs on rank {c['cp_rank']} of {size} but its forward ran on rank {config.rank} "
            f"of {config.world_size} ({config.algorithm}, Ulysses degree {config.ulysses_size}; the backward's CP "
            f"mesh dimensions: {c['cp_sizes']})"
        )
    if config.given_mask and config.load_balance != c["load_balance"]:
        raise RuntimeError(
            f"cp_cache: the forward (cache {cache_id}) ran with load balancing "
            f"{'on' if config.load_balance else 'off'} and the backward picked the mask's rows with it "
            f"{'on' if c['load_balance'] else 'off'}; keep torch's _cp_options.enable_load_balance "
            "unchanged between a forward with a given mask and its backward"
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
