"""The conventions of torch_npu's fused attention ops that the handlers, the step kernels and
the emulator share: the op schemas and binding a call's arguments by name, the sparse modes,
the compressed causal mask, the ``[B, N, S, 8]`` softmax statistics and the dtype rules (the op
takes one dtype and is in no autocast list). Layouts live in ``layout.py``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["bind_arguments", "describe", "INT_MAX", "MASK_SIZE", "STATS_WIDTH", "FLOAT32_LOWEST",
           "SparseMode", "CAUSAL_MODES", "COMPRESSED_MASK_MODES", "FORWARD_V3", "GRAD_V3", "FORWARD_V1",
           "GRAD_V1", "RING_UPDATE", "SCHEMAS", "causal_mask", "is_compressed_mask", "stats_from_lse",
           "stats_views_from_lse", "lse_from_stats", "op_exists", "check_one_dtype", "autocast_off",
           "autocast_inputs", "define_attention_ops"]

log = logging.getLogger("cp_cache")

INT_MAX = 2147483647  # default of pre_tockens / next_tockens: no band limit
MASK_SIZE = 2048  # side of the compressed mask that sparse modes 2, 3, 4, 7, 8 take
STATS_WIDTH = 8  # softmax_max / softmax_sum are [B, N, S, 8] float32, the value replicated
FLOAT32_LOWEST = float(torch.finfo(torch.float32).min)  # softmax_max of a row that sees no key (sum 0)


class SparseMode(enum.IntEnum):
    """``sparse_mode`` of the fused attention ops."""

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
COMPRESSED_MASK_MODES = (
    SparseMode.LEFT_UP_CAUSAL, SparseMode.RIGHT_DOWN_CAUSAL, SparseMode.BAND,
    SparseMode.RIGHT_DOWN_CAUSAL_BAND, SparseMode.BAND_LEFT_UP_CAUSAL,
)

# ---------------------------------------------------------------- schemas (v1: seed, offset and lengths as ints)

_MASKS = "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None"
_BAND = "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0"
_TAIL = 'int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None'


def _lengths(v3: bool) -> str:
    if v3:
        return "SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None"
    return "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None"


def _forward_schema(v3: bool) -> str:
    name = "npu_fusion_attention_v3" if v3 else "npu_fusion_attention"
    returns = "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)" if v3 else "(Tensor, Tensor, Tensor, Tensor, int, int, int)"
    given_dropout = "" if v3 else ", Tensor? dropout_mask=None, int seed=0, int offset=0"
    return (
        f"{name}(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, {_MASKS}, "
        f"float scale=1., float keep_prob=1., {_BAND}, {_lengths(v3)}, {_TAIL}{given_dropout}) -> {returns}"
    )


def _grad_schema(v3: bool) -> str:
    name = "npu_fusion_attention_grad_v3" if v3 else "npu_fusion_attention_grad"
    rng = "Tensor? seed=None, Tensor? offset=None" if v3 else "int seed=0, int offset=0, int numels=0"
    return (
        f"{name}(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str input_layout, *, "
        f"{_MASKS}, Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        f"Tensor? attention_in=None, float scale_value=1., float keep_prob=1., {_BAND}, {rng}, "
        f"{_lengths(v3)}, {_TAIL}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    )


FORWARD_V3 = _forward_schema(v3=True)
GRAD_V3 = _grad_schema(v3=True)
FORWARD_V1 = _forward_schema(v3=False)
GRAD_V1 = _grad_schema(v3=False)
# the fused merge of two partial attention results (online softmax); layouts SBH and TND
RING_UPDATE = (
    "npu_ring_attention_update(Tensor prev_attn_out, Tensor prev_softmax_max, Tensor prev_softmax_sum, "
    "Tensor cur_attn_out, Tensor cur_softmax_max, Tensor cur_softmax_sum, *, Tensor? actual_seq_qlen=None, "
    'str input_layout="SBH", str input_softmax_layout="") -> (Tensor, Tensor, Tensor)'
)
SCHEMAS = {s.split("(", 1)[0]: s for s in (FORWARD_V3, GRAD_V3, FORWARD_V1, GRAD_V1, RING_UPDATE)}


def op_exists(name: str) -> bool:
    """Whether ``torch.ops.npu.<name>`` exists (the real op or the emulator's)."""
    try:
        getattr(torch.ops.npu, name)
    except (AttributeError, RuntimeError):
        return False
    return True


# ---------------------------------------------------------------- the compressed causal mask

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
    """The op's mask arguments for causal attention: ``sparse_mode`` 2 (left-up) or, ``right_down``,
    3 (a query shorter than its keys sits at their end; packed documents: causal in each)."""
    mode = SparseMode.RIGHT_DOWN_CAUSAL if right_down else SparseMode.LEFT_UP_CAUSAL
    return dict(atten_mask=causal_mask(device), sparse_mode=int(mode), next_tockens=0)


def band_arguments(device: torch.device | str, pre_tockens: int, next_tockens: int = 0) -> dict:
    """The op's mask arguments for a band: query i sees keys i - ``pre_tockens`` .. i + ``next_tockens``
    (a causal window of w keys: (w - 1, 0))."""
    return dict(atten_mask=causal_mask(device), sparse_mode=int(SparseMode.BAND), pre_tockens=pre_tockens,
                next_tockens=next_tockens)


def is_compressed_mask(mask: Tensor) -> bool:
    """Whether ``mask`` has the compressed shape: [..., 2048, 2048] with every leading dim 1."""
    shape = tuple(mask.shape)
    return len(shape) >= 2 and shape[-2:] == (MASK_SIZE, MASK_SIZE) and all(s == 1 for s in shape[:-2])


# ---------------------------------------------------------------- softmax statistics


def stats_from_lse(lse: Tensor) -> tuple[Tensor, Tensor]:
    """(softmax_max, softmax_sum) [B, N, S, 8] float32 encoding ``lse`` as max = LSE, sum = 1 (the grad
    kernel treats them like the forward's own pair)."""
    softmax_max = lse.float().unsqueeze(-1).expand(*lse.shape, STATS_WIDTH).contiguous()
    return softmax_max, torch.ones_like(softmax_max)


def stats_views_from_lse(lse: Tensor) -> tuple[Tensor, Tensor]:
    """``stats_from_lse`` as stride-0 views: 4 bytes per query token and head, not 64, for autograd to
    save (docs/lifetime.md); the grad kernels get the contiguous form."""
    shape = (*lse.shape, STATS_WIDTH)
    one = torch.ones((), dtype=torch.float32, device=lse.device)
    return lse.float().unsqueeze(-1).expand(shape), one.expand(shape)


def lse_from_stats(softmax_max: Tensor, softmax_sum: Tensor) -> Tensor:
    """The float32 LSE [B, N, S] of the ops' statistics: max + log(sum)."""
    return softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())


# ---------------------------------------------------------------- a call's arguments by name


class _Parameter(NamedTuple):
    name: str
    positional: bool
    has_default: bool
    default: Any


# id(schema) -> (schema, its parameters, how many may be positional, their names); the schema is held so
# that its id stays its own
_PARAMETERS: dict[int, tuple[Any, tuple[_Parameter, ...], int, frozenset]] = {}


def _parameters(schema) -> tuple[tuple[_Parameter, ...], int, frozenset]:
    found = _PARAMETERS.get(id(schema))
    if found is None or found[0] is not schema:
        params = tuple(_Parameter(a.name, not a.kwarg_only, a.has_default_value(),
                                  a.default_value if a.has_default_value() else None) for a in schema.arguments)
        found = _PARAMETERS[id(schema)] = (schema, params, sum(p.positional for p in params),
                                           frozenset(p.name for p in params))
    return found[1:]


def bind_arguments(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in (``schema``: ``op._schema`` or a parsed
    schema); TypeError as Python's for a wrong call."""
    params, positional, names = _parameters(schema)
    if len(args) > positional:
        raise TypeError(f"{schema.name}: takes {positional} positional arguments, got {len(args)}")
    bound = {p.name: value for p, value in zip(params, args)}  # the positional parameters come first
    if kwargs:
        unknown = sorted(kwargs.keys() - names)
        if unknown:
            raise TypeError(f"{schema.name}: unexpected keyword argument(s) {unknown}")
        twice = sorted(bound.keys() & kwargs.keys())
        if twice:
            raise TypeError(f"{schema.name}: argument {twice[0]!r} given twice")
        bound.update(kwargs)
    for p in params[len(args):]:
        if p.name not in bound:
            if not p.has_default:
                raise TypeError(f"{schema.name}: missing required argument {p.name!r}")
            bound[p.name] = p.default
    return bound


def describe(value: Any) -> str:
    """An argument for error messages (tensors by shape and dtype)."""
    if isinstance(value, Tensor):
        return f"<tensor of shape {tuple(value.shape)} and dtype {value.dtype}>"
    return repr(value)


def check_one_dtype(op: str, a: dict[str, Any], names: tuple[str, ...]) -> None:
    """TypeError naming them unless the given inputs ``names`` share one dtype: the op is in no
    autocast list, so float32 q/k (after RoPE) beside a bfloat16 v would reach it."""
    given = [(name, a[name]) for name in names if isinstance(a.get(name), Tensor)]
    dtypes = {t.dtype for _, t in given}
    if len(dtypes) > 1:
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
    """``tensors`` as ``scaled_dot_product_attention`` receives them under autocast: every floating
    tensor but float64 in autocast's dtype where it is on for their device (one dtype for the op)."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


# ---------------------------------------------------------------- defining an op pair (op-plugin's derivative)

# forward arguments the grad op takes as tensors (saved) and as values (kept on ctx)
_SAVED_INPUTS = ("query", "key", "value", "pse", "padding_mask", "atten_mask", "actual_seq_qlen",
                 "actual_seq_kvlen", "sink")
_PASSED_ON = ("head_num", "input_layout", "keep_prob", "pre_tockens", "next_tockens", "inner_precise",
              "prefix", "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout")


def _derivative(forward, grad_op, v3: bool):
    """(setup_context, backward) of derivatives.yaml's formula: the grad op gets the forward's inputs
    and saved outputs (result0 as attention_in, result1/2 as softmax_max/sum, result3 as softmax_in,
    result4/5 as seed/offset; v1 passes them and the lengths as ints and lists, on ctx)."""
    names = [arg.name for arg in forward._schema.arguments]

    def setup_context(ctx, inputs, output):
        a = dict(zip(names, inputs))
        ctx.args = {name: a[name] for name in _PASSED_ON}
        ctx.args["scale_value"] = a["scale"]
        saved_outputs = list(output[:4])
        if v3:
            ctx.mark_non_differentiable(output[4], output[5])
            saved_outputs += [output[4], output[5]]
            ctx.rng = {}
        else:
            ctx.rng = dict(seed=output[4], offset=output[5], numels=output[6],
                           actual_seq_qlen=a["actual_seq_qlen"], actual_seq_kvlen=a["actual_seq_kvlen"])
        inputs_saved = [a[name] for name in _SAVED_INPUTS]
        if not v3:
            inputs_saved[6] = inputs_saved[7] = None  # lists travel on ctx.rng
        ctx.save_for_backward(*inputs_saved, *saved_outputs)

    def backward(ctx, grad_out, *unused_grads):
        saved = ctx.saved_tensors
        inputs = dict(zip(_SAVED_INPUTS, saved[:len(_SAVED_INPUTS)]))
        results = saved[len(_SAVED_INPUTS):]
        kwargs = dict(ctx.args, **ctx.rng)
        if v3:
            kwargs.update(seed=results[4], offset=results[5], actual_seq_qlen=inputs["actual_seq_qlen"],
                          actual_seq_kvlen=inputs["actual_seq_kvlen"])
        head_num, layout = kwargs.pop("head_num"), kwargs.pop("input_layout")
        dq, dk, dv, dpse, dsink = grad_op(
            inputs["query"], inputs["key"], inputs["value"], grad_out, head_num, layout, pse=inputs["pse"],
            padding_mask=inputs["padding_mask"], atten_mask=inputs["atten_mask"], softmax_max=results[1],
            softmax_sum=results[2], softmax_in=results[3], attention_in=results[0], sink=inputs["sink"], **kwargs)
        grads = dict.fromkeys(names)
        grads.update(query=dq, key=dk, value=dv, pse=None if inputs["pse"] is None else dpse,
                     sink=None if inputs["sink"] is None else dsink)
        return tuple([grads[name] for name in names])

    return setup_context, backward


def _autograd_kernel(op, setup_context, backward):
    """The op's Autograd kernel: ``backward`` around the op run below autograd, ``setup_context`` given
    every argument (defaults read once here: ``torch.library.register_autograd`` reads the schema per
    call, about 0.1 ms per call of these 21-argument ops, host time torch_npu's C++ does not spend)."""
    defaults = tuple(a.default_value if a.has_default_value() else None for a in op._schema.arguments)
    below_autograd = torch._C._after_autograd_keyset

    def below(keyset, args: tuple):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    class Derivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            output = below(keyset, args)
            ctx.passed = len(args)
            setup_context(ctx, args + defaults[len(args):], output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return (None, *backward(ctx, *grads)[:ctx.passed])

    def kernel(keyset, *args, **kwargs):
        if kwargs:  # the schemas have no keyword-only arguments: the dispatcher passes none
            raise RuntimeError(f"{op}: unexpected keyword-only arguments {sorted(kwargs)}")
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Derivative.apply(keyset, *args)
        return below(keyset, args)

    return kernel


def define_attention_ops(lib, forward: str, grad: str, kernels: tuple, fakes: tuple, dispatch_key: str) -> None:
    """Define the op pair of the schemas ``forward`` / ``grad`` (a v3 or v1 pair, under any name) in the
    library fragment ``lib``: their ``kernels`` and ``fakes`` (forward, grad) and the derivative."""
    namespace = lib.ns
    fname, gname = (schema.split("(", 1)[0] for schema in (forward, grad))
    lib.define(forward)
    lib.define(grad)
    for name, kernel, fake in ((fname, kernels[0], fakes[0]), (gname, kernels[1], fakes[1])):
        lib.impl(name, kernel, dispatch_key)
        torch.library.register_fake(f"{namespace}::{name}", fake, lib=lib)
    ops = getattr(torch.ops, namespace)
    v3 = len(getattr(ops, fname).default._schema.returns) == 6  # seed and offset as tensors
    setup_context, backward = _derivative(getattr(ops, fname).default, getattr(ops, gname), v3)
    lib.impl(fname, _autograd_kernel(getattr(ops, fname).default, setup_context, backward), "Autograd",
             with_keyset=True)
