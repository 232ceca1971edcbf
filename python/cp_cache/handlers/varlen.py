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

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from ..config import load_balance_enabled
from ..documents import check_documents, cumulative_lengths
from ..kernels import get_kernel
from ..merge import fused_merge_available
from ..npu_ops import CAUSAL_MODES, SparseMode, is_compressed_mask, lse_from_stats, stats_views_from_lse
from ..ring import RingConfig
from ..varlen import TND, encode_documents
from . import ring_ops
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
                      keep_prob=float(a["keep_prob"]), policy=cp.policy, algorithm="ring",  # whatever is enabled
                      documents=encode_documents(cu))


def varlen_forward(handlers, a: dict[str, Any], started: float, wrap) -> tuple:
    """The forward handler's TND path (``handlers``: the AttentionHandlers; ``wrap``: its DTensor wrapper)."""
    causal = _causal(a)
    cu = _documents(a)
    mesh, placements = _check_sharding({n: a[n] for n in ("query", "key", "value")})
    config = _config(a, causal, cu, mesh, handlers.config)
    q, k, v = (a[n].to_local() for n in ("query", "key", "value"))
    kernel_name = get_kernel(handlers.config.kernel).name
    fused_merge = handlers.config.fused_merge and fused_merge_available()
    # the ring runs in the custom op (handlers/ring_ops.py): now when eager, in the graph when traced
    out, lse, seed = ring_ops.ring_forward(q, k, v, None, ring_ops.group_names([mesh.get_group()]),
                                           ring_ops.encode_forward_call(config, kernel_name, fused_merge))
    softmax_max, softmax_sum = stats_views_from_lse(lse)  # [T/W, N, 8] views of the LSE
    outputs = (
        wrap(out, mesh, placements),
        wrap(softmax_max, mesh, _TND_PLACEMENTS),
        wrap(softmax_sum, mesh, _TND_PLACEMENTS),
        torch.empty(0, dtype=q.dtype, device=q.device),
        seed,
        torch.tensor([config.world_size], dtype=torch.int64, device="meta" if q.is_meta else "cpu"),
    )
    handlers.call_log.set_handler_seconds("forward", started)
    return outputs


def varlen_backward(handlers, a: dict[str, Any], started: float, wrap) -> tuple:
    """The grad handler's TND path."""
    causal = _causal(a)
    cu = _documents(a)
    ring_ops.check_seed(a["seed"])
    tensors = {n: a[n] for n in ("query", "key", "value")}
    mesh, placements = _check_sharding(tensors)
    for name in ("dy", "attention_in"):
        tensors[name] = sharded_like(a[name], name, mesh, placements)
    q, k, v, dy, out = (tensors[n].to_local() for n in tensors)
    lse = lse_from_stats(*(local_tensor(a[n], n) for n in ("softmax_max", "softmax_sum")))
    called = dict(layout=TND, head_num=int(a["head_num"]), scale=float(a["scale_value"]),
                  keep_prob=float(a["keep_prob"]), causal=causal, documents=encode_documents(cu))
    call = ring_ops.encode_backward_call(called, handlers.config.policy, [mesh.size()], mesh.get_local_rank(), False)
    dq, dk, dv = ring_ops.ring_backward(dy, q, k, v, out, lse, a["seed"], None,
                                        ring_ops.group_names([mesh.get_group()]), call)
    outputs = (
        wrap(dq, mesh, placements),
        wrap(dk, mesh, placements),
        wrap(dv, mesh, placements),
        torch.empty(0, dtype=q.dtype, device=q.device),
        torch.zeros((), dtype=torch.float32, device=q.device),
    )
    handlers.call_log.set_handler_seconds("backward", started)
    return outputs
