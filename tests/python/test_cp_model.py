"""Model code under cp_cache.context_parallel, the SDPA route, and enable/disable semantics.

Training: TinyDecoder (F.scaled_dot_product_attention, routed by the emulator to the
v3 op) under ``cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions])``
trains a few optimizer steps on W = 1, 2, 4 gloo ranks (loopback) with the loss and
the gradients (all-reduced, averaged) of the single-process run at every step.
One spawned run per world size does every rank-side check; the tests read its results.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import cp_cache
from cp_cache.testing.reference import dense_attention, dense_bounds, error_bound, rank_positions, rel_err
from cp_cache import layout as L
from cp_cache.testing import emulator_installed, install_npu_emulator, uninstall_npu_emulator
from cp_cache.testing.multiprocess import run_ranks

WORLDS = (1, 2, 4)
SEQ = 16  # divisible by 2W for W = 1, 2, 4
BATCH = 2
STEPS = 3
K_TRAIN = 10.0  # CP float32 may err K_TRAIN x as much as the float32 single process (both vs float64)


def _calls() -> tuple[int, int]:
    """How many CP attention forwards and backwards this process has run."""
    stats = cp_cache.call_stats()
    return stats["forward"]["calls"], stats["backward"]["calls"]


@pytest.fixture(autouse=True)
def no_live_caches():
    yield
    assert cp_cache.stats()["live_entries"] == 0


# ---------------------------------------------------------------- training, rank side


@dataclass(frozen=True)
class Spec:
    kv_heads: int = 4
    optimizer: str = "sgd"  # sgd | adam
    checkpoint: str = "none"
    policy: str = "handle"

    @property
    def name(self) -> str:
        return f"kv{self.kv_heads}-{self.optimizer}-{self.checkpoint}-{self.policy}"


SPECS = [
    Spec(),
    Spec(kv_heads=2, optimizer="adam"),
    Spec(kv_heads=1, optimizer="sgd", checkpoint="non_reentrant"),
    Spec(optimizer="adam", checkpoint="reentrant"),
    Spec(policy="stack"),
    Spec(kv_heads=2, optimizer="adam", policy="stack"),
]


def _model(spec: Spec):
    from cp_cache.testing.models import ModelConfig, TinyDecoder

    torch.manual_seed(0)  # the same init on every rank and in the reference
    config = ModelConfig(vocab=64, dim=32, heads=4, kv_heads=spec.kv_heads, layers=2, max_seq=SEQ)
    return TinyDecoder(config, checkpoint=spec.checkpoint)


def _optimizer(spec: Spec, model):
    if spec.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _grad_err(model, truth) -> float:
    """max over parameters of max|grad - truth grad| / max|truth grad|."""
    return max(rel_err(p.grad.double(), t.grad) for p, t in zip(model.parameters(), truth.parameters()))


def _param_err(model, truth) -> float:
    return max(float((p.detach().double() - t.detach()).abs().max())
               for p, t in zip(model.parameters(), truth.parameters()))


def _train(spec: Spec, mesh, world: int) -> dict:
    """CP training (float32) next to the single-process model in float32 ("ref") and in float64
    ("truth"): both float32 runs are measured against the float64 one, which sets the bound."""
    import torch.distributed as dist

    from cp_cache.testing.models import loss_fn, make_batch

    model = _model(spec)
    reference = copy.deepcopy(model)
    truth = copy.deepcopy(model).double()
    opt, ref_opt, truth_opt = _optimizer(spec, model), _optimizer(spec, reference), _optimizer(spec, truth)
    out = {"loss": [], "ref_loss": [], "truth_loss": [], "grad_err": [], "ref_grad_err": [], "live": [],
           "calls": [], "grads": []}
    if spec.policy != "handle":
        cp_cache.enable(spec.policy)
    for step in range(STEPS):
        tokens, labels, positions = make_batch(BATCH, SEQ, 64, seed=step)
        # single process, full sequence, float32 and float64 (the loss in float64 too)
        ref_loss = loss_fn(reference(tokens, positions), labels)
        ref_loss.backward()
        truth_loss = F.cross_entropy(truth(tokens, positions).flatten(0, 1), labels.flatten())
        truth_loss.backward()
        # context parallel
        calls = _calls()
        with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1]):
            assert tokens.shape == (BATCH, SEQ // world)  # sharded in place
            loss = loss_fn(model(tokens, positions), labels)
            loss.backward()
        assert tokens.shape == (BATCH, SEQ)  # restored
        out["calls"].append(tuple(now - then for now, then in zip(_calls(), calls)))
        loss = loss.detach()
        dist.all_reduce(loss)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        out["loss"].append(float(loss) / world)
        out["ref_loss"].append(float(ref_loss.detach()))
        out["truth_loss"].append(float(truth_loss.detach()))
        out["grad_err"].append(_grad_err(model, truth))
        out["ref_grad_err"].append(_grad_err(reference, truth))
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        for o in (opt, ref_opt, truth_opt):
            o.step()
            o.zero_grad()
        out["live"].append(cp_cache.stats()["live_entries"])
    out["param_err"] = _param_err(model, truth)
    out["ref_param_err"] = _param_err(reference, truth)
    out["param_scale"] = max(float(t.detach().abs().max()) for t in truth.parameters())
    if spec.policy != "handle":
        cp_cache.enable("handle")
    out["stack_depth"] = cp_cache.stats()["stack_depth"]
    return out


# ---------------------------------------------------------------- SDPA route, rank side


def _sdpa_inputs(world: int):
    g = torch.Generator().manual_seed(11)
    B, N, S, D = 3, 3, 4 * world, 8
    return [torch.randn(B, N, S, D, generator=g) for _ in range(4)]


def _sdpa_route(rank: int, world: int, mesh) -> dict:
    """F.scaled_dot_product_attention on local tensors under cp_cache.context_parallel."""
    res = {}
    before = dict(vars(F))
    emulator_sdpa = F.scaled_dot_product_attention
    q, k, v, dout = _sdpa_inputs(world)
    calls = _calls()
    with cp_cache.context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        changed = sorted(name for name, value in vars(F).items() if before.get(name, None) is not value)
        res["changed_attributes"] = changed
        res["route_name"] = emulator_sdpa.__name__  # torch's wrapper lands on F.<this name>
        res["patched_is_emulator"] = F.scaled_dot_product_attention is emulator_sdpa
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        res["out_type"] = type(out).__name__
        out.backward(dout)
        res["out"], res["dq"], res["dk"], res["dv"] = (t.detach() for t in (out, ql.grad, kl.grad, vl.grad))
    res["calls"] = tuple(now - then for now, then in zip(_calls(), calls))
    res["restored"] = F.scaled_dot_product_attention is emulator_sdpa
    res["enabled_after"] = cp_cache.enabled()

    # without buffers: only the dispatcher part (shards made by hand, head-tail)
    q, k, v, dout = _sdpa_inputs(world)
    pos = rank_positions(world, rank, q.size(2) // world, load_balance=True)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    calls = _calls()[0]
    with cp_cache.context_parallel(mesh):
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        out.backward(dout[:, :, pos])
    res["nobuf_calls"] = _calls()[0] - calls
    res["nobuf"] = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    res["live"] = cp_cache.stats()["live_entries"]
    return res


# ---------------------------------------------------------------- enable/disable, rank side


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[str, str]] = []

    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))


def _table_semantics(rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import context_parallel as torch_cp

    v3 = torch.ops.npu.npu_fusion_attention_v3.default
    grad = torch.ops.npu.npu_fusion_attention_grad_v3.default

    def present() -> bool:
        table = DTensor._op_dispatcher._custom_op_handlers
        registered = cp_cache.dispatch.registered_handlers()
        return (registered is not None and table.get(v3) is registered.forward_handler
                and table.get(grad) is registered.backward_handler)

    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, 2, 4 * world, 8, generator=g) for _ in range(3)]
    q, k, v = (distribute_tensor(t, mesh, [Shard(2)]) for t in full)

    def reaches_ring() -> tuple[bool, str]:
        calls = _calls()[0]
        try:
            torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.3)
            error = ""
        except Exception as exc:  # noqa: BLE001 - reported
            error = type(exc).__name__
        return _calls()[0] > calls, error

    res = {}
    buf = torch.arange(4 * world, dtype=torch.float32).view(1, -1)
    res["initial"] = (cp_cache.enabled(), present())
    cp_cache.enable()
    cp_cache.enable()  # idempotent
    res["enabled"] = (cp_cache.enabled(), present(), reaches_ring())
    with torch_cp(mesh, buffers=[buf], buffer_seq_dims=[1]):
        res["torch_cp_inside_enabled_before"] = (present(), reaches_ring())
    res["torch_cp_after_enabled_before"] = (cp_cache.enabled(), present(), reaches_ring())
    cp_cache.disable()
    res["disabled"] = (cp_cache.enabled(), present(), reaches_ring())
    with torch_cp(mesh, buffers=[buf], buffer_seq_dims=[1]):
        res["torch_cp_inside_disabled"] = present()
        cp_cache.enable()
        res["torch_cp_enabled_inside"] = (present(), reaches_ring())
    res["torch_cp_after_enabled_inside"] = (cp_cache.enabled(), present(), reaches_ring())

    # disable() with a graph still holding a handle: logged, and the cache lives on with its graph
    records = _Records()
    logger = logging.getLogger("cp_cache")
    logger.addHandler(records)
    qg = distribute_tensor(full[0], mesh, [Shard(2)]).requires_grad_()
    with cp_cache.context_parallel(mesh):
        out = torch.ops.npu.npu_fusion_attention_v3(qg, k, v, 2, "BNSD", scale=0.3)
    res["live_before_disable"] = cp_cache.stats()["live_entries"]
    cp_cache.disable()
    res["live_after_disable"] = cp_cache.stats()["live_entries"]
    del out, qg
    res["live_after_drop"] = cp_cache.stats()["live_entries"]
    # stack policy: an entry whose backward never runs is dropped by disable(), and logged
    cp_cache.enable("stack")
    with cp_cache.context_parallel(mesh):
        out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.3)
    res["stack_depth"] = cp_cache.stats()["stack_depth"]
    try:
        cp_cache.enable("handle")
        res["switch_with_pending"] = ""
    except RuntimeError as exc:
        res["switch_with_pending"] = str(exc)
    del out
    cp_cache.disable()
    logger.removeHandler(records)
    res["log"] = records.messages
    res["stack_depth_after"] = cp_cache.stats()["stack_depth"]
    res["live_end"] = cp_cache.stats()["live_entries"]
    cp_cache.enable("handle")
    return res


def _model_rank(rank: int, world: int, specs: list[Spec]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    install_npu_emulator(route_sdpa=True)
    mesh = init_device_mesh("cpu", (world,))
    results = {"table": _table_semantics(rank, world, mesh)}
    cp_cache.disable()
    results["sdpa"] = _sdpa_route(rank, world, mesh)
    results["train"] = {spec.name: _train(spec, mesh, world) for spec in specs}
    results["enabled_at_end"] = cp_cache.enabled()
    results["live_entries"] = cp_cache.stats()["live_entries"]
    return results


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_model_rank, world, SPECS, timeout=240.0)
    return _RESULTS[world]


# ---------------------------------------------------------------- tests: training


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_training_matches_single_process(world, spec):
    """CP in float32 errs, against the float64 model, at most K_TRAIN times as much as the float32
    single process does (both measured in the rank's run). The steps compound the rounding (Adam
    divides by the gradients' own size), so a step's bound follows the worst reference error so far."""
    for r, res in enumerate(_results(world)):
        t = res["train"][spec.name]
        for step in range(STEPS):
            loss_ref = max(abs(a - b) for a, b in zip(t["ref_loss"][:step + 1], t["truth_loss"][:step + 1]))
            loss_bound = error_bound(loss_ref, scale=abs(t["truth_loss"][step]), factor=K_TRAIN)
            assert abs(t["loss"][step] - t["truth_loss"][step]) <= loss_bound, (
                r, step, t["loss"][step], t["truth_loss"][step], loss_bound)
            grad_bound = error_bound(max(t["ref_grad_err"][:step + 1]), factor=K_TRAIN)
            assert t["grad_err"][step] <= grad_bound, (r, step, t["grad_err"][step], grad_bound, t["ref_grad_err"])
            # every layer's attention ran through the handlers, forward and backward
            fwd, bwd = t["calls"][step]
            layers = 2
            recompute = spec.checkpoint in ("non_reentrant", "reentrant")
            assert fwd == layers * (2 if recompute else 1), (step, fwd)
            assert bwd == layers, (step, bwd)
            assert t["live"][step] == 0
        assert t["param_err"] <= error_bound(t["ref_param_err"], scale=t["param_scale"], factor=K_TRAIN), (
            r, t["param_err"], t["ref_param_err"])
        assert t["stack_depth"] == 0
        # the loss moved: the optimizer really stepped
        assert t["ref_loss"][-1] != t["ref_loss"][0]


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_agree_after_allreduce(world):
    results = _results(world)
    for spec in SPECS:
        for res in results[1:]:
            assert res["train"][spec.name]["loss"] == results[0]["train"][spec.name]["loss"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kv_heads", (4, 2))
def test_handle_and_stack_policies_same_numbers(world, kv_heads):
    optimizer = "sgd" if kv_heads == 4 else "adam"
    for res in _results(world):
        handle = res["train"][Spec(kv_heads=kv_heads, optimizer=optimizer).name]
        stack = res["train"][Spec(kv_heads=kv_heads, optimizer=optimizer, policy="stack").name]
        assert handle["loss"] == stack["loss"]
        for gh, gs in zip(handle["grads"], stack["grads"]):
            for a, b in zip(gh, gs):
                assert torch.equal(a, b)


# ---------------------------------------------------------------- tests: SDPA route


def _check_against_dense(world: int, per_rank: list[dict]):
    q, k, v, dout = _sdpa_inputs(world)
    ref = dense_attention(q, k, v, dout, causal=True)
    bounds = dense_bounds(q, k, v, dout, ref, causal=True, keys=("out", "dq", "dk", "dv"))
    for key in ("out", "dq", "dk", "dv"):
        got = torch.zeros_like(ref[key])
        for r, part in enumerate(per_rank):
            got[:, :, rank_positions(world, r, q.size(2) // world, load_balance=True)] = part[key].double()
        err = rel_err(got, ref[key])
        assert err <= bounds[key], (key, err, bounds[key])


@pytest.mark.parametrize("world", WORLDS)
def test_sdpa_route_reaches_handler(world):
    results = _results(world)
    for res in results:
        s = res["sdpa"]
        # torch's wrapper replaced exactly F.scaled_dot_product_attention, nothing else
        assert s["changed_attributes"] == ["scaled_dot_product_attention"]
        assert s["route_name"] == "scaled_dot_product_attention"
        assert not s["patched_is_emulator"]
        assert s["restored"] and not s["enabled_after"]
        assert s["out_type"] == "Tensor"
        assert s["calls"] == (1, 1)
        assert s["nobuf_calls"] == 1
        assert s["live"] == 0
    _check_against_dense(world, [res["sdpa"] for res in results])
    _check_against_dense(world, [res["sdpa"]["nobuf"] for res in results])


# ---------------------------------------------------------------- tests: enable/disable in the ranks


@pytest.mark.parametrize("world", WORLDS)
def test_handler_table_survives_torch_context_parallel(world):
    for res in _results(world):
        t = res["table"]
        assert t["initial"] == (False, False)
        # outside a CP region the handlers stay in the table but pass the call on (the
        # emulated op alone has no sharding strategy: DTensor raises, as without cp_cache)
        outside = (False, "NotImplementedError")
        assert t["enabled"] == (True, True, outside)
        assert t["torch_cp_inside_enabled_before"] == (True, (True, ""))
        assert t["torch_cp_after_enabled_before"] == (True, True, outside)
        assert t["torch_cp_inside_disabled"] is False
        assert t["torch_cp_enabled_inside"] == (True, (True, ""))
        assert t["torch_cp_after_enabled_inside"] == (True, True, outside)


@pytest.mark.parametrize("world", WORLDS)
def test_disable_removes_handlers_and_logs_live_caches(world):
    for res in _results(world):
        t = res["table"]
        enabled, present, (reached, _error) = t["disabled"]
        assert (enabled, present, reached) == (False, False, False)
        assert t["live_before_disable"] == 1
        assert t["live_after_disable"] == 1  # the graph still owns its cache
        assert t["live_after_drop"] == 0
        warnings = [m for level, m in t["log"] if level == "WARNING"]
        assert any("1 step caches" in m and "still alive" in m for m in warnings), t["log"]
        assert t["stack_depth"] == 1
        assert "1 stack entries of the 'stack' policy" in t["switch_with_pending"]
        assert any("dropped 1 stack entries" in m for m in warnings), t["log"]
        assert t["stack_depth_after"] == 0 and t["live_end"] == 0
        assert res["live_entries"] == 0


# ---------------------------------------------------------------- tests: enable/disable in this process


@pytest.fixture
def emulated():
    """The emulator's ops in this process (no SDPA route); leaves the process as found."""
    was_installed = emulator_installed()
    config = cp_cache.active_config()
    install_npu_emulator(route_sdpa=False)
    yield
    cp_cache.disable()
    if config is not None:
        cp_cache.enable(config.policy, kernel=config.kernel)
    if not was_installed:
        uninstall_npu_emulator()


def _in_table() -> bool:
    from torch.distributed.tensor import DTensor

    return torch.ops.npu.npu_fusion_attention_v3.default in DTensor._op_dispatcher._custom_op_handlers


def test_enable_is_idempotent(emulated, monkeypatch):
    monkeypatch.delenv("CP_CACHE_POLICY", raising=False)
    cp_cache.enable()
    cp_cache.enable()
    assert cp_cache.enabled() and _in_table() and cp_cache.active_config().policy == "handle"
    cp_cache.disable()
    assert not cp_cache.enabled() and not _in_table()
    cp_cache.disable()  # twice is fine too
    assert not cp_cache.enabled()


def test_invalid_policy_argument(emulated):
    with pytest.raises(ValueError, match=r"policy='bogus'"):
        cp_cache.enable("bogus")
    assert not cp_cache.enabled()


def test_policy_from_environment(emulated, monkeypatch):
    monkeypatch.setenv("CP_CACHE_POLICY", "nonsense")
    with pytest.raises(ValueError, match=r"CP_CACHE_POLICY='nonsense'"):
        cp_cache.enable()
    monkeypatch.setenv("CP_CACHE_POLICY", "stack")
    cp_cache.enable()
    assert cp_cache.active_config().policy == "stack"
    cp_cache.enable("handle")  # the argument wins over the environment
    assert cp_cache.active_config().policy == "handle"


def test_disable_logs_live_caches(emulated, caplog):
    cp_cache.enable()
    store = cp_cache.store()
    cache = store.create()
    handle = store.attach(cache)
    del cache
    with caplog.at_level(logging.WARNING, logger="cp_cache"):
        cp_cache.disable()
    assert any("1 step caches" in r.getMessage() and "still alive" in r.getMessage() for r in caplog.records)
    assert cp_cache.stats()["live_entries"] == 1
    del handle
    assert cp_cache.stats()["live_entries"] == 0


def test_disable_drops_and_logs_stack_entries(emulated, caplog):
    cp_cache.enable("stack")
    store = cp_cache.store()
    store.push(store.create())
    with pytest.raises(RuntimeError, match="1 stack entries"):
        cp_cache.enable("handle")
    with caplog.at_level(logging.WARNING, logger="cp_cache"):
        cp_cache.disable()
    assert any("dropped 1 stack entries" in r.getMessage() for r in caplog.records)
    assert cp_cache.stats()["stack_depth"] == 0
