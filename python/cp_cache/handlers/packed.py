"""What the CP handlers accept for packed documents: ``input_layout="TND"`` with
``actual_seq_qlen`` / ``actual_seq_kvlen``.

q/k/v are DTensors ``Shard(0)`` on a 1-D mesh; the lengths are the GLOBAL cumulative
document ends, the same on every rank (a plain tensor or list). The local shards hold the
positions of the call's placement (``config.document_placement``: the configured one,
"balanced" or "head_tail", under torch's ``_cp_options.enable_load_balance``, contiguous
without), for causal and full attention alike; local lengths may differ between ranks. A
backward whose lengths or placement differ from its forward's is refused.

Lengths given as tensors (the op's schema) are checked here from their shapes alone and
travel to the custom op (``handlers/ops.py``), whose kernel reads and checks their values
(``read_documents``) and puts the documents into the call's plan before the strategy runs:
so a traced call (fake tensors: values unknown) records the op without reading them, and a
compiled graph reads the lengths of each call, not those it was traced with. Lengths given
as lists go into the plan here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from ..arguments import describe
from ..documents import check_documents, check_lengths_tensor, check_local_length, cumulative_lengths
from ..npu_ops import CAUSAL_MODES, SparseMode, is_compressed_mask
from ..placement import BALANCED, CONTIGUOUS
from ..plan import CallPlan, MaskSpec
from .cp_mesh import CPSharding

__all__ = ["packed_mask", "packed_documents", "same_documents", "check_packed_tokens", "check_local_tokens",
           "read_documents", "packed_sharding"]

_UNSUPPORTED_WHEN_SET = ("pse", "padding_mask", "prefix")
_TND_PLACEMENTS = (Shard(0),)
_LENGTHS = ("actual_seq_qlen", "actual_seq_kvlen")


def packed_mask(a: dict[str, Any]) -> MaskSpec:
    """Causal per document or full; anything else unsupported raises naming it."""
    for name in _UNSUPPORTED_WHEN_SET:
        if a[name] is not None:
            raise NotImplementedError(f"cp_cache ring attention does not support {name}={describe(a[name])} yet")
    if a["softmax_layout"]:
        raise NotImplementedError(
            f"cp_cache ring attention does not support softmax_layout={a['softmax_layout']!r} yet")
    mode, mask = a["sparse_mode"], a["atten_mask"]
    if mask is None:
        return MaskSpec()  # the op computes full attention (per document) whatever sparse_mode says
    if mode in CAUSAL_MODES and is_compressed_mask(mask):
        return MaskSpec(causal=True)
    raise NotImplementedError(
        f"cp_cache ring attention with input_layout='TND' supports full attention (no atten_mask) and causal "
        f"attention per document (sparse_mode {int(SparseMode.LEFT_UP_CAUSAL)} or "
        f"{int(SparseMode.RIGHT_DOWN_CAUSAL)} with the compressed 2048x2048 mask), not sparse_mode={mode} with "
        f"atten_mask={describe(mask)}")


def packed_documents(a: dict[str, Any]) -> tuple[tuple[int, ...], tuple[Optional[Tensor], Optional[Tensor]]]:
    """(documents, lengths): the global cumulative document ends given as lists, read and checked
    now (constants of a traced graph), or the tensors given, checked from their shapes alone, for
    the custom op to read (``read_documents``): host data whose values a traced call does not know."""
    for name in _LENGTHS:
        if a[name] is None:
            raise ValueError(f"input_layout='TND' needs {name}: the global cumulative document ends (last = T)")
        if isinstance(a[name], DTensor):
            raise ValueError(f"{name} must be a plain tensor or list of the global cumulative ends, the same on "
                             f"every rank, not a DTensor ({describe(a[name])})")
    if not any(isinstance(a[name], Tensor) for name in _LENGTHS):
        return same_documents(a["actual_seq_qlen"], a["actual_seq_kvlen"]), (None, None)
    return (), tuple(_lengths_tensor(a[name], name) for name in _LENGTHS)


def _lengths_tensor(value: Any, name: str) -> Tensor:
    """``value`` as the op's lengths tensor: a tensor checked from its shape; a list (one of q/kv
    given as a list, the other as a tensor) checked and made an int64 tensor."""
    if isinstance(value, Tensor):
        check_lengths_tensor(value, name)
        return value
    return torch.tensor(cumulative_lengths(value, name), dtype=torch.int64)


def same_documents(qlen: Any, kvlen: Any) -> tuple[int, ...]:
    """The documents of ``actual_seq_qlen`` (reads its values), the same as ``actual_seq_kvlen``'s."""
    cu_q = cumulative_lengths(qlen, "actual_seq_qlen")
    cu_kv = cumulative_lengths(kvlen, "actual_seq_kvlen")
    if cu_q != cu_kv:
        raise ValueError(f"actual_seq_qlen={list(cu_q)} and actual_seq_kvlen={list(cu_kv)} differ; packed "
                         "self-attention under CP needs the same documents for queries and keys")
    return cu_q


def check_packed_tokens(plan: CallPlan, total: int) -> None:
    """The global T against the plan's documents and placement when known (ValueError naming
    them), else from the shapes alone: contiguous slices need T divisible by W."""
    if plan.documents:
        check_documents(plan.documents, total, plan.world_size, plan.document_placement, name="actual_seq_qlen")
    elif plan.document_placement == CONTIGUOUS and total % plan.world_size:
        raise ValueError(f"input_layout='TND' without load balancing cuts the global sequence into W="
                         f"{plan.world_size} equal slices: its T={total} tokens do not divide by W")


def check_local_tokens(plan: CallPlan, local_rows: int) -> None:
    """This rank's local length against what the plan's placement gives it (ValueError naming both)."""
    if plan.document_placement != BALANCED:  # even shards: T = W * local rows
        check_packed_tokens(plan, local_rows * plan.world_size)
    placement = plan.document_placement
    check_documents(plan.documents, plan.documents[-1], plan.world_size, placement, name="actual_seq_qlen")
    check_local_length(plan.documents, plan.world_size, placement, plan.rank, local_rows)


def read_documents(plan: CallPlan, qlen: Optional[Tensor], kvlen: Optional[Tensor], local_rows: int) -> CallPlan:
    """``plan`` with the documents of the lengths tensors ``packed_documents`` left to the custom op,
    read on the host and checked as documents given as lists are (``plan`` itself when none were
    left). Run by the op's kernel, never while tracing: the lengths are host data (a CPU tensor:
    no device sync), and a graph records the op, not the values."""
    if qlen is None and kvlen is None:
        return plan
    plan = replace(plan, documents=same_documents(qlen, kvlen))
    check_local_tokens(plan, local_rows)
    return plan


def packed_sharding(tensors: dict[str, Any]) -> CPSharding:
    """Every tensor a DTensor Shard(0) on the same 1-D mesh: its one CP dimension."""
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
    return CPSharding(mesh, _TND_PLACEMENTS, cp_dims=(0,), head_shards=1)
