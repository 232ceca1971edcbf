"""The step cache of one CP attention call: what the forward writes, what the backward reads.

A cache holds the ring configuration as metadata and one record per ring step:
the step's part as the tag, and the dropout ``seed`` and ``offset`` tensors of each
kernel call of the step, in order (seed, offset, seed, offset, ...), or nothing
(the reference kernel draws none).
"""

from __future__ import annotations

import hashlib
import struct

from .. import _C
from ..ring import RingConfig, RingStep

__all__ = ["cache_from_forward", "config_from_cache", "steps_from_cache", "pairing_key"]

_META_KEYS = ("world_size", "rank", "causal", "load_balance", "layout", "head_num", "scale", "keep_prob",
              "window", "pre_tockens", "next_tockens", "given_mask", "policy", "algorithm", "documents",
              "ulysses_size")
_KERNEL_KEY = "kernel"


def _step_tensors(step: RingStep) -> list:
    tensors = []
    for call, (seed, offset) in enumerate(step.rng):
        if seed is None or offset is None:
            raise RuntimeError(
                f"ring step {step.index} ({step.part}), kernel call {call}: a dropout seed without an "
                f"offset or the reverse (seed={seed}, offset={offset}); a call records both"
            )
        tensors += [seed, offset]
    return tensors


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
        if len(tensors) % 2:
            raise RuntimeError(
                f"cp_cache: step {index} of cache {cache.id} holds {len(tensors)} tensors; a step record "
                "holds a seed and an offset per kernel call, or nothing"
            )
        rng = tuple(zip(tensors[0::2], tensors[1::2]))
        source = (config.rank - index) % config.world_size
        steps.append(RingStep(index=index, source_rank=source, part=part, rng=rng))
    return steps


def pairing_key(config: RingConfig, kernel_name: str, steps: list[RingStep]) -> int:
    """A fingerprint of everything the backward reads from the cache: two forwards with
    the same key are interchangeable for their backwards (the stack policy's pop check)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr((config, kernel_name)).encode())
    for step in steps:
        digest.update(step.part.encode())
        for tensor in _step_tensors(step):
            digest.update(struct.pack("<q", int(tensor.reshape(-1)[0])))
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)
