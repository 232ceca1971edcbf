"""Turning the CP handlers on and off, next to torch's and torch_npu's CP registration.

``enable()`` puts the handlers in DTensor's table, and again on every CP entry and exit: cp_cache wraps whichever
``_enable_cp_dtensor_dispatcher`` / ``_disable_cp_dtensor_dispatcher`` pair it finds (``import torch_npu``
replaces torch's) and runs it first. The entries the handlers displaced serve non-CP calls; after ``disable()``
the table holds the same objects as before."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

from . import _C, mixers, sdpa
from .config import CPConfig, resolve_config
from .handlers import AttentionHandlers
from .handlers.attention import CALL_LOG
from .kernels.npu import available as npu_available
from .mixers import region as regions

__all__ = ["enable", "disable", "enabled", "active_config", "active_mesh", "call_stats", "context_parallel"]

log = logging.getLogger("cp_cache")


def _torch_cp():
    from torch.distributed.tensor.experimental._context_parallel import _attention
    return _attention


def _is_ours(handler) -> bool:
    return isinstance(getattr(handler, "__self__", None), AttentionHandlers)


class _Registration:
    """The handlers of one ``enable()`` and everything it changed in torch, to undo it."""

    def __init__(self, handlers: AttentionHandlers):
        from torch.distributed.tensor.experimental._context_parallel import _sharding_rules
        self.adopt(handlers)
        # enabled inside a CP entry, its exit counts; torch's and torch_npu's switches both set these rules on entry
        self.depth = 1 if _sharding_rules._cp_strategy_contexts else 0
        # displaced outside CP and inside the current CP entry: {op: entry or None}
        self._displaced: tuple[dict, dict] = ({}, {})
        cp = _torch_cp()
        self.previous_enable, self.previous_disable = (cp._enable_cp_dtensor_dispatcher,
                                                       cp._disable_cp_dtensor_dispatcher)
        self.enter_cp, self.exit_cp = self._enter_cp, self._exit_cp  # one bound-method object each, for identity
        cp._enable_cp_dtensor_dispatcher, cp._disable_cp_dtensor_dispatcher = self.enter_cp, self.exit_cp

    def adopt(self, handlers: AttentionHandlers) -> None:
        """A new configuration keeps the switches and the depth."""
        self.handlers = handlers
        handlers.registration = self

    def _here(self) -> dict:
        return self._displaced[self.depth > 0]

    def displaced(self, op):
        """What would serve ``op`` without cp_cache where the process is now (in or out of a CP region), or None."""
        return self._here().get(op)

    def overlay(self) -> None:
        """Remembers the foreign entries the handlers displace."""
        displaced, table = self._here(), DTensor._op_dispatcher._custom_op_handlers
        for op, handler in self.handlers.table().items():
            previous = table.get(op)
            if not _is_ours(previous):
                displaced.setdefault(op, previous)  # the first: a CP exit may have dropped it since
            table[op] = handler

    def hooked(self) -> bool:
        cp = _torch_cp()
        return cp._enable_cp_dtensor_dispatcher is self.enter_cp and cp._disable_cp_dtensor_dispatcher is self.exit_cp

    def unregister(self) -> None:
        """Gives torch's CP switches back (unless replaced since) and the table the entries displaced there."""
        cp = _torch_cp()
        if self.hooked():
            cp._enable_cp_dtensor_dispatcher = self.previous_enable
            cp._disable_cp_dtensor_dispatcher = self.previous_disable
        else:
            log.warning("cp_cache.disable(): torch's CP dispatcher switches were replaced after cp_cache.enable() "
                        "(now %s / %s); leaving them as they are", cp._enable_cp_dtensor_dispatcher,
                        cp._disable_cp_dtensor_dispatcher)
        displaced, table = self._here(), DTensor._op_dispatcher._custom_op_handlers
        for op in [op for op, handler in table.items() if _is_ours(handler)]:
            if displaced.get(op) is None:
                del table[op]
            else:
                table[op] = displaced[op]

    def _enter_cp(self) -> None:
        self.depth += 1
        if self.depth == 1:  # nested entries keep the outer entry's state
            self.previous_enable()
        if _registered is self:
            self.overlay()
            mixers.set_active(True)

    def _exit_cp(self) -> None:
        self.depth = max(self.depth - 1, 0)  # at 0: an exit whose entry came before cp_cache.enable()
        if self.depth == 0:
            self._displaced[1].clear()  # already empty when the depth was 0
            self.previous_disable()
        if _registered is self:
            self.overlay()
            mixers.set_active(self.depth > 0)


_registered: _Registration | None = None


def _forget_restored(wrapped) -> None:
    """``_restore_function`` keeps the SDPA wrapper in ``_replaced_functions``: one more entry per region."""
    if torch.nn.functional.scaled_dot_product_attention is not wrapped:  # restored: the record is stale
        getattr(_torch_cp(), "_replaced_functions", {}).pop(wrapped, None)


def enable(policy: str | None = None, *, kernel: str | None = None, fused_merge: bool | None = None,
           algorithm: str | None = None, exchange: str | None = None, documents: str | None = None,
           keep_kv: bool | None = None, grad_partials: str | None = None,
           document_capacity: int | None = None) -> None:
    """Idempotent; an argument left None reads ``CP_CACHE_<NAME>`` (docs/api.md). RuntimeError when the policy
    changes while stack entries wait. Call it after ``import torch_npu`` (it replaces torch's CP switches)."""
    global _registered
    config = resolve_config(policy, kernel=kernel, fused_merge=fused_merge, algorithm=algorithm, exchange=exchange,
                            documents=documents, keep_kv=keep_kv, grad_partials=grad_partials,
                            document_capacity=document_capacity)
    if config.kernel == "npu" and not npu_available():
        raise RuntimeError("cp_cache.enable(kernel='npu') needs torch.ops.npu.npu_fusion_attention_v3: import torch_npu "
                           "(Ascend) or call cp_cache.emulator.install_npu_emulator() (CPU) first, or leave kernel=None "
                           "for torch's fused kernels")
    handlers = AttentionHandlers(config, CALL_LOG)
    if not npu_available():  # SDPA to cp_cache's own op, on torch's fused kernels (torch_npu routes it on an NPU)
        sdpa.install()
    previous = _registered
    if previous is not None and config.policy != previous.handlers.config.policy:
        depth = _C.default_store().depth
        if depth:
            raise RuntimeError(f"cp_cache.enable(policy={config.policy!r}): {depth} stack entries of the "
                               f"{previous.handlers.config.policy!r} policy still wait for their backward")
    if previous is not None and previous.hooked():
        previous.adopt(handlers)  # keep the wrapped switches, the replaced entries and the depth
        _registered = previous
    else:
        if previous is not None:
            previous.unregister()
        _registered = _Registration(handlers)  # wraps the switches it finds
    _registered.overlay()
    mixers.install(active=_registered.depth > 0)
    log.info("cp_cache enabled: %s, ops=%s", config, sorted(str(op) for op in handlers.table()))


def disable() -> None:
    """Gives torch's (or torch_npu's) CP dispatcher back; drops stack entries and logs the caches still alive."""
    global _registered
    if _registered is not None:
        registration, _registered = _registered, None
        registration.unregister()
    mixers.uninstall()
    sdpa.uninstall()
    dropped = _C.default_store().clear()
    stats = _C.default_store().stats()
    if dropped:
        log.warning("cp_cache disabled: dropped %d stack entries whose backward never ran", dropped)
    if stats["live_entries"]:
        log.warning("cp_cache disabled with %d step caches (%d bytes) still alive: graphs that still hold their "
                    "handles", stats["live_entries"], stats["live_bytes"])


def enabled() -> bool:
    return _registered is not None


def active_config() -> CPConfig | None:
    """None when cp_cache is disabled."""
    return None if _registered is None else _registered.handlers.config


def active_mesh():
    """The innermost ``cp_cache.context_parallel()`` region's mesh, or None (torch's alone is not seen)."""
    return getattr(regions.active(), "mesh", None)


def active_documents() -> tuple[tuple[int, ...], str] | None:
    """(cumulative ends, placement) the innermost region laid its buffers out by, or None."""
    return getattr(regions.active(), "documents", None)


def registered_handlers() -> AttentionHandlers | None:
    """Tests check which handler a table holds."""
    return None if _registered is None else _registered.handlers


def call_stats() -> dict[str, dict]:
    """The last CP attention call of each direction (fields: docs/api.md)."""
    return CALL_LOG.snapshot()


@contextlib.contextmanager
def context_parallel(mesh, *, buffers: list[torch.Tensor] | None = None, buffer_seq_dims: list[int] | None = None,
                     no_restore_buffers: set[torch.Tensor] | None = None, algorithm: str | None = None,
                     documents=None, model: torch.nn.Module | None = None) -> Iterator[None]:
    """torch's ``context_parallel()`` with cp_cache enabled inside. ``documents``: a packed batch's cumulative ends
    (e.g. ``cu_seq_lens_q``): the buffers are laid out by ``shard_documents`` (restored on exit). ``model``: checked
    on entry (every layer that mixes tokens served, else refused); any model run inside is checked as it starts."""
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    outer_config = active_config()  # None: cp_cache is enabled for the block only
    if outer_config is None:
        enable(algorithm=algorithm)
    elif not _registered.hooked() or (algorithm is not None and algorithm != outer_config.algorithm):
        if not _registered.hooked():
            log.warning("cp_cache: torch's CP dispatcher switches were replaced after cp_cache.enable() "
                        "(torch_npu imported late?); enabling again on top of them")
        enable(**dataclasses.asdict(dataclasses.replace(outer_config, algorithm=algorithm or outer_config.algorithm)))
    entered = len(regions.ACTIVE)
    try:
        if model is not None:
            mixers.check_model(model)
        placed = _region_documents(documents, mesh)
        seq_dims = regions.buffer_seq_dims(buffers or [], buffer_seq_dims)
        region = functools.partial(regions.Region, mesh, placed, algorithm=active_config().algorithm)
        if buffers and documents is not None:
            with _documents_buffers(mesh, placed, buffers, seq_dims, no_restore_buffers) as sharded, \
                    _dispatcher_only(mesh):
                regions.ACTIVE.append(region(sharded))
                yield
        elif buffers:
            _check_sequence_lengths(mesh, buffers, seq_dims)
            unsharded = region(regions.sharded_buffers(buffers, seq_dims, mesh.size()))  # before torch shards them
            with torch_context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims,
                                        no_restore_buffers=no_restore_buffers):
                wrapped = torch.nn.functional.scaled_dot_product_attention
                regions.ACTIVE.append(unsharded)
                yield
            _forget_restored(wrapped)
        else:
            with _dispatcher_only(mesh):
                regions.ACTIVE.append(region())
                yield
    finally:
        del regions.ACTIVE[entered:]  # this region, once entered
        _leave(outer_config)


def _leave(outer_config: CPConfig | None) -> None:
    if outer_config is None:
        disable()
    elif _registered is not None and _registered.handlers.config != outer_config:
        enable(**dataclasses.asdict(outer_config))


@contextlib.contextmanager
def _dispatcher_only(mesh) -> Iterator[None]:
    """torch's context_parallel() without buffers: only its SDPA patch and handler table."""
    attention = _torch_cp()
    attention._dispatch_mode = attention._DispatchMode.MONKEY_PATCH
    attention._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    wrapped = torch.nn.functional.scaled_dot_product_attention
    try:
        yield
    finally:
        attention._disable_context_parallel_dispatcher_impl()
        _forget_restored(wrapped)


def _check_sequence_lengths(mesh, buffers, seq_dims) -> None:
    """ValueError (on every rank alike) rather than the uneven shards torch would make."""
    from .layout import load_balance_enabled
    world = mesh.size()
    chunks = 2 * world if load_balance_enabled() else world
    for index, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        length = buffer.size(dim)
        if length % chunks:
            layout = "head-tail load balancing" if chunks == 2 * world else "contiguous sharding"
            raise ValueError(
                f"context_parallel: buffers[{index}] has T={length} tokens on dimension {dim}, which {layout} "
                f"over W={world} ranks cannot cut into {chunks} equal chunks: pad the batch to a multiple of "
                f"{chunks} (e.g. a collator's pad_to_multiple_of={chunks}), or, for a packed batch, give its "
                "documents (context_parallel(..., documents=cu_seq_lens_q)), which take any length")


def _region_documents(documents, mesh) -> tuple[tuple[int, ...], str] | None:
    if documents is None:
        return None
    from .documents import cumulative_lengths
    from .packing import configured_placement
    if mesh.ndim != 1:
        raise ValueError(f"context_parallel: documents= lays buffers out over a 1-D mesh, got a {mesh.ndim}-D "
                         f"mesh {mesh}")
    capacity = active_config().document_capacity
    if capacity is not None:  # the integration reads each rank's placed tokens, not padded shards
        raise NotImplementedError(f"context_parallel: documents= with document_capacity={capacity} is not supported "
                                  "yet (the transformers integration takes each rank's placed tokens, unpadded); "
                                  "enable cp_cache without a capacity for this region")
    ends = documents.tolist() if isinstance(documents, torch.Tensor) else list(documents)
    if ends[:1] == [0]:
        ends = ends[1:]
    return cumulative_lengths(ends, "documents"), configured_placement(None, None)


@contextlib.contextmanager
def _documents_buffers(mesh, placed, buffers, seq_dims, no_restore) -> Iterator[tuple]:
    """Each buffer replaced in place by this rank's shard, put back on exit unless in ``no_restore``."""
    from .packing import shard_documents
    ends, placement = placed
    shards = [shard_documents(b, ends, mesh, dim, placement=placement) for b, dim in zip(buffers, seq_dims)]
    sharded = regions.sharded_buffers(buffers, seq_dims, mesh.size(), [t.size(d) for t, d in zip(shards, seq_dims)])
    kept = [None if no_restore and b in no_restore else b.clone() for b in buffers]
    for buffer, shard in zip(buffers, shards):
        buffer.resize_(shard.shape)
        buffer.copy_(shard)
    try:
        yield sharded
    finally:
        for buffer, original in zip(buffers, kept):
            if original is not None:
                buffer.resize_(original.shape)
                buffer.copy_(original)
