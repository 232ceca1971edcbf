"""The DTensor handlers of ``npu_fusion_attention_v3`` and its grad, bound to one CPConfig.

With q/k/v DTensors sharded on the sequence dimension of one mesh dimension (two for
hybrid; other dimensions Replicate or sharded on heads: ``cp_mesh``), the forward runs
ring, Ulysses or hybrid attention and returns DTensors; the call's step cache goes out in the
``seed`` slot (a handle whose storage owns it, or, under the stack policy, the
cache's pairing key) and autograd hands it back to the grad op's ``seed``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import _C, agreement
from .. import layout as L
from ..config import HANDLE_POLICY, STACK_POLICY, CPConfig, load_balance_enabled
from ..kernels import get_kernel
from ..merge import fused_merge_available
from ..npu_ops import lse_from_stats, stats_views_from_lse
from ..ring import RingConfig, ring_attention_backward, ring_attention_forward
from ..ring_plan import MaskSpec, positions
from ..ulysses import ulysses_attention_backward, ulysses_attention_forward
from . import step_records as records
from .arguments import bind_arguments, describe
from .calls import CallLog
from .checks import local_mask_rows, local_tensor, mask_spec, sharded_like
from .cp_mesh import CPSharding, cp_sharding, resolve_algorithm, whole_mask
from .varlen import is_varlen, varlen_backward, varlen_forward

__all__ = ["AttentionHandlers"]

_STATS_SEQ_DIM = 2  # softmax_max / softmax_sum are [B, N, S, 8]
_CHECK_ERRORS = (ValueError, NotImplementedError, TypeError, RuntimeError)


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


def _first_agreement_group(op_call, args, kwargs):
    """(group, size) of the mesh dimension where the call's first agreement happens (the
    ring's, or Ulysses' inner one), or None when the arguments do not say."""
    try:
        a = bind_arguments(op_call._schema, args, kwargs)
        sharding = cp_sharding({n: a[n] for n in ("query", "key", "value")}, L.check_layout(a["input_layout"]))
    except Exception:  # noqa: BLE001 - the refusal itself is what gets raised
        return None
    dim = sharding.cp_dims[-1]
    return sharding.mesh.get_group(dim), sharding.mesh.size(dim)


@contextlib.contextmanager
def _refused_together(direction: str, op_call, args, kwargs):
    """Argument checks before the ring: a refusal on this rank joins the ranks' agreement (as
    a refusal signature) before it is raised, so the other ranks, already waiting in theirs,
    raise too instead of waiting for a ring this rank will not enter."""
    try:
        yield
    except _CHECK_ERRORS as error:
        found = _first_agreement_group(op_call, args, kwargs)
        if found is None or found[1] == 1:
            raise
        agreement.agree(agreement.refusal_signature(direction, error), *found, error)
        raise  # every rank refused the same way: each raises its own error


def _slot_tensor(value: int) -> Tensor:
    return torch.tensor([value], dtype=torch.int64)


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
        ulysses_size=_ulysses_size(algorithm, sharding),
    )


def _ulysses_size(algorithm: str, sharding: CPSharding) -> int:
    if algorithm == "ulysses":
        return sharding.size
    if algorithm == "hybrid":  # the inner CP dimension (0: none, which a backward reports as a mismatch)
        return sharding.mesh.size(sharding.cp_dims[1]) if len(sharding.cp_dims) == 2 else 0
    return 1


def _run_forward(q, k, v, config: RingConfig, sharding: CPSharding, kernel, mask_rows, fused_merge: bool):
    if config.algorithm in ("ulysses", "hybrid"):
        inner = sharding.group(len(sharding.cp_dims) - 1)
        ring_group = sharding.group(0) if config.algorithm == "hybrid" else None
        return ulysses_attention_forward(q, k, v, config, group=inner, ring_group=ring_group, kernel=kernel,
                                         fused_merge=fused_merge, mask=mask_rows)
    return ring_attention_forward(q, k, v, config, group=sharding.group(0), kernel=kernel, mask_rows=mask_rows,
                                  fused_merge=fused_merge)


def _run_backward(dy, q, k, v, out, lse, steps, config: RingConfig, sharding: CPSharding, kernel, mask_rows):
    if config.algorithm in ("ulysses", "hybrid"):
        inner = sharding.group(len(sharding.cp_dims) - 1)
        ring_group = sharding.group(0) if config.algorithm == "hybrid" else None
        return ulysses_attention_backward(dy, q, k, v, out, lse, steps, config, group=inner, ring_group=ring_group,
                                          kernel=kernel, mask=mask_rows)
    return ring_attention_backward(dy, q, k, v, out, lse, steps, config, group=sharding.group(0), kernel=kernel,
                                   mask_rows=mask_rows)


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


def _check_backward_matches(a: dict[str, Any], layout: str, spec: MaskSpec, config: RingConfig, cache_id: int) -> None:
    called = dict(layout=layout, head_num=int(a["head_num"]), scale=float(a["scale_value"]),
                  keep_prob=float(a["keep_prob"]), mask=spec)
    recorded = dict(layout=config.layout, head_num=config.head_num, scale=config.scale,
                    keep_prob=config.keep_prob, mask=config.mask)
    if called != recorded:
        raise RuntimeError(
            f"cp_cache: backward called with {called} but its forward (cache {cache_id}) ran with {recorded}"
        )


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
        with _refused_together("forward", op_call, args, kwargs):
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
                kernel = get_kernel(self.config.kernel)
        if varlen:  # packed documents: handlers/varlen.py (its checks are on arguments every rank shares)
            return varlen_forward(self, a, started, _wrap)
        q, k, v = (a[n].to_local() for n in ("query", "key", "value"))
        fused_merge = self.config.fused_merge and fused_merge_available()
        ring_started = time.perf_counter()
        result = _run_forward(q, k, v, config, sharding, kernel, mask_rows, fused_merge)
        ring_seconds = time.perf_counter() - ring_started

        seq_dim, q_total = L.seq_dim(layout), a["query"].size(L.seq_dim(layout))
        softmax_max, softmax_sum = stats_views_from_lse(result.lse)  # the memory floor: LSE + 4 bytes
        stats_placements = sharding.stats_placements(layout)
        outputs = (
            _wrap(result.out, mesh, placements, seq_dim, q_total),
            _wrap(softmax_max, mesh, stats_placements, _STATS_SEQ_DIM, q_total),
            _wrap(softmax_sum, mesh, stats_placements, _STATS_SEQ_DIM, q_total),
            torch.empty(0, dtype=q.dtype, device=q.device),
            self._seed_slot(config, kernel.name, result.steps),
            _slot_tensor(config.world_size),
        )
        self.call_log.record("forward", result, started, ring_seconds, fused_merge=fused_merge)
        return outputs

    def _seed_slot(self, config: RingConfig, kernel_name: str, steps) -> Tensor:
        """The seed output: the cache's handle, or (stack policy) its pairing key after the push."""
        cache = records.cache_from_forward(config, kernel_name, steps)
        if self.config.policy == HANDLE_POLICY:
            return _C.default_store().attach(cache)
        cache.pairing_key = records.pairing_key(config, kernel_name, steps)
        _C.default_store().push(cache)  # skipped (and the cache dropped) in a recompute
        return _slot_tensor(cache.pairing_key)

    # ------------------------------------------------------------ backward

    def _claim_cache(self, seed: Any):
        """The forward's cache from the seed slot: resolve a handle, or pop the stack."""
        if isinstance(seed, DTensor):
            raise RuntimeError(
                "cp_cache: the seed argument of npu_fusion_attention_grad_v3 is a DTensor; it must be "
                "the seed output of the CP attention forward (a plain int64 tensor)"
            )
        if not isinstance(seed, Tensor):
            raise RuntimeError(
                f"cp_cache: npu_fusion_attention_grad_v3 got seed={describe(seed)}; it needs the seed "
                "output of the CP attention forward"
            )
        store = _C.default_store()
        if store.is_handle(seed):
            cache = store.resolve(seed)
            if _C.in_graph_task() and not _C.current_graph_task_keeps_graph():
                store.release(seed)  # this graph's backward runs once: free the cache now
            return cache
        if self.config.policy == STACK_POLICY:
            return store.pop(int(seed.reshape(-1)[0]))
        return store.resolve(seed)  # raises, naming what was passed and the likely cause

    def backward(self, op_call, args, kwargs):
        """Handler of ``npu_fusion_attention_grad_v3`` for DTensor inputs."""
        started = time.perf_counter()
        with _refused_together("backward", op_call, args, kwargs):
            a = bind_arguments(op_call._schema, args, kwargs)
            varlen = is_varlen(a)
            if not varlen:
                layout = L.check_layout(a["input_layout"])
                spec = mask_spec(a)  # same argument checks as the forward
                cache = self._claim_cache(a["seed"])
                config, kernel_name = records.config_from_cache(cache)
                tensors = {n: a[n] for n in ("query", "key", "value")}
                sharding = cp_sharding(tensors, layout)
                mesh, placements = sharding.mesh, sharding.placements
                spec = spec.simplified(a["query"].size(L.seq_dim(layout)))
                _check_backward_matches(dict(a, head_num=sharding.local_heads(int(a["head_num"]))), layout, spec,
                                        config, cache.id)
                for name in ("dy", "attention_in"):
                    tensors[name] = sharded_like(a[name], name, mesh, placements)
                if (sharding.size != config.world_size or sharding.rank != config.rank
                        or _ulysses_size(config.algorithm, sharding) != config.ulysses_size):
                    raise RuntimeError(
                        f"cp_cache: backward runs on rank {sharding.rank} of {sharding.size} but its "
                        f"forward ran on rank {config.rank} of {config.world_size} ({config.algorithm}, Ulysses "
                        f"degree {config.ulysses_size})"
                    )
                lse = lse_from_stats(*(local_tensor(a[n], n) for n in ("softmax_max", "softmax_sum")))
                steps = records.steps_from_cache(cache, config)
                mask_rows = _mask_rows(a, layout, config)
        if varlen:
            return varlen_backward(self, a, started, _wrap)
        q, k, v, dy, out = (tensors[n].to_local() for n in tensors)
        del cache
        ring_started = time.perf_counter()
        result = _run_backward(dy, q, k, v, out, lse, steps, config, sharding, get_kernel(kernel_name), mask_rows)
        ring_seconds = time.perf_counter() - ring_started
        seq_dim = L.seq_dim(layout)
        q_total, kv_total = a["query"].size(seq_dim), a["key"].size(seq_dim)
        outputs = (
            _wrap(result.dq, mesh, placements, seq_dim, q_total),
            _wrap(result.dk, mesh, placements, seq_dim, kv_total),
            _wrap(result.dv, mesh, placements, seq_dim, kv_total),
            torch.empty(0, dtype=q.dtype, device=q.device),  # dpse: no pse
            torch.zeros((), dtype=torch.float32, device=q.device),  # dsink: no sink (0-d, as the op's meta)
        )
        self.call_log.record("backward", result, started, ring_seconds)
        return outputs
