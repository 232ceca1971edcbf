"""What ``cp_cache.enable()`` decides, frozen, and the one place torch's CP options are read.

``enable()`` builds one ``CPConfig`` and registers handlers bound to it; nothing
else carries configuration to the handlers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .kernels import KERNEL_NAMES
from .plan import ALGORITHMS, EXCHANGES
from .step_cache import HANDLE_POLICY, POLICIES, STACK_POLICY

__all__ = [
    "HANDLE_POLICY",
    "STACK_POLICY",
    "POLICIES",
    "POLICY_ENV",
    "FUSED_MERGE_ENV",
    "KERNELS",
    "ALGORITHMS",
    "ALGORITHM_ENV",
    "EXCHANGES",
    "EXCHANGE_ENV",
    "CPConfig",
    "resolve_config",
    "load_balance_enabled",
]

POLICY_ENV = "CP_CACHE_POLICY"
FUSED_MERGE_ENV = "CP_CACHE_FUSED_MERGE"
KERNELS = KERNEL_NAMES
ALGORITHM_ENV = "CP_CACHE_ALGORITHM"
EXCHANGE_ENV = "CP_CACHE_EXCHANGE"


@dataclass(frozen=True)
class CPConfig:
    """How the CP attention handlers run.

    policy: where the step cache waits for its backward: "handle" (in the op's seed
        output, owned by autograd) or "stack" (torch_npu's discipline, natively).
    kernel: the step kernel, "npu" or "reference"; None picks "npu" when the op exists.
    algorithm: how the sequence is distributed: "ring", "ulysses" (all-to-all to head
        shards), "hybrid" (Ulysses over the inner of two CP mesh dims, the ring over the
        outer) or "auto" (per call, ``plan.choose_algorithm``).
    fused_merge: merge ring steps with ``npu_ring_attention_update`` when the op exists
        (else, or when False, the float32 merge in plain torch).
    exchange: how the ring's K/V travel: "direct" (each rank sends each other rank only the
        rows that rank's queries may attend to) or "ring" (whole blocks relayed round the ring).
    """

    policy: str = HANDLE_POLICY
    kernel: str | None = None
    algorithm: str = "ring"
    fused_merge: bool = True
    exchange: str = "direct"

    def __post_init__(self) -> None:
        _check_choice("exchange", self.exchange, EXCHANGES)
        _check_choice("policy", self.policy, POLICIES)
        if self.kernel is not None:
            _check_choice("kernel", self.kernel, KERNELS)
        _check_choice("algorithm", self.algorithm, ALGORITHMS)


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not a cp_cache {name}; use one of {choices}")


def resolve_config(policy: str | None = None, *, kernel: str | None = None,
                   fused_merge: bool | None = None, algorithm: str | None = None,
                   exchange: str | None = None) -> CPConfig:
    """A CPConfig from explicit arguments, falling back on the environment (CP_CACHE_POLICY,
    CP_CACHE_FUSED_MERGE: "0" turns the fused merge off, CP_CACHE_ALGORITHM, CP_CACHE_EXCHANGE)."""
    if exchange is None:
        exchange = os.environ.get(EXCHANGE_ENV, "direct").strip() or "direct"
        if exchange not in EXCHANGES:
            raise ValueError(f"environment variable {EXCHANGE_ENV}={exchange!r} is not a cp_cache exchange; "
                             f"use one of {EXCHANGES}")
    if algorithm is None:
        algorithm = os.environ.get(ALGORITHM_ENV, "ring").strip() or "ring"
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"environment variable {ALGORITHM_ENV}={algorithm!r} is not a cp_cache algorithm; "
                f"use one of {ALGORITHMS}"
            )
    if policy is None:
        policy = os.environ.get(POLICY_ENV, HANDLE_POLICY)
        if policy not in POLICIES:
            raise ValueError(
                f"environment variable {POLICY_ENV}={policy!r} is not a cp_cache policy; use one of {POLICIES}"
            )
    if fused_merge is None:
        value = os.environ.get(FUSED_MERGE_ENV, "1").strip()
        if value not in ("0", "1"):
            raise ValueError(f"environment variable {FUSED_MERGE_ENV}={value!r}: use 0 or 1")
        fused_merge = value == "1"
    return CPConfig(policy=policy, kernel=kernel, fused_merge=fused_merge, algorithm=algorithm, exchange=exchange)


def load_balance_enabled() -> bool:
    """torch's ``_cp_options.enable_load_balance``: whether ``context_parallel(buffers=...)``
    shards head-tail (rank r holds chunks r and 2W-1-r of 2W) rather than contiguously."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    return bool(_cp_options.enable_load_balance)
