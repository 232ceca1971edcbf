"""cp_cache as an attention implementation of Hugging Face transformers 5.x (docs/transformers.md): ``register()``
adds it to ``AttentionInterface`` (with a mask hook: no dense mask). ``attention_forward`` calls the NPU op on each
layer's local q/k/v, inside ``cp_cache.context_parallel`` as DTensors sharded as the buffers were. The mask is the
one the model asks for; what the op cannot express raises. Only ``register()`` imports transformers."""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from .. import layout as L
from ..dispatch import active_documents, active_mesh
from ..mixers.region import in_cp
from ..engine.agreement import CHECK_ERRORS, agree_on_refusal
from ..documents import document_positions, sequence_positions
from ..npu_ops import SparseMode, autocast_inputs, band_arguments, causal_arguments, describe

__all__ = ["NAME", "register", "attention_forward", "mask_hook"]

NAME = "cp_cache"

# keyword arguments of transformers' attention call that change the scores in a way the op cannot express
_REFUSED = {"softcap": "logit soft-capping", "position_bias": "an additive position bias", "head_mask": "a head mask"}


def register() -> None:
    """Register "cp_cache" in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_hook)


def mask_hook(batch_size: int, q_length: int, kv_length: int, *args, attention_mask: Optional[Tensor] = None,
              **kwargs) -> Optional[Tensor]:
    """None: a 2-D mask that masks nothing is dropped (a host read); any other reaches ``attention_forward``."""
    if attention_mask is not None and attention_mask.dim() == 2 and bool(attention_mask.all()):
        return None
    return attention_mask


@dataclass(frozen=True)
class _Sharding:
    """Where the local sequence sits in the global one."""
    mesh: Any  # None: single process
    held: Optional[Tensor]  # the global positions of the local tokens (CPU int64); None: KV cache
    seq: int  # the global sequence length
    load_balance: bool
    documents: Optional[tuple[int, ...]] = None  # the ends the region laid its buffers out by
    placement: Optional[str] = None


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      sliding_window: Optional[int] = None, s_aux: Optional[Tensor] = None,
                      **kwargs) -> tuple[Tensor, None]:
    """The attention function: q ``[B, N, S, D]``, k/v ``[B, Nkv, S, D|Dv]`` -> ``(out [B, S, N, Dv], None)``."""
    mesh = active_mesh()
    if mesh is None and in_cp():
        raise RuntimeError("cp_cache attention: a CP region entered through torch's context_parallel() is active; "
                           "enter it with cp_cache.context_parallel(mesh, buffers=[...]) so that the attention "
                           "knows its mesh")
    try:
        _refuse(attention_mask, kwargs, query, key, value, s_aux)
        sharding = _sharding(mesh, query, key)
        if sharding.documents is not None and kwargs.get("cu_seq_lens_q") is None:
            raise ValueError(f"cp_cache attention: the CP region laid its buffers out by documents="
                             f"{list(sharding.documents)}, but the call has no cu_seq_lens_q/k (pass the packed "
                             "batch's cu_seq_lens_q and cu_seq_lens_k to the model)")
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        window = _window(sliding_window, causal)
        documents = _checked_documents(kwargs, sharding)
        if documents is not None and query.size(0) != 1:
            raise NotImplementedError(f"cp_cache attention: packed documents (cu_seq_lens_q/k) need batch size 1 "
                                      f"(the documents flattened into one row), got query {describe(query)}")
        scale = query.size(-1) ** -0.5 if scaling is None else float(scaling)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"cp_cache attention: dropout={dropout!r} must be in [0, 1)")
        options = dict(scale=scale, keep_prob=1.0 - float(dropout))
        if s_aux is not None:
            options["sink"] = s_aux.float()
    except CHECK_ERRORS as error:
        if mesh is not None and mesh.ndim == 1:  # a refusal on one rank is raised on every rank, not left waiting
            agree_on_refusal("forward", [mesh.get_group()], error)
        raise
    query, key, value = autocast_inputs(query, key, value)  # one dtype, as SDPA under autocast
    return _call(query, key, value, causal, window, documents, sharding, options), None


def _refuse(attention_mask: Optional[Tensor], kwargs: dict, query: Tensor, key: Tensor, value: Tensor,
            s_aux: Optional[Tensor]) -> None:
    if attention_mask is not None:
        raise NotImplementedError(f"cp_cache attention: attention_mask={describe(attention_mask)} is not supported: it "
                                  "takes the causal, sliding-window and packed-document masks the model asks for, not "
                                  "a mask tensor (padding, or a custom mask); pack the batch without padding "
                                  "(DataCollatorWithFlattening) and pass attention_mask=None")
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"cp_cache attention: {name}={describe(kwargs[name])} ({what}) is not supported")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("cp_cache attention: output_attentions=True is not supported (the attention "
                                  "weights are never formed); use attn_implementation='eager' to read them")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"cp_cache attention: query, key and value must be [B, N, S, D], got "
                         f"{describe(query)}, {describe(key)}, {describe(value)}")
    if s_aux is not None and tuple(s_aux.shape) != (query.size(1),):
        raise ValueError(f"cp_cache attention: s_aux (the sinks) must be [N] = [{query.size(1)}] (one per query "
                         f"head), got {describe(s_aux)}")


def _window(sliding_window: Optional[int], causal: bool) -> Optional[int]:
    if sliding_window is None:
        return None
    if int(sliding_window) != sliding_window or sliding_window < 1:
        raise ValueError(f"cp_cache attention: sliding_window={sliding_window!r} must be a positive integer")
    if not causal:  # transformers' models differ on it (|i - j| < w or <= w): not knowable from the call
        raise NotImplementedError(f"cp_cache attention: sliding_window={sliding_window} with is_causal=False "
                                  "(a bidirectional window) is not supported")
    return int(sliding_window)


def _sharding(mesh, query: Tensor, key: Tensor) -> _Sharding:
    s_q, s_kv = query.size(2), key.size(2)
    if mesh is None:
        held = torch.arange(s_q) if s_q == s_kv else None  # a shorter query: decoding over a KV cache
        return _Sharding(None, held, s_kv, False)
    if mesh.ndim != 1:
        raise NotImplementedError(f"cp_cache attention: a {mesh.ndim}-D CP mesh {mesh} is not supported; "
                                  "cp_cache.context_parallel(mesh, ...) takes a 1-D mesh here")
    if s_q != s_kv:
        raise NotImplementedError(f"cp_cache attention under CP: query length {s_q} != key length {s_kv} "
                                  "(a KV cache, or cross-attention) is not supported")
    world, rank, load_balance = mesh.size(), mesh.get_local_rank(), L.load_balance_enabled()
    region = active_documents()
    if region is not None:  # the buffers were laid out by cp_cache's document placement
        documents, placement = region
        held = document_positions(documents, rank, world, placement)
        if s_q != held.numel():
            raise ValueError(f"cp_cache attention: the local sequence has {s_q} tokens, but the region's documents="
                             f"{list(documents)} under placement {placement!r} give rank {rank} {held.numel()}: "
                             "pass the batch's input_ids, position_ids and labels as the region's buffers")
        return _Sharding(mesh, held, documents[-1], load_balance, documents, placement)
    return _Sharding(mesh, sequence_positions(rank, world, s_q, load_balance), s_q * world, load_balance)


_LAST: list = [(), (), None]  # the last read: weak references to its tensors, its key, its documents


def _checked_documents(kwargs: dict, sharding: _Sharding) -> Optional[tuple[int, ...]]:
    """The documents of (position_ids, cu_seq_lens_q, cu_seq_lens_k), read and checked: every layer of a forward
    passes the same tensors, so one host read per forward (the last read held by identity and version, weakly)."""
    given = (kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
    compiling = torch.compiler.is_compiling()  # no cache (its key would pin the lengths), no host read
    if not compiling:
        key = (tuple(_identity(t) for t in given), sharding.seq, sharding.documents, sharding.placement,
               None if sharding.held is None else tuple(sharding.held[:1].tolist() + [len(sharding.held)]),
               sharding.load_balance, None if sharding.mesh is None else sharding.mesh.get_local_rank())
        refs, last_key, last = _LAST
        if key == last_key and all(ref() is t for ref, t in zip(refs, given) if isinstance(t, Tensor)):
            return last
    documents = _read_documents(given[1], given[2], sharding)
    if given[0] is not None and sharding.held is not None:
        _check_positions(given[0], sharding, documents, compiling)
    if not compiling:
        _LAST[:] = [tuple(weakref.ref(t) if isinstance(t, Tensor) else None for t in given), key, documents]
    return documents


def _identity(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", id(value), value._version)
    return None if value is None else ("list", tuple(int(x) for x in value))


def _read_documents(cu_q: Any, cu_k: Any, sharding: _Sharding) -> Optional[tuple[int, ...]]:
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError(f"cp_cache attention: cu_seq_lens_q={describe(cu_q)} and cu_seq_lens_k={describe(cu_k)}: "
                         "packed documents need both")
    q, k = ([int(x) for x in (c.tolist() if isinstance(c, Tensor) else c)] for c in (cu_q, cu_k))
    if q != k:
        raise NotImplementedError(f"cp_cache attention: cu_seq_lens_q={q} and cu_seq_lens_k={k} differ; only "
                                  "self-attention within the same documents is supported")
    if sharding.held is None:
        raise NotImplementedError("cp_cache attention: packed documents (cu_seq_lens_q/k) with a query shorter "
                                  "than the keys (a KV cache) are not supported")
    if sharding.documents is not None and tuple(q[1:]) != sharding.documents:
        raise ValueError(f"cp_cache attention: cu_seq_lens_q={q} are not the documents the CP region laid its "
                         f"buffers out by (documents={list(sharding.documents)}); pass the batch's cu_seq_lens_q "
                         "to cp_cache.context_parallel(..., documents=...)")
    if len(q) < 2 or q[0] != 0 or q[-1] != sharding.seq or any(b <= a for a, b in zip(q, q[1:])):
        raise ValueError(f"cp_cache attention: cu_seq_lens_q={q} must be the cumulative document lengths of the "
                         f"whole sequence: 0 first, strictly increasing, the last = {sharding.seq} (the global "
                         "length; under CP the ranks hold its shards)")
    return tuple(q)


_POSITIONS_HINT = ("Under cp_cache.context_parallel pass position_ids among its buffers (sharded with input_ids); "
                   "packed documents (position_ids restarting at 0) need cu_seq_lens_q/k "
                   "(DataCollatorWithFlattening(return_flash_attn_kwargs=True))")


def _check_positions(position_ids: Tensor, sharding: _Sharding, documents: Optional[tuple[int, ...]],
                     compiling: bool) -> None:
    """RoPE reads ``position_ids``, the mask follows the tokens' places: they must agree, else the mask would
    silently differ. Compiled: an assertion in the graph, failing when it runs."""
    held = expected = sharding.held
    if documents is not None:
        starts, ends = torch.tensor(documents[:-1]), torch.tensor(documents[1:])
        expected = held - starts[torch.searchsorted(ends, held, right=True)]
    got = position_ids.detach().to("cpu", torch.int64)
    if got.dim() != 2 or got.size(-1) != held.numel():
        raise ValueError(f"cp_cache attention: position_ids={describe(position_ids)} must be [B, S] over the "
                         f"{held.numel()} local tokens")
    if compiling:
        torch._assert_async((got == expected).all(), "cp_cache attention: position_ids are not the positions of "
                            "the tokens in their sequence or documents. " + _POSITIONS_HINT)
        return
    wrong = (got != expected).any(0).nonzero().flatten()
    if wrong.numel():
        at = int(wrong[0])
        raise ValueError(f"cp_cache attention: position_ids={describe(position_ids)} are not the positions of the "
                         f"tokens in their {'documents' if documents else 'sequence'}: local token {at} (global "
                         f"position {int(sharding.held[at])}) has position id {got[:, at].tolist()}, expected "
                         f"{int(expected[at])}. " + _POSITIONS_HINT)


@functools.lru_cache(maxsize=4)
def _document_mask(documents: tuple[int, ...], causal: bool, window: Optional[int], device) -> Tensor:
    """[S, S] bool, True = masked out: other documents, and the causal / window rule within one."""
    pos = torch.arange(documents[-1], device=device)
    doc = torch.searchsorted(torch.tensor(documents[1:], device=device), pos, right=True)
    i, j = pos[:, None], pos[None, :]
    masked = doc[:, None] != doc[None, :]
    if causal:
        masked |= j > i
    if window is not None:  # causal only
        masked |= j <= i - window
    return masked


def _call(query: Tensor, key: Tensor, value: Tensor, causal: bool, window: Optional[int],
          documents: Optional[tuple[int, ...]], sharding: _Sharding, options: dict) -> Tensor:
    """Packed documents as TND ``[T, N, D]`` where the buffers were laid out by the region's documents or
    contiguously, else BNSD with an explicit [S, S] mask. Returns ``[B, S, N, Dv]``."""
    packed = documents is not None and (sharding.documents is not None or sharding.mesh is None
                                        or not sharding.load_balance)
    if documents is not None and not packed:
        mask_args = dict(atten_mask=_document_mask(documents, causal, window, query.device),
                         sparse_mode=int(SparseMode.ALL_MASK))
    elif window is not None:  # causal: keys i-w < j <= i
        mask_args = band_arguments(query.device, window - 1)
    elif causal:  # right-down: a query shorter than the keys (decoding) sits at their end
        mask_args = causal_arguments(query.device, right_down=True)
    else:  # full attention
        mask_args = dict(sparse_mode=int(SparseMode.MASK))
    if packed:
        ends = torch.tensor(documents[1:], dtype=torch.int64)
        mask_args.update(actual_seq_qlen=ends, actual_seq_kvlen=ends)
        q, k, v = (_sharded(t[0].transpose(0, 1).contiguous(), sharding, 0) for t in (query, key, value))
    else:
        q, k, v = (_sharded(t, sharding, 2) for t in (query, key, value))
    out = _op()(q, k, v, query.size(1), L.TND if packed else "BNSD", **mask_args, **options)[0]
    out = out.to_local() if isinstance(out, DTensor) else out
    return out.unsqueeze(0) if packed else out.transpose(1, 2)


def _sharded(t: Tensor, sharding: _Sharding, seq_dim: int) -> Tensor:
    if sharding.mesh is None:
        return t
    if sharding.documents is None:  # even shards
        return DTensor.from_local(t, sharding.mesh, [Shard(seq_dim)], run_check=False)
    shape = list(t.shape)
    shape[seq_dim] = sharding.seq
    return DTensor.from_local(t, sharding.mesh, [Shard(seq_dim)], run_check=False, shape=torch.Size(shape),
                              stride=tuple(math.prod(shape[i + 1:]) for i in range(len(shape))))


def _op() -> Callable:
    """The NPU op where it exists (real or emulated), else cp_cache's own (torch's fused kernels)."""
    op = getattr(torch.ops.npu, "npu_fusion_attention_v3", None)
    return op if op is not None else torch.ops.cp_cache.fusion_attention
