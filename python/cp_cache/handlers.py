"""DTensor custom-op handlers for the NPU fused attention ops.

With q/k/v DTensors sharded on the sequence dimension of a 1-D mesh, a call of
``npu_fusion_attention_v3`` runs ring attention and returns DTensors; the step
cache of the call goes out in the ``seed`` slot (a handle whose storage owns it,
or, under the stack policy, the cache's pairing key) and comes back to
``npu_fusion_attention_grad_v3(seed=...)`` through autograd.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from . import _C
from . import layout as L
from .kernels import get_kernel
from .kernels.npu import lse_from_stats, stats_from_lse
from .ring import RingConfig, RingStep, ring_attention_backward, ring_attention_forward

log = logging.getLogger("cp_cache")

HANDLE_POLICY = "handle"
STACK_POLICY = "stack"
POLICIES = (HANDLE_POLICY, STACK_POLICY)

_COMPRESSED_MASK_SHAPE = (2048, 2048)
_CAUSAL_SPARSE_MODES = (2, 3)  # left-up / right-down: the same for a square global attention
_MASK_AS_GIVEN_MODES = (0, 1)
_UNSUPPORTED_WHEN_SET = ("pse", "padding_mask", "prefix", "actual_seq_qlen", "actual_seq_kvlen", "sink")
_STATS_SEQ_DIM = 2  # softmax_max / softmax_sum are [B, N, S, 8]


@dataclass
class CallRecord:
    """What the last call of one direction cost on this process."""

    bytes_sent: int = 0
    handler_seconds: float = 0.0  # whole handler, ring included
    ring_seconds: float = 0.0  # kernels and communication
    calls: int = 0

    @property
    def overhead_seconds(self) -> float:
        return self.handler_seconds - self.ring_seconds


@dataclass
class HandlerState:
    policy: str = HANDLE_POLICY
    kernel_name: str | None = None  # None: "npu" when the op exists, else "reference"
    last_forward: CallRecord = field(default_factory=CallRecord)
    last_backward: CallRecord = field(default_factory=CallRecord)
    lock: threading.Lock = field(default_factory=threading.Lock)


STATE = HandlerState()


def bind_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, positional or keyword, defaults filled in."""
    schema = op._schema
    names = {a.name for a in schema.arguments}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"{schema.name}: unexpected keyword argument(s) {unknown}")
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{schema.name}: takes {len(positional)} positional arguments, got {len(args)}")
    bound: dict[str, Any] = {}
    for index, argument in enumerate(schema.arguments):
        if not argument.kwarg_only and index < len(args):
            if argument.name in kwargs:
                raise TypeError(f"{schema.name}: argument {argument.name!r} given twice")
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            raise TypeError(f"{schema.name}: missing required argument {argument.name!r}")
    return bound


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"<tensor of shape {tuple(value.shape)} and dtype {value.dtype}>"
    return repr(value)


def _is_causal(a: dict[str, Any], layout: str) -> bool:
    """Causal or full attention from the mask arguments; anything else raises."""
    for name in _UNSUPPORTED_WHEN_SET:
        if a[name] is not None:
            raise NotImplementedError(
                f"cp_cache ring attention does not support {name}={_describe(a[name])} yet"
            )
    if a["softmax_layout"]:
        raise NotImplementedError(
            f"cp_cache ring attention does not support softmax_layout={a['softmax_layout']!r} yet"
        )
    mode, mask = a["sparse_mode"], a["atten_mask"]
    if mode not in _MASK_AS_GIVEN_MODES + _CAUSAL_SPARSE_MODES:
        raise NotImplementedError(
            f"cp_cache ring attention supports sparse_mode 0, 1 (no mask: full attention) and "
            f"2, 3 (compressed causal mask), not sparse_mode={mode}"
        )
    if mask is None:
        return False  # the op computes full attention whatever sparse_mode says
    if mode in _CAUSAL_SPARSE_MODES:
        if tuple(mask.shape[-2:]) != _COMPRESSED_MASK_SHAPE or any(s != 1 for s in mask.shape[:-2]):
            raise NotImplementedError(
                f"cp_cache ring attention with sparse_mode={mode} needs the compressed 2048x2048 "
                f"causal mask, got atten_mask={_describe(mask)}"
            )
        return True
    raise NotImplementedError(
        f"cp_cache ring attention does not support an arbitrary atten_mask ({_describe(mask)} with "
        f"sparse_mode={mode}); pass no mask for full attention or the compressed causal mask "
        "with sparse_mode=2"
    )


def _check_sharding(tensors: dict[str, Any], layout: str):
    """(mesh, placements) shared by the named DTensors, sharded on the layout's sequence dim."""
    seq_dim = L.seq_dim(layout)
    mesh = placements = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            raise TypeError(
                f"cp_cache ring attention needs {name} as a DTensor sharded on the sequence "
                f"dimension {seq_dim} of layout {layout!r}, got {type(tensor).__name__}"
            )
        if tensor.device_mesh.ndim != 1:
            raise NotImplementedError(
                f"cp_cache ring attention needs a 1-D device mesh, {name} is on a "
                f"{tensor.device_mesh.ndim}-D mesh {tensor.device_mesh}"
            )
        if tuple(tensor.placements) != (Shard(seq_dim),):
            raise NotImplementedError(
                f"cp_cache ring attention needs {name} sharded as (Shard({seq_dim}),) for layout "
                f"{layout!r}, got placements={tuple(tensor.placements)}"
            )
        if mesh is None:
            mesh, placements = tensor.device_mesh, tensor.placements
        elif tensor.device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {tensor.device_mesh}, query on {mesh}")
    return mesh, placements


def _wrap(local: Tensor, mesh, placements) -> DTensor:
    shape, stride = torch.distributed.tensor._utils.compute_global_tensor_info(local, mesh, placements)
    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    )
    return DTensor(local, spec, requires_grad=False)


def _pairing_key(config: RingConfig, kernel_name: str, steps: list[RingStep]) -> int:
    """A fingerprint of everything the backward reads from the cache: two forwards with
    the same key are interchangeable for their backwards."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr((config, kernel_name)).encode())
    for step in steps:
        digest.update(step.part.encode())
        for tensor in (step.seed, step.offset):
            value = 0 if tensor is None else int(tensor.reshape(-1)[0])
            digest.update(struct.pack("<q", value))
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


_META_KEYS = ("world_size", "rank", "causal", "load_balance", "layout", "head_num", "scale", "keep_prob")


def _cache_from_forward(config: RingConfig, kernel_name: str, steps: list[RingStep]):
    cache = _C.default_store().create()
    for key in _META_KEYS:
        cache.set_meta(key, getattr(config, key))
    cache.set_meta("kernel", kernel_name)
    for step in steps:
        owned = [t for t in (step.seed, step.offset) if t is not None]
        cache.add_step(step.part, owned)
    return cache


def _config_from_cache(cache) -> tuple[RingConfig, str]:
    meta = cache.metadata
    return RingConfig(**{key: meta[key] for key in _META_KEYS}), meta["kernel"]


def _steps_from_cache(cache, config: RingConfig) -> list[RingStep]:
    steps = []
    for index, (part, owned) in enumerate(cache.steps):
        seed, offset = (owned + [None, None])[:2]
        source = (config.rank - index) % config.world_size
        steps.append(RingStep(index=index, source_rank=source, part=part, seed=seed, offset=offset))
    return steps


def _slot_tensor(value: int) -> Tensor:
    return torch.tensor([value], dtype=torch.int64)


def fusion_attention_forward(op_call, args, kwargs):
    """Handler of ``npu_fusion_attention_v3`` for DTensor inputs."""
    started = time.perf_counter()
    a = bind_arguments(op_call, args, kwargs)
    layout = L.check_layout(a["input_layout"])
    causal = _is_causal(a, layout)
    mesh, placements = _check_sharding({"query": a["query"], "key": a["key"], "value": a["value"]}, layout)
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    load_balance = causal and _cp_options.enable_load_balance
    q, k, v = (a[name].to_local() for name in ("query", "key", "value"))
    world_size = mesh.size()
    if load_balance and q.size(L.seq_dim(layout)) % 2:
        global_len = a["query"].size(L.seq_dim(layout))
        raise ValueError(
            f"causal load balancing splits the sequence into 2*W = {2 * world_size} chunks; the "
            f"query sequence length {global_len} is not divisible by {2 * world_size}"
        )
    config = RingConfig(
        world_size=world_size,
        rank=mesh.get_local_rank(),
        causal=causal,
        load_balance=load_balance,
        layout=layout,
        head_num=int(a["head_num"]),
        scale=float(a["scale"]),
        keep_prob=float(a["keep_prob"]),
    )
    kernel = get_kernel(STATE.kernel_name)
    ring_started = time.perf_counter()
    result = ring_attention_forward(q, k, v, config, group=mesh.get_group(), kernel=kernel)
    ring_seconds = time.perf_counter() - ring_started

    cache = _cache_from_forward(config, kernel.name, result.steps)
    if STATE.policy == HANDLE_POLICY:
        seed_slot = _C.default_store().attach(cache)
    else:
        cache.pairing_key = _pairing_key(config, kernel.name, result.steps)
        _C.default_store().push(cache)  # skipped (and the cache dropped) in a recompute
        seed_slot = _slot_tensor(cache.pairing_key)
    del cache

    softmax_max, softmax_sum = stats_from_lse(result.lse)
    stats_placements = (Shard(_STATS_SEQ_DIM),)
    outputs = (
        _wrap(result.out, mesh, placements),
        _wrap(softmax_max, mesh, stats_placements),
        _wrap(softmax_sum, mesh, stats_placements),
        torch.empty(0, dtype=q.dtype, device=q.device),
        seed_slot,
        _slot_tensor(world_size),
    )
    _record(STATE.last_forward, result.bytes_sent, started, ring_seconds)
    return outputs


def _claim_cache(seed: Any):
    """The forward's cache from the seed slot: resolve a handle, or pop the stack."""
    if isinstance(seed, DTensor):
        raise RuntimeError(
            "cp_cache: the seed argument of npu_fusion_attention_grad_v3 is a DTensor; it must be "
            "the seed output of the CP attention forward (a plain int64 tensor)"
        )
    if not isinstance(seed, Tensor):
        raise RuntimeError(
            f"cp_cache: npu_fusion_attention_grad_v3 got seed={_describe(seed)}; it needs the seed "
            "output of the CP attention forward"
        )
    store = _C.default_store()
    if store.is_handle(seed):
        cache = store.resolve(seed)
        if _C.in_graph_task() and not _C.current_graph_task_keeps_graph():
            store.release(seed)  # this graph's backward runs once: free the cache now
        return cache
    if STATE.policy == STACK_POLICY:
        return store.pop(int(seed.reshape(-1)[0]))
    return store.resolve(seed)  # raises, naming what was passed and the likely cause


def fusion_attention_backward(op_call, args, kwargs):
    """Handler of ``npu_fusion_attention_grad_v3`` for DTensor inputs."""
    started = time.perf_counter()
    a = bind_arguments(op_call, args, kwargs)
    layout = L.check_layout(a["input_layout"])
    causal = _is_causal(a, layout)  # same argument checks as the forward
    cache = _claim_cache(a["seed"])
    config, kernel_name = _config_from_cache(cache)
    called = dict(layout=layout, head_num=int(a["head_num"]), scale=float(a["scale_value"]),
                  keep_prob=float(a["keep_prob"]), causal=causal)
    recorded = dict(layout=config.layout, head_num=config.head_num, scale=config.scale,
                    keep_prob=config.keep_prob, causal=config.causal)
    if called != recorded:
        raise RuntimeError(
            f"cp_cache: backward called with {called} but its forward (cache {cache.id}) ran with "
            f"{recorded}"
        )
    tensors = {name: a[name] for name in ("query", "key", "value")}
    mesh, placements = _check_sharding(tensors, layout)
    for name in ("dy", "attention_in"):
        tensors[name] = _sharded_like(a[name], name, mesh, placements)
    if mesh.size() != config.world_size or mesh.get_local_rank() != config.rank:
        raise RuntimeError(
            f"cp_cache: backward runs on rank {mesh.get_local_rank()} of {mesh.size()} but its "
            f"forward ran on rank {config.rank} of {config.world_size}"
        )
    q, k, v, dy, out = (tensors[name].to_local() for name in tensors)
    softmax_max, softmax_sum = (_local(a[name], name) for name in ("softmax_max", "softmax_sum"))
    lse = lse_from_stats(softmax_max, softmax_sum)
    steps = _steps_from_cache(cache, config)
    del cache
    ring_started = time.perf_counter()
    result = ring_attention_backward(
        dy, q, k, v, out, lse, steps, config, group=mesh.get_group(), kernel=get_kernel(kernel_name)
    )
    ring_seconds = time.perf_counter() - ring_started
    empty = torch.empty(0, dtype=q.dtype, device=q.device)
    outputs = (
        _wrap(result.dq, mesh, placements),
        _wrap(result.dk, mesh, placements),
        _wrap(result.dv, mesh, placements),
        empty,
        empty.clone(),
    )
    _record(STATE.last_backward, result.bytes_sent, started, ring_seconds)
    return outputs


def _sharded_like(value: Any, name: str, mesh, placements) -> DTensor:
    """``value`` as a DTensor with the query's sharding (an incoming gradient may come
    replicated, e.g. from a sum)."""
    if not isinstance(value, DTensor):
        raise TypeError(f"cp_cache: npu_fusion_attention_grad_v3 needs {name} as a DTensor, got {_describe(value)}")
    if value.device_mesh != mesh:
        raise ValueError(f"{name} is on mesh {value.device_mesh}, query on {mesh}")
    if tuple(value.placements) != tuple(placements):
        value = value.redistribute(mesh, placements)
    return value


def _local(value: Any, name: str) -> Tensor:
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, Tensor):
        return value
    raise RuntimeError(f"cp_cache: npu_fusion_attention_grad_v3 needs {name}, got {_describe(value)}")


def _record(record: CallRecord, bytes_sent: int, started: float, ring_seconds: float) -> None:
    with STATE.lock:
        record.bytes_sent = bytes_sent
        record.handler_seconds = time.perf_counter() - started
        record.ring_seconds = ring_seconds
        record.calls += 1
