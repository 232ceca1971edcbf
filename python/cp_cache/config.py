"""What ``cp_cache.enable()`` decides, frozen: ``CPConfig``, its environment fallbacks and
``document_placement`` (the placement a TND call uses). ``enable()`` builds one ``CPConfig`` and
registers handlers bound to it; nothing else carries configuration to the handlers."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

from .documents import check_capacity
from .kernels import kernel_names
from .placement import BALANCED, CONTIGUOUS, HEAD_TAIL
from .plan import ALGORITHMS, EXCHANGES, GRAD_PARTIALS, check_choice, check_exchange_options
from .step_cache import HANDLE_POLICY, POLICIES, STACK_POLICY

__all__ = ["HANDLE_POLICY", "STACK_POLICY", "POLICIES", "POLICY_ENV", "FUSED_MERGE_ENV", "ALGORITHMS",
           "ALGORITHM_ENV", "EXCHANGES", "EXCHANGE_ENV", "DOCUMENT_PLACEMENTS", "DOCUMENTS_ENV",
           "DOCUMENT_CAPACITY_ENV", "CPConfig", "resolve_config", "document_placement",
           "documents_from_env", "document_capacity_from_env"]

POLICY_ENV = "CP_CACHE_POLICY"
FUSED_MERGE_ENV = "CP_CACHE_FUSED_MERGE"
ALGORITHM_ENV = "CP_CACHE_ALGORITHM"
EXCHANGE_ENV = "CP_CACHE_EXCHANGE"
DOCUMENT_PLACEMENTS = (BALANCED, HEAD_TAIL)  # under load balancing; without it, contiguous
DOCUMENTS_ENV = "CP_CACHE_DOCUMENTS"
DOCUMENT_CAPACITY_ENV = "CP_CACHE_DOCUMENT_CAPACITY"
KEEP_KV_ENV = "CP_CACHE_KEEP_KV"
GRAD_PARTIALS_ENV = "CP_CACHE_GRAD_PARTIALS"


@dataclass(frozen=True)
class CPConfig:
    """The arguments of ``enable()`` (docs/api.md). kernel: None picks "npu" when the op exists. exchange: "direct"
    (only the K/V rows each rank's queries may attend to) or "ring" (whole blocks). keep_kv: the ring's backward
    reuses the K/V its forward received. documents: the placement under load balancing."""
    policy: str = HANDLE_POLICY
    kernel: str | None = None
    algorithm: str = "ring"
    fused_merge: bool = True
    exchange: str = "direct"
    documents: str = BALANCED
    keep_kv: bool = False
    grad_partials: str = "float32"
    document_capacity: Optional[int] = None

    def __post_init__(self) -> None:
        check_exchange_options(self.exchange, self.keep_kv, self.grad_partials)
        check_capacity(self.document_capacity, "document_capacity")
        check_choice("policy", self.policy, POLICIES)
        if self.kernel is not None:
            check_choice("kernel", self.kernel, kernel_names(), "step kernel (cp_cache.kernels.register adds one)")
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("documents", self.documents, DOCUMENT_PLACEMENTS, "document placement")

    def for_own_op(self) -> "CPConfig":
        """The configuration cp_cache's own op (``op.py``) runs: the "torch" kernel unless one is configured."""
        return self if self.kernel else replace(self, kernel="torch")


def resolve_config(policy: str | None = None, *, kernel: str | None = None, fused_merge: bool | None = None,
                   algorithm: str | None = None, exchange: str | None = None, documents: str | None = None,
                   keep_kv: bool | None = None, grad_partials: str | None = None,
                   document_capacity: int | None = None) -> CPConfig:
    """An argument left None reads ``CP_CACHE_<ARGUMENT>`` (but ``kernel``; the flags take 0 or 1)."""
    exchange = _from_env(EXCHANGE_ENV, "direct", EXCHANGES, "exchange") if exchange is None else exchange
    algorithm = _from_env(ALGORITHM_ENV, "ring", ALGORITHMS, "algorithm") if algorithm is None else algorithm
    documents = documents_from_env() if documents is None else documents
    document_capacity = document_capacity_from_env() if document_capacity is None else document_capacity
    if policy is None:  # unlike the others, neither stripped nor defaulted when empty
        policy = os.environ.get(POLICY_ENV, HANDLE_POLICY)
        check_choice(f"environment variable {POLICY_ENV}", policy, POLICIES, "policy")
    fused_merge = _flag_from_env(FUSED_MERGE_ENV, True) if fused_merge is None else fused_merge
    keep_kv = _flag_from_env(KEEP_KV_ENV, False) if keep_kv is None else keep_kv
    if grad_partials is None:
        grad_partials = _from_env(GRAD_PARTIALS_ENV, "float32", GRAD_PARTIALS, "grad_partials")
    return CPConfig(policy=policy, kernel=kernel, fused_merge=fused_merge, algorithm=algorithm, exchange=exchange,
                    documents=documents, keep_kv=keep_kv, grad_partials=grad_partials,
                    document_capacity=document_capacity)


def _flag_from_env(name: str, default: bool) -> bool:
    value = os.environ.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name}={value!r}: use 0 or 1")
    return value == "1"


def documents_from_env() -> str:
    return _from_env(DOCUMENTS_ENV, BALANCED, DOCUMENT_PLACEMENTS, "document placement")


def document_capacity_from_env() -> Optional[int]:
    """Unset or empty: None."""
    value = os.environ.get(DOCUMENT_CAPACITY_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"environment variable {DOCUMENT_CAPACITY_ENV}={value!r}: use a positive integer (rows "
                         "per rank), or leave it unset")
    return int(value)


def _from_env(name: str, default: str, choices: tuple, what: str) -> str:
    value = os.environ.get(name, default).strip() or default
    check_choice(f"environment variable {name}", value, choices, what)
    return value


def document_placement(configured: str, load_balance: bool) -> str:
    """Contiguous without load balancing."""
    return configured if load_balance else CONTIGUOUS
