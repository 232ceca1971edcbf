"""One DTensor call of the attention op (or its grad), prepared once: its ``CallPlan``, where
its tensors lie, and how its results are wrapped back into DTensors.

``prepare`` is the one path from the op's bound arguments to a plan, for the forward and
the backward alike (the grad op repeats the forward's arguments; its plan is checked
against the one the forward recorded). Every check that can refuse the call runs here,
before the first exchange (``refusal_shared`` shares a refusal with the other ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import layout as L
from ..arguments import bind_arguments
from ..config import CPConfig, document_placement, load_balance_enabled
from ..documents import sequence_positions
from ..engine import agreement
from ..engine.merge import fused_merge_available
from ..kernels import get_kernel
from ..npu_ops import stats_views_from_lse
from ..plan import CallPlan, MaskSpec
from . import ops
from .checks import local_mask_rows, local_sink, mask_spec
from .cp_mesh import CPSharding, cp_sharding, resolve_algorithm, whole_mask
from .packed import check_packed_tokens, packed_documents, packed_mask, packed_sharding

__all__ = ["Call", "prepare", "refusal_shared"]

_QKV = ("query", "key", "value")


@dataclass
class Call:
    """A prepared call: its bound arguments, its plan, the CP sharding of q/k/v, the given
    mask's rows for this rank (ring) or whole (Ulysses), the CP groups by name, the packed
    documents' lengths tensors (q, kv) the custom op reads (``handlers/packed.py``; (None, None)
    when the plan holds the documents or there are none), and the attention sinks as this
    rank's tensor (None without)."""

    args: dict[str, Any]
    plan: CallPlan
    sharding: CPSharding
    mask: Optional[Tensor]
    lengths: tuple[Optional[Tensor], Optional[Tensor]] = (None, None)
    sink: Optional[Tensor] = None

    @property
    def groups(self) -> str:
        """The CP dimensions' process groups, outer first, as the custom ops take them."""
        return ops.group_names(self.sharding.group(i) for i in range(len(self.sharding.cp_dims)))

    def local(self, *names: str) -> tuple[Tensor, ...]:
        return tuple(self.args[n].to_local() for n in names)

    def wrap_forward(self, out: Tensor, lse: Tensor) -> tuple[DTensor, DTensor, DTensor]:
        """(out, softmax_max, softmax_sum) as DTensors: out sharded like the query, the statistics
        (stride-0 views of the LSE: the memory floor) on their own sequence dim."""
        seq_dim, stats_seq_dim = L.seq_dim(self.plan.layout), L.stats_dims(self.plan.layout)[0]
        total = self.args["query"].size(seq_dim)
        stats_placements = self.sharding.stats_placements(self.plan.layout)
        return (_wrap(out, self.sharding.mesh, self.sharding.placements, seq_dim, total),
                *(_wrap(stats, self.sharding.mesh, stats_placements, stats_seq_dim, total)
                  for stats in stats_views_from_lse(lse)))

    def wrap_grads(self, *grads: Tensor) -> tuple[DTensor, ...]:
        """(dq, dk, dv) as DTensors sharded like (query, key, value), with their global lengths."""
        seq_dim = L.seq_dim(self.plan.layout)
        return tuple(_wrap(g, self.sharding.mesh, self.sharding.placements, seq_dim, self.args[n].size(seq_dim))
                     for g, n in zip(grads, _QKV))


def _wrap(local: Tensor, mesh, placements, seq_dim: int, total: int) -> DTensor:
    """``local`` as a DTensor sharded on ``seq_dim`` with global length ``total`` (that of the
    input it follows: shards may be uneven)."""
    shape, stride = torch.distributed.tensor._utils.compute_global_tensor_info(local, mesh, placements)
    if shape[seq_dim] != total:
        local_len = local.size(seq_dim)  # uneven shards: the global shape is not local * W
        shape[seq_dim] = total
        stride = [local.stride(i) // local_len * total
                  if i != seq_dim and local.stride(i) >= local.stride(seq_dim) else stride[i]
                  for i in range(local.dim())]
    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    )
    return DTensor(local, spec, requires_grad=False)


# ---------------------------------------------------------------- building the plan


def prepare(a: dict[str, Any], cp: CPConfig, *, backward: bool = False) -> Call:
    """The call of the bound arguments ``a`` under the configuration ``cp``. ``backward``: the
    grad op's (its scale is ``scale_value``; the algorithm need not fit the mesh, a mismatch
    with the forward's is reported by the op)."""
    scale = float(a["scale_value" if backward else "scale"])
    if a["input_layout"] == L.TND:
        return _prepare_packed(a, cp, scale)
    layout = L.check_layout(a["input_layout"])
    spec = mask_spec(a)
    sharding = cp_sharding({n: a[n] for n in _QKV}, layout)
    global_seq = a["query"].size(L.seq_dim(layout))
    spec = spec.simplified(global_seq)
    algorithm = _algorithm(a, layout, spec, sharding, cp.algorithm, strict=not backward)
    # positions matter for every mask but none: the local shards are head-tail when torch's
    # CP load balancing is on
    load_balance = spec.positional and load_balance_enabled()
    if load_balance and global_seq % (2 * sharding.size):
        # on the global length, the same on every rank, so every rank refuses together
        raise ValueError(
            f"load balancing splits the sequence into 2*W = {2 * sharding.size} chunks; the "
            f"query sequence length {global_seq} is not divisible by {2 * sharding.size}"
        )
    sink = local_sink(a["sink"], int(a["head_num"]), sharding.mesh, sharding.head_shards)
    plan = CallPlan(world_size=sharding.size, rank=sharding.rank, layout=layout,
                    head_num=sharding.local_heads(int(a["head_num"])), scale=scale, keep_prob=float(a["keep_prob"]),
                    mask=spec, load_balance=load_balance, algorithm=algorithm, cp_sizes=tuple(sharding.cp_sizes),
                    sink=sink is not None, **_execution(cp))
    return Call(a, plan, sharding, _mask_rows(a, plan), sink=sink)


def _prepare_packed(a: dict[str, Any], cp: CPConfig, scale: float) -> Call:
    spec = packed_mask(a)
    documents, lengths = packed_documents(a)
    sharding = packed_sharding({n: a[n] for n in _QKV})
    sink = local_sink(a["sink"], int(a["head_num"]), sharding.mesh, sharding.head_shards)
    load_balance = load_balance_enabled()
    plan = CallPlan(world_size=sharding.size, rank=sharding.rank, layout=L.TND, head_num=int(a["head_num"]),
                    scale=scale, keep_prob=float(a["keep_prob"]), mask=spec, load_balance=load_balance,
                    algorithm="ring", cp_sizes=tuple(sharding.cp_sizes), documents=documents,
                    placement=document_placement(cp.documents, load_balance), sink=sink is not None,
                    **_execution(cp))
    # on global lengths, the same on every rank: every rank refuses together
    check_packed_tokens(plan, a["query"].size(0))
    return Call(a, plan, sharding, None, lengths, sink)


def _execution(cp: CPConfig) -> dict:
    """The step kernel, the merge and the ring's exchange this process runs with."""
    return dict(kernel=get_kernel(cp.kernel).name, fused_merge=cp.fused_merge and fused_merge_available(),
                exchange=cp.exchange)


def _algorithm(a: dict[str, Any], layout: str, spec: MaskSpec, sharding: CPSharding, configured: str,
               strict: bool) -> str:
    """The algorithm this call runs (``configured``, "auto" resolved by the local head counts)."""
    q, k, v = (a[n].to_local() for n in _QKV)
    nq = sharding.local_heads(int(a["head_num"]))
    qd = L.dims(q, layout, nq)
    nkv = L.heads_of(k, layout, qd.head_dim)
    # from the global length, so that every rank picks the same even if local lengths differ
    local_seq = a["query"].size(L.seq_dim(layout)) // sharding.size
    return resolve_algorithm(configured, sharding, nq=nq, nkv=nkv, given_mask=spec.given, strict=strict,
                             batch=qd.batch, local_seq=local_seq, head_dim=qd.head_dim, itemsize=q.element_size(),
                             v_head_dim=L.value_head_dim(v, layout, nkv))


def _mask_rows(a: dict[str, Any], plan: CallPlan) -> Optional[Tensor]:
    """The given mask's rows of this rank's queries (the ring), or the whole mask (Ulysses,
    hybrid); None for the other mask kinds."""
    if not plan.mask.given:
        return None
    if plan.algorithm != "ring":
        return whole_mask(a["atten_mask"], a["query"], plan.layout)
    local_len = a["query"].to_local().size(L.seq_dim(plan.layout))
    rows = sequence_positions(plan.rank, plan.world_size, local_len, plan.load_balance)
    return local_mask_rows(a["atten_mask"], a["query"], plan.layout, rows)


# ---------------------------------------------------------------- refusals


def _first_agreement(op_call, args, kwargs):
    """(group, size) of the mesh dimension where the call's first agreement happens, or None
    when the arguments do not say or are traced (fake tensors: no collective while tracing)."""
    try:
        a = bind_arguments(op_call._schema, args, kwargs)
        tensors = {n: a[n] for n in _QKV}
        sharding = (packed_sharding(tensors) if a["input_layout"] == L.TND
                    else cp_sharding(tensors, L.check_layout(a["input_layout"])))
    except Exception:  # noqa: BLE001 - the refusal itself is what gets raised
        return None
    if any(_traced(t.to_local()) for t in tensors.values()):
        return None
    return agreement.first_agreement([sharding.group(i) for i in range(len(sharding.cp_dims))])


def _traced(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def refusal_shared(direction: str, op_call, args, kwargs):
    """A context in which a refusal of this rank is shared with the other ranks of the call."""
    return agreement.refusal_shared(direction, lambda: _first_agreement(op_call, args, kwargs))
