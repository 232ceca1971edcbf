"""Step-cache lifetime under every autograd mode, for both policies.

One spawned pair of ranks (gloo on loopback) executes the whole case matrix once per
policy at W = 2, then at W = 1 on a one-rank mesh of each rank (each rank takes every
other (policy, case) of the W = 1 matrix), on a 2-layer TinyDecoder whose attention goes
F.scaled_dot_product_attention -> npu_fusion_attention_v3 (emulator) -> the
cp_cache handlers, and returns per case: the outcome ("ok" or the exception
raised), the gradient error against a reference run, and store snapshots
(live_entries, live_bytes, stack_depth) after forward, after backward and at
the end of the step. The tests below check one case each.

References: without dropout the dense single-process run (no CP); with dropout
the same CP model run without checkpointing from the same RNG state (the ring
draws one dropout seed per step, which a dense run cannot reproduce).

What "correct" means with dropout and ``preserve_rng_state=False``: the
recompute draws new dropout masks. The layers after a checkpointed block saved
activations of the *original* forward, and the block's backward differentiates
the *recomputed* block at its original input. The backward must therefore use
the recompute's own dropout seeds, which gives a well-defined gradient: that of
a model whose block i has the original forward's value and the recompute's
derivative (``replay_body``: ``y_re + (y_orig - y_re).detach()`` with the RNG
states each call started from, recorded by the checkpointed function). Using
the original forward's seeds with the recomputed output (the stack policy's
pairing) would differentiate neither; the stack policy detects it through the
pairing key and raises.
"""

from __future__ import annotations

import functools
import gc
import re
import threading
import traceback

import pytest
import torch

import lifetime_harness as H
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import error_bound, float32_model_error

POLICIES = ("handle", "stack")


@functools.lru_cache(maxsize=None)
def tolerance() -> float:
    """The bound of a case's gradient error: 20x the float32 rounding of the harness models on this
    machine (one process, float32 gradients against float64, the worst over the models and batches
    the cases use) + 32 eps."""
    configs = (H.CONFIG, H.ModelConfig(**{**H.CONFIG.__dict__, "heads": 4}))
    batches = [*range(9), *range(10, 14), *range(20, 23)]
    rounding = max(float32_model_error(H.make_model(seed=seed, config=config), *H.batch(b))["grad_rel"]
                   for seed in range(3) for config in configs for b in batches)
    return error_bound(rounding)


class Boom(RuntimeError):
    pass


# ------------------------------------------------------------------ the cases
#
# A case is fn(env, rec) -> None; it fills ``rec`` as it goes: "err" (gradient
# error, worst over steps), "fwd"/"bwd"/"end" (snapshots, the worst over steps
# when several), and case-specific fields. An exception ends the case; the
# runner records it.


def _worst(rec: dict, key: str, s: dict) -> None:
    old = rec.get(key)
    rec[key] = s if old is None else {k: max(old[k], s[k]) for k in s}


def _err(rec: dict, value: float) -> None:
    rec["err"] = max(rec.get("err", 0.0), value)


def _measured_step(env, rec, model, data, body=H.plain_body, seed=None) -> dict:
    """One CP training step with snapshots after forward, backward and at the end."""
    with H.sharded(env, data) as (shard,):
        if seed is not None:
            torch.manual_seed(seed)
        loss = H.local_loss(model, shard, body)
        _worst(rec, "fwd", H.snap())
        loss.backward()
        _worst(rec, "bwd", H.snap())
        del loss
    _worst(rec, "end", H.snap())
    return H.grads(env, model)


def case_plain(env, rec):
    """Several SGD steps; each step's gradients against the dense model's at the same weights."""
    model, ref = H.make_model(), H.make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    for step in range(4):
        data = H.batch(step)
        got = _measured_step(env, rec, model, data)
        expect = H.dense_grads(ref, data)
        _err(rec, H.rel_err(got, expect))
        for m, g in ((model, got), (ref, expect)):
            for name, p in m.named_parameters():
                p.grad = g[name]
        opt.step()
        ref_opt.step()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    rec["weights_err"] = H.rel_err(dict(model.named_parameters()), dict(ref.named_parameters()))
    _err(rec, rec["weights_err"])


def _ckpt(body):
    def case(env, rec):
        model = H.make_model()
        for step in range(2):
            data = H.batch(1 + step)
            _err(rec, H.rel_err(_measured_step(env, rec, model, data, body), H.dense_grads(model, data)))

    return case


def _dropout_ckpt(reentrant: bool, preserve: bool):
    def case(env, rec):
        model = H.make_model(H.DROPOUT)
        for step in range(2):
            data = H.batch(2 + step)
            seed = 100 + 10 * step + env.rank
            states: dict = {}
            got = _measured_step(env, rec, model, data, H.checkpoint_body(reentrant, preserve, states), seed)
            assert all(len(s) == 2 for s in states.values()), {i: len(s) for i, s in states.items()}
            original = H.cp_grads(env, H.twin(model), data, H.plain_body, seed)
            if preserve:
                expect = original
            else:
                # each block's derivative is the recompute's: replay the RNG states it saw
                first = {i: s[0] for i, s in states.items()}
                recompute = {i: s[-1] for i, s in states.items()}
                expect = H.cp_grads(env, H.twin(model), data, H.replay_body(first, recompute))
                # not vacuous: the recompute did draw other masks than the original forward
                rec["differs_from_original"] = min(
                    rec.get("differs_from_original", 1e9), H.rel_err(got, original))
            _err(rec, H.rel_err(got, expect))

    return case


def _dropout_selective(env, rec):
    """Attention saved by selective checkpointing: the recompute does not redraw its masks."""
    model, data = H.make_model(H.DROPOUT), H.batch(3)
    seed = 7 + env.rank
    got = _measured_step(env, rec, model, data, H.selective_body(save_attention=True), seed)
    _err(rec, H.rel_err(got, H.cp_grads(env, H.twin(model), data, H.plain_body, seed)))


def _pipeline(order: list[str], dropout: bool):
    """Microbatches run in ``order`` ("F0", "B0", ...); accumulated gradients vs F0 B0 F1 B1 ..."""

    def case(env, rec):
        model = H.make_model(H.DROPOUT if dropout else 0.0)
        n = len(order) // 2
        datas = [H.batch(10 + i) for i in range(n)]
        seed = 50 + env.rank
        ref_model = H.twin(model)
        with H.sharded(env, *datas) as shards:
            torch.manual_seed(seed)
            losses = {}
            for item in order:
                i = int(item[1:])
                if item[0] == "F":
                    losses[i] = H.local_loss(model, shards[i]) / n
                    _worst(rec, "fwd", H.snap())
                else:
                    losses.pop(i).backward()
                    _worst(rec, "bwd", H.snap())
            _worst(rec, "end", H.snap())
            # reference: the same forwards in order F0 B0 F1 B1 ... draw the same seeds
            torch.manual_seed(seed)
            for i in range(n):
                (H.local_loss(ref_model, shards[i]) / n).backward()
        got, expect = H.grads(env, model), H.grads(env, ref_model)
        if not dropout:
            dense = None
            for data in datas:
                dense = H.add(dense, {k: v / n for k, v in H.dense_grads(model, data).items()})
            _err(rec, H.rel_err(expect, dense))
        _err(rec, H.rel_err(got, expect))

    return case


def case_retain_graph(env, rec, body=H.plain_body):
    model, data = H.make_model(), H.batch(4)
    expect = H.dense_grads(model, data)
    with H.sharded(env, data) as (shard,):
        loss = H.local_loss(model, shard, body)
        _worst(rec, "fwd", H.snap())
        loss.backward(retain_graph=True)
        rec["bwd1"] = H.snap()
        _err(rec, H.rel_err(H.grads(env, model), expect))
        loss.backward()
        _worst(rec, "bwd", H.snap())
        del loss
    _worst(rec, "end", H.snap())
    _err(rec, H.rel_err(H.grads(env, model), expect))


def _grad_subset(which: str):
    """torch.autograd.grad w.r.t. a subset: block 0's parameters (every attention backward
    runs) or the last MLP's (no attention backward runs)."""

    def case(env, rec):
        model, data = H.make_model(), H.batch(5)
        prefix = "blocks.0." if which == "block0" else "blocks.1.mlp."
        names = [n for n, _ in model.named_parameters() if n.startswith(prefix)]
        params = [model.get_parameter(n) for n in names]
        expect = H.dense_grads(model, data)
        with H.sharded(env, data) as (shard,):
            loss = H.local_loss(model, shard)
            _worst(rec, "fwd", H.snap())
            got = torch.autograd.grad(loss, params)
            _worst(rec, "bwd", H.snap())
            del loss
        _worst(rec, "end", H.snap())
        for p, g in zip(params, got):
            p.grad = g
        full = H.grads(env, model)
        _err(rec, H.rel_err({n: full[n] for n in names}, {n: expect[n] for n in names}))

    return case


def _then_train(env, rec, model):
    """A normal training step after the forward-only steps: still correct?"""
    data = H.batch(6)
    expect = H.dense_grads(model, data)
    with H.sharded(env, data) as (shard,):
        H.local_loss(model, shard).backward()
    rec["train_after"] = H.snap()
    _err(rec, H.rel_err(H.grads(env, model), expect))


def case_no_grad(env, rec):
    model = H.make_model()
    for step in range(2):
        with H.sharded(env, H.batch(step)) as (shard,), torch.no_grad():
            loss = H.local_loss(model, shard)
            _worst(rec, "fwd", H.snap())
            del loss
        _worst(rec, "end", H.snap())
    _then_train(env, rec, model)


def case_eval_dropped(env, rec):
    model = H.make_model(H.DROPOUT)
    model.eval()
    for step in range(2):
        with H.sharded(env, H.batch(step)) as (shard,):
            loss = H.local_loss(model, shard)
            assert loss.requires_grad
            _worst(rec, "fwd", H.snap())
            del loss  # the graph is dropped without a backward
        _worst(rec, "end", H.snap())
    _then_train(env, rec, H.make_model())


def case_exception(env, rec):
    model = H.make_model()

    def wrap(i, block, x):
        y = block(x)  # the attention of block i has run
        if i == len(model.blocks) - 1:
            raise Boom("raised in the last layer after its attention ran")
        return y

    for step in range(2):
        try:
            with H.sharded(env, H.batch(step)) as (shard,):
                H.local_loss(model, shard, H.per_block(wrap))
        except Boom:
            pass
        _worst(rec, "end", H.snap())
    _then_train(env, rec, model)


def _copying_hook(kind: str):
    """A saved-tensor hook that copies: torch's save_on_cpu(pin_memory=True), or clone."""

    def case(env, rec):
        model, data = H.make_model(), H.batch(8)
        expect = H.dense_grads(model, data)
        if kind == "save_on_cpu":
            hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
        try:
            with H.sharded(env, data) as (shard,):
                with hooks:
                    loss = H.local_loss(model, shard)
                _worst(rec, "fwd", H.snap())
                loss.backward()
                del loss
        finally:
            _worst(rec, "end", H.snap())
        _err(rec, H.rel_err(H.grads(env, model), expect))

    return case


def _threads(schedule: str):
    """Three threads, each with its own model (plain, non-reentrant, reentrant checkpoint;
    2 and 4 heads, so their caches differ).

    "free": each thread runs 3 steps freely interleaved; "barrier": all forwards, a
    barrier, then all backwards (the stack sees the others' entries on top);
    "handoff": each thread runs its forward and hands the backward to a new thread.
    Run at W = 1 only: the collectives of several threads on one process group may
    interleave across ranks.
    """
    bodies = [H.plain_body, H.checkpoint_body(False), H.checkpoint_body(True)]

    def case(env, rec):
        configs = [H.ModelConfig(**{**H.CONFIG.__dict__, "heads": 2 + 2 * (i % 2)}) for i in range(3)]
        models = [H.make_model(seed=i, config=c) for i, c in enumerate(configs)]
        datas = [H.batch(20 + i) for i in range(3)]
        expects = [H.dense_grads(m, d, b) for m, d, b in zip(models, datas, bodies)]
        outcome: list = [None] * 3
        barrier = threading.Barrier(3)

        def backward(loss, failure):
            try:
                loss.backward()
            except BaseException as e:  # noqa: BLE001
                failure.append(e)

        def worker(i, shard):
            try:
                for _ in range(3 if schedule == "free" else 1):
                    loss = H.local_loss(models[i], shard, bodies[i])
                    if schedule == "barrier":
                        barrier.wait()
                    if schedule == "handoff":
                        failure: list = []
                        t = threading.Thread(target=backward, args=(loss, failure))
                        t.start()
                        t.join()
                        if failure:
                            raise failure[0]
                    else:
                        loss.backward()
                    del loss
                    err = H.rel_err(H.grads(env, models[i]), expects[i])
                    outcome[i] = max(outcome[i] or 0.0, err)
            except BaseException as e:  # noqa: BLE001
                if schedule == "barrier":
                    barrier.abort()
                outcome[i] = f"{type(e).__name__}: {e}"

        with H.sharded(env, *datas) as shards:  # one CP context for all (torch's patch is global)
            threads = [threading.Thread(target=worker, args=(i, shards[i])) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        rec["end"] = H.snap()
        rec["threads"] = outcome
        numbers = [e for e in outcome if not isinstance(e, str)]
        raised = [e for e in outcome if isinstance(e, str) and "BrokenBarrierError" not in e]
        if numbers:
            rec["err"] = max(numbers)
        if raised:
            rec["threads_raised"] = len(raised)
            raise RuntimeError(raised[0])

    return case


CASES = {
    "plain": case_plain,
    "ckpt_nonreentrant": _ckpt(H.checkpoint_body(False)),
    "ckpt_reentrant": _ckpt(H.checkpoint_body(True)),
    "ckpt_nested": _ckpt(H.nested_body(outer_reentrant=False)),
    "ckpt_nested_reentrant_outer": _ckpt(H.nested_body(outer_reentrant=True)),
    "selective_save_attention": _ckpt(H.selective_body(True)),
    "selective_recompute_all": _ckpt(H.selective_body(False)),
    "dropout_nonreentrant_rng": _dropout_ckpt(False, True),
    "dropout_reentrant_rng": _dropout_ckpt(True, True),
    "dropout_nonreentrant_norng": _dropout_ckpt(False, False),
    "dropout_reentrant_norng": _dropout_ckpt(True, False),
    "dropout_selective_save_attention": _dropout_selective,
    "pipeline_f0f1b0b1": _pipeline(["F0", "F1", "B0", "B1"], False),
    "pipeline_1f1b_4": _pipeline(["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], False),
    "pipeline_f0f1b0b1_dropout": _pipeline(["F0", "F1", "B0", "B1"], True),
    "pipeline_1f1b_4_dropout": _pipeline(["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], True),
    "retain_graph": case_retain_graph,
    "retain_graph_ckpt": lambda env, rec: case_retain_graph(env, rec, H.checkpoint_body(False)),
    "grad_subset_block0": _grad_subset("block0"),
    "grad_subset_no_attention": _grad_subset("mlp"),
    "no_grad": case_no_grad,
    "eval_grad_dropped": case_eval_dropped,
    "exception_after_attention": case_exception,
    "save_on_cpu": _copying_hook("save_on_cpu"),
    "clone_hook": _copying_hook("clone"),
    "threads_free": _threads("free"),
    "threads_barrier": _threads("barrier"),
    "threads_handoff": _threads("handoff"),
}
W1_ONLY = {"threads_free", "threads_barrier", "threads_handoff"}


def _run_cases(env, items) -> dict:
    """{(policy, case): record} of each (policy, case name) of ``items``, in order (the cases of
    one policy one after the other under one enable(), as a training run would meet them)."""
    import cp_cache

    store = cp_cache.store()
    out = {}
    enabled = None
    for policy, name in items:
        if policy != enabled:
            if enabled is not None:
                cp_cache.disable()
            cp_cache.enable(policy=policy)
            enabled = policy
        rec: dict = {}
        try:
            CASES[name](env, rec)
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            rec["status"] = "raised"
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["where"] = traceback.format_exc()[-3000:]
        gc.collect()
        rec["after"] = H.snap()  # what the case left behind
        rec["dropped"] = store.clear()
        out[(policy, name)] = rec
    cp_cache.disable()
    return out


def _matrix(world: int, policies, names) -> list:
    return [(p, n) for p in policies for n in names if not (world > 1 and n in W1_ONLY)]


def _lifetime_rank(rank: int, world: int, policies, names) -> dict:
    """{W: {(policy, case): record}}: W = ``world`` on every rank; with a pair, also W = 1 on a
    one-rank mesh of each rank, every other (policy, case) on each (CP of degree 1 in a larger
    world: cp_cache reads the size from the CP group; one process start for both W)."""
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.testing import install_npu_emulator

    install_npu_emulator()
    out = {world: _run_cases(H.Env(rank, world), _matrix(world, policies, names))}
    if world == 2:
        alone = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pair", "cp"))["cp"]
        out[1] = _run_cases(H.Env(0, 1, mesh=alone), _matrix(1, policies, names)[rank::world])
    return out


_RESULTS: dict = {}


def results(world: int) -> list[dict]:
    """W = 2: each rank's records; W = 1: one record set, the two ranks' halves together."""
    if world not in _RESULTS:
        ranks = run_ranks(_lifetime_rank, 2, POLICIES, list(CASES), timeout=360.0)
        _RESULTS[2] = [r[2] for r in ranks]
        _RESULTS[1] = [{k: v for r in ranks for k, v in r[1].items()}]
        assert set(_RESULTS[1][0]) == set(_matrix(1, POLICIES, CASES)), sorted(_RESULTS[1][0])
    return _RESULTS[world]


# ------------------------------------------------------------------ expectations

ZERO = {"live_entries": 0, "live_bytes": 0, "stack_depth": 0}
LAYERS = H.CONFIG.layers

# live caches right after forward with the handle policy (per microbatch alive)
HANDLE_FWD_LIVE = {
    "plain": LAYERS, "selective_save_attention": LAYERS, "dropout_selective_save_attention": LAYERS,
    "retain_graph": LAYERS, "grad_subset_block0": LAYERS, "grad_subset_no_attention": LAYERS,
    "eval_grad_dropped": LAYERS, "save_on_cpu": 0, "clone_hook": 0,
    "pipeline_f0f1b0b1": 2 * LAYERS, "pipeline_f0f1b0b1_dropout": 2 * LAYERS,
    "pipeline_1f1b_4": 2 * LAYERS, "pipeline_1f1b_4_dropout": 2 * LAYERS,
}
# live caches after backward (the worst over a case's backwards) where not 0
HANDLE_BWD_LIVE = {
    # after B0 the other microbatch in flight still holds its caches
    "pipeline_f0f1b0b1": LAYERS, "pipeline_f0f1b0b1_dropout": LAYERS,
    "pipeline_1f1b_4": LAYERS, "pipeline_1f1b_4_dropout": LAYERS,
    # no attention backward ran: the caches live until the graph is dropped (then 0 at "end")
    "grad_subset_no_attention": LAYERS,
}
FULL_CHECKPOINT = {
    "ckpt_nonreentrant", "ckpt_reentrant", "ckpt_nested", "ckpt_nested_reentrant_outer",
    "selective_recompute_all", "dropout_nonreentrant_rng", "dropout_reentrant_rng",
    "dropout_nonreentrant_norng", "dropout_reentrant_norng", "retain_graph_ckpt", "no_grad",
}

MISPAIRING = "mis-pairing"
EMPTY_STACK = "pop from an empty step-cache stack"
# the stack policy: cases that raise, and the message
STACK_RAISES = {
    "dropout_nonreentrant_norng": MISPAIRING,
    "dropout_reentrant_norng": MISPAIRING,
    "pipeline_f0f1b0b1_dropout": MISPAIRING,
    "pipeline_1f1b_4_dropout": MISPAIRING,
    "retain_graph": EMPTY_STACK,
    "retain_graph_ckpt": EMPTY_STACK,
}
# ... and cases whose outcome depends on how threads interleave: a thread that pops another
# thread's entry raises (their models differ), one that finds its own on top works
STACK_MAY_RAISE = {"threads_free": MISPAIRING, "threads_barrier": MISPAIRING, "threads_handoff": MISPAIRING}
# torch's save_on_cpu cannot copy the DTensors CP attention saves: torch raises in the forward,
# before cp_cache sees anything, under either policy
SAVE_ON_CPU_DTENSOR = "mixed torch.Tensor and DTensor"
TORCH_RAISES = {"save_on_cpu"}
STACK_RAISES["save_on_cpu"] = SAVE_ON_CPU_DTENSOR
HANDLE_RAISES = {
    "save_on_cpu": SAVE_ON_CPU_DTENSOR,
    "clone_hook": "whose storage no handle created.*saved-tensor hook",
}


def _ids():
    return [(w, p, n) for w in (2, 1) for p in POLICIES for n in CASES if not (w > 1 and n in W1_ONLY)]


@pytest.mark.parametrize("world,policy,name", _ids(), ids=lambda x: str(x))
def test_case(world, policy, name):
    rec = results(world)[0][(policy, name)]
    detail = f"{policy}/{name} W={world}: {rec}"
    raises = (HANDLE_RAISES if policy == "handle" else STACK_RAISES).get(name)
    for rank_results in results(world):
        r = rank_results[(policy, name)]
        if policy == "stack" and name in STACK_MAY_RAISE and r["status"] == "raised":
            raises = STACK_MAY_RAISE[name]
        if raises:
            assert r["status"] == "raised" and re.search(raises, r["error"], re.S), detail
            assert name in TORCH_RAISES or "cp_cache" in r["error"], detail
        else:
            assert r["status"] == "ok", detail + "\n" + r.get("where", "")
        # never a wrong gradient: whatever was computed before or without raising is right
        assert r.get("err", 0.0) <= tolerance(), detail
        if policy == "handle":
            # nothing alive after the step, whatever happened
            assert r["after"] == ZERO and r["dropped"] == 0, detail
            if "end" in r:
                assert r["end"]["live_entries"] == 0 and r["end"]["live_bytes"] == 0, detail
            if "bwd" in r:
                assert r["bwd"]["live_entries"] == HANDLE_BWD_LIVE.get(name, 0), detail
            if "bwd1" in r:  # retain_graph=True keeps the caches of a plain graph for the 2nd backward
                assert r["bwd1"]["live_entries"] == (0 if name in FULL_CHECKPOINT else LAYERS), detail
            if "fwd" in r:
                expect = HANDLE_FWD_LIVE.get(name, 0 if name in FULL_CHECKPOINT else None)
                assert expect is None or r["fwd"]["live_entries"] == expect, detail
        else:
            assert r["after"]["live_entries"] == r["after"]["stack_depth"], detail


def test_dropout_recompute_drew_new_masks():
    """The preserve_rng_state=False cases are not vacuous: the original forward's gradient differs."""
    for world in (1, 2):
        for name in ("dropout_nonreentrant_norng", "dropout_reentrant_norng"):
            rec = results(world)[0][("handle", name)]
            assert rec["differs_from_original"] > tolerance(), rec  # the error check would catch it


def outcome_table(world: int) -> str:
    """The measured outcomes as a Markdown table (docs/lifetime.md)."""
    res = results(world)[0]
    lines = ["| case | handle | stack |", "|---|---|---|"]
    for name in CASES:
        if (POLICIES[0], name) not in res:
            continue
        cells = []
        for policy in POLICIES:
            r = res[(policy, name)]
            if r["status"] == "ok":
                text = "works"
            else:
                text = "raises: " + r["error"].split(":")[0] + ": …" + _phrase(r["error"])
            parts = []
            if "fwd" in r:
                parts.append(f"alive after fwd {r['fwd']['live_entries']}")
            left = r["after"]["live_entries"]
            parts.append(f"left alive {left}")
            cells.append(f"{text} ({', '.join(parts)})")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _phrase(error: str) -> str:
    for key in (MISPAIRING, EMPTY_STACK, "saved-tensor hook", "Boom"):
        if key in error:
            return key
    return error[:80]


if __name__ == "__main__":
    # python tests/python/test_lifetime.py [W] [case ...]: print the measured outcomes
    import sys

    worlds = [int(sys.argv[1])] if len(sys.argv) > 1 else [1, 2]
    names = sys.argv[2:] or list(CASES)
    for w in worlds:
        _RESULTS[w] = [r[w] for r in run_ranks(_lifetime_rank, w, POLICIES, names, timeout=240.0)]
        print(f"W = {w}")
        print(outcome_table(w))
        for key, r in sorted(_RESULTS[w][0].items()):
            print(key, {k: (v[:300] if isinstance(v, str) else v) for k, v in r.items() if k != "where"})
