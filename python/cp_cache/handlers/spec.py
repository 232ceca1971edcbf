"""One call of the attention op (or its grad), read once: the ``CallSpec``, which also wraps the results as DTensors.

Every refusal happens here and is shared with the other ranks (``share_refusal``). The backward only checks its
arguments against its forward's plan. Packed lengths given as tensors are checked by shape and read by the custom
op (a trace cannot read them)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import layout as L
from ..config import CPConfig, document_placement
from ..documents import (check_lengths_tensor, check_packed_tokens, cumulative_lengths, same_documents,
                         sequence_positions)
from ..engine import agreement
from ..engine.merge import fused_merge_available
from ..engine.transport import group_state
from ..npu_ops import (CAUSAL_MODES, INT_MAX, SparseMode, check_one_dtype, describe, is_compressed_mask,
                       stats_views_from_lse)
from ..placement import CONTIGUOUS
from ..plan import CallPlan, MaskSpec, decide_algorithm

__all__ = ["CallSpec", "CPSharding", "read_call", "read_local", "share_refusal", "sequence_sharded", "cp_sharding",
           "sharded_like", "local_tensor", "sink_grad_like"]

_QKV = ("query", "key", "value")


@dataclass
class CallSpec:
    """``mask``: a given mask's rows (ring) or whole (Ulysses); ``lengths``: packed lengths for the custom op."""
    args: dict[str, Any]
    plan: CallPlan
    sharding: CPSharding
    mask: Optional[Tensor]
    lengths: tuple[Optional[Tensor], Optional[Tensor]] = (None, None)
    sink: Optional[Tensor] = None

    def local(self, *names: str) -> tuple[Tensor, ...]:
        """Local tensors without a ``to_local`` autograd node (the handler runs below autograd)."""
        return tuple([self.args[n]._local_tensor for n in names])

    def wrap_forward(self, out: Tensor, lse: Tensor) -> tuple[DTensor, DTensor, DTensor]:
        """(out, softmax_max, softmax_sum) as DTensors, the statistics stride-0 views of the LSE."""
        seq_dim, stats_seq_dim, stats_placements = _stats_layout(self.sharding.placements, self.plan.layout)
        total = self.args["query"].size(seq_dim)
        return (_wrap(out, self.sharding.mesh, self.sharding.placements, seq_dim, total),
                *(_wrap(stats, self.sharding.mesh, stats_placements, stats_seq_dim, total)
                  for stats in stats_views_from_lse(lse)))

    def wrap_grads(self, *grads: Tensor) -> tuple[DTensor, ...]:
        """A gradient laid out as its input's local tensor takes its spec (else autograd assumes even shards)."""
        seq_dim = _SEQUENCE_SHARD[self.plan.layout].dim
        return tuple([_grad_like(g, self.args[n], self.sharding, seq_dim) for g, n in zip(grads, _QKV)])


def _grad_like(grad: Tensor, input: DTensor, sharding, seq_dim: int) -> DTensor:
    local = input._local_tensor
    if (grad.shape == local.shape and grad.stride() == local.stride() and grad.dtype == input.dtype
            and input.placements == sharding.placements):
        return DTensor(grad, input._spec, requires_grad=False)
    return _wrap(grad, sharding.mesh, sharding.placements, seq_dim, input.size(seq_dim))


@functools.lru_cache(maxsize=64)
def _stats_layout(placements: tuple, layout: str) -> tuple[int, int, tuple]:
    """(the output's sequence dim, the statistics' [B, N, S, 8] one, the statistics' placements)."""
    seq, head = L.seq_dim(layout), L.head_dim_index(layout)
    stats_seq, stats_head = L.stats_dims(layout)
    stats = tuple(Shard(stats_seq) if p == Shard(seq) else Shard(stats_head) if p == Shard(head) else Replicate()
                  for p in placements)
    return seq, stats_seq, stats


def _wrap(local: Tensor, mesh, placements, seq_dim: int, total: int) -> DTensor:
    """Global length ``total``: shards may be uneven. Specs are cached, but not for symbolic sizes."""
    make = _spec if type(local) is Tensor and type(total) is int else _spec.__wrapped__
    spec = make(mesh, tuple(placements), tuple(local.shape), local.stride(), local.dtype, seq_dim, total)
    return DTensor(local, spec, requires_grad=False)


@functools.lru_cache(maxsize=256)
def _spec(mesh, placements: tuple, shape: tuple, stride: tuple, dtype, seq_dim: int, total: int) -> DTensorSpec:
    local = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    global_shape, global_stride = torch.distributed.tensor._utils.compute_global_tensor_info(local, mesh, placements)
    # not compared with local * W: shards may be uneven, and while tracing a comparison would guard against it
    local_len = shape[seq_dim]
    global_shape[seq_dim] = total
    if local_len:  # dims that step over the whole local sequence (outer ones) step over the global one
        global_stride = [stride[i] // local_len * total if i != seq_dim and stride[i] >= stride[seq_dim] * local_len
                         else global_stride[i] for i in range(len(shape))]
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(global_shape), tuple(global_stride), dtype))


def read_call(a: dict[str, Any], cp: CPConfig, *, backward: bool = False) -> CallSpec:
    """A dense call reuses its CP group's last read with the same ``_repeat_key`` (saves about 0.1 ms of host
    time forward, 0.6 ms backward)."""
    check_one_dtype(GRAD_OP if backward else FORWARD_OP, a, _ONE_DTYPE[backward])
    key = _repeat_key(a, cp, backward)
    if key is None:
        return _read_call(a, cp, backward)
    mesh = a["query"]._spec.mesh
    state = group_state(mesh.get_group(key[-1]))
    read = state.memo.get(key)
    if read is None or read[1].mesh is not mesh:
        call = _read_call(a, cp, backward)
        state.keep(key, (call.plan, call.sharding))
        return call
    plan, sharding = read
    sink = a["sink"]
    if sink is not None:  # no call otherwise: this runs on every call
        sink = local_sink(sink, int(a["head_num"]), sharding.mesh, sharding.head_shards)
    return CallSpec(a, plan, sharding, None, sink=sink)


FORWARD_OP, GRAD_OP = "npu_fusion_attention_v3", "npu_fusion_attention_grad_v3"
_ONE_DTYPE = {False: ("query", "key", "value"), True: ("query", "key", "value", "dy", "attention_in")}
_SCALARS = ("input_layout", "head_num", "keep_prob", "sparse_mode", "pre_tockens", "next_tockens", "softmax_layout")


def _repeat_key(a: dict[str, Any], cp: CPConfig, backward: bool) -> Optional[tuple]:
    """None for calls read afresh: packed documents, a given mask, arguments cp_cache refuses, traced calls."""
    # loops, not generators: this runs on every call
    if a["input_layout"] == L.TND:
        return None
    for name in _UNSUPPORTED_WHEN_SET:
        if a[name] is not None:
            return None
    mask, query = a["atten_mask"], a["query"]
    if mask is not None and (a["sparse_mode"] in _GIVEN_MASK_MODES or type(mask) is not Tensor):
        return None
    shard = _SEQUENCE_SHARD.get(a["input_layout"])
    if type(query) is not DTensor or shard not in query._spec.placements:
        return None
    key = [backward, cp, L.load_balance_enabled(), a["scale_value" if backward else "scale"], a["sink"] is None,
           None if mask is None else (mask.shape, mask.dtype)]
    for name in _SCALARS:
        key.append(a[name])
    # the specs by their parts: DTensorSpec's hash and equality are slow Python calls; the mesh is checked on a hit
    mesh = query._spec.mesh
    for name in _QKV:
        t = a[name]
        if type(t) is not DTensor or type(t._local_tensor) is not Tensor or t._spec.mesh is not mesh:
            return None
        key += (t._spec.placements, getattr(t._spec, "shard_order", None), t._spec.tensor_meta, t._local_tensor.shape)
    key.append(query._spec.placements.index(shard))  # last: the CP dimension whose group holds the read
    return tuple(key)


def _read_call(a: dict[str, Any], cp: CPConfig, backward: bool) -> CallSpec:
    scale = float(a["scale_value" if backward else "scale"])
    if a["input_layout"] == L.TND:
        return _read_packed(a, cp, scale, backward)
    layout = L.check_layout(a["input_layout"])
    spec = mask_spec(a)
    sharding = cp_sharding({n: a[n] for n in _QKV}, layout)
    global_seq = a["query"].size(L.seq_dim(layout))
    spec = spec.simplified(global_seq)
    algorithm = decide_algorithm(cp.algorithm, sharding.cp_dims, packed=False, given_mask=spec.given,
                                 backward=backward, costs=_costs(a, layout, sharding, cp),
                                 placements=sharding.placements)
    # positions matter for every mask but none: the shards are head-tail under torch's load balancing
    load_balance = spec.positional and L.load_balance_enabled()
    if load_balance and global_seq % (2 * sharding.size):
        # on the global length, the same on every rank, so every rank refuses together
        raise ValueError(f"load balancing splits the sequence into 2*W = {2 * sharding.size} chunks; the "
                         f"query sequence length {global_seq} is not divisible by {2 * sharding.size}")
    sink = local_sink(a["sink"], int(a["head_num"]), sharding.mesh, sharding.head_shards)
    plan = CallPlan(world_size=sharding.size, rank=sharding.rank, layout=layout,
                    head_num=sharding.local_heads(int(a["head_num"])), scale=scale, keep_prob=float(a["keep_prob"]),
                    mask=spec, load_balance=load_balance, algorithm=algorithm, cp_sizes=tuple(sharding.cp_sizes),
                    sink=sink is not None, **_execution(cp))
    return CallSpec(a, plan, sharding, _mask_rows(a, plan), sink=sink)


def read_local(a: dict[str, Any], cp: CPConfig, *, backward: bool = False) -> CallSpec:
    """A call on plain tensors: the plan of a single rank, through the same strategies."""
    check_one_dtype(GRAD_OP if backward else FORWARD_OP, a, _ONE_DTYPE[backward])
    scale, head_num = float(a["scale_value" if backward else "scale"]), int(a["head_num"])
    sink = local_sink(a["sink"], head_num, None, 1)
    common = dict(world_size=1, rank=0, head_num=head_num, scale=scale, keep_prob=float(a["keep_prob"]),
                  sink=sink is not None, **_execution(cp))
    if a["input_layout"] == L.TND:
        documents, lengths = packed_documents(a)
        plan = CallPlan(layout=L.TND, mask=mask_spec(a), documents=documents, placement=CONTIGUOUS, **common)
        check_packed_tokens(plan, a["query"].size(0))
        return CallSpec(a, plan, None, None, lengths, sink)
    layout = L.check_layout(a["input_layout"])
    seq = a["query"].size(L.seq_dim(layout))
    plan = CallPlan(layout=layout, mask=mask_spec(a).simplified(seq), **common)
    rows = local_mask_rows(a["atten_mask"], a["query"], layout, torch.arange(seq)) if plan.mask.given else None
    return CallSpec(a, plan, None, rows, sink=sink)


def _read_packed(a: dict[str, Any], cp: CPConfig, scale: float, backward: bool) -> CallSpec:
    spec = mask_spec(a)
    documents, lengths = packed_documents(a)
    sharding = cp_sharding({n: a[n] for n in _QKV}, L.TND)
    sink = local_sink(a["sink"], int(a["head_num"]), sharding.mesh, sharding.head_shards)
    load_balance = L.load_balance_enabled()
    algorithm = decide_algorithm(cp.algorithm, sharding.cp_dims, packed=True, given_mask=False, backward=backward,
                                 placements=sharding.placements)
    plan = CallPlan(world_size=sharding.size, rank=sharding.rank, layout=L.TND, head_num=int(a["head_num"]),
                    scale=scale, keep_prob=float(a["keep_prob"]), mask=spec, load_balance=load_balance,
                    algorithm=algorithm, cp_sizes=tuple(sharding.cp_sizes), documents=documents,
                    placement=document_placement(cp.documents, load_balance), capacity=cp.document_capacity,
                    sink=sink is not None, **_execution(cp))
    if plan.capacity is not None and algorithm != "ring":
        raise NotImplementedError(f"cp_cache document_capacity={plan.capacity} runs on the packed-documents ring; "
                                  f"algorithm={algorithm!r} takes packed documents without a capacity yet")
    # on global lengths, the same on every rank: every rank refuses together
    check_packed_tokens(plan, a["query"].size(0))
    return CallSpec(a, plan, sharding, None, lengths, sink)


_LENGTHS = ("actual_seq_qlen", "actual_seq_kvlen")


def packed_documents(a: dict[str, Any]) -> tuple[tuple[int, ...], tuple[Optional[Tensor], Optional[Tensor]]]:
    """Lists are read now (constants of a trace); tensors are checked by shape and left for the custom op."""
    for name in _LENGTHS:
        if a[name] is None:
            raise ValueError(f"input_layout='TND' needs {name}: the global cumulative document ends (last = T)")
        if isinstance(a[name], DTensor):
            raise ValueError(f"{name} must be a plain tensor or list of the global cumulative ends, the same on "
                             f"every rank, not a DTensor ({describe(a[name])})")
    if not any(isinstance(a[name], Tensor) for name in _LENGTHS):
        return same_documents(a["actual_seq_qlen"], a["actual_seq_kvlen"]), (None, None)
    lengths = []
    for name in _LENGTHS:
        if isinstance(a[name], Tensor):
            check_lengths_tensor(a[name], name)
            lengths.append(a[name])
        else:  # a list beside a tensor: checked and made an int64 tensor
            lengths.append(torch.tensor(cumulative_lengths(a[name], name), dtype=torch.int64))
    return (), tuple(lengths)


def _execution(cp: CPConfig) -> dict:
    """The step kernel (by default "npu": the handler serves that op), merge and exchange options."""
    return dict(kernel=cp.kernel or "npu", fused_merge=cp.fused_merge and fused_merge_available(),
                exchange=cp.exchange, keep_kv=cp.keep_kv, grad_partials=cp.grad_partials)


def _costs(a: dict[str, Any], layout: str, sharding: CPSharding, cp: CPConfig):
    """What "auto"'s cost model reads of a dense call (``plan.choose_algorithm``)."""
    def costs() -> dict:
        q, k, v = (a[n].to_local() for n in _QKV)
        nq = sharding.local_heads(int(a["head_num"]))
        qd = L.dims(q, layout, nq)
        nkv = L.heads_of(k, layout, qd.head_dim)
        # from the global length, so that every rank picks the same even if local lengths differ
        local_seq = a["query"].size(L.seq_dim(layout)) // sharding.size
        return dict(nq=nq, nkv=nkv, world=sharding.size, batch=qd.batch, local_seq=local_seq,
                    head_dim=qd.head_dim, itemsize=q.element_size(), v_head_dim=L.value_head_dim(v, layout, nkv),
                    keep_kv=cp.keep_kv, grad_partials=cp.grad_partials)
    return costs


_PACKED_UNSUPPORTED_WHEN_SET = ("pse", "padding_mask", "prefix")
_UNSUPPORTED_WHEN_SET = _PACKED_UNSUPPORTED_WHEN_SET + ("actual_seq_qlen", "actual_seq_kvlen")
_GIVEN_MASK_MODES = (SparseMode.MASK, SparseMode.ALL_MASK)
_SUPPORTED_MODES = _GIVEN_MASK_MODES + CAUSAL_MODES + (SparseMode.BAND,)
# a band with the compressed mask: in every document, or (packed) in the last / first one, the others causal
_BAND_DOCUMENT = {SparseMode.BAND: "", SparseMode.RIGHT_DOWN_CAUSAL_BAND: "last",
                  SparseMode.BAND_LEFT_UP_CAUSAL: "first"}


def mask_spec(a: dict[str, Any]) -> MaskSpec:
    """On global positions; NotImplementedError naming what is not supported."""
    packed = a["input_layout"] == L.TND
    for name in _PACKED_UNSUPPORTED_WHEN_SET if packed else _UNSUPPORTED_WHEN_SET:
        if a[name] is not None:
            raise NotImplementedError(f"cp_cache ring attention does not support {name}={describe(a[name])} yet")
    if a["softmax_layout"]:
        raise NotImplementedError(
            f"cp_cache ring attention does not support softmax_layout={a['softmax_layout']!r} yet")
    mode, mask = a["sparse_mode"], a["atten_mask"]
    if not packed and mode not in _SUPPORTED_MODES:
        raise NotImplementedError(f"cp_cache ring attention supports sparse_mode 0, 1 (a given mask, or none: full "
                                  f"attention), 2, 3 (compressed causal mask) and 4 (band), not sparse_mode={mode}")
    if mask is None:
        return MaskSpec()  # the op computes full attention (per document) whatever sparse_mode says
    if packed:
        if not ((mode in CAUSAL_MODES or mode in _BAND_DOCUMENT) and is_compressed_mask(mask)):
            raise NotImplementedError(
                f"cp_cache ring attention with input_layout='TND' supports full attention (no atten_mask), causal "
                f"attention per document (sparse_mode {int(SparseMode.LEFT_UP_CAUSAL)} or "
                f"{int(SparseMode.RIGHT_DOWN_CAUSAL)}) and a band inside each document (sparse_mode "
                f"{int(SparseMode.BAND)} with pre_tockens/next_tockens; 7 / 8: inside the last / first document, "
                f"the others causal), each with the compressed 2048x2048 mask; not sparse_mode={mode} with "
                f"atten_mask={describe(mask)} (explicit masks are not taken with packed documents)")
    elif mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"atten_mask must be bool or uint8 (1 = masked out), got {describe(mask)}")
    elif mode in _GIVEN_MASK_MODES:
        band = mode == SparseMode.MASK and (a["pre_tockens"] < INT_MAX or a["next_tockens"] < INT_MAX)
        return MaskSpec(given=True, window=band, pre_tockens=int(a["pre_tockens"]) if band else INT_MAX,
                        next_tockens=int(a["next_tockens"]) if band else INT_MAX)
    elif not is_compressed_mask(mask):
        raise NotImplementedError(f"cp_cache ring attention with sparse_mode={mode} needs the compressed 2048x2048 "
                                  f"mask, got atten_mask={describe(mask)}")
    if mode in CAUSAL_MODES:
        return MaskSpec(causal=True)
    return MaskSpec(window=True, pre_tockens=int(a["pre_tockens"]), next_tockens=int(a["next_tockens"]),
                    band_document=_BAND_DOCUMENT[mode])


def _mask_rows(a: dict[str, Any], plan: CallPlan) -> Optional[Tensor]:
    """This rank's rows (ring), or the whole mask as a plain tensor (Ulysses and hybrid)."""
    if not plan.mask.given:
        return None
    mask, seq_dim = a["atten_mask"], L.seq_dim(plan.layout)
    if plan.algorithm == "ring":
        rows = sequence_positions(plan.rank, plan.world_size, a["query"].to_local().size(seq_dim), plan.load_balance)
        return local_mask_rows(mask, a["query"], plan.layout, rows)
    if isinstance(mask, DTensor):
        if not all(isinstance(p, Replicate) for p in mask.placements):
            raise NotImplementedError(f"cp_cache Ulysses attention takes atten_mask as a plain tensor or replicated, "
                                      f"got a DTensor with placements={tuple(mask.placements)}; use algorithm='ring' "
                                      "for a sharded mask")
        mask = mask.to_local()
    seq = a["query"].size(seq_dim)
    if mask.dim() not in (2, 4) or tuple(mask.shape[-2:]) != (seq, seq):
        raise ValueError(f"atten_mask for sparse_mode 0/1 must be [S, S], [1, 1, S, S], [B, 1, S, S] or [B, N, S, S] "
                         f"over the global sequence S={seq}, got <tensor of shape {tuple(mask.shape)}>")
    return mask


def local_mask_rows(mask: Any, query: DTensor, layout: str, positions: Tensor) -> Tensor:
    """Picked at ``positions`` from a plain or replicated ``mask``; a query-sharded DTensor's local rows as is."""
    seq = query.size(L.seq_dim(layout))
    if mask.dim() not in (2, 4) or mask.shape[-1] != seq:
        raise ValueError(f"atten_mask for sparse_mode 0/1 must be [S, S], [1, 1, S, S], [B, 1, S, S] or [B, N, S, S] "
                         f"over the global sequence S={seq}, got {describe(mask)}")
    if isinstance(mask, DTensor):
        placements = tuple(mask.placements)
        if all(isinstance(p, Replicate) for p in placements):
            mask = mask.to_local()
        elif placements == (Shard(mask.dim() - 2),):
            # the row count is checked by the ring once the ranks agree on it (a refusal must be every rank's)
            return mask.to_local()
        else:
            raise NotImplementedError(f"cp_cache ring attention takes atten_mask replicated or sharded on its query "
                                      f"dimension (Shard({mask.dim() - 2})), got placements={placements}")
    if mask.shape[-2] != seq:
        raise ValueError(f"atten_mask must be square over the global sequence S={seq}, got {describe(mask)}")
    return mask.index_select(mask.dim() - 2, positions.to(mask.device))


@dataclass(frozen=True)
class CPSharding:
    """How q/k/v lie on their mesh: its CP dimensions (outer first) and the head split."""
    mesh: Any
    placements: tuple
    cp_dims: tuple[int, ...]
    head_shards: int  # product of the sizes of the Shard(head) dimensions (1: none)

    @property
    def cp_sizes(self) -> list[int]:
        return [self.mesh.size(d) for d in self.cp_dims]

    @property
    def size(self) -> int:
        """Ranks over which the sequence is split."""
        return math.prod(self.cp_sizes)

    @property
    def rank(self) -> int:
        """This rank's sequence chunk, nested over the CP dimensions in DTensor's order."""
        rank = 0
        for d in self.cp_dims:
            rank = rank * self.mesh.size(d) + self.mesh.get_local_rank(d)
        return rank

    @functools.cached_property  # a mesh keeps its groups; a repeated call's sharding is the last one's
    def groups(self) -> tuple:
        return tuple(self.mesh.get_group(d) for d in self.cp_dims)

    def local_heads(self, head_num: int) -> int:
        """``head_num``: the op's, over all heads."""
        if head_num % self.head_shards:
            raise ValueError(f"head_num={head_num} is not divisible by the {self.head_shards} tensor-parallel head "
                             f"shards of placements={self.placements}")
        return head_num // self.head_shards


def sequence_sharded(query: Any, layout: Any) -> bool:
    """A CP call; data or tensor parallel and replicated calls are left to others."""
    return isinstance(query, DTensor) and _SEQUENCE_SHARD.get(layout) in query._spec.placements


_SEQUENCE_SHARD = {layout: Shard(L.seq_dim(layout)) for layout in L.ALL_LAYOUTS}


def cp_sharding(tensors: dict[str, Any], layout: str) -> CPSharding:
    """Packed documents: Shard(0) on every mesh dimension (``plan.decide_algorithm`` refuses a count but 1 or 2)."""
    seq, head = L.seq_dim(layout), L.head_dim_index(layout)
    mesh = placements = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            where = (f"dimension 0 (T) of layout {layout!r}" if layout == L.TND
                     else f"the sequence dimension {seq} of layout {layout!r}")
            raise TypeError(f"cp_cache ring attention needs {name} as a DTensor sharded on {where}, got "
                            f"{type(tensor).__name__}")
        ndim = tensor.device_mesh.ndim
        if layout == L.TND and tuple(tensor.placements) != (Shard(0),) * ndim:
            raise NotImplementedError(f"cp_cache attention with input_layout='TND' needs {name} sharded on T on "
                                      f"every mesh dimension, {(Shard(0),) * ndim} on its {ndim}-D mesh "
                                      f"(data or tensor parallel dimensions: give the CP submesh), got "
                                      f"placements={tuple(tensor.placements)}")
        if mesh is None:
            mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        elif tensor.device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {tensor.device_mesh}, query on {mesh}")
        elif tuple(tensor.placements) != placements:
            raise NotImplementedError(f"cp_cache CP attention needs q, k, v placed alike; query has {placements}, "
                                      f"{name} has {tuple(tensor.placements)}")
    cp_dims = tuple(d for d, p in enumerate(placements) if p == Shard(seq))
    others = [p for p in placements if p != Shard(seq) and not isinstance(p, Replicate) and p != Shard(head)]
    if not cp_dims or others:
        raise NotImplementedError(f"cp_cache ring attention needs query sharded as (Shard({seq}),) for layout "
                                  f"{layout!r} on the CP mesh dimension(s), other mesh dimensions Replicate() or "
                                  f"Shard({head}) (heads); got placements={placements}")
    head_shards = math.prod(mesh.size(d) for d, p in enumerate(placements) if p == Shard(head))
    return CPSharding(mesh, placements, cp_dims, head_shards)


def sharded_like(value: Any, name: str, mesh, placements) -> DTensor:
    """With the query's sharding: an incoming gradient may come replicated, e.g. from a sum."""
    if not isinstance(value, DTensor):
        raise TypeError(f"cp_cache: npu_fusion_attention_grad_v3 needs {name} as a DTensor, got {describe(value)}")
    if value.device_mesh != mesh:
        raise ValueError(f"{name} is on mesh {value.device_mesh}, query on {mesh}")
    if tuple(value.placements) != tuple(placements):
        value = value.redistribute(mesh, placements)
    return value


def local_tensor(value: Any, name: str) -> Tensor:
    if isinstance(value, DTensor):
        return value._local_tensor  # as ``CallSpec.local``
    if isinstance(value, Tensor):
        return value
    raise RuntimeError(f"cp_cache: npu_fusion_attention_grad_v3 needs {name}, got {describe(value)}")


def local_sink(sink: Any, head_num: int, mesh, head_shards: int) -> Optional[Tensor]:
    """This rank's sinks from a plain tensor or one replicated on the query's mesh; ``head_num``: the op's."""
    if sink is None:
        return None
    if not isinstance(sink, Tensor) or not sink.dtype.is_floating_point or tuple(sink.shape) != (head_num,):
        raise ValueError(f"sink must be a floating tensor of shape [head_num] = [{head_num}] (one logit per query "
                         f"head), got sink={describe(sink)}")
    if head_shards > 1:
        raise NotImplementedError(f"cp_cache ring attention does not support sink={describe(sink)} with the heads "
                                  f"split over {head_shards} tensor-parallel shards yet")
    if isinstance(sink, DTensor):
        if sink.device_mesh != mesh or not all(isinstance(p, Replicate) for p in sink.placements):
            raise NotImplementedError(f"cp_cache ring attention takes sink as a plain tensor or a DTensor replicated "
                                      f"on the query's mesh, got placements={tuple(sink.placements)} on "
                                      f"{sink.device_mesh}")
        return sink.to_local()
    return sink


def sink_grad_like(sink: Any, dsink: Tensor, cp_dims: tuple[int, ...]) -> Tensor:
    """For a replicated sink, ``Partial`` on the CP dimensions and replicated on the others (same rows)."""
    if not isinstance(sink, DTensor):
        return dsink
    mesh = sink.device_mesh
    placements = [Partial() if dim in cp_dims else Replicate() for dim in range(mesh.ndim)]
    return DTensor.from_local(dsink, mesh, placements, shape=sink.shape, stride=sink.stride())


def share_refusal(direction: str, a: dict[str, Any], error: BaseException) -> None:
    """Shares the refusal with the CP ranks (not while tracing); raises the agreed error where the refusals differ."""
    tensors = {n: a[n] for n in _QKV}
    try:
        groups = list(cp_sharding(tensors, a["input_layout"]).groups)
    except Exception:  # noqa: BLE001 - the refusal itself is what gets raised
        groups = []
    if groups:
        from torch._subclasses.fake_tensor import FakeTensor
        if any(t._local_tensor.is_meta or isinstance(t._local_tensor, FakeTensor) for t in tensors.values()):
            groups = []
    agreement.agree_on_refusal(direction, groups, error)
