"""The step cache of one CP attention call: what the forward writes, what the backward reads.

A cache holds the ring configuration as metadata and one record per ring step:
the step's part as the tag, and its dropout ``seed`` and ``offset`` tensors,
both or neither (the reference kernel draws none).
"""

from __future__ import annotations

import hashlib
import struct

from .. import _C
from ..ring import RingConfig, RingStep

__all__ = ["cache_from_forward", "config_from_cache", "steps_from_cache", "pairing_key"]

_META_KEYS = ("world_size", "rank", "causal", "load_balance", "layout", "head_num", "scale", "keep_prob")
_KERNEL_KEY = "kernel"


def _step_tensors(step: RingStep) -> list:
    if (step.seed is None) != (step.offset is None):
        raise RuntimeError(
            f"ring step {step.index} ({step.part}) has a dropout seed without an offset or the "
            f"reverse (seed={step.seed}, offset={step.offset}); a step records both or neither"
        )
    return [] if step.seed is None else [step.seed, step.offset]


def cache_from_forward(config: RingConfig, kernel_name: str, steps: list[RingStep]):
    """A new cache of the process-wide store holding what the backward of this call needs."""
    cache = _C.default_store().create()
    for key in _META_KEYS:
        cache.set_meta(key, getattr(config, key))
    cache.set_meta(_KERNEL_KEY, kernel_name)
    for step in steps:
        cache.add_step(step.part, _step_tensors(step))
    return cache


def config_from_cache(cache) -> tuple[RingConfig, str]:
    """The ring configuration and kernel name the forward ran with."""
    meta = cache.metadata
    return RingConfig(**{key: meta[key] for key in _META_KEYS}), meta[_KERNEL_KEY]


def steps_from_cache(cache, config: RingConfig) -> list[RingStep]:
    """The forward's ring steps, in order."""
    steps = []
    for index, (part, tensors) in enumerate(cache.steps):
        if len(tensors) not in (0, 2):
            raise RuntimeError(
                f"cp_cache: step {index} of cache {cache.id} holds {len(tensors)} tensors; a step "
                "record holds its dropout seed and offset, or nothing"
            )
        seed, offset = tensors if tensors else (None, None)
        source = (config.rank - index) % config.world_size
        steps.append(RingStep(index=index, source_rank=source, part=part, seed=seed, offset=offset))
    return steps


def pairing_key(config: RingConfig, kernel_name: str, steps: list[RingStep]) -> int:
    """A fingerprint of everything the backward reads from the cache: two forwards with
    the same key are interchangeable for their backwards (the stack policy's pop check)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr((config, kernel_name)).encode())
    for step in steps:
        digest.update(step.part.encode())
        for tensor in (step.seed, step.offset):
            value = 0 if tensor is None else int(tensor.reshape(-1)[0])
            digest.update(struct.pack("<q", value))
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)
