"""The step cache of one CP attention call, and the cache policies: the one home of policy.

A cache holds the plan's text and per ring step its part, each kernel call's dropout (seed, offset) and
(``keep_kv``) the K/V rows received. "handle": the ``seed`` output's storage owns the cache, which lives as long
as autograd keeps the graph. "stack" (torch_npu's): the seed slot carries a key that the backward's pop checks.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from torch import Tensor

from . import _C
from .engine.loop import RingStep
from .plan import CallPlan

__all__ = ["HANDLE_POLICY", "STACK_POLICY", "POLICIES", "seed_slot", "claim", "plan_of", "steps_of", "pairing_key"]

HANDLE_POLICY = "handle"
STACK_POLICY = "stack"
POLICIES = (HANDLE_POLICY, STACK_POLICY)

_PLAN_KEY = "plan"
_KEPT = "+kept"  # a step record whose last two tensors are the K/V rows it received (keep_kv)


def _step_tensors(step: RingStep) -> list:
    tensors = []
    for call, (seed, offset) in enumerate(step.rng):
        if seed is None or offset is None:
            raise RuntimeError(f"ring step {step.index} ({step.part}), kernel call {call}: a dropout seed without an "
                               f"offset or the reverse (seed={seed}, offset={offset}); a call records both")
        tensors += [seed, offset]
    return tensors


def plan_of(cache) -> CallPlan:
    return CallPlan.decode(cache.meta(_PLAN_KEY))


def steps_of(cache) -> list[RingStep]:
    steps = []
    for index, (part, tensors) in enumerate(cache.steps):
        kept = ()
        if part.endswith(_KEPT):
            part, kept, tensors = part[:-len(_KEPT)], tuple(tensors[-2:]), tensors[:-2]
        if len(tensors) % 2:
            raise RuntimeError(f"cp_cache: step {index} of cache {cache.id} holds {len(tensors)} tensors; a step "
                               "record holds a seed and an offset per kernel call, or nothing")
        steps.append(RingStep(index=index, part=part, rng=tuple(zip(tensors[0::2], tensors[1::2])), kept=kept))
    return steps


def pairing_key(plan: CallPlan, steps: list[RingStep]) -> int:
    """Of all the backward reads: forwards with the same key are interchangeable for their backwards."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(plan.text.encode())
    for step in steps:
        digest.update(step.part.encode())
        for tensor in _step_tensors(step):
            digest.update(struct.pack("<q", int(tensor.reshape(-1)[0])))
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def seed_slot(policy: str, plan: CallPlan, steps: list[RingStep]) -> Tensor:
    """The forward's seed output for a new cache: its handle, or (stack policy) its pairing key after the push."""
    store = _C.default_store()
    cache = store.create()
    cache.set_meta(_PLAN_KEY, plan.text)
    for step in steps:
        cache.add_step(step.part + (_KEPT if step.kept else ""), _step_tensors(step) + list(step.kept))
    if policy != STACK_POLICY:
        return store.attach(cache)
    cache.pairing_key = pairing_key(plan, steps)
    store.push(cache)  # skipped (and the cache dropped) in a recompute
    return torch.tensor([cache.pairing_key], dtype=torch.int64)


def claim(seed: Tensor, policy: str) -> tuple[str, list[RingStep], int]:
    """(plan text, step records, cache id) of the cache ``seed`` names: a handle resolved (released when this
    graph's backward runs once), or the stack popped. No reference to the cache outlives the call."""
    store = _C.default_store()
    if store.is_handle(seed):
        cache = store.resolve(seed)
        if _C.in_graph_task() and not _C.current_graph_task_keeps_graph():
            store.release(seed)  # this graph's backward runs once: free the cache now
    elif policy == STACK_POLICY:
        cache = store.pop(int(seed.reshape(-1)[0]))
    else:
        cache = store.resolve(seed)  # raises, naming what was passed and the likely cause
    return cache.meta(_PLAN_KEY), steps_of(cache), cache.id
