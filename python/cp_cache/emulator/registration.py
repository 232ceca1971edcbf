"""Defining the emulated ops under ``torch.ops.npu``: schemas (from ``cp_cache.npu_ops``),
CPU kernels and fake kernels over ``attention_math``, and op-plugin's derivative.

Each kernel binds its ``(args, kwargs)`` by the op's schema, so the long argument
lists are written once, in ``npu_ops``.
"""

from __future__ import annotations

import torch

from .. import layout as L
from ..npu_ops import FORWARD_V1, FORWARD_V3, GRAD_V1, GRAD_V3, autocast_off, bind_arguments, check_one_dtype
from . import attention_math as M
from . import ring_update
from . import varlen_math as V

__all__ = ["define_ops"]

_SCHEMAS = {s: torch._C.parse_schema(s) for s in (FORWARD_V3, GRAD_V3, FORWARD_V1, GRAD_V1)}


def _bind(schema: str, args: tuple, kwargs: dict) -> dict:
    return bind_arguments(_SCHEMAS[schema], args, kwargs)


_ONE_DTYPE = ("query", "key", "value", "dy", "attention_in")  # those of them the op takes


def _without_autocast(kernel):
    """A CPU kernel run as a device kernel runs: the caller's autocast does not reach its math."""
    def run(*args, **kwargs):
        with autocast_off("cpu"):
            return kernel(*args, **kwargs)

    return run


def _check_no_given_dropout(a: dict) -> None:
    """The v1 forward's dropout_mask / seed / offset inputs: the emulator draws its own."""
    for name, default in (("dropout_mask", None), ("seed", 0), ("offset", 0)):
        if a[name] is not default and a[name] != default:
            raise NotImplementedError(
                f"npu emulator: {name}={M.describe(a[name])} is not supported (the emulator draws its "
                f"own dropout seed and offset; only {name}={default})"
            )


def _check(a: dict, *, read_values: bool) -> "M._Dims":
    """The call's dims, checked; ``read_values=False`` (the fakes): from shapes alone, as torch_npu's
    meta functions (TND's lengths tensors are not read: under fake tensors their values are unknown)."""
    check_one_dtype("npu_fusion_attention", a, _ONE_DTYPE)
    if a["input_layout"] == V.LAYOUT:
        return V.check_tnd_call(a["query"], a["key"], a["value"], a["head_num"], a["pse"], a["padding_mask"],
                                a["atten_mask"], a["keep_prob"], a["prefix"], a["actual_seq_qlen"],
                                a["actual_seq_kvlen"], a["sparse_mode"], a["softmax_layout"], a["sink"],
                                read_values=read_values)
    return M.check_call(a["query"], a["key"], a["value"], a["head_num"], a["input_layout"], a["pse"],
                        a["padding_mask"], a["keep_prob"], a["prefix"], a["actual_seq_qlen"],
                        a["actual_seq_kvlen"], a["sparse_mode"], a["softmax_layout"], a["sink"])


def _forward_arguments(schema: str, args: tuple, kwargs: dict, read_values: bool) -> tuple[dict, "M._Dims"]:
    """The forward op's bound arguments and dimensions, checked (the CPU and fake kernels alike)."""
    a = _bind(schema, args, kwargs)
    d = _check(a, read_values=read_values)
    if schema != FORWARD_V3:
        _check_no_given_dropout(a)
    return a, d


def _dropout_numels(a: dict, d) -> int:
    if isinstance(d, V.TndDims):
        return V.dropout_numels(d) if a["keep_prob"] < 1.0 else 0
    return d.B * d.Nq * d.Sq * d.Skv if a["keep_prob"] < 1.0 else 0


# ---------------------------------------------------------------- forward


def _forward(schema: str):
    v3 = schema == FORWARD_V3

    def kernel(*args, **kwargs):
        a, d = _forward_arguments(schema, args, kwargs, read_values=True)
        seed, offset = M.draw_seed_offset(a["keep_prob"])
        math = V.tnd_forward if isinstance(d, V.TndDims) else M.forward_math
        layout_arg = () if isinstance(d, V.TndDims) else (a["input_layout"],)
        out, smax, ssum = math(
            a["query"], a["key"], a["value"], d, *layout_arg, a["atten_mask"], a["scale"],
            a["keep_prob"], a["pre_tockens"], a["next_tockens"], a["sparse_mode"], int(seed[0]), int(offset[0]),
            a["sink"],
        )
        softmax_out = M.empty(a["query"].dtype, a["query"].device)
        if v3:
            return out, smax, ssum, softmax_out, seed, offset
        return out, smax, ssum, softmax_out, int(seed[0]), int(offset[0]), _dropout_numels(a, d)

    return kernel


def _forward_fake(schema: str):
    v3 = schema == FORWARD_V3

    def kernel(*args, **kwargs):
        a, d = _forward_arguments(schema, args, kwargs, read_values=False)
        query = a["query"]
        stat_shape = V.stats_shape(d) if isinstance(d, V.TndDims) else (d.B, d.Nq, d.Sq, M.STATS_WIDTH)
        sdt = M.stat_dtype(query.dtype)
        out_shape = L.output_shape(query, a["key"], a["value"], a["input_layout"], a["head_num"])
        tensors = (
            query.new_empty(out_shape),  # the query's shape with V's head size (MLA), as the meta function
            query.new_empty(stat_shape, dtype=sdt),
            query.new_empty(stat_shape, dtype=sdt),
            query.new_empty((0,)),
        )
        if v3:
            return tensors + (torch.empty(1, dtype=torch.int64, device=query.device),
                              torch.empty(1, dtype=torch.int64, device=query.device))
        return tensors + (0, 0, _dropout_numels(a, d))

    return kernel


# ---------------------------------------------------------------- grad


def _empty_dsink(schema: str, query: torch.Tensor) -> torch.Tensor:
    """dsink when no sink is given, float32 as torch_npu's meta functions give it:
    0-d from the v3 grad, [0] from v1."""
    shape = () if schema == GRAD_V3 else (0,)
    return torch.zeros(shape, dtype=torch.float32, device=query.device)


def _fake_dsink(schema: str, query: torch.Tensor, sink) -> torch.Tensor:
    """dsink's shape as torch_npu's meta functions give it: the sink's shape and dtype, on the
    query's device; without a sink, ``_empty_dsink``."""
    if sink is None:
        return _empty_dsink(schema, query)
    return torch.empty(sink.shape, dtype=sink.dtype, device=query.device)


def _grad(schema: str):
    def kernel(*args, **kwargs):
        a = _bind(schema, args, kwargs)
        d = _check(a, read_values=True)
        query = a["query"]
        out_shape = L.output_shape(query, a["key"], a["value"], a["input_layout"], a["head_num"])
        if tuple(a["dy"].shape) != out_shape:
            raise ValueError(
                f"npu_fusion_attention_grad: dy shape {list(a['dy'].shape)} != the output's shape {list(out_shape)} "
                f"(the query's {list(query.shape)} with the value's head size)"
            )
        dropout = a["keep_prob"] < 1.0
        math = V.tnd_backward if isinstance(d, V.TndDims) else M.backward_math
        layout_arg = () if isinstance(d, V.TndDims) else (a["input_layout"],)
        dq, dk, dv, dsink = math(
            query, a["key"], a["value"], a["dy"], d, *layout_arg, a["atten_mask"], a["softmax_max"],
            a["softmax_sum"], a["attention_in"], a["scale_value"], a["keep_prob"], a["pre_tockens"],
            a["next_tockens"], a["sparse_mode"],
            M.read_int(a["seed"]) if dropout else 0, M.read_int(a["offset"]) if dropout else 0, a["sink"],
        )
        if dsink is None:
            dsink = _empty_dsink(schema, query)
        return dq, dk, dv, M.empty(query.dtype, query.device), dsink

    return kernel


def _grad_fake(schema: str):
    def kernel(*args, **kwargs):
        a = _bind(schema, args, kwargs)
        _check(a, read_values=False)
        query = a["query"]
        return (
            torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(a["key"], memory_format=torch.contiguous_format),
            torch.empty_like(a["value"], memory_format=torch.contiguous_format),
            query.new_empty((0,)),
            _fake_dsink(schema, query, a["sink"]),
        )

    return kernel


# ---------------------------------------------------------------- autograd (derivatives.yaml)

# forward arguments the grad op takes as tensors (saved) and as values (kept on ctx)
_SAVED_INPUTS = ("query", "key", "value", "pse", "padding_mask", "atten_mask", "actual_seq_qlen",
                 "actual_seq_kvlen", "sink")
_PASSED_ON = ("head_num", "input_layout", "keep_prob", "pre_tockens", "next_tockens", "inner_precise",
              "prefix", "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout")


def _derivative(forward_schema: str, grad_op_name: str):
    """(setup_context, backward) of op-plugin's formula: the grad op gets the forward's
    inputs and its saved outputs (result0 as attention_in, result1/2 as softmax_max/sum,
    result3 as softmax_in, result4/5 as seed/offset)."""
    v3 = forward_schema == FORWARD_V3
    names = [arg.name for arg in _SCHEMAS[forward_schema].arguments]

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
            # v1 passes seed/offset/numels as ints and the lengths as lists
            ctx.rng = dict(seed=output[4], offset=output[5], numels=output[6],
                           actual_seq_qlen=a["actual_seq_qlen"], actual_seq_kvlen=a["actual_seq_kvlen"])
        inputs_saved = [a[name] for name in _SAVED_INPUTS]
        if not v3:
            inputs_saved[6] = inputs_saved[7] = None  # lists travel on ctx.rng
        ctx.save_for_backward(*inputs_saved, *saved_outputs)

    def backward(ctx, grad_out, *unused_grads):
        saved = ctx.saved_tensors
        inputs = dict(zip(_SAVED_INPUTS, saved[: len(_SAVED_INPUTS)]))
        results = saved[len(_SAVED_INPUTS):]
        kwargs = dict(ctx.args)
        kwargs.update(ctx.rng)
        if v3:
            kwargs.update(seed=results[4], offset=results[5],
                          actual_seq_qlen=inputs["actual_seq_qlen"], actual_seq_kvlen=inputs["actual_seq_kvlen"])
        head_num, layout = kwargs.pop("head_num"), kwargs.pop("input_layout")
        grad_op = getattr(torch.ops.npu, grad_op_name)
        dq, dk, dv, dpse, dsink = grad_op(
            inputs["query"], inputs["key"], inputs["value"], grad_out, head_num, layout,
            pse=inputs["pse"], padding_mask=inputs["padding_mask"], atten_mask=inputs["atten_mask"],
            softmax_max=results[1], softmax_sum=results[2], softmax_in=results[3], attention_in=results[0],
            sink=inputs["sink"], **kwargs,
        )
        grads = dict.fromkeys(names)
        grads.update(query=dq, key=dk, value=dv)
        grads["pse"] = dpse if inputs["pse"] is not None else None
        grads["sink"] = dsink if inputs["sink"] is not None else None
        return tuple([grads[name] for name in names])

    return setup_context, backward


def _autograd_kernel(op, setup_context, backward):
    """The op's Autograd kernel: ``backward`` (op-plugin's formula) around the op run below
    autograd, ``setup_context`` given every argument (the ones the dispatcher left out as equal
    to their defaults filled in). What ``torch.library.register_autograd`` registers, without its
    per-call cost: that fills the defaults by reading the schema's argument list once per
    argument, about 0.1 ms per call of these 21-argument ops that needs a gradient, host time
    torch_npu's C++ autograd does not spend (and which would count as cp_cache's in the
    ``overhead`` bench); the defaults are read once here."""
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


# ---------------------------------------------------------------- definition

_OPS = (  # (forward schema, grad schema)
    (FORWARD_V3, GRAD_V3),
    (FORWARD_V1, GRAD_V1),
)


def _name(schema: str) -> str:
    return schema.split("(", 1)[0]


def define_ops() -> torch.library.Library:
    """A library fragment defining the four attention ops and ``npu_ring_attention_update``
    under ``torch.ops.npu``; destroy it to undefine."""
    lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901
    try:
        for forward, grad in _OPS:
            fname, gname = _name(forward), _name(grad)
            lib.define(forward)
            lib.define(grad)
            lib.impl(fname, _without_autocast(_forward(forward)), "CPU")
            lib.impl(gname, _without_autocast(_grad(grad)), "CPU")
            torch.library.register_fake(f"npu::{fname}", _forward_fake(forward), lib=lib)
            torch.library.register_fake(f"npu::{gname}", _grad_fake(grad), lib=lib)
            setup_context, backward = _derivative(forward, gname)
            lib.impl(fname, _autograd_kernel(getattr(torch.ops.npu, fname).default, setup_context, backward),
                     "Autograd", with_keyset=True)
        ring_update.define(lib)  # npu_ring_attention_update: the fused merge, no autograd
    except Exception:
        lib._destroy()
        raise
    return lib
