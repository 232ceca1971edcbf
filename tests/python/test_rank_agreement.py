"""Ranks that disagree fail together, before any K/V moves (cp_cache.engine.agreement via the ring).

One spawned run per W (2, 4) executes every case; each case catches its exception on
every rank and returns (type, message). A mismatch is put on the last rank only.
"""

from __future__ import annotations

import time

import pytest
import torch

from cp_cache import layout as L
from cp_cache.kernels import ReferenceKernel
from cp_cache.algorithms import RING, run_backward, run_forward
from cp_cache.testing.reference import ring_plan
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import dense_attention, rank_positions

B, N, D, S_LOCAL = 1, 2, 8, 4
PG_TIMEOUT = 4.0

BASE = dict(causal=True, load_balance=True, layout="BNSD", head_num=N, scale=0.3, keep_prob=1.0)

# name -> (config changes on the last rank, input changes on the last rank, expected field, value on rank 0,
#          value on the last rank)
MISMATCHES = {
    "seq": ({}, dict(s=8), "local query shape", "(1, 2, 4, 8)", "(1, 2, 8, 8)"),
    "odd_seq": ({}, dict(s=5), "local query shape", "(1, 2, 4, 8)", "(1, 2, 5, 8)"),
    "heads": (dict(head_num=4), dict(n=4), "head count", "2", "4"),
    "kv_heads": ({}, dict(nkv=1), "K/V head count", "2", "1"),
    "dtype": ({}, dict(dtype=torch.bfloat16), "query dtype", "torch.float32", "torch.bfloat16"),
    "layout": (dict(layout="BSND"), dict(layout="BSND"), "layout", "'BNSD'", "'BSND'"),
    "scale": (dict(scale=0.25), {}, "scale", "0.3", "0.25"),
    "keep_prob": (dict(keep_prob=0.9), {}, "keep_prob", "1.0", "0.9"),
    "causal": (dict(causal=False), {}, "mask kind", "causal", "none (full)"),
    "load_balance": (dict(load_balance=False), {}, "load balancing", "True", "False"),
    "window": (dict(pre_tockens=5), {}, "pre_tockens", "3", "5"),
    "window_next": (dict(next_tockens=1), {}, "next_tockens", "0", "1"),
    "exchange": (dict(exchange="ring"), {}, "exchange", "direct, keep_kv=False, grad_partials='float32'",
                 "ring, keep_kv=False, grad_partials='float32'"),
}
WINDOW = dict(causal=False, window=True, pre_tockens=3, next_tockens=0)


def _inputs(rank: int, world: int, s=S_LOCAL, n=N, nkv=N, dtype=torch.float32, layout="BNSD"):
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(B, h, S_LOCAL * world, D, generator=g, dtype=torch.float64) for h in (N, N, N, N)]
    pos = rank_positions(world, rank, S_LOCAL, True)
    q, k, v, dout = (t.index_select(2, pos) for t in full)
    if s != S_LOCAL or n != N or nkv != N:  # a deliberately different local shape
        q, dout = torch.randn(B, n, s, D, dtype=torch.float64), torch.randn(B, n, s, D, dtype=torch.float64)
        k, v = torch.randn(B, nkv, s, D, dtype=torch.float64), torch.randn(B, nkv, s, D, dtype=torch.float64)
    return [L.from_bnsd(t, layout).to(dtype) for t in (q, k, v, dout)], full, pos


def _outcome(fn) -> tuple:
    try:
        fn()
        return ("ok", "", "")
    except Exception as exc:  # noqa: BLE001 - returned to the test
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else ""
        return (type(exc).__name__, str(exc), cause)


class _RaisingKernel:
    """A step kernel that raises on its first backward call (on the rank it is given to)."""

    def __init__(self):
        self.inner = ReferenceKernel()
        self.name = self.inner.name

    def forward(self, *a, **kw):
        return self.inner.forward(*a, **kw)

    def backward(self, *a, **kw):
        raise RuntimeError("injected kernel failure")


def _agreement_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import cp_cache
    from cp_cache.engine import agreement

    group, last, ker = dist.group.WORLD, world - 1, ReferenceKernel()
    results = {}

    # every mismatch field, forward, raised on every rank
    for name, (cfg_change, in_change, *_rest) in MISMATCHES.items():
        base = dict(BASE, **(WINDOW if name.startswith("window") else {}))
        cfg = dict(base, **(cfg_change if rank == last else {}))
        (q, k, v, _), _, _ = _inputs(rank, world, **(in_change if rank == last else {}))
        config = ring_plan(world_size=world, rank=rank, **cfg)
        results[name] = _outcome(lambda: run_forward(RING, config, q, k, v, groups=[group], kernel=ker))

    # a backward that disagrees (scale) after an agreeing forward
    (q, k, v, dout), full, pos = _inputs(rank, world)
    config = ring_plan(world_size=world, rank=rank, **BASE)
    fwd = run_forward(RING, config, q, k, v, groups=[group], kernel=ker)
    bad = ring_plan(world_size=world, rank=rank, **dict(BASE, scale=0.25 if rank == last else 0.3))
    results["backward_scale"] = _outcome(lambda: run_backward(RING, bad, dout, q, k, v, fwd.out, fwd.lse, fwd.steps, groups=[group], kernel=ker))

    # the same bad argument on every rank: the same check fails on every rank
    invalid = ring_plan(world_size=world, rank=rank, **dict(BASE, keep_prob=2.0))
    results["all_invalid"] = _outcome(lambda: run_forward(RING, invalid, q, k, v, groups=[group], kernel=ker))

    # agreeing calls: right answer against dense float64; one all_gather per call on the CPU side
    # group, none on the CP group, signature built once
    from cp_cache.engine.agreement import SideGroup

    gathers, on_cp_group, inside = [], [], []
    real_all_gather, real_side_gather = dist.all_gather, SideGroup.all_gather_async

    def counting_all_gather(*a, **kw):  # outside the side group's own (which may be the CP group's gloo)
        if not inside:
            on_cp_group.append(1)
        return real_all_gather(*a, **kw)

    def counting_side_gather(self, tensor):
        gathers.append(1)
        inside.append(1)
        try:
            return real_side_gather(self, tensor)
        finally:
            inside.pop()

    dist.all_gather, SideGroup.all_gather_async = counting_all_gather, counting_side_gather
    try:
        before = agreement.counters()
        fwd = run_forward(RING, config, q, k, v, groups=[group], kernel=ker)
        bwd = run_backward(RING, config, dout, q, k, v, fwd.out, fwd.lse, fwd.steps, groups=[group], kernel=ker)
        first = agreement.counters()
        for _ in range(3):
            run_forward(RING, config, q, k, v, groups=[group], kernel=ker)
        steady = agreement.counters()
    finally:
        dist.all_gather, SideGroup.all_gather_async = real_all_gather, real_side_gather
    results["agree"] = dict(counters=(before, first, steady), all_gathers=len(gathers),
                            cp_group_gathers=len(on_cp_group))
    ref = dense_attention(*full, causal=True)  # scale 1/sqrt(D)
    config_ref = ring_plan(world_size=world, rank=rank, **dict(BASE, scale=1 / D ** 0.5))
    fwd = run_forward(RING, config_ref, q, k, v, groups=[group], kernel=ker)
    bwd = run_backward(RING, config_ref, dout, q, k, v, fwd.out, fwd.lse, fwd.steps, groups=[group], kernel=ker)
    results["agree"]["errors"] = {
        name: float((got.double() - ref[name].index_select(2, pos)).abs().max())
        for name, got in (("out", fwd.out), ("dq", bwd.dq), ("dk", bwd.dk), ("dv", bwd.dv))
    }

    results["sequence"] = _sequence(rank, world, group, ker)

    # last: a rank raises an ordinary exception inside the ring; the others raise too, in time
    kernel = _RaisingKernel() if rank == last else ker
    fwd = run_forward(RING, config, q, k, v, groups=[group], kernel=ker)
    started = time.monotonic()
    outcome = _outcome(lambda: run_backward(RING, config, dout, q, k, v, fwd.out, fwd.lse, fwd.steps, groups=[group], kernel=kernel))
    if outcome[0] == "ok":  # this rank's ring finished: its next communication must fail in time
        outcome = _outcome(lambda: run_forward(RING, config, q, k, v, groups=[group], kernel=ker))
    seconds = time.monotonic() - started
    if rank == last:  # stay alive (connections open), so the others fail by the group's timeout
        time.sleep(PG_TIMEOUT + 2.0)
    del fwd
    results["kernel_raises"] = dict(outcome=outcome, seconds=seconds,
                                    live_entries=cp_cache.stats()["live_entries"])
    return results


def _sequence(rank: int, world: int, group, ker) -> dict:
    """Calls in sequence on one group: a repeated call equals its first bit for bit (its bytes
    too), alternating configurations each equal their own first call, and ranks that disagree, or
    refuse, after earlier calls raise the same error, with the next call right again."""
    (q, k, v, dout), _, _ = _inputs(rank, world)
    causal = ring_plan(world_size=world, rank=rank, **BASE)
    window = ring_plan(world_size=world, rank=rank, **dict(BASE, **WINDOW))

    def call(config, qkv=(q, k, v)):
        fwd = run_forward(RING, config, *qkv, groups=[group], kernel=ker)
        bwd = run_backward(RING, config, dout, *qkv, fwd.out, fwd.lse, fwd.steps, groups=[group], kernel=ker)
        traffic = torch.tensor([fwd.bytes_sent, fwd.bytes_received, bwd.bytes_sent, bwd.bytes_received])
        return [fwd.out, fwd.lse, bwd.dq, bwd.dk, bwd.dv, traffic]

    out = {}
    cold = call(causal)
    out["hot_equal"] = all(torch.equal(a, b) for a, b in zip(cold, call(causal)))
    window_first = call(window)
    alternating = [call(causal), call(window), call(causal)]
    out["alternating_equal"] = all(torch.equal(a, b) for got, want in zip(alternating, (cold, window_first, cold))
                                   for a, b in zip(got, want))
    # after earlier calls: a disagreement (a longer local block on the last rank), then a refusal
    # (keep_prob out of range on the last rank), each the same error on every rank
    last = rank == world - 1
    longer = [torch.randn(B, N, 2 * S_LOCAL, D) for _ in range(3)]
    refusing = ring_plan(world_size=world, rank=rank, **dict(BASE, keep_prob=2.0))
    out["disagree"] = _outcome(lambda: call(causal, longer) if last else call(causal))
    out["refuse"] = _outcome(lambda: call(refusing if last else causal))
    out["after_equal"] = all(torch.equal(a, b) for a, b in zip(call(causal), cold))
    return out


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_agreement_rank, world, timeout=120.0, pg_timeout=PG_TIMEOUT)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatch_raises_on_every_rank(world, name):
    field, value0, value_last = MISMATCHES[name][2:]
    messages = set()
    for rank, res in enumerate(_results(world)):
        kind, message, _ = res[name]
        assert kind == "RuntimeError", (rank, kind, message)
        assert message.startswith("cp_cache: the ranks disagree on"), message
        expected = f"{field}: rank 0 {value0}, " + ", ".join(
            f"rank {r} {value0 if r < world - 1 else value_last}" for r in range(1, world))
        assert expected in message, (expected, message)
        messages.add(message)
    assert len(messages) == 1  # the same message on every rank


@pytest.mark.parametrize("world", [2, 4])
def test_odd_local_length_on_one_rank(world):
    """The rank whose own check fails says so in the agreed message and chains its error."""
    for rank, res in enumerate(_results(world)):
        kind, message, cause = res["odd_seq"]
        assert "argument checks: rank 0 'passed'" in message and f"rank {world - 1} 'ValueError'" in message
        assert cause == ("ValueError" if rank == world - 1 else "")


@pytest.mark.parametrize("world", [2, 4])
def test_backward_mismatch_and_shared_refusal(world):
    for res in _results(world):
        kind, message, _ = res["backward_scale"]
        assert kind == "RuntimeError" and "scale: rank 0 0.3" in message and f"rank {world - 1} 0.25" in message
        kind, message, _ = res["all_invalid"]
        assert kind == "ValueError" and "keep_prob must be in (0, 1]" in message


@pytest.mark.parametrize("world", [2, 4])
def test_agreeing_calls_right_and_one_collective_each(world):
    from cp_cache.testing.reference import error_bound

    # the bound: 20x dense torch's float32 error on the same inputs (+ 32 eps of the largest value)
    full = _inputs(0, world)[1]
    ref, low = (dense_attention(*full, causal=True, dtype=dt) for dt in (torch.float64, torch.float32))
    bound = {n: error_bound(float((low[n].double() - ref[n]).abs().max()), scale=float(ref[n].abs().max()))
             for n in ("out", "dq", "dk", "dv")}
    for res in _results(world):
        agree = res["agree"]
        assert all(agree["errors"][n] <= bound[n] for n in bound), (agree["errors"], bound)
        before, first, steady = agree["counters"]
        # one exchange per ring call (forward and backward): its signatures all_gathered on the
        # side group, and no other all_gather
        assert first["exchanges"] - before["exchanges"] == 2
        assert steady["exchanges"] - first["exchanges"] == 3
        assert agree["all_gathers"] == 5 and agree["cp_group_gathers"] == 0, agree
        # the signature is built once per distinct local configuration, then reused
        assert steady["signatures_built"] == first["signatures_built"]
        assert steady["disagreements"] == first["disagreements"] == before["disagreements"]


@pytest.mark.parametrize("world", [2, 4])
def test_rank_raising_in_ring_fails_every_rank_in_time(world):
    for rank, res in enumerate(_results(world)):
        out = res["kernel_raises"]
        kind, message, _ = out["outcome"]
        assert kind != "ok", (rank, out)
        if rank == world - 1:
            assert "injected kernel failure" in message
        assert out["seconds"] < 3 * PG_TIMEOUT, (rank, out)
        assert out["live_entries"] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_calls_in_sequence_are_their_first_and_disagree_together(world):
    results = _results(world)
    for rank, res in enumerate(results):
        out = res["sequence"]
        assert out["hot_equal"] and out["alternating_equal"] and out["after_equal"], (rank, out)
        assert out["disagree"][0] == "RuntimeError" and "local query shape" in out["disagree"][1], (rank, out)
        assert out["refuse"][0] == "RuntimeError" and f"rank {world - 1} refused the call" in out["refuse"][1], \
            (rank, out)
    for key in ("disagree", "refuse"):  # the same message on every rank
        assert len({res["sequence"][key][1] for res in results}) == 1, key
