"""cp_cache next to torch_npu's own CP (2.13.0 and 2.12.0, their Python files loaded over the
emulator, as ``import torch_npu`` loads them): after ``cp_cache.enable()`` cp_cache's handlers are
the ones that run on every CP entry point, entered once, repeatedly or nested, and dropout trains
correctly through each; ``cp_cache.disable()`` gives torch_npu's behaviour back exactly.

Which handler ran is proven by the step caches created (one per attention call, cp_cache's
store) and by the handler table inside the context; "trains correctly" by a model-free
directional-derivative check of the CP loss with dropout (the RNG reset per forward).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.torch_npu_wheel import VERSIONS, fetch

WORLD = 2
SEQ = 16
LAYERS = 2
DROPOUT = 0.2


@pytest.fixture(scope="module", autouse=True)
def wheels():
    for version in VERSIONS:
        fetch(version)  # fails (does not skip) with the loader's message when the index is unreachable


# ---------------------------------------------------------------- rank side


def _torch_cp_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def _ops():
    return torch.ops.npu.npu_fusion_attention_v3.default, torch.ops.npu.npu_fusion_attention_grad_v3.default


def _table_state() -> tuple:
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher._custom_op_handlers
    return tuple(table.get(op) for op in _ops())


def _ours(entries: tuple) -> bool:
    import cp_cache

    handlers = cp_cache.dispatch.registered_handlers()
    return handlers is not None and entries == (handlers.forward_handler, handlers.backward_handler)


def _model_and_batch():
    from cp_cache.testing.models import ModelConfig, TinyDecoder, make_batch

    torch.manual_seed(0)
    config = ModelConfig(dim=16, heads=4, kv_heads=2, layers=LAYERS, max_seq=SEQ, dropout=DROPOUT)
    return TinyDecoder(config), make_batch(1, SEQ, config.vocab, seed=1)


@contextlib.contextmanager
def _entry(path: str, mesh, model, batch):
    """Enter CP by ``path``; yields the (tokens, labels, positions) the model sees."""
    import cp_cache
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

    cp = _torch_cp_module()
    tokens, labels, positions = (t.clone() for t in batch)
    # the backward runs after the context: keep the sharded buffers autograd saved as they are
    buffers = dict(buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1],
                   no_restore_buffers={tokens, labels, positions})
    if path == "torch.context_parallel":
        with torch_context_parallel(mesh, **buffers):
            yield tokens, labels, positions
    elif path == "cp_cache.context_parallel":
        with cp_cache.context_parallel(mesh, **buffers):
            yield tokens, labels, positions
    elif path == "nested":  # torch's inside cp_cache's, the dispatcher entered twice
        with cp_cache.context_parallel(mesh):
            with torch_context_parallel(mesh, **buffers):
                cp._enable_context_parallel_dispatcher()
                assert _ours(_table_state()), "nested entry lost cp_cache's handlers"
                cp._disable_context_parallel_dispatcher()
                assert _ours(_table_state()), "nested exit lost cp_cache's handlers"
                yield tokens, labels, positions
    elif path == "module_wrapper":
        from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _ContextParallel
        from torch.distributed.tensor.parallel import parallelize_module

        if not getattr(model, "_cp_wrapped", False):
            plan = {f"blocks.{i}.attention.sdpa": _ContextParallel(
                seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA) for i in range(LAYERS)}
            parallelize_module(model, mesh, plan)
            model._cp_wrapped = True
        shards = _context_parallel_shard(mesh, [tokens, labels, positions], [1, 1, 1])
        cp._enable_context_parallel_dispatcher()
        try:
            yield tuple(shards)
        finally:
            cp._disable_context_parallel_dispatcher()
    else:
        raise ValueError(f"unknown entry path {path!r}")


PATHS = ("torch.context_parallel", "cp_cache.context_parallel", "nested", "module_wrapper")


def _check_path(path: str, mesh, world: int) -> dict:
    import torch.distributed as dist

    import cp_cache
    from cp_cache.testing.models import loss_fn
    from cp_cache.testing.reference import directional_derivative_check

    model, batch = _model_and_batch()
    model.train()
    seen: dict = {"inside_ours": [], "created": []}

    def loss() -> torch.Tensor:
        torch.manual_seed(1234 + dist.get_rank())  # the same dropout masks every call
        created = cp_cache.stats()["created"]
        with _entry(path, mesh, model, batch) as (tokens, labels, positions):
            seen["inside_ours"].append(_ours(_table_state()))
            value = loss_fn(model(tokens, positions), labels)
        seen["created"].append(cp_cache.stats()["created"] - created)
        return value

    def total(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    params = [p for p in model.parameters() if p.requires_grad]
    # (error, bound) per direction, the bound measured from the central differences at eps and eps/2
    checks = directional_derivative_check(loss, params, directions=3, eps=5e-2, reduce=total)
    return dict(checks=checks, **seen, live_after=cp_cache.stats()["live_entries"])


def _coexist_rank(rank: int, world: int, version: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import cp_cache
    from cp_cache.testing import install_npu_emulator
    from cp_cache.testing.torch_npu_wheel import load_torch_npu_cp

    install_npu_emulator(route_sdpa=True)
    mesh = init_device_mesh("cpu", (world,))
    cp = _torch_cp_module()
    out: dict = {}
    with load_torch_npu_cp(version) as npu:
        before = dict(switches=(cp._enable_cp_dtensor_dispatcher, cp._disable_cp_dtensor_dispatcher),
                      table=_table_state())
        cp_cache.enable()
        out["switches_wrapped"] = cp._enable_cp_dtensor_dispatcher is not npu.enable_dispatcher
        for path in PATHS:
            out[path] = _check_path(path, mesh, world)
            out[path]["ours_after"] = _ours(_table_state())
        cp_cache.disable()
        out["switches_restored"] = (cp._enable_cp_dtensor_dispatcher, cp._disable_cp_dtensor_dispatcher) == (
            npu.enable_dispatcher, npu.disable_dispatcher) == before["switches"]
        out["table_restored"] = _table_state() == before["table"]
        # torch_npu's own behaviour again: its handlers inside CP, nothing created in cp_cache's store
        created = cp_cache.stats()["created"]
        cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH
        cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
        out["torch_npu_inside_after_disable"] = _table_state() == (npu.forward_handler, npu.backward_handler)
        cp._disable_context_parallel_dispatcher_impl()
        out["created_after_disable"] = cp_cache.stats()["created"] - created
    return out


@pytest.fixture(scope="module", params=VERSIONS)
def coexistence(request):
    return request.param, run_ranks(_coexist_rank, WORLD, request.param, timeout=300)


def test_enable_wraps_and_disable_gives_torch_npu_back(coexistence):
    version, results = coexistence
    for r in results:
        assert r["switches_wrapped"], version
        assert r["switches_restored"], version
        assert r["table_restored"], version
        assert r["torch_npu_inside_after_disable"], version
        assert r["created_after_disable"] == 0, version


@pytest.mark.parametrize("path", PATHS)
def test_cp_cache_handlers_run_and_dropout_trains(coexistence, path):
    version, results = coexistence
    for rank, r in enumerate(results):
        res = r[path]
        assert all(res["inside_ours"]), (version, path, rank, res["inside_ours"])
        # one step cache per attention call, in every forward (1 + 2 per direction)
        assert res["created"] == [LAYERS] * len(res["created"]), (version, path, rank, res["created"])
        assert res["ours_after"], (version, path, rank)
        assert res["live_after"] == 0, (version, path, rank)
        # torch_npu's own dropout gradients miss the slope by 10-60 %: some direction must resolve 10 %
        assert all(err <= bound for err, bound in res["checks"]), (version, path, rank, res["checks"])
        assert min(bound for _, bound in res["checks"]) < 0.1, (version, path, rank, res["checks"])


def _late_import_rank(rank: int, world: int, version: str) -> dict:
    """cp_cache enabled first, torch_npu imported afterwards (it replaces the switches):
    cp_cache.context_parallel() notices and puts cp_cache on top again."""
    from torch.distributed.device_mesh import init_device_mesh

    import cp_cache
    from cp_cache.testing import install_npu_emulator
    from cp_cache.testing.torch_npu_wheel import load_torch_npu_cp

    install_npu_emulator(route_sdpa=True)
    mesh = init_device_mesh("cpu", (world,))
    cp_cache.enable()
    out = {}
    with load_torch_npu_cp(version) as npu:
        out["torch_npu_on_top_after_import"] = _torch_cp_module()._enable_cp_dtensor_dispatcher is npu.enable_dispatcher
        with cp_cache.context_parallel(mesh):
            out["ours_inside"] = _ours(_table_state())
        cp_cache.disable()
        out["switches_restored"] = _torch_cp_module()._enable_cp_dtensor_dispatcher is npu.enable_dispatcher
    return out


def test_torch_npu_imported_after_enable():
    for r in run_ranks(_late_import_rank, WORLD, "2.13.0", timeout=120):
        assert r == dict(torch_npu_on_top_after_import=True, ours_inside=True, switches_restored=True)
