"""torch_npu's own CP Python files (torch-npu wheels from PyPI) loaded over the NPU emulator.

For each supported torch-npu version: the wheel's files are fetched (a failed fetch is a
failure, with the loader's message, not a skip), the CP modules are loaded, torch's CP
dispatcher entry then installs torch_npu's handlers and its exit takes them out, and
leaving the loader gives torch back exactly as it was. One causal ring attention forward
and backward at W=2 (load balancing on and off) runs through torch_npu's handlers and is
compared with a dense float64 computation.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from cp_cache.testing import install_npu_emulator
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import dense_attention, error_bound, rank_positions
from cp_cache.testing.torch_npu_wheel import (
    CP_STRATEGY_TYPE_ERROR,
    VERSIONS,
    cp_strategy_breaks_on_this_torch,
    fetch,
    load_torch_npu_cp,
    wheel_meta_functions,
    wheel_root,
)

B, N, D, S_LOCAL = 1, 2, 8, 16  # global sequence 32 at W=2
WORLD = 2
MASK = 2048


def _root(version: str):
    try:
        return fetch(version)
    except Exception as e:  # noqa: BLE001 - the loader's message is the failure
        pytest.fail(f"fetching torch-npu {version} failed: {e}", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def emulator():
    install_npu_emulator(route_sdpa=True)
    yield


def _cp_attention():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


# ---------------------------------------------------------------- fetch, load, unload (this process)


@pytest.mark.parametrize("version", VERSIONS)
def test_fetch_gives_the_cp_files(version):
    root = _root(version)
    assert wheel_root(version) == root
    cp = root / "torch_npu/distributed/tensor/experimental/_context_parallel"
    assert (cp / "_npu_attention.py").is_file()
    assert (root / "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").is_file()
    assert not list(root.rglob("*.whl")) and not list(root.rglob("*.so"))


def test_wheel_root_names_version_folder_and_command(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        wheel_root("9.9.9", cache_dir=tmp_path)
    text = str(err.value)
    assert "9.9.9" in text and str(tmp_path / "9.9.9") in text and "fetch" in text


@pytest.mark.parametrize("version", VERSIONS)
def test_load_patches_torch_and_exit_restores_it(version):
    _root(version)
    from torch.distributed.tensor import DTensor

    att = _cp_attention()
    before = dict(vars(att))
    handlers_before = DTensor._op_dispatcher._custom_op_handlers
    table_before = dict(handlers_before)
    existing_before = dict(att.existing_custom_ops)
    prop = DTensor._op_dispatcher.sharding_propagator
    strategies_before = dict(prop.op_strategy_funcs)
    implicit_before = DTensor._op_dispatcher._allow_implicit_replication
    v3 = torch.ops.npu.npu_fusion_attention_v3.default

    with load_torch_npu_cp(version) as loaded:
        assert loaded.version == version
        assert att._enable_cp_dtensor_dispatcher is loaded.enable_dispatcher
        assert att._disable_cp_dtensor_dispatcher is loaded.disable_dispatcher
        assert loaded.enable_dispatcher.__module__.startswith("torch_npu.")
        patched = {c.target.rsplit(".", 1)[-1] for c in loaded.changes if c.where == "module attribute"}
        assert {"_enable_cp_dtensor_dispatcher", "_disable_cp_dtensor_dispatcher"} <= patched
        assert loaded.custom_ops[v3] is loaded.forward_handler
        assert (loaded.step_cache_stack is not None) == (version == "2.12.0")
        assert "torch_npu" in sys.modules

    after = vars(att)
    assert set(after) == set(before)
    assert all(after[k] is before[k] for k in before), [k for k in before if after[k] is not before[k]]
    assert DTensor._op_dispatcher._custom_op_handlers is handlers_before
    assert dict(handlers_before) == table_before
    assert dict(att.existing_custom_ops) == existing_before
    assert dict(prop.op_strategy_funcs) == strategies_before
    assert DTensor._op_dispatcher._allow_implicit_replication == implicit_before
    assert not [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]


def test_versions_load_one_after_the_other():
    for version in VERSIONS:
        _root(version)
    seen = []
    for version in VERSIONS + VERSIONS[:1]:
        with load_torch_npu_cp(version) as loaded:
            seen.append(loaded.cp_module.__file__)
            with pytest.raises(RuntimeError, match="exit it first"):
                with load_torch_npu_cp(version):
                    pass
    assert len(set(seen)) == len(VERSIONS)


def test_what_differs_between_the_versions():
    """What docs/ascend.md says was checked: torch-npu 2.14.0's kept files (CP handlers, op schemas,
    meta functions) equal 2.13.0's but for version.py; 2.12.0's CP handlers differ (its stack)."""
    def files(version):
        root = _root(version)
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and p.name != ".cp_cache-extracted"}

    newest, previous, oldest = (files(v) for v in ("2.14.0", "2.13.0", "2.12.0"))
    assert set(newest) == set(previous)
    assert [name for name in newest if newest[name] != previous[name]] == ["torch_npu/version.py"]
    handlers = "torch_npu/distributed/tensor/experimental/_context_parallel/_npu_attention.py"
    assert oldest[handlers] != previous[handlers]


@pytest.mark.parametrize("version", VERSIONS)
def test_meta_functions_of_the_wheel(version):
    _root(version)
    fns = wheel_meta_functions(version)
    assert set(fns) == {"npu_fusion_attention", "npu_fusion_attention_v3",
                        "npu_fusion_attention_grad", "npu_fusion_attention_grad_v3"}
    fwd_v3 = fns["npu_fusion_attention_v3"][0]
    meta = dict(device="meta", dtype=torch.bfloat16)
    shapes = {  # layout: (q, kv, attention_out, softmax stats) for B=2, N=4, Nkv=2, S=16, D=8
        "BNSD": ((2, 4, 16, 8), (2, 2, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)),
        "BSND": ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 4, 8), (2, 4, 16, 8)),
        "BSH": ((2, 16, 32), (2, 16, 16), (2, 16, 32), (2, 4, 16, 8)),
        "SBH": ((16, 2, 32), (16, 2, 16), (16, 2, 32), (2, 4, 16, 8)),
        "TND": ((32, 4, 8), (32, 2, 8), (32, 4, 8), (32, 4, 8)),
    }
    for layout, (qs, kvs, outs, stats) in shapes.items():
        q, k, v = torch.empty(qs, **meta), torch.empty(kvs, **meta), torch.empty(kvs, **meta)
        res = fwd_v3(q, k, v, 4, layout)
        assert tuple(res[0].shape) == outs and res[0].dtype == torch.bfloat16, layout
        assert tuple(res[1].shape) == stats and res[1].dtype == torch.float32, layout
        assert res[4].dtype == torch.int64 and tuple(res[4].shape) == (1,)
        if layout != "TND":  # the emulator's own fake kernel agrees
            emu = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 4, layout)
            assert [tuple(t.shape) for t in emu[:3]] == [tuple(t.shape) for t in res[:3]], layout


# ---------------------------------------------------------------- CP forward + backward at W=2 (ranks)


def _full_inputs(world: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(B, N, S_LOCAL * world, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _sharded_call(rank: int, world: int, mesh, lb: bool) -> dict:
    """Causal attention on this rank's shards through whatever handles the op, forward and backward."""
    from torch.distributed.tensor import DTensor, Shard

    pos = rank_positions(world, rank, S_LOCAL, lb)
    q, k, v, dout = (t.index_select(2, pos).float() for t in _full_inputs(world))
    qd, kd, vd = (DTensor.from_local(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v))
    mask = torch.ones(MASK, MASK, dtype=torch.bool).triu(1)
    o = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, N, "BNSD", atten_mask=mask, scale=1.0 / math.sqrt(D),
                                              keep_prob=1.0, next_tockens=0, sparse_mode=2)[0]
    o.backward(DTensor.from_local(dout, mesh, [Shard(2)]) if isinstance(o, DTensor) else dout)
    local = o.to_local() if isinstance(o, DTensor) else o
    return {"type": type(o).__name__, "pos": pos, "out": local.detach().double(),
            **{n: t.grad.to_local().double() for n, t in zip("qkv", (qd, kd, vd))}}


def _cp_rank(rank: int, world: int, version: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    install_npu_emulator(route_sdpa=True)
    mesh = init_device_mesh("cpu", (world,))
    att = _cp_attention()
    v3 = torch.ops.npu.npu_fusion_attention_v3.default
    g3 = torch.ops.npu.npu_fusion_attention_grad_v3.default
    before = dict(vars(att))
    res: dict = {}
    with load_torch_npu_cp(version) as loaded:
        for lb in (True, False):
            att._cp_options.enable_load_balance = lb
            table_before = dict(DTensor._op_dispatcher._custom_op_handlers)
            att._dispatch_mode = att._DispatchMode.MONKEY_PATCH
            att._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
            try:
                table = DTensor._op_dispatcher._custom_op_handlers
                res[f"entered_{lb}"] = (table.get(v3) is loaded.forward_handler,
                                        table.get(g3) is loaded.backward_handler)
                try:
                    res[f"run_{lb}"] = _sharded_call(rank, world, mesh, lb)
                    res[f"out_type_{lb}"] = res[f"run_{lb}"].pop("type")
                except TypeError as error:  # torch-npu 2.13/2.14 on torch 2.14+: CP_STRATEGY_TYPE_ERROR
                    res[f"error_{lb}"] = str(error)
                res[f"stack_{lb}"] = None if loaded.step_cache_stack is None else len(loaded.step_cache_stack)
            finally:
                att._disable_context_parallel_dispatcher_impl()
                att._cp_options.enable_load_balance = True
            after_table = DTensor._op_dispatcher._custom_op_handlers
            res[f"left_{lb}"] = (after_table.get(v3) is not loaded.forward_handler
                                 and after_table.get(g3) is not loaded.backward_handler)
            res[f"table_back_{lb}"] = sorted(map(str, after_table)) == sorted(map(str, table_before))
    res["restored"] = all(vars(att).get(k) is before[k] for k in before) and set(vars(att)) == set(before)
    res["no_torch_npu"] = not [n for n in sys.modules if n.startswith("torch_npu")]
    return res


_RUNS: dict = {}


def _runs(version: str) -> list:
    if version not in _RUNS:
        _root(version)
        _RUNS[version] = run_ranks(_cp_rank, WORLD, version, timeout=240.0)
    return _RUNS[version]


@pytest.mark.parametrize("version", VERSIONS)
def test_context_parallel_entry_installs_torch_npu_handlers_and_exit_removes_them(version):
    for res in _runs(version):
        for lb in (True, False):
            assert res[f"entered_{lb}"] == (True, True), res[f"entered_{lb}"]
            assert res[f"left_{lb}"]
        assert res["restored"] and res["no_torch_npu"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("load_balance", (True, False), ids=("lb", "contiguous"))
def test_torch_npu_cp_matches_dense(version, load_balance):
    runs = _runs(version)
    if cp_strategy_breaks_on_this_torch(version):  # on torch 2.14+: refused by its own sharding strategy
        assert all(res.get(f"error_{load_balance}") == CP_STRATEGY_TYPE_ERROR for res in runs), runs
        return
    q, k, v, dout = _full_inputs(WORLD)
    dense = dense_attention(q, k, v, dout, causal=True)
    ref = {"out": dense["out"], "q": dense["dq"], "k": dense["dk"], "v": dense["dv"]}
    low = dense_attention(q, k, v, dout, causal=True, dtype=torch.float32)  # dense torch in float32: the bounds
    low = {"out": low["out"], "q": low["dq"], "k": low["dk"], "v": low["dv"]}
    got = {}
    for key in ("out", "q", "k", "v"):
        full = torch.empty_like(ref[key])
        for res in runs:
            run = res[f"run_{load_balance}"]
            full.index_copy_(2, run["pos"], run[key])
        got[key] = full
        err = float((full - ref[key]).norm() / ref[key].norm())
        bound = error_bound(float((low[key].double() - ref[key]).norm() / ref[key].norm()))  # 20x + 32 eps
        assert err <= bound, f"torch-npu {version} lb={load_balance} {key}: relative error {err:.3g} > {bound:.3g}"
    if version == "2.12.0":  # its stack is empty again after each backward
        assert all(res[f"stack_{load_balance}"] == 0 for res in runs)
