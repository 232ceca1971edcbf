"""DTensor calls of npu_fusion_attention_v3 that are not context parallel, after cp_cache.enable().

cp_cache takes effect only where CP is. A call whose query has no ``Shard(seq)`` mesh dimension
(data parallel ``Shard(batch)``, tensor parallel ``Shard(heads)``, ``Replicate``, a shard of the
head size), and every call made outside a CP region, goes to what serves it without cp_cache:
torch_npu's layer-1 DTensor handler, or DTensor's own sharding propagation (which, for the
emulated op alone, has no sharding strategy and raises). Checked here:

* the same results (``torch.equal``) or the same error, with and without ``enable()``: the
  cases of torch_npu's ``test_attention_ops`` for the v3 op (BNSD forward and backward for five
  sparse modes, BSND, BSH; every placement those tests use) at W = 2 and 4, without and with
  torch-npu 2.14.0's files loaded, outside and inside a CP region; and in LocalTensor mode
  (ranks simulated in one process: symbolic ranks and sizes);
* with torch_npu loaded and cp_cache enabled, every torch_npu case agrees with the op on the
  whole tensors (bounded by that op's own float32 error, measured in the same run);
* a CP call on fake tensors with a symbolic sequence length runs through the handler;
* sequence-sharded calls inside a CP region run cp_cache (their backward too, after the
  region); outside one they do not (torch_npu's handler serves them, or DTensor raises);
* the handler table after ``disable()`` and after every CP exit holds exactly the entries
  (the same objects) it held before.

One spawned group of 4 gloo ranks (loopback) does the multi-rank checks (W = 2 on pairs of it);
one more process (started as the ranks are) does the LocalTensor-mode checks on a fake process group.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import pytest
import torch

from cp_cache.testing.multiprocess import capture, run_ranks
from cp_cache.testing.torch_npu_wheel import NEWEST, fetch

WORLD = 4  # the rank group; W = 2 runs on its pairs
WORLDS = (2, 4)
B, N, S, D = 4, 4, 8, 8  # B and N divisible by W: batch and head shards are even
SCALE = 0.08838  # torch_npu's tests'
MASK = 2048
VERSION = NEWEST  # torch-npu 2.14.0
MODES = ("plain", "torch_npu")  # the emulator alone; torch-npu 2.14.0's files loaded over it
SPARSE = ((0, 128, 128), (1, 65536, 65536), (2, 65536, 0), (3, 65536, 0), (4, 128, 128))
RUN_TIMEOUT_S = 540
PG_TIMEOUT_S = 90


@dataclass(frozen=True)
class NpuTest:
    """One of torch_npu's ``test_attention_ops`` tests of the v3 op: its layout, its mask
    arguments (sparse_mode, pre_tockens, next_tockens; None: none) and whether it runs the backward."""

    name: str
    layout: str
    sparse: tuple | None
    backward: bool

    @property
    def ndim(self) -> int:
        return 3 if self.layout == "BSH" else 4

    @property
    def seq_dim(self) -> int:
        return 2 if self.layout == "BNSD" else 1


NPU_TESTS = (
    [NpuTest(f"v3_forward_bnsd[{m}]", "BNSD", (m, p, n), False) for m, p, n in SPARSE]
    + [NpuTest(f"v3_backward_bnsd[{m}]", "BNSD", (m, p, n), True) for m, p, n in SPARSE]
    + [NpuTest("v3_bsnd", "BSND", None, True), NpuTest("v3_bsh", "BSH", None, True)]
)


def _placements(t: NpuTest) -> list:
    """torch_npu's: Shard of every dim of the query, then Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(d) for d in range(t.ndim)] + [Replicate()]


def _label(placement) -> str:
    return type(placement).__name__ + (f"({placement.dim})" if hasattr(placement, "dim") else "()")


@pytest.fixture(scope="module", autouse=True)
def wheels():
    fetch(VERSION)  # fails (does not skip) with the loader's message when the files cannot be had


# ---------------------------------------------------------------- rank side: calls


def _op():
    return torch.ops.npu.npu_fusion_attention_v3


def _inputs(t: NpuTest, dtype=torch.float32) -> list:
    """q, k, v, dy (the same on every rank) and torch_npu's test mask for the case."""
    g = torch.Generator().manual_seed(7)
    shape = {"BNSD": (B, N, S, D), "BSND": (B, S, N, D), "BSH": (B, S, N * D)}[t.layout]
    tensors = [torch.randn(shape, generator=g).to(dtype) for _ in range(4)]
    mask = None
    if t.sparse is not None and t.sparse[0] == 0:
        pre, nxt = t.sparse[1], t.sparse[2]
        ones = torch.ones(B, N, S, S)
        mask = (ones.triu(pre + 1) + ones.tril(-nxt - 1)).bool()
    elif t.sparse is not None and t.sparse[0] in (2, 3, 4):
        mask = torch.ones(MASK, MASK, dtype=torch.bool).triu(1)
    return tensors + [mask]


def _mask_kwargs(t: NpuTest) -> dict:
    if t.sparse is None:
        return {}
    mode, pre, nxt = t.sparse
    return dict(sparse_mode=mode, pre_tockens=pre, next_tockens=nxt)


def _local(t: NpuTest, inputs: list) -> list:
    """The op on the whole tensors (no DTensor): out, softmax_max, softmax_sum (and dq, dk, dv)."""
    q, k, v, dy, mask = inputs
    leaves = [x.clone().requires_grad_(t.backward) for x in (q, k, v)]
    res = _op()(*leaves, head_num=N, input_layout=t.layout, scale=SCALE, atten_mask=mask, **_mask_kwargs(t))
    got = list(res[:3])
    if t.backward:
        res[0].backward(dy)
        got += [x.grad for x in leaves]
    return [x.detach() for x in got]


def _distributed(t: NpuTest, placement, mesh, inputs: list) -> tuple[str, list]:
    """torch_npu's test body for one placement: ("ok", the results as whole tensors) or
    ("<error type>: <message>", [])."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, k, v, dy, mask = inputs
    kwargs = _mask_kwargs(t)
    try:
        dq, dk, dv = (distribute_tensor(x, mesh, [placement]).requires_grad_(t.backward) for x in (q, k, v))
        if mask is not None:
            mask_placement = Replicate() if isinstance(placement, Shard) and mask.ndim <= placement.dim else placement
            kwargs["atten_mask"] = distribute_tensor(mask, mesh, [mask_placement])
        res = _op()(dq, dk, dv, head_num=N, input_layout=t.layout, scale=SCALE, **kwargs)
        got = [r.full_tensor() for r in res[:3]]
        if t.backward:
            res[0].backward(distribute_tensor(dy, mesh, res[0].placements))
            got += [x.grad.full_tensor() for x in (dq, dk, dv)]
        return "ok", [x.detach() for x in got]
    except Exception as e:  # noqa: BLE001 - compared with and without enable()
        return f"{type(e).__name__}: {e}", []


def _npu_cases(meshes: dict) -> dict:
    """{(W, test, placement): (status, tensors)} of every torch_npu case."""
    return {(w, t.name, _label(p)): _distributed(t, p, mesh, _inputs(t))
            for w, mesh in meshes.items() for t in NPU_TESTS for p in _placements(t)}


def _agreement_with_local(results: dict) -> dict:
    """{(W, test, placement): [(rel_err vs the op on whole tensors, bound)]}: the bound is the
    error bound of that op's own float32 error against its float64 result on the same inputs."""
    from cp_cache.testing.reference import error_bound, rel_err

    tests = {t.name: t for t in NPU_TESTS}
    references = {}
    out = {}
    for key, (status, got) in results.items():
        t = tests[key[1]]
        if t.name not in references:
            low, high = _local(t, _inputs(t)), _local(t, _inputs(t, torch.float64))
            references[t.name] = (low, [error_bound(rel_err(a.double(), b)) for a, b in zip(low, high)])
        low, bounds = references[t.name]
        out[key] = [(rel_err(a.double(), b.double()), bound) for a, b, bound in zip(got, low, bounds)]
    return out


# ---------------------------------------------------------------- rank side: CP regions


def _enter_cp(mesh) -> None:
    """torch's CP dispatcher entry (what cp_cache.context_parallel() enters without buffers)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention._dispatch_mode = _attention._DispatchMode.MONKEY_PATCH
    _attention._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)


def _exit_cp() -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention._disable_context_parallel_dispatcher_impl()


INSIDE_TESTS = [t for t in NPU_TESTS if t.name in ("v3_backward_bnsd[0]", "v3_backward_bnsd[2]", "v3_bsnd")]


def _inside_cp_cases(mesh) -> dict:
    """Calls without a CP mesh dimension (batch, heads, head size, replicated), made inside a CP
    region (forward and backward): {(test, placement): (status, tensors)}."""
    out = {}
    for t in INSIDE_TESTS:
        for p in _placements(t):
            if getattr(p, "dim", None) == t.seq_dim:
                continue
            _enter_cp(mesh)
            try:
                out[(t.name, _label(p))] = _distributed(t, p, mesh, _inputs(t))
            finally:
                _exit_cp()
    return out


def _runs_cp_cache(fn) -> tuple[int, int]:
    """(forward, backward) calls cp_cache's handlers ran during ``fn()``."""
    import cp_cache

    before = cp_cache.call_stats()
    fn()
    after = cp_cache.call_stats()
    return tuple(after[d]["calls"] - before[d]["calls"] for d in ("forward", "backward"))


def _sequence_sharded(mesh) -> dict:
    """Sequence-sharded calls (BNSD Shard(2), no mask: contiguous shards are right whatever the
    load balancing) with cp_cache enabled: inside a CP region with the backward after it, and
    outside any region: the calls cp_cache ran, and the output's error against the op on whole
    tensors with its bound."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from cp_cache.testing.reference import error_bound, rel_err

    t = NpuTest("seq", "BNSD", None, True)
    inputs = _inputs(t)
    q, k, v, dy, mask = inputs
    low, high = _local(t, inputs), _local(t, _inputs(t, torch.float64))
    leaves = [distribute_tensor(x, mesh, [Shard(2)]).requires_grad_() for x in (q, k, v)]
    kw = dict(head_num=N, input_layout="BNSD", scale=SCALE, atten_mask=mask, **_mask_kwargs(t))
    res: dict = {}

    def forward():
        _enter_cp(mesh)
        try:
            res["out"] = _op()(*leaves, **kw)[0]
        finally:
            _exit_cp()

    res["inside"] = _runs_cp_cache(forward)
    res["backward_after"] = _runs_cp_cache(lambda: res["out"].backward(distribute_tensor(dy, mesh, [Shard(2)])))
    res["inside_err"] = (rel_err(res.pop("out").full_tensor().double(), low[0].double()),
                         error_bound(rel_err(low[0].double(), high[0])))
    outside = {}
    res["outside"] = _runs_cp_cache(lambda: outside.update(error=capture(lambda: _op()(*leaves, **kw))[0]))
    res["outside_error"] = outside["error"]
    return res


# ---------------------------------------------------------------- rank side: the handler table


def _table() -> dict:
    from torch.distributed.tensor import DTensor

    return dict(DTensor._op_dispatcher._custom_op_handlers)


def _differs(now: dict, before: dict) -> list[str]:
    """The ops whose entries are not the same objects as before (added, removed or replaced)."""
    return sorted(str(op) for op in set(now) | set(before) if now.get(op, None) is not before.get(op, None))


def _cp_exits(mesh) -> dict:
    """{entry path: ops whose table entries differ after leaving the region from before entering}."""
    import cp_cache
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention

    out = {}
    before = _table()
    _enter_cp(mesh)
    _exit_cp()
    out["dispatcher"] = _differs(_table(), before)
    buf = torch.zeros(1, WORLD * 2)
    with torch_context_parallel(mesh, buffers=[buf], buffer_seq_dims=[1], no_restore_buffers={buf}):
        _attention._enable_context_parallel_dispatcher()  # the module-wrapper path, nested
        _attention._disable_context_parallel_dispatcher()
    out["torch.context_parallel"] = _differs(_table(), before)
    with cp_cache.context_parallel(mesh):  # torch's nested inside cp_cache's
        with torch_context_parallel(mesh, buffers=[buf], buffer_seq_dims=[1], no_restore_buffers={buf}):
            pass
    out["cp_cache.context_parallel"] = _differs(_table(), before)
    return out


# ---------------------------------------------------------------- rank side: one mode


def _compare(without: dict, with_: dict) -> dict:
    """{key: (status without, status with, same)}: same status and equal tensors."""
    out = {}
    for key, (status, got) in without.items():
        status2, got2 = with_[key]
        same = status == status2 and len(got) == len(got2) and all(torch.equal(a, b) for a, b in zip(got, got2))
        out[key] = (status, status2, same)
    return out


def _mode(meshes: dict) -> dict:
    import cp_cache

    table_before = _table()
    npu_without = _npu_cases(meshes)
    inside_without = {w: _inside_cp_cases(m) for w, m in meshes.items()}
    cp_cache.enable()
    table_enabled = _table()
    npu_with = _npu_cases(meshes)
    inside_with = {w: _inside_cp_cases(m) for w, m in meshes.items()}
    res = dict(
        table_unchanged_by_calls=_differs(_table(), table_enabled),
        exits=_cp_exits(meshes[WORLD]),
        sequence={w: _sequence_sharded(m) for w, m in meshes.items()},
    )
    cp_cache.disable()
    res["table_after_disable"] = _differs(_table(), table_before)
    res["npu"] = _compare(npu_without, npu_with)
    res["npu_status"] = {k: s for k, (s, _) in npu_with.items()}
    res["npu_vs_local"] = _agreement_with_local({k: v for k, v in npu_with.items() if v[0] == "ok"})
    res["inside"] = {w: _compare(inside_without[w], inside_with[w]) for w in meshes}
    return res


def _non_cp_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.testing import install_npu_emulator
    from cp_cache.testing.torch_npu_wheel import load_torch_npu_cp

    install_npu_emulator()
    meshes = {world: init_device_mesh("cpu", (world,)),
              2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pairs", "pair"))["pair"]}
    out = {"plain": _mode(meshes)}
    with load_torch_npu_cp(VERSION):
        out["torch_npu"] = _mode(meshes)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_non_cp_rank, WORLD, timeout=RUN_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)


# ---------------------------------------------------------------- LocalTensor mode (one process)

LT_PLACEMENTS = ("Shard(0)", "Shard(1)", "Shard(2)", "Replicate()")


def _per_rank(dt, world: int) -> list:
    """A DTensor's local tensor on each simulated rank."""
    local = dt.to_local()
    ranks = getattr(local, "_local_tensors", None)
    return [(ranks[r] if ranks is not None else local).detach().clone() for r in range(world)]


def _lt_call(placement, mesh, world: int, inside: bool) -> tuple[str, list]:
    """BNSD forward and backward under LocalTensorMode: ("ok", per-rank out and dq) or the error."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import distribute_tensor

    t = NpuTest("lt", "BNSD", None, True)
    q, k, v, dy, _ = _inputs(t)
    try:
        with LocalTensorMode(world):
            leaves = [distribute_tensor(x, mesh, [placement]).requires_grad_() for x in (q, k, v)]
            if inside:
                _enter_cp(mesh)
            try:
                res = _op()(*leaves, head_num=N, input_layout="BNSD", scale=SCALE)
                res[0].backward(distribute_tensor(dy, mesh, res[0].placements))
            finally:
                if inside:
                    _exit_cp()
            return "ok", _per_rank(res[0], world) + _per_rank(leaves[0].grad, world)
    except Exception as e:  # noqa: BLE001 - compared with and without enable()
        return f"{type(e).__name__}: {e}", []


def _lt_mode(mesh, world: int) -> dict:
    import cp_cache
    from torch.distributed.tensor import Replicate, Shard

    placements = dict(zip(LT_PLACEMENTS, (Shard(0), Shard(1), Shard(2), Replicate())))
    cases = [(label, inside) for label in LT_PLACEMENTS for inside in (False, True)]
    without = {c: _lt_call(placements[c[0]], mesh, world, c[1]) for c in cases}
    cp_cache.enable()
    try:
        with_ = {c: _lt_call(placements[c[0]], mesh, world, c[1]) for c in cases}
    finally:
        cp_cache.disable()
    return _compare(without, with_)


def _symbolic_call(mesh) -> dict:
    """A CP call (BNSD Shard(2), cp_cache enabled, inside a CP region) on fake tensors whose
    sequence length is symbolic: it runs through the handler (shapes only, no collective)."""
    import cp_cache
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Shard
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC,
                                                      DimDynamic.DYNAMIC, DimDynamic.STATIC])
    local = [mode.from_tensor(torch.randn(B, N, S, D), symbolic_context=dynamic) for _ in range(3)]
    symbolic = str(local[0].shape[2])
    cp_cache.enable()
    try:
        with mode:
            q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]) for t in local)
            _enter_cp(mesh)
            try:
                out = _op()(q, k, v, head_num=N, input_layout="BNSD", scale=SCALE)
            finally:
                _exit_cp()
            return dict(symbolic=symbolic, shaped_like_query=bool(out[0].shape == q.shape),
                        stats_shape=tuple(int(x) for x in out[1].shape),
                        specialized=str(local[0].shape[2]) != symbolic)
    finally:
        cp_cache.disable()


def _local_tensor_main(results, world: int) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from cp_cache.testing import install_npu_emulator
        from cp_cache.testing.torch_npu_wheel import load_torch_npu_cp

        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        install_npu_emulator()
        mesh = init_device_mesh("cpu", (world,))
        out = {"plain": _lt_mode(mesh, world), "symbolic": _symbolic_call(mesh)}
        with load_torch_npu_cp(VERSION):
            out["torch_npu"] = _lt_mode(mesh, world)
        dist.destroy_process_group()
        results.put(("ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("error", traceback.format_exc()))


@pytest.fixture(scope="module")
def local_tensor() -> dict:
    import queue

    import torch.multiprocessing as mp

    from cp_cache.testing import multiprocess

    # a new process as run_ranks starts them: forked from the suite's forkserver (torch and
    # cp_cache imported once there, no process group), or spawned
    ctx = mp.get_context(multiprocess.START_METHOD)
    if multiprocess.START_METHOD == "forkserver":
        ctx.set_forkserver_preload(list(multiprocess.FORKSERVER_PRELOAD))
    results = ctx.Queue()
    proc = ctx.Process(target=_local_tensor_main, args=(results, WORLD), daemon=True)
    proc.start()
    try:
        kind, value = results.get(timeout=RUN_TIMEOUT_S)
    except queue.Empty:
        kind, value = "error", f"no result within {RUN_TIMEOUT_S} s"
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    assert kind == "ok", value
    return value


# ---------------------------------------------------------------- tests


def _not_same(compared: dict) -> str:
    """The cases whose results differ, one a line: without enable() / with it."""
    return "\n".join(f"{k}: without: {a[:160]!r} / with: {b[:160]!r}" for k, (a, b, same) in compared.items()
                     if not same)


@pytest.mark.parametrize("mode", MODES)
def test_table_after_disable_is_the_table_before_enable(ranks, mode):
    for r, res in enumerate(ranks):
        assert res[mode]["table_after_disable"] == [], (mode, r)


@pytest.mark.parametrize("mode", MODES)
def test_table_after_every_cp_exit_is_the_table_before_entry(ranks, mode):
    for r, res in enumerate(ranks):
        assert res[mode]["exits"] == {path: [] for path in res[mode]["exits"]}, (mode, r)
        assert res[mode]["table_unchanged_by_calls"] == [], (mode, r)


@pytest.mark.parametrize("mode", MODES)
def test_non_cp_calls_same_with_and_without_enable(ranks, mode):
    """Every placement, sequence shards included: outside a CP region cp_cache serves nothing."""
    for r, res in enumerate(ranks):
        compared = res[mode]["npu"]
        calls = sum(len(_placements(t)) for t in NPU_TESTS)
        assert len(compared) == len(WORLDS) * calls, (mode, len(compared))
        differ = _not_same(compared)
        assert not differ, f"{mode}, rank {r}:\n{differ}"


def test_torch_npu_attention_ops_cases_pass_with_cp_cache_enabled(ranks):
    """With torch_npu's files loaded and cp_cache enabled, torch_npu's own v3 DTensor cases run
    and agree with the op on whole tensors."""
    for r, res in enumerate(ranks):
        status = res["torch_npu"]["npu_status"]
        failed = {k: s[:300] for k, s in status.items() if s != "ok"}
        assert failed == {}, r
        errors = res["torch_npu"]["npu_vs_local"]
        assert len(errors) == len(status)
        off = {k: e for k, e in errors.items() if any(err > bound for err, bound in e)}
        assert off == {}, r


@pytest.mark.parametrize("mode", MODES)
def test_non_cp_calls_inside_a_cp_region_same_with_and_without_enable(ranks, mode):
    for r, res in enumerate(ranks):
        for w in WORLDS:
            compared = res[mode]["inside"][w]
            assert len(compared) == sum(len(_placements(t)) - 1 for t in INSIDE_TESTS)
            differ = _not_same(compared)
            assert not differ, f"{mode}, W={w}, rank {r}:\n{differ}"


@pytest.mark.parametrize("mode", MODES)
def test_sequence_sharded_calls_inside_cp_run_cp_cache(ranks, mode):
    for r, res in enumerate(ranks):
        for w in WORLDS:
            seq = res[mode]["sequence"][w]
            assert seq["inside"] == (1, 0), (mode, w, r)
            assert seq["backward_after"] == (0, 1), (mode, w, r)  # the backward after the region
            err, bound = seq["inside_err"]
            assert err <= bound, (mode, w, r, err, bound)


def test_sequence_sharded_calls_outside_cp(ranks):
    """Outside a CP region cp_cache runs nothing: torch_npu's layer-1 handler serves the call when
    loaded; without it DTensor raises, as it does without cp_cache (no sharding strategy)."""
    for r, res in enumerate(ranks):
        for w in WORLDS:
            for mode, error in (("torch_npu", "no error"), ("plain", "NotImplementedError")):
                seq = res[mode]["sequence"][w]
                assert (seq["outside"], seq["outside_error"]) == ((0, 0), error), (mode, w, r)


@pytest.mark.parametrize("mode", MODES)
def test_local_tensor_mode_same_with_and_without_enable(local_tensor, mode):
    """LocalTensor mode (ranks simulated in one process; ranks and local sizes are SymInts):
    every placement, outside and inside a CP region."""
    compared = local_tensor[mode]
    assert len(compared) == 2 * len(LT_PLACEMENTS)
    differ = _not_same(compared)
    assert not differ, f"{mode}:\n{differ}"


def test_symbolic_sequence_length_through_the_handler(local_tensor):
    res = local_tensor["symbolic"]
    assert res["symbolic"].startswith("s"), res  # the local sequence length was a SymInt
    assert res["shaped_like_query"], res
    assert res["stats_shape"] == (B, N, S * WORLD, 8), res


def test_report(ranks, local_tensor):
    """The counts behind the checks (read with -s)."""
    for mode in MODES:
        res = ranks[0][mode]
        same = sum(s for _, _, s in res["npu"].values())
        print(f"{mode}: torch_npu cases same with/without enable(): {same}/{len(res['npu'])}")
        by_test: dict = {}
        for key, status in res["npu_status"].items():
            agrees = status == "ok" and all(err <= bound for err, bound in res["npu_vs_local"][key])
            by_test.setdefault(key[:2], []).append(agrees)
        passed = sum(all(v) for v in by_test.values())
        print(f"{mode}: torch_npu tests (x W = 2, 4) whose every placement runs with enable() and agrees "
              f"with the op on whole tensors: {passed}/{len(by_test)}")
        lt = local_tensor[mode]
        print(f"{mode}: LocalTensor cases same: {sum(s for _, _, s in lt.values())}/{len(lt)}")
    print(f"symbolic sequence length through the handler: {local_tensor['symbolic']}")
