"""The DTensor handlers of ``npu_fusion_attention_v3`` and its grad, bound to one CPConfig.

With q/k/v DTensors sharded on the sequence dimension of one mesh dimension (two for
hybrid; other dimensions Replicate or sharded on heads: ``cp_mesh``), the forward runs
ring, Ulysses or hybrid attention and returns DTensors; the call's step cache goes out in the
``seed`` slot (a handle whose storage owns it, or, under the stack policy, the
cache's pairing key) and autograd hands it back to the grad op's ``seed``.
The handlers check and wrap; the local work (ring, Ulysses, step cache) runs in the custom
ops of ``ring_ops``, so that a traced (compiled) graph records it.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import agreement
from .. import layout as L
from ..config import CPConfig, load_balance_enabled
from ..kernels import get_kernel
from ..merge import fused_merge_available
from ..npu_ops import lse_from_stats, stats_views_from_lse
from ..ring import RingConfig
from ..ring_plan import MaskSpec, positions
from ..ulysses import ulysses_degree
from . import ring_ops
from .arguments import bind_arguments
from .calls import CallLog
from .checks import local_mask_rows, local_tensor, mask_spec, sharded_like
from .cp_mesh import CPSharding, cp_sharding, resolve_algorithm, whole_mask
from .varlen import is_varlen, varlen_backward, varlen_forward

__all__ = ["AttentionHandlers"]

_STATS_SEQ_DIM = 2  # softmax_max / softmax_sum are [B, N, S, 8]


def _wrap(local: Tensor, mesh, placements, seq_dim: Optional[int] = None, total: Optional[int] = None) -> DTensor:
    """``local`` as a DTensor; sharded on ``seq_dim`` with global length ``total`` when given
    (that of the input it follows: shards may be uneven), else even shards."""
    shape, stride = torch.distributed.tensor._utils.compute_global_tensor_info(local, mesh, placements)
    if seq_dim is not None and shape[seq_dim] != total:
        local_len = local.size(seq_dim)  # uneven shards: the global shape is not local * W
        shape[seq_dim] = total
        stride = [local.stride(i) // local_len * total
                  if i != seq_dim and local.stride(i) >= local.stride(seq_dim) else stride[i]
                  for i in range(local.dim())]
    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    )
    return DTensor(local, spec, requires_grad=False)


def _first_agreement(op_call, args, kwargs):
    """(group, size) of the mesh dimension where the call's first agreement happens (the
    ring's, or Ulysses' inner one), or None when the arguments do not say or are traced
    (fake tensors: no collective while tracing)."""
    try:
        a = bind_arguments(op_call._schema, args, kwargs)
        tensors = {n: a[n] for n in ("query", "key", "value")}
        sharding = cp_sharding(tensors, L.check_layout(a["input_layout"]))
    except Exception:  # noqa: BLE001 - the refusal itself is what gets raised
        return None
    if any(_traced(t.to_local()) for t in tensors.values()):
        return None
    dim = sharding.cp_dims[-1]
    return sharding.mesh.get_group(dim), sharding.mesh.size(dim)


def _traced(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def _refusal_shared(direction: str, op_call, args, kwargs):
    return agreement.refusal_shared(direction, lambda: _first_agreement(op_call, args, kwargs))


def _slot_tensor(value: int, like: Tensor) -> Tensor:
    """An int64 [1] output slot, on the CPU (on meta when ``like`` is: tracing with meta tensors)."""
    return torch.tensor([value], dtype=torch.int64, device="meta" if like.is_meta else "cpu")


def _algorithm(a: dict[str, Any], layout: str, spec: MaskSpec, sharding: CPSharding, cp: CPConfig) -> str:
    """The algorithm this call runs (``cp.algorithm``, "auto" resolved by the local head counts)."""
    q, k = a["query"].to_local(), a["key"].to_local()
    nq = sharding.local_heads(int(a["head_num"]))
    qd = L.dims(q, layout, nq)
    nkv = L.heads_of(k, layout, qd.head_dim)
    # from the global length, so that every rank picks the same even if local lengths differ
    local_seq = a["query"].size(L.seq_dim(layout)) // sharding.size
    return resolve_algorithm(cp.algorithm, sharding, nq=nq, nkv=nkv, given_mask=spec.given, batch=qd.batch,
                             local_seq=local_seq, head_dim=qd.head_dim, itemsize=q.element_size())


def _ring_config(a: dict[str, Any], layout: str, spec: MaskSpec, sharding: CPSharding, cp: CPConfig,
                 algorithm: str) -> RingConfig:
    world_size = sharding.size
    # positions matter for every mask but none: the local shards are head-tail when torch's
    # CP load balancing is on (DESIGN section 5)
    load_balance = (spec.causal or spec.window or spec.given) and load_balance_enabled()
    # on the global length, the same on every rank, so every rank refuses together (a local
    # length that differs between ranks is caught by the ring's agreement)
    if load_balance and a["query"].size(L.seq_dim(layout)) % (2 * world_size):
        raise ValueError(
            f"load balancing splits the sequence into 2*W = {2 * world_size} chunks; the "
            f"query sequence length {a['query'].size(L.seq_dim(layout))} is not divisible by {2 * world_size}"
        )
    return RingConfig(
        world_size=world_size, rank=sharding.rank, causal=spec.causal, load_balance=load_balance,
        layout=layout, head_num=sharding.local_heads(int(a["head_num"])), scale=float(a["scale"]),
        keep_prob=float(a["keep_prob"]), window=spec.window, pre_tockens=spec.pre_tockens,
        next_tockens=spec.next_tockens, given_mask=spec.given, policy=cp.policy, algorithm=algorithm,
        ulysses_size=ulysses_degree(algorithm, sharding.cp_sizes),
    )


def _cp_groups(sharding: CPSharding) -> str:
    """The CP dimensions' process groups, outer first, as the ops take them."""
    return ring_ops.group_names(sharding.group(i) for i in range(len(sharding.cp_dims)))


def _mask_rows(a: dict[str, Any], layout: str, config: RingConfig):
    """The given mask's rows of this rank's queries (None for the other mask kinds); for
    Ulysses, the whole mask."""
    if not config.given_mask:
        return None
    if config.algorithm != "ring":
        return whole_mask(a["atten_mask"], a["query"], layout)
    local_len = a["query"].to_local().size(L.seq_dim(layout))
    rows = positions(config.rank, config.world_size, local_len, config.load_balance)
    return local_mask_rows(a["atten_mask"], a["query"], layout, rows)


class AttentionHandlers:
    """The forward and backward handlers of one ``cp_cache.enable()``, and the table that
    maps the ops to them (the same bound methods every time, so a table can be checked)."""

    def __init__(self, config: CPConfig, call_log: CallLog):
        self.config = config
        self.call_log = call_log
        self.forward_handler = self.forward
        self.backward_handler = self.backward

    def table(self) -> dict:
        """{op overload: handler} for the ops that exist in this process (real or emulated)."""
        table = {}
        for name, handler in (("npu_fusion_attention_v3", self.forward_handler),
                              ("npu_fusion_attention_grad_v3", self.backward_handler)):
            try:
                table[getattr(torch.ops.npu, name).default] = handler
            except (AttributeError, RuntimeError):
                pass
        return table

    # ------------------------------------------------------------ forward

    def forward(self, op_call, args, kwargs):
        """Handler of ``npu_fusion_attention_v3`` for DTensor inputs."""
        started = time.perf_counter()
        with _refusal_shared("forward", op_call, args, kwargs):
            a = bind_arguments(op_call._schema, args, kwargs)
            varlen = is_varlen(a)
            if not varlen:
                layout = L.check_layout(a["input_layout"])
                spec = mask_spec(a)
                sharding = cp_sharding({n: a[n] for n in ("query", "key", "value")}, layout)
                mesh, placements = sharding.mesh, sharding.placements
                spec = spec.simplified(a["query"].size(L.seq_dim(layout)))
                algorithm = _algorithm(a, layout, spec, sharding, self.config)
                config = _ring_config(a, layout, spec, sharding, self.config, algorithm)
                mask_rows = _mask_rows(a, layout, config)
                kernel_name = get_kernel(self.config.kernel).name
        if varlen:  # packed documents: handlers/varlen.py (its checks are on arguments every rank shares)
            return varlen_forward(self, a, started, _wrap)
        q, k, v = (a[n].to_local() for n in ("query", "key", "value"))
        fused_merge = self.config.fused_merge and fused_merge_available()
        # the local work runs in a custom op: now when eager, in the compiled graph when traced
        out, lse, seed = ring_ops.ring_forward(q, k, v, mask_rows, _cp_groups(sharding),
                                               ring_ops.encode_forward_call(config, kernel_name, fused_merge))

        seq_dim, q_total = L.seq_dim(layout), a["query"].size(L.seq_dim(layout))
        softmax_max, softmax_sum = stats_views_from_lse(lse)  # the memory floor: LSE + 4 bytes
        stats_placements = sharding.stats_placements(layout)
        outputs = (
            _wrap(out, mesh, placements, seq_dim, q_total),
            _wrap(softmax_max, mesh, stats_placements, _STATS_SEQ_DIM, q_total),
            _wrap(softmax_sum, mesh, stats_placements, _STATS_SEQ_DIM, q_total),
            torch.empty(0, dtype=q.dtype, device=q.device),
            seed,
            _slot_tensor(config.world_size, q),
        )
        self.call_log.set_handler_seconds("forward", started)
        return outputs

    # ------------------------------------------------------------ backward

    def backward(self, op_call, args, kwargs):
        """Handler of ``npu_fusion_attention_grad_v3`` for DTensor inputs."""
        started = time.perf_counter()
        with _refusal_shared("backward", op_call, args, kwargs):
            a = bind_arguments(op_call._schema, args, kwargs)
            varlen = is_varlen(a)
            if not varlen:
                layout = L.check_layout(a["input_layout"])
                spec = mask_spec(a)  # same argument checks as the forward
                ring_ops.check_seed(a["seed"])
                tensors = {n: a[n] for n in ("query", "key", "value")}
                sharding = cp_sharding(tensors, layout)
                mesh, placements = sharding.mesh, sharding.placements
                spec = spec.simplified(a["query"].size(L.seq_dim(layout)))
                for name in ("dy", "attention_in"):
                    tensors[name] = sharded_like(a[name], name, mesh, placements)
                lse = lse_from_stats(*(local_tensor(a[n], n) for n in ("softmax_max", "softmax_sum")))
                called = dict(layout=layout, head_num=sharding.local_heads(int(a["head_num"])),
                              scale=float(a["scale_value"]), keep_prob=float(a["keep_prob"]),
                              mask=ring_ops.flat_fields(spec))
                mask_rows, load_balance = None, False
                if spec.given:  # the mask's rows (ring) or whole mask (Ulysses), as the forward took them
                    called["algorithm"] = _algorithm(a, layout, spec, sharding, self.config)
                    load_balance = load_balance_enabled()
                    mask_rows = _mask_rows(a, layout, RingConfig(
                        world_size=sharding.size, rank=sharding.rank, causal=False, load_balance=load_balance,
                        layout=layout, head_num=called["head_num"], scale=called["scale"],
                        keep_prob=called["keep_prob"], given_mask=True, algorithm=called["algorithm"]))
                call = ring_ops.encode_backward_call(called, self.config.policy,
                                                     sharding.cp_sizes, sharding.rank,
                                                     load_balance)
        if varlen:
            return varlen_backward(self, a, started, _wrap)
        q, k, v, dy, out = (tensors[n].to_local() for n in tensors)
        dq, dk, dv = ring_ops.ring_backward(dy, q, k, v, out, lse, a["seed"], mask_rows, _cp_groups(sharding), call)
        seq_dim = L.seq_dim(layout)
        q_total, kv_total = a["query"].size(seq_dim), a["key"].size(seq_dim)
        outputs = (
            _wrap(dq, mesh, placements, seq_dim, q_total),
            _wrap(dk, mesh, placements, seq_dim, kv_total),
            _wrap(dv, mesh, placements, seq_dim, kv_total),
            torch.empty(0, dtype=q.dtype, device=q.device),  # dpse: no pse
            torch.zeros((), dtype=torch.float32, device=q.device),  # dsink: no sink (0-d, as the op's meta)
        )
        self.call_log.set_handler_seconds("backward", started)
        return outputs
