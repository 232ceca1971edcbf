"""Defining the emulated ops under ``torch.ops.npu``: schemas (from ``cp_cache.npu_ops``),
CPU kernels and fake kernels over ``attention_math``, and op-plugin's derivative.

Each kernel binds its ``(args, kwargs)`` by the op's schema, so the long argument
lists are written once, in ``npu_ops``.
"""

from __future__ import annotations

import torch

from .. import layout as L
from ..npu_ops import (FORWARD_V1, FORWARD_V3, GRAD_V1, GRAD_V3, autocast_off, bind_arguments, check_one_dtype,
                       define_attention_ops)
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


# ---------------------------------------------------------------- definition

def define_ops() -> torch.library.Library:
    """A library fragment defining the four attention ops and ``npu_ring_attention_update``
    under ``torch.ops.npu``; destroy it to undefine."""
    lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901
    try:
        for forward, grad in ((FORWARD_V3, GRAD_V3), (FORWARD_V1, GRAD_V1)):
            define_attention_ops(lib, forward, grad, (_without_autocast(_forward(forward)),
                                                      _without_autocast(_grad(grad))),
                                 (_forward_fake(forward), _grad_fake(grad)), "CPU")
        ring_update.define(lib)  # npu_ring_attention_update: the fused merge, no autograd
    except Exception:
        lib._destroy()
        raise
    return lib
