"""The CP handlers' path for packed documents: ``input_layout="TND"`` with
``actual_seq_qlen`` / ``actual_seq_kvlen`` (DESIGN.md section 10).

q/k/v are DTensors ``Shard(0)`` on a 1-D mesh; the lengths are the GLOBAL cumulative
document ends, the same on every rank (a plain tensor or list). The layout of the local
shards follows torch's ``_cp_options.enable_load_balance`` (per-document head-tail when on,
contiguous when off), for causal and full attention alike: the documents decide which
local rows belong together. The step cache records the documents with the configuration,
and the backward refuses lengths that differ from its forward's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from ..config import load_balance_enabled
from ..documents import check_documents, cumulative_lengths
from ..kernels import get_kernel
from ..merge import fused_merge_available
from ..npu_ops import CAUSAL_MODES, SparseMode, is_compressed_mask, lse_from_stats, stats_views_from_lse
from ..ring import RingConfig
from ..varlen import TND, decode_documents, encode_documents, varlen_ring_backward, varlen_ring_forward
from . import step_records as records
from .arguments import describe
from .checks import local_tensor, sharded_like

__all__ = ["is_varlen", "varlen_forward", "varlen_backward"]

_UNSUPPORTED_WHEN_SET = ("pse", "padding_mask", "prefix", "sink")
_TND_PLACEMENTS = (Shard(0),)


def is_varlen(a: dict[str, Any]) -> bool:
    return a["input_layout"] == TND


def _causal(a: dict[str, Any]) -> bool:
    """Whether the TND call is causal per document; anything else unsupported raises naming it."""
    for name in _UNSUPPORTED_WHEN_SET:
        if a[name] is not None:
            raise NotImplementedError(f"cp_cache ring attention does not support {name}={describe(a[name])} yet")
    if a["softmax_layout"]:
        raise NotImplementedError(
            f"cp_cache ring attention does not support softmax_layout={a['softmax_layout']!r} yet")
    mode, mask = a["sparse_mode"], a["atten_mask"]
    if mask is None:
        return False  # the op computes full attention (per document) whatever sparse_mode says
    if mode in CAUSAL_MODES and is_compressed_mask(mask):
        return True
    raise NotImplementedError(
        f"cp_cache ring attention with input_layout='TND' supports full attention (no atten_mask) and causal "
        f"attention per document (sparse_mode {int(SparseMode.LEFT_UP_CAUSAL)} or "
        f"{int(SparseMode.RIGHT_DOWN_CAUSAL)} with the compressed 2048x2048 mask), not sparse_mode={mode} with "
        f"atten_mask={describe(mask)}")


def _documents(a: dict[str, Any]) -> tuple[int, ...]:
    """The global cumulative document ends; q and kv lengths must be the same documents."""
    for name in ("actual_seq_qlen", "actual_seq_kvlen"):
        if a[name] is None:
            raise ValueError(f"input_layout='TND' needs {name}: the global cumulative document ends (last = T)")
        if isinstance(a[name], DTensor):
            raise ValueError(f"{name} must be a plain tensor or list of the global cumulative ends, the same on "
                             f"every rank, not a DTensor ({describe(a[name])})")
    cu_q = cumulative_lengths(a["actual_seq_qlen"], "actual_seq_qlen")
    cu_kv = cumulative_lengths(a["actual_seq_kvlen"], "actual_seq_kvlen")
    if cu_q != cu_kv:
        raise ValueError(f"actual_seq_qlen={list(cu_q)} and actual_seq_kvlen={list(cu_kv)} differ; packed "
                         "self-attention under CP needs the same documents for queries and keys")
    return cu_q


def _check_sharding(tensors: dict[str, Any]):
    """(mesh, placements): every tensor a DTensor Shard(0) on the same 1-D mesh."""
    mesh = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            raise TypeError(f"cp_cache ring attention needs {name} as a DTensor sharded on dimension 0 (T) of "
                            f"layout 'TND', got {type(tensor).__name__}")
        if tensor.device_mesh.ndim != 1:
            raise NotImplementedError(f"cp_cache ring attention needs a 1-D device mesh, {name} is on a "
                                      f"{tensor.device_mesh.ndim}-D mesh {tensor.device_mesh}")
        if tuple(tensor.placements) != _TND_PLACEMENTS:
            raise NotImplementedError(f"cp_cache ring attention needs {name} sharded as (Shard(0),) for layout "
                                      f"'TND', got placements={tuple(tensor.placements)}")
        if mesh is None:
            mesh = tensor.device_mesh
        elif tensor.device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {tensor.device_mesh}, query on {mesh}")
    return mesh, _TND_PLACEMENTS


def _config(a: dict[str, Any], causal: bool, cu, mesh, cp) -> RingConfig:
    world_size = mesh.size()
    load_balance = load_balance_enabled()
    # on global lengths, the same on every rank: every rank refuses together
    check_documents(cu, a["query"].size(0), world_size, load_balance, name="actual_seq_qlen")
    return RingConfig(world_size=world_size, rank=mesh.get_local_rank(), causal=causal, load_balance=load_balance,
                      layout=TND, head_num=int(a["head_num"]), scale=float(a["scale"]),
                      keep_prob=float(a["keep_prob"]), policy=cp.policy, algorithm=cp.algorithm,
                      documents=encode_documents(cu))


def varlen_forward(handlers, a: dict[str, Any], started: float, wrap) -> tuple:
    """The forward handler's TND path (``handlers``: the AttentionHandlers; ``wrap``: its DTensor wrapper)."""
    causal = _causal(a)
    cu = _documents(a)
    mesh, placements = _check_sharding({n: a[n] for n in ("query", "key", "value")})
    config = _config(a, causal, cu, mesh, handlers.config)
    q, k, v = (a[n].to_local() for n in ("query", "key", "value"))
    kernel = get_kernel(handlers.config.kernel)
    ring_started = time.perf_counter()
    fused_merge = handlers.config.fused_merge and fused_merge_available()
    result = varlen_ring_forward(q, k, v, config, group=mesh.get_group(), kernel=kernel, fused_merge=fused_merge)
    ring_seconds = time.perf_counter() - ring_started
    softmax_max, softmax_sum = stats_views_from_lse(result.lse)  # [T/W, N, 8] views of the LSE
    outputs = (
        wrap(result.out, mesh, placements),
        wrap(softmax_max, mesh, _TND_PLACEMENTS),
        wrap(softmax_sum, mesh, _TND_PLACEMENTS),
        torch.empty(0, dtype=q.dtype, device=q.device),
        handlers._seed_slot(config, kernel.name, result.steps),
        torch.tensor([config.world_size], dtype=torch.int64),
    )
    handlers.call_log.record("forward", result, started, ring_seconds, fused_merge=fused_merge)
    return outputs


def varlen_backward(handlers, a: dict[str, Any], started: float, wrap) -> tuple:
    """The grad handler's TND path."""
    causal = _causal(a)
    cu = _documents(a)
    cache = handlers._claim_cache(a["seed"])
    config, kernel_name = records.config_from_cache(cache)
    tensors = {n: a[n] for n in ("query", "key", "value")}
    mesh, placements = _check_sharding(tensors)
    called = dict(layout=TND, head_num=int(a["head_num"]), scale=float(a["scale_value"]),
                  keep_prob=float(a["keep_prob"]), causal=causal, documents=list(cu))
    recorded = dict(layout=config.layout, head_num=config.head_num, scale=config.scale, keep_prob=config.keep_prob,
                    causal=config.causal, documents=list(decode_documents(config.documents)) if config.documents
                    else [])
    if called != recorded:
        raise RuntimeError(f"cp_cache: backward called with {called} but its forward (cache {cache.id}) ran with "
                           f"{recorded}")
    if mesh.size() != config.world_size or mesh.get_local_rank() != config.rank:
        raise RuntimeError(f"cp_cache: backward runs on rank {mesh.get_local_rank()} of {mesh.size()} but its "
                           f"forward ran on rank {config.rank} of {config.world_size}")
    for name in ("dy", "attention_in"):
        tensors[name] = sharded_like(a[name], name, mesh, placements)
    q, k, v, dy, out = (tensors[n].to_local() for n in tensors)
    lse = lse_from_stats(*(local_tensor(a[n], n) for n in ("softmax_max", "softmax_sum")))
    steps = records.steps_from_cache(cache, config)
    del cache
    ring_started = time.perf_counter()
    result = varlen_ring_backward(dy, q, k, v, out, lse, steps, config, group=mesh.get_group(),
                                  kernel=get_kernel(kernel_name))
    ring_seconds = time.perf_counter() - ring_started
    outputs = (
        wrap(result.dq, mesh, placements),
        wrap(result.dk, mesh, placements),
        wrap(result.dv, mesh, placements),
        torch.empty(0, dtype=q.dtype, device=q.device),
        torch.zeros((), dtype=torch.float32, device=q.device),
    )
    handlers.call_log.record("backward", result, started, ring_seconds)
    return outputs
