"""The emulator against torch_npu 2.14.0's own files: the four op schemas equal the wheel's
``npu_native_functions_by_codegen.yaml``, and the emulator's fake (meta) outputs equal the
wheel's meta functions in shape and dtype for every layout the emulator accepts, on meta
tensors and under FakeTensorMode (TND included: from shapes alone, the lengths unread), with
V's head dim equal to Q/K's and differing from it (MLA: D_qk=12, D_v=8)."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from cp_cache.npu_ops import SCHEMAS
from cp_cache.testing import install_npu_emulator
from cp_cache.testing.torch_npu_wheel import NEWEST, fetch, wheel_meta_functions

VERSION = NEWEST  # torch-npu 2.14.0
OPS = ("npu_fusion_attention_v3", "npu_fusion_attention_grad_v3", "npu_fusion_attention", "npu_fusion_attention_grad")
EMULATED_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")


@pytest.fixture(scope="module", autouse=True)
def wheel_and_emulator():
    fetch(VERSION)  # fails (does not skip) with the loader's message when the index is unreachable
    install_npu_emulator(route_sdpa=False)


@functools.cache
def _wheel_meta() -> dict:
    """{op: the wheel's meta function}, compiled once for the module: extracting them parses the
    wheel's meta files (about 0.6 s), which every test below would otherwise repeat."""
    return {name: fn for name, (fn, _where) in wheel_meta_functions(VERSION).items()}


def _yaml_schemas() -> dict[str, str]:
    text = (fetch(VERSION) / "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").read_text()
    found: dict[str, str] = {}
    for match in re.finditer(r"^\s*-?\s*func:\s*(.+)$", text, flags=re.M):
        schema = match.group(1).strip()
        name = schema.split("(", 1)[0]
        if name in OPS:
            assert found.setdefault(name, schema) == schema, f"{name} appears with two schemas"
    return found


def test_schemas_equal_torch_npu_yaml():
    wheel = _yaml_schemas()
    assert set(wheel) == set(OPS)
    for name in OPS:
        registered = str(getattr(torch.ops.npu, name).default._schema).removeprefix("npu::")
        assert SCHEMAS[name] == wheel[name], name
        assert registered == wheel[name], name


HEAD_DIMS = {"same": (8, 8), "mla": (12, 8)}  # (D of Q/K, D of V)


def _shapes(layout: str, gqa: bool, dims: str) -> tuple:
    """(q, k, v) shapes: B=2, N=4 (Nkv 2 with GQA), S=16 (TND: T=32), Q/K and V head dims of ``dims``."""
    nkv = 2 if gqa else 4
    d, dv = HEAD_DIMS[dims]
    return {
        "BNSD": ((2, 4, 16, d), (2, nkv, 16, d), (2, nkv, 16, dv)),
        "BSND": ((2, 16, 4, d), (2, 16, nkv, d), (2, 16, nkv, dv)),
        "BSH": ((2, 16, 4 * d), (2, 16, nkv * d), (2, 16, nkv * dv)),
        "SBH": ((16, 2, 4 * d), (16, 2, nkv * d), (16, 2, nkv * dv)),
        "TND": ((32, 4, d), (32, nkv, d), (32, nkv, dv)),
    }[layout]


def _inputs(layout: str, dtype: torch.dtype, gqa: bool, dims: str = "same"):
    """q, k, v on the meta device (``_shapes``)."""
    return tuple(torch.empty(shape, device="meta", dtype=dtype) for shape in _shapes(layout, gqa, dims))


def _signature(outputs) -> list:
    return [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else o for o in outputs]


DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("layout", EMULATED_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dims", HEAD_DIMS)
def test_forward_fakes_equal_wheel_meta(layout, dtype, gqa, dims):
    meta = _wheel_meta()
    q, k, v = _inputs(layout, dtype, gqa, dims)
    for name in ("npu_fusion_attention_v3", "npu_fusion_attention"):
        ours = getattr(torch.ops.npu, name)(q, k, v, 4, layout)
        theirs = meta[name](q, k, v, 4, layout)
        assert _signature(ours) == _signature(theirs), name
        assert all(o.device == q.device for o in ours if isinstance(o, torch.Tensor)), name
        assert (ours[0].shape == q.shape) == (dims == "same"), name  # MLA: the output has V's head dim


@pytest.mark.parametrize("layout", EMULATED_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dims", HEAD_DIMS)
def test_grad_fakes_equal_wheel_meta(layout, dtype, gqa, dims):
    meta = _wheel_meta()
    q, k, v = _inputs(layout, dtype, gqa, dims)
    dy = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 4, layout)[0]  # the output's shape: V's head dim
    ours = torch.ops.npu.npu_fusion_attention_grad_v3(q, k, v, dy, 4, layout)
    theirs = meta["npu_fusion_attention_grad_v3"](q, k, v, dy, 4, layout)
    assert _signature(ours) == _signature(theirs)
    ours_v1 = torch.ops.npu.npu_fusion_attention_grad(q, k, v, dy, 4, layout)
    theirs_v1 = meta["npu_fusion_attention_grad"](q, k, v, dy, 4, layout)
    # the wheel's v1 meta returns None for dpse although the schema says Tensor: compare the rest
    assert theirs_v1[3] is None
    assert _signature(ours_v1[:3]) + _signature(ours_v1[4:]) == _signature(theirs_v1[:3]) + _signature(theirs_v1[4:])


ALL_LAYOUTS = EMULATED_LAYOUTS + ("TND",)


def _fake_inputs(mode, layout: str, dtype: torch.dtype, gqa: bool, dims: str = "same"):
    """q, k, v as fake tensors of ``mode`` (``_shapes``) and the lengths each op version takes (TND):
    v3 a fake int64 tensor whose values the fakes cannot read (no constant behind it), v1 a list."""
    q, k, v = (mode.from_tensor(torch.empty(shape, dtype=dtype)) for shape in _shapes(layout, gqa, dims))
    if layout != "TND":
        return q, k, v, {}, {}
    cu = mode.from_tensor(torch.tensor([10, 32]))
    return q, k, v, dict(actual_seq_qlen=cu, actual_seq_kvlen=cu), dict(actual_seq_qlen=[10, 32],
                                                                        actual_seq_kvlen=[10, 32])


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dims", HEAD_DIMS)
def test_fakes_equal_wheel_meta_under_fake_tensor_mode(layout, dtype, gqa, dims):
    """Under FakeTensorMode (what torch.compile traces with), every layout TND included: the fakes
    work from shapes alone (reading a lengths value would raise DataDependentOutputException) and
    give the wheel's meta outputs: shapes, dtypes and the v1 ints."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    meta = _wheel_meta()
    mode = FakeTensorMode()
    with mode:
        q, k, v, lengths_v3, lengths_v1 = _fake_inputs(mode, layout, dtype, gqa, dims)
        for name, lengths in (("npu_fusion_attention_v3", lengths_v3), ("npu_fusion_attention", lengths_v1)):
            ours = getattr(torch.ops.npu, name)(q, k, v, 4, layout, **lengths)
            theirs = meta[name](q, k, v, 4, layout, **lengths)
            assert _signature(ours) == _signature(theirs), name
            assert all(isinstance(o, FakeTensor) for o in ours if isinstance(o, torch.Tensor)), name
        out = ours[0]
        for name, lengths in (("npu_fusion_attention_grad_v3", lengths_v3), ("npu_fusion_attention_grad", lengths_v1)):
            ours = getattr(torch.ops.npu, name)(q, k, v, out, 4, layout, attention_in=out, **lengths)
            theirs = meta[name](q, k, v, out, 4, layout, attention_in=out, **lengths)
            if name == "npu_fusion_attention_grad":  # the wheel's v1 meta gives None for dpse
                assert theirs[3] is None
                ours, theirs = ours[:3] + ours[4:], theirs[:3] + theirs[4:]
            assert _signature(ours) == _signature(theirs), name


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", HEAD_DIMS)
def test_sink_fakes_equal_wheel_meta(layout, dtype, dims):
    """With a sink (float32 [N]; a float64 one to tell the sink's dtype from the default): the
    forward's outputs as without, and the grads' dsink in the sink's shape and dtype, under
    FakeTensorMode as the wheel's meta functions give them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = _wheel_meta()
    mode = FakeTensorMode()
    with mode:
        q, k, v, lengths_v3, lengths_v1 = _fake_inputs(mode, layout, dtype, gqa=False, dims=dims)
        for sink_dtype in (torch.float32, torch.float64):
            sink = mode.from_tensor(torch.empty(4, dtype=sink_dtype))
            for name, lengths in (("npu_fusion_attention_v3", lengths_v3), ("npu_fusion_attention", lengths_v1)):
                ours = getattr(torch.ops.npu, name)(q, k, v, 4, layout, sink=sink, **lengths)
                theirs = meta[name](q, k, v, 4, layout, sink=sink, **lengths)
                assert _signature(ours) == _signature(theirs), (name, sink_dtype)
            out = ours[0]
            for name, lengths in (("npu_fusion_attention_grad_v3", lengths_v3),
                                  ("npu_fusion_attention_grad", lengths_v1)):
                ours = getattr(torch.ops.npu, name)(q, k, v, out, 4, layout, attention_in=out, sink=sink, **lengths)
                theirs = meta[name](q, k, v, out, 4, layout, attention_in=out, sink=sink, **lengths)
                if name == "npu_fusion_attention_grad":  # the wheel's v1 meta gives None for dpse
                    ours, theirs = ours[:3] + ours[4:], theirs[:3] + theirs[4:]
                assert _signature(ours) == _signature(theirs), (name, sink_dtype)
                assert (tuple(ours[-1].shape), ours[-1].dtype) == ((4,), sink_dtype), name


def test_tnd_without_lengths_is_refused_by_name():
    # TND is emulated (tests/python/test_varlen_emulator.py); it needs the cumulative lengths
    q = torch.empty(32, 4, 8, device="meta")
    with pytest.raises(ValueError, match=r"input_layout='TND' needs actual_seq_qlen"):
        torch.ops.npu.npu_fusion_attention_v3(q, q, q, 4, "TND")


def test_v1_given_dropout_inputs_are_refused_by_name():
    q = torch.randn(1, 2, 4, 8)
    for name, value in (("dropout_mask", torch.ones(1, 2, 4, 4, dtype=torch.uint8)), ("seed", 3), ("offset", 5)):
        with pytest.raises(NotImplementedError, match=rf"{name}="):
            torch.ops.npu.npu_fusion_attention(q, q, q, 2, "BNSD", **{name: value})
