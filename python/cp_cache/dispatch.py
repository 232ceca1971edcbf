"""Turning the CP handlers on and off, and torch's context_parallel() with them active.

torch's ``context_parallel()`` *replaces* ``DTensor._op_dispatcher._custom_op_handlers``
on entry (a copy of the table it captured at import, plus its SDPA handlers) and on
exit (that captured table). The handlers are therefore put both in the live table
and in the captured one, so they survive either replacement.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

from . import _C, handlers

log = logging.getLogger("cp_cache")

POLICY_ENV = "CP_CACHE_POLICY"
_enabled = False


def _ops() -> dict:
    """The handled ops that exist in this process (real torch_npu or the emulator)."""
    table = {}
    for name, handler in (
        ("npu_fusion_attention_v3", handlers.fusion_attention_forward),
        ("npu_fusion_attention_grad_v3", handlers.fusion_attention_backward),
    ):
        try:
            table[getattr(torch.ops.npu, name).default] = handler
        except (AttributeError, RuntimeError):
            pass
    return table


def _handler_tables() -> list[dict]:
    tables = [DTensor._op_dispatcher._custom_op_handlers]
    from torch.distributed.tensor.experimental._context_parallel import _attention

    if _attention.existing_custom_ops is not tables[0]:
        tables.append(_attention.existing_custom_ops)
    return tables


def resolve_policy(policy: str | None) -> str:
    chosen = policy if policy is not None else os.environ.get(POLICY_ENV, handlers.HANDLE_POLICY)
    if chosen not in handlers.POLICIES:
        source = "policy" if policy is not None else f"environment variable {POLICY_ENV}"
        raise ValueError(f"{source}={chosen!r} is not a cp_cache policy; use one of {handlers.POLICIES}")
    return chosen


def enable(policy: str | None = None, *, kernel: str | None = None) -> None:
    """Register the CP handlers for the NPU attention ops (idempotent).

    ``policy``: "handle" (default) or "stack"; None reads CP_CACHE_POLICY.
    ``kernel``: the step kernel, "npu" or "reference"; None picks "npu" when the op exists.
    """
    global _enabled
    chosen = resolve_policy(policy)
    ops = _ops()
    if not ops:
        raise RuntimeError(
            "cp_cache.enable(): torch.ops.npu.npu_fusion_attention_v3 does not exist; import "
            "torch_npu on an Ascend machine, or call cp_cache.testing.install_npu_emulator() on CPU"
        )
    if _enabled and chosen != handlers.STATE.policy:
        depth = _C.default_store().depth
        if depth:
            raise RuntimeError(
                f"cp_cache.enable(policy={chosen!r}): {depth} stack entries of the "
                f"{handlers.STATE.policy!r} policy still wait for their backward"
            )
    handlers.STATE.policy = chosen
    handlers.STATE.kernel_name = kernel
    for table in _handler_tables():
        table.update(ops)
    _enabled = True
    log.info("cp_cache enabled: policy=%s, ops=%s", chosen, sorted(str(op) for op in ops))


def disable() -> None:
    """Unregister the handlers; log the caches still alive (stack entries are dropped)."""
    global _enabled
    for table in _handler_tables():
        for op in _ops():
            table.pop(op, None)
    dropped = _C.default_store().clear()
    stats = _C.default_store().stats()
    if dropped:
        log.warning("cp_cache disabled: dropped %d stack entries whose backward never ran", dropped)
    if stats["live_entries"]:
        log.warning(
            "cp_cache disabled with %d step caches (%d bytes) still alive: graphs that still "
            "hold their handles", stats["live_entries"], stats["live_bytes"],
        )
    _enabled = False


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def context_parallel(
    mesh,
    *,
    buffers: list[torch.Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:
    """torch's ``context_parallel()`` with the cp_cache handlers active inside.

    Enables cp_cache (default policy) when it is not enabled, and disables it again
    on exit in that case.
    """
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention

    was_enabled = enabled()
    if not was_enabled:
        enable()
    try:
        if buffers:
            with torch_context_parallel(
                mesh, buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers
            ):
                yield
        else:
            # torch's context_parallel() needs a buffer to shard; without one, only the
            # dispatcher part of it (SDPA patch and handler table) is entered.
            _attention._dispatch_mode = _attention._DispatchMode.MONKEY_PATCH
            _attention._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
            try:
                for table in _handler_tables():
                    table.update(_ops())
                yield
            finally:
                _attention._disable_context_parallel_dispatcher_impl()
    finally:
        if not was_enabled:
            disable()
