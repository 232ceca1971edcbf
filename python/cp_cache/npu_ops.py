"""The conventions of torch_npu's fused attention ops that the handlers, the step kernels and the emulator
share: op schemas, binding arguments by name, sparse modes, the compressed causal mask, the ``[B, N, S, 8]``
softmax statistics and the dtype rules (one dtype, in no autocast list). Layouts live in ``layout.py``."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import threading
from typing import Any

import torch
from torch import Tensor

__all__ = ["bind_arguments", "describe", "INT_MAX", "MASK_SIZE", "STATS_WIDTH", "FLOAT32_LOWEST", "SparseMode",
           "CAUSAL_MODES", "COMPRESSED_MASK_MODES", "FORWARD_V3", "GRAD_V3", "FORWARD_V1", "GRAD_V1", "RING_UPDATE",
           "SCHEMAS", "causal_mask", "is_compressed_mask", "stats_from_lse", "stats_views_from_lse", "lse_from_stats",
           "op_exists", "check_one_dtype", "autocast_off", "autocast_inputs", "define_attention_ops"]

log = logging.getLogger("cp_cache")
INT_MAX = 2147483647  # default of pre_tockens / next_tockens: no band limit
MASK_SIZE = 2048  # side of the compressed mask that sparse modes 2, 3, 4, 7, 8 take
STATS_WIDTH = 8  # softmax_max / softmax_sum are [B, N, S, 8] float32, the value replicated
FLOAT32_LOWEST = float(torch.finfo(torch.float32).min)  # softmax_max of a row that sees no key (sum 0)


class SparseMode(enum.IntEnum):
    MASK = 0  # atten_mask as given, band from pre/next_tockens
    ALL_MASK = 1  # atten_mask as given, pre/next_tockens ignored
    LEFT_UP_CAUSAL = 2
    RIGHT_DOWN_CAUSAL = 3
    BAND = 4
    PREFIX = 5
    PREFIX_COMPRESS = 6
    RIGHT_DOWN_CAUSAL_BAND = 7
    BAND_LEFT_UP_CAUSAL = 8


CAUSAL_MODES = (SparseMode.LEFT_UP_CAUSAL, SparseMode.RIGHT_DOWN_CAUSAL)
COMPRESSED_MASK_MODES = (SparseMode.LEFT_UP_CAUSAL, SparseMode.RIGHT_DOWN_CAUSAL, SparseMode.BAND,
                         SparseMode.RIGHT_DOWN_CAUSAL_BAND, SparseMode.BAND_LEFT_UP_CAUSAL)

_MASKS = "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None"
_BAND = "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0"
_TAIL = 'int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None'


def _schemas(v3: bool) -> tuple[str, str]:
    """The forward and grad schemas of the v3 op pair (seed, offset and lengths as tensors) or v1's."""
    suffix = "_v3" if v3 else ""
    lengths = ("SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None" if v3
               else "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None")
    returns = "Tensor, Tensor" if v3 else "int, int, int"
    given_dropout = "" if v3 else ", Tensor? dropout_mask=None, int seed=0, int offset=0"
    rng = "Tensor? seed=None, Tensor? offset=None" if v3 else "int seed=0, int offset=0, int numels=0"
    forward = (f"npu_fusion_attention{suffix}(Tensor query, Tensor key, Tensor value, int head_num, "
               f"str input_layout, {_MASKS}, float scale=1., float keep_prob=1., {_BAND}, {lengths}, "
               f"{_TAIL}{given_dropout}) -> (Tensor, Tensor, Tensor, Tensor, {returns})")
    grad = (f"npu_fusion_attention_grad{suffix}(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
            f"str input_layout, *, {_MASKS}, Tensor? softmax_max=None, Tensor? softmax_sum=None, "
            f"Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., float keep_prob=1., "
            f"{_BAND}, {rng}, {lengths}, {_TAIL}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    return forward, grad


FORWARD_V3, GRAD_V3 = _schemas(v3=True)
FORWARD_V1, GRAD_V1 = _schemas(v3=False)
# the fused merge of two partial attention results (online softmax); layouts SBH and TND
RING_UPDATE = ("npu_ring_attention_update(Tensor prev_attn_out, Tensor prev_softmax_max, Tensor prev_softmax_sum, "
               "Tensor cur_attn_out, Tensor cur_softmax_max, Tensor cur_softmax_sum, *, Tensor? actual_seq_qlen=None, "
               'str input_layout="SBH", str input_softmax_layout="") -> (Tensor, Tensor, Tensor)')
SCHEMAS = {s.split("(", 1)[0]: s for s in (FORWARD_V3, GRAD_V3, FORWARD_V1, GRAD_V1, RING_UPDATE)}


def op_exists(name: str) -> bool:
    """Whether ``torch.ops.npu.<name>`` exists (the real op or the emulator's)."""
    try:
        getattr(torch.ops.npu, name)
    except (AttributeError, RuntimeError):
        return False
    return True


_CAUSAL_MASKS: dict[torch.device, Tensor] = {}
_CAUSAL_MASKS_LOCK = threading.Lock()


def causal_mask(device: torch.device | str) -> Tensor:
    """The bool ``triu(ones(2048, 2048), 1)`` mask (True = masked out) for ``device``, built once."""
    device = torch.device(device)
    mask = _CAUSAL_MASKS.get(device)
    if mask is None:
        with _CAUSAL_MASKS_LOCK:
            mask = _CAUSAL_MASKS.get(device)
            if mask is None:
                mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device), 1)
                _CAUSAL_MASKS[device] = mask
                log.debug("built the compressed causal mask for %s", device)
    return mask


def causal_arguments(device: torch.device | str, *, right_down: bool = False) -> dict:
    """``sparse_mode`` 2, or 3 ``right_down`` (a query shorter than its keys sits at their end)."""
    mode = SparseMode.RIGHT_DOWN_CAUSAL if right_down else SparseMode.LEFT_UP_CAUSAL
    return dict(atten_mask=causal_mask(device), sparse_mode=int(mode), next_tockens=0)


def band_arguments(device: torch.device | str, pre_tockens: int, next_tockens: int = 0) -> dict:
    """Query i sees keys i - ``pre_tockens`` .. i + ``next_tockens`` (a causal window of w: (w - 1, 0))."""
    return dict(atten_mask=causal_mask(device), sparse_mode=int(SparseMode.BAND), pre_tockens=pre_tockens,
                next_tockens=next_tockens)


def sdpa_arguments(query: Tensor, key: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
                   scale: float | None) -> dict:
    """SDPA's arguments (BNSD) as the v3 op's, the way torch_npu maps them: scale 1/sqrt(D) unless given,
    keep_prob 1 - dropout_p, ``is_causal`` as sparse_mode 2, a bool ``attn_mask`` (True = attend) inverted
    and broadcast to [1 or B, 1 or N, Sq, Skv]."""
    args = dict(scale=float(scale) if scale is not None else 1.0 / math.sqrt(query.size(-1)),
                keep_prob=1.0 - float(dropout_p))
    if is_causal:
        args.update(causal_arguments(query.device))
    elif attn_mask is not None:
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        heads = query.size(1) if mask.size(1) != 1 else 1
        batch = query.size(0) if mask.size(0) != 1 or heads != 1 else 1
        args.update(atten_mask=torch.logical_not(mask.expand(batch, heads, query.size(2), key.size(2))).contiguous(),
                    sparse_mode=int(SparseMode.MASK))
    return args


def is_compressed_mask(mask: Tensor) -> bool:
    """Whether ``mask`` has the compressed shape: [..., 2048, 2048] with every leading dim 1."""
    shape = tuple(mask.shape)
    return len(shape) >= 2 and shape[-2:] == (MASK_SIZE, MASK_SIZE) and all(s == 1 for s in shape[:-2])


def stats_from_lse(lse: Tensor) -> tuple[Tensor, Tensor]:
    """[B, N, S, 8] float32 (max = LSE, sum = 1): the grad kernel treats them like the forward's own."""
    softmax_max = lse.float().unsqueeze(-1).expand(*lse.shape, STATS_WIDTH).contiguous()
    return softmax_max, torch.ones_like(softmax_max)


def stats_views_from_lse(lse: Tensor) -> tuple[Tensor, Tensor]:
    """``stats_from_lse`` as stride-0 views for autograd to save: 4 bytes per token and head, not 64."""
    shape = (*lse.shape, STATS_WIDTH)
    return lse.float().unsqueeze(-1).expand(shape), torch.ones((), dtype=torch.float32, device=lse.device).expand(shape)


def lse_from_stats(softmax_max: Tensor, softmax_sum: Tensor) -> Tensor:
    return softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())


_REQUIRED = object()  # the default of a parameter that has none
# id(schema) -> (schema held so that its id stays its own, (name, default)s, how many positional, names)
_PARAMETERS: dict[int, tuple[Any, tuple[tuple[str, Any], ...], int, frozenset]] = {}


def _parameters(schema) -> tuple[tuple[tuple[str, Any], ...], int, frozenset]:
    found = _PARAMETERS.get(id(schema))
    if found is None or found[0] is not schema:
        params = tuple((a.name, a.default_value if a.has_default_value() else _REQUIRED) for a in schema.arguments)
        found = _PARAMETERS[id(schema)] = (schema, params, sum(not a.kwarg_only for a in schema.arguments),
                                           frozenset(name for name, _ in params))
    return found[1:]


def bind_arguments(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Defaults filled in (``schema``: ``op._schema`` or a parsed one); TypeError as Python's for a wrong call."""
    params, positional, names = _parameters(schema)
    if len(args) > positional:
        raise TypeError(f"{schema.name}: takes {positional} positional arguments, got {len(args)}")
    bound = {name: value for (name, _), value in zip(params, args)}  # the positional parameters come first
    if kwargs:
        unknown = sorted(kwargs.keys() - names)
        if unknown:
            raise TypeError(f"{schema.name}: unexpected keyword argument(s) {unknown}")
        twice = sorted(bound.keys() & kwargs.keys())
        if twice:
            raise TypeError(f"{schema.name}: argument {twice[0]!r} given twice")
        bound.update(kwargs)
    for name, default in params[len(args):]:
        if name not in bound:
            if default is _REQUIRED:
                raise TypeError(f"{schema.name}: missing required argument {name!r}")
            bound[name] = default
    return bound


def describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"<tensor of shape {tuple(value.shape)} and dtype {value.dtype}>"
    return repr(value)


def check_one_dtype(op: str, a: dict[str, Any], names: tuple[str, ...]) -> None:
    """The op is in no autocast list: float32 q/k (after RoPE) beside a bfloat16 v would reach it."""
    given = [(name, a[name]) for name in names if isinstance(a.get(name), Tensor)]
    if len({t.dtype for _, t in given}) > 1:
        listed = ", ".join(f"{name} {t.dtype}" for name, t in given)
        raise TypeError(f"{op}: {listed}: the op takes one dtype for all of them (float16, bfloat16 or float32); "
                        "cast them to one first (under autocast: torch.get_autocast_dtype(device_type), as "
                        "scaled_dot_product_attention does)")


def autocast_off(device_type: str):
    """A block without the caller's autocast on ``device_type``: a kernel's math as on the device."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """As ``scaled_dot_product_attention`` gets them under autocast (float64 kept as it is)."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


# forward arguments the grad op takes as tensors (saved) and as values (kept on ctx)
_SAVED_INPUTS = ("query", "key", "value", "pse", "padding_mask", "atten_mask", "actual_seq_qlen",
                 "actual_seq_kvlen", "sink")
_PASSED_ON = ("head_num", "input_layout", "keep_prob", "pre_tockens", "next_tockens", "inner_precise",
              "prefix", "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout")


def _autograd_kernel(op, grad_op):
    """derivatives.yaml's formula, the defaults read once: ``torch.library.register_autograd`` reads the
    schema per call, ~0.1 ms per call of these 21-argument ops, host time torch_npu's C++ does not spend."""
    names = [a.name for a in op._schema.arguments]
    defaults = tuple(a.default_value if a.has_default_value() else None for a in op._schema.arguments)
    v3 = len(op._schema.returns) == 6  # seed and offset as tensors
    below_autograd = torch._C._after_autograd_keyset

    def below(keyset, args: tuple):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    class Derivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            output = below(keyset, args)
            ctx.passed = len(args)
            a = dict(zip(names, args + defaults[len(args):]))
            ctx.args = {name: a[name] for name in _PASSED_ON}
            ctx.args["scale_value"] = a["scale"]
            saved = {name: a[name] for name in _SAVED_INPUTS}
            saved.update(attention_in=output[0], softmax_max=output[1], softmax_sum=output[2], softmax_in=output[3])
            if v3:
                ctx.mark_non_differentiable(output[4], output[5])
                saved.update(seed=output[4], offset=output[5])
            else:
                lengths = {name: saved.pop(name) for name in ("actual_seq_qlen", "actual_seq_kvlen")}  # lists
                ctx.args.update(seed=output[4], offset=output[5], numels=output[6], **lengths)
            ctx.saved_names = tuple(saved)
            ctx.save_for_backward(*saved.values())
            return output

        @staticmethod
        def backward(ctx, grad_out, *unused_grads):
            kwargs = dict(zip(ctx.saved_names, ctx.saved_tensors), **ctx.args)
            head_num, layout = kwargs.pop("head_num"), kwargs.pop("input_layout")
            q, k, v = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
            dq, dk, dv, dpse, dsink = grad_op(q, k, v, grad_out, head_num, layout, **kwargs)
            grads = dict(query=dq, key=dk, value=dv, pse=None if kwargs["pse"] is None else dpse,
                         sink=None if kwargs["sink"] is None else dsink)
            return (None, *[grads.get(name) for name in names[:ctx.passed]])

    def kernel(keyset, *args, **kwargs):
        if kwargs:  # the schemas have no keyword-only arguments: the dispatcher passes none
            raise RuntimeError(f"{op}: unexpected keyword-only arguments {sorted(kwargs)}")
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Derivative.apply(keyset, *args)
        return below(keyset, args)

    return kernel


def define_attention_ops(lib, forward: str, grad: str, kernels: tuple, fakes: tuple, dispatch_key: str) -> None:
    """The op pair ``forward`` / ``grad`` (v3 or v1, any name) in ``lib``: kernels, fakes, derivative."""
    fname, gname = (schema.split("(", 1)[0] for schema in (forward, grad))
    lib.define(forward)
    lib.define(grad)
    for name, kernel, fake in ((fname, kernels[0], fakes[0]), (gname, kernels[1], fakes[1])):
        lib.impl(name, kernel, dispatch_key)
        torch.library.register_fake(f"{lib.ns}::{name}", fake, lib=lib)
    ops = getattr(torch.ops, lib.ns)
    lib.impl(fname, _autograd_kernel(getattr(ops, fname).default, getattr(ops, gname)), "Autograd", with_keyset=True)
