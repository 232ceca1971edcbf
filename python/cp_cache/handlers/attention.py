"""The DTensor handlers of ``npu_fusion_attention_v3`` and its grad, bound to one CPConfig.

With q/k/v DTensors sharded on the sequence dimension of a 1-D mesh, the forward
runs ring attention and returns DTensors; the call's step cache goes out in the
``seed`` slot (a handle whose storage owns it, or, under the stack policy, the
cache's pairing key) and autograd hands it back to the grad op's ``seed``.
The handlers check and wrap; the local work (ring, step cache) runs in the custom
ops of ``ring_ops``, so that a traced (compiled) graph records it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import layout as L
from ..config import CPConfig, load_balance_enabled
from ..kernels import get_kernel
from ..merge import fused_merge_available
from ..npu_ops import lse_from_stats, stats_views_from_lse
from ..ring import RingConfig
from ..ring_plan import MaskSpec, positions
from . import ring_ops
from .arguments import bind_arguments
from .calls import CallLog
from .checks import check_sharding, local_mask_rows, local_tensor, mask_spec, sharded_like

__all__ = ["AttentionHandlers"]

_STATS_SEQ_DIM = 2  # softmax_max / softmax_sum are [B, N, S, 8]


def _wrap(local: Tensor, mesh, placements) -> DTensor:
    shape, stride = torch.distributed.tensor._utils.compute_global_tensor_info(local, mesh, placements)
    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    )
    return DTensor(local, spec, requires_grad=False)


def _slot_tensor(value: int, like: Tensor) -> Tensor:
    """An int64 [1] output slot, on the CPU (on meta when ``like`` is: tracing with meta tensors)."""
    return torch.tensor([value], dtype=torch.int64, device="meta" if like.is_meta else "cpu")


def _ring_config(a: dict[str, Any], layout: str, spec: MaskSpec, mesh, cp: CPConfig) -> RingConfig:
    world_size = mesh.size()
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
        world_size=world_size, rank=mesh.get_local_rank(), causal=spec.causal, load_balance=load_balance,
        layout=layout, head_num=int(a["head_num"]), scale=float(a["scale"]), keep_prob=float(a["keep_prob"]),
        window=spec.window, pre_tockens=spec.pre_tockens, next_tockens=spec.next_tockens, given_mask=spec.given,
        policy=cp.policy, algorithm=cp.algorithm,
    )


def _mask_rows(a: dict[str, Any], layout: str, config: RingConfig):
    """The given mask's rows of this rank's queries (None for the other mask kinds)."""
    if not config.given_mask:
        return None
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
        a = bind_arguments(op_call._schema, args, kwargs)
        layout = L.check_layout(a["input_layout"])
        spec = mask_spec(a)
        mesh, placements = check_sharding({n: a[n] for n in ("query", "key", "value")}, layout)
        spec = spec.simplified(a["query"].size(L.seq_dim(layout)))
        config = _ring_config(a, layout, spec, mesh, self.config)
        mask_rows = _mask_rows(a, layout, config)
        q, k, v = (a[n].to_local() for n in ("query", "key", "value"))
        kernel_name = get_kernel(self.config.kernel).name
        fused_merge = self.config.fused_merge and fused_merge_available()
        # the ring runs in a custom op: now when eager, in the compiled graph when traced
        out, lse, seed = ring_ops.ring_forward(q, k, v, mask_rows, mesh.get_group().group_name,
                                               ring_ops.encode_forward_call(config, kernel_name, fused_merge))

        softmax_max, softmax_sum = stats_views_from_lse(lse)  # the memory floor: LSE + 4 bytes
        stats_placements = (Shard(_STATS_SEQ_DIM),)
        outputs = (
            _wrap(out, mesh, placements),
            _wrap(softmax_max, mesh, stats_placements),
            _wrap(softmax_sum, mesh, stats_placements),
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
        a = bind_arguments(op_call._schema, args, kwargs)
        layout = L.check_layout(a["input_layout"])
        spec = mask_spec(a)  # same argument checks as the forward
        ring_ops.check_seed(a["seed"])
        tensors = {n: a[n] for n in ("query", "key", "value")}
        mesh, placements = check_sharding(tensors, layout)
        spec = spec.simplified(a["query"].size(L.seq_dim(layout)))
        for name in ("dy", "attention_in"):
            tensors[name] = sharded_like(a[name], name, mesh, placements)
        q, k, v, dy, out = (tensors[n].to_local() for n in tensors)
        lse = lse_from_stats(*(local_tensor(a[n], n) for n in ("softmax_max", "softmax_sum")))
        # the given mask's rows for the layout of now; the op checks that the forward's was the same
        load_balance = spec.given and load_balance_enabled()
        rows_config = RingConfig(world_size=mesh.size(), rank=mesh.get_local_rank(), causal=False,
                                 load_balance=load_balance, layout=layout, head_num=int(a["head_num"]),
                                 scale=float(a["scale_value"]), keep_prob=float(a["keep_prob"]), given_mask=spec.given)
        called = dict(layout=layout, head_num=int(a["head_num"]), scale=float(a["scale_value"]),
                      keep_prob=float(a["keep_prob"]), mask=ring_ops.flat_fields(spec))
        dq, dk, dv = ring_ops.ring_backward(
            dy, q, k, v, out, lse, a["seed"], _mask_rows(a, layout, rows_config), mesh.get_group().group_name,
            ring_ops.encode_backward_call(called, self.config.policy, load_balance),
        )
        outputs = (
            _wrap(dq, mesh, placements),
            _wrap(dk, mesh, placements),
            _wrap(dv, mesh, placements),
            torch.empty(0, dtype=q.dtype, device=q.device),  # dpse: no pse
            torch.zeros((), dtype=torch.float32, device=q.device),  # dsink: no sink (0-d, as the op's meta)
        )
        self.call_log.set_handler_seconds("backward", started)
        return outputs
