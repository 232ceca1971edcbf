"""Ring attention (cp_cache.algorithms.ring) against a dense float64 single-process reference.

The ranks run in spawned processes over gloo on loopback (W = 2, 4) or in this
process (W = 1, no group). Each spawned run executes the whole case matrix
once and returns the local results; every test then checks one case.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import pytest
import torch

from cp_cache.testing.reference import (
    AttentionCase,
    case_bounds,
    case_dense,
    case_positions,
    full_inputs,
    gather,
    keep_mask,
    rel_err,
    shard,
)
from cp_cache import layout as L
from cp_cache.kernels import NpuKernel, ReferenceKernel, get_kernel
from cp_cache.algorithms import RING, run_backward, run_forward
from cp_cache.engine.loop import RingStep
from cp_cache.masks.causal import step_part
from cp_cache.plan import CallPlan
from cp_cache.testing.reference import ring_plan
from cp_cache.testing.multiprocess import run_ranks

try:
    from cp_cache.testing import (
        emulator_installed,
        install_npu_emulator,
        uninstall_npu_emulator,
    )

    HAVE_EMULATOR = True
except ImportError:  # the emulator is optional for these tests
    HAVE_EMULATOR = False

LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")
MODES = ("causal_lb", "causal", "full")


@dataclass(frozen=True)
class Case(AttentionCase):
    kernel: str  # reference | npu
    keep_prob: float = 1.0
    B: int = 3
    nq: int = 3
    D: int = 8
    s_local: int = 6

    @property
    def name(self) -> str:
        g = "gqa" if self.gqa else "mha"
        kp = "" if self.keep_prob == 1.0 else f"-drop{self.keep_prob}"
        return f"{self.kernel}-{self.layout}-{self.mode}-{g}-{self.dtype}{kp}"

    @property
    def nkv(self) -> int:
        return 1 if self.gqa else self.nq


def _cases() -> list[Case]:
    kernels = ["reference"] + (["npu"] if HAVE_EMULATOR else [])
    out = []
    for kernel in kernels:
        for lay in LAYOUTS:
            for mode in MODES:
                for gqa in (False, True):
                    out.append(Case(lay, mode, gqa, "float32", kernel))
        # bf16: a subset (every layout, every mode once)
        for i, lay in enumerate(LAYOUTS):
            for mode in MODES:
                out.append(Case(lay, mode, bool(i % 2), "bfloat16", kernel))
    if HAVE_EMULATOR:
        for mode in MODES:
            out.append(Case("BSND", mode, True, "float32", "npu", keep_prob=0.75))
    return out


CASES = _cases()


# ---------------------------------------------------------------- rank side


def _config(case: Case, world: int, rank: int) -> CallPlan:
    return ring_plan(
        world_size=world,
        rank=rank,
        causal=case.causal,
        load_balance=case.load_balance,
        layout=case.layout,
        head_num=case.nq,
        scale=1.0 / math.sqrt(case.D),
        keep_prob=case.keep_prob,
    )


class _Watch:
    """Wraps a kernel; at each call counts the received K/V blocks that are still alive."""

    def __init__(self, kernel):
        self.inner = kernel
        self.name = kernel.name
        self.own = None  # the block of step 0 (never skipped): this rank's own
        self.refs: list[weakref.ref] = []
        self.max_alive = 0

    def _see(self, k):
        base = k if k._base is None else k._base
        if self.own is None:
            self.own = base
        elif base is not self.own and not any(r() is base for r in self.refs):
            self.refs.append(weakref.ref(base))
        self.max_alive = max(self.max_alive, sum(r() is not None for r in self.refs))

    def forward(self, q, k, v, **kw):
        self._see(k)
        return self.inner.forward(q, k, v, **kw)

    def backward(self, q, k, v, *a, **kw):
        self._see(k)
        return self.inner.backward(q, k, v, *a, **kw)


def _run_cases(rank: int, world: int, cases: list[Case], group) -> dict:
    if any(c.kernel == "npu" for c in cases):
        install_npu_emulator(route_sdpa=False)
    results = {}
    for case in cases:
        q, k, v, dout = full_inputs(case, world)
        pos = case_positions(case, world, rank)
        ql, kl, vl, dl = (shard(t, case, pos) for t in (q, k, v, dout))
        cfg = _config(case, world, rank)
        kernel = _Watch(get_kernel(case.kernel))
        torch.manual_seed(1234 + rank)
        fwd = run_forward(RING, cfg, ql, kl, vl, groups=[group], kernel=kernel)
        max_alive_fwd, seen_fwd = kernel.max_alive, len(kernel.refs)
        kernel = _Watch(get_kernel(case.kernel))
        bwd = run_backward(RING, cfg, dl, ql, kl, vl, fwd.out, fwd.lse, fwd.steps, groups=[group], kernel=kernel)
        results[case.name] = dict(
            out=fwd.out, lse=fwd.lse, dq=bwd.dq, dk=bwd.dk, dv=bwd.dv,
            fwd_bytes=fwd.bytes_sent, bwd_bytes=bwd.bytes_sent,
            block_bytes=kl.nbytes + vl.nbytes,
            steps=[(s.index, s.source_rank(rank, world), s.part, None if s.seed is None else int(s.seed[0]),
                    None if s.offset is None else int(s.offset[0])) for s in fwd.steps],
            max_alive=max(max_alive_fwd, kernel.max_alive),
            blocks_seen=(seen_fwd, len(kernel.refs)),
            dtypes=(fwd.out.dtype, fwd.lse.dtype, bwd.dq.dtype, bwd.dk.dtype, bwd.dv.dtype),
        )
    return results


def _ring_rank(rank: int, world: int, cases: list[Case]) -> dict:
    import torch.distributed as dist

    from cp_cache.engine import loop

    # one stage ahead, as at real sizes (the small cases of the other modules post every stage
    # at once: engine/loop.SMALL_EXCHANGE_BYTES)
    loop.SMALL_EXCHANGE_BYTES = 0
    return _run_cases(rank, world, cases, dist.group.WORLD)


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        if world == 1:
            # in this process: leave the emulator as we found it for other test modules
            was_installed = HAVE_EMULATOR and emulator_installed()
            try:
                _RESULTS[world] = [_run_cases(0, 1, CASES, None)]
            finally:
                if HAVE_EMULATOR and not was_installed:
                    uninstall_npu_emulator()
        else:
            _RESULTS[world] = run_ranks(_ring_rank, world, CASES, timeout=180.0)
    return _RESULTS[world]


# ---------------------------------------------------------------- dropout masks on the full sequence


def _keep_mask(results: list[dict], case: Case, world: int) -> torch.Tensor:
    """The full keep mask from every rank's recorded steps (index, source, part, seed, offset)."""
    return keep_mask([[s[1:] for s in res[case.name]["steps"]] for res in results], case, world)


# ---------------------------------------------------------------- tests


WORLDS = (1, 2, 4)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ring_matches_dense(world, case):
    results = _results(world)
    q, k, v, dout = full_inputs(case, world)
    keep = _keep_mask(results, case, world) if case.keep_prob < 1 else None
    ref = case_dense(q, k, v, dout, case, keep)
    got = gather([res[case.name] for res in results], case, world)
    dt = case.torch_dtype
    for r, res in enumerate(results):
        assert res[case.name]["dtypes"] == (dt, torch.float32, dt, dt, dt)
    # bounds: a multiple of dense torch's error in the case dtype on the same inputs (float32: 20x,
    # + 32 eps; bf16, computed in float32 and rounded once where dense bf16 rounds every op: 4x + eps/2)
    if dt == torch.float32:
        bound = case_bounds(q, k, v, dout, case, ref, keep)
    else:
        bound = case_bounds(q, k, v, dout, case, ref, keep, factor=4.0, floor=0.5)
    for key in ("out", "lse", "dq", "dk", "dv"):
        err = rel_err(got[key], ref[key])
        assert err <= bound[key], f"{case.name} W={world} {key}: relative error {err:.3g} > {bound[key]:.3g}"


def _blocks_exchanged(case: Case, rank: int, world: int) -> tuple[float, float]:
    """(blocks of K/V this rank sends, blocks it receives) under the direct exchange."""
    if not case.causal:
        return world - 1, world - 1
    if not case.load_balance:  # rank r's block is wholly before ranks > r
        return world - 1 - rank, rank
    # head-tail: ranks p < r see all of r's block (their tail chunk comes after both of r's),
    # ranks p > r its head chunk only; r sees the head chunk of each p < r, all of each p > r
    return rank + (world - 1 - rank) / 2, rank / 2 + (world - 1 - rank)


@pytest.mark.parametrize("world", WORLDS)
def test_bytes_and_liveness(world):
    """Forward sends each other rank the rows of its K/V block that rank needs: full attention
    every row, causal on contiguous shards whole blocks to the later ranks, causal head-tail whole
    blocks to the earlier ranks and the head half to the later ones; backward sends them again
    plus the float32 dK/dV partials of the rows it received; <= 2 blocks alive."""
    results = _results(world)
    for case in CASES:
        for r, res in enumerate(results):
            rr = res[case.name]
            block = rr["block_bytes"]
            sent, received = _blocks_exchanged(case, r, world)
            assert rr["fwd_bytes"] == sent * block, (case.name, r, rr["fwd_bytes"], sent)
            item = torch.empty((), dtype=case.torch_dtype).element_size()
            dkv = block // item * 4
            assert rr["bwd_bytes"] == sent * block + received * dkv, (case.name, r)
            # the caller keeps its own block; besides it two receive buffers serve every hop:
            # the block being computed and the one being received into (a block sent earlier)
            assert rr["max_alive"] <= 2, (case.name, r, rr["max_alive"])
            # the watch saw the buffers the kernel ran on: one per hop for the first two hops,
            # then the same two again (so the check is real, and no hop allocates)
            ran = sum(1 for s in rr["steps"] if s[0] > 0 and s[2] != "skip")
            assert rr["blocks_seen"] == (min(ran, 2), min(ran, 2)), (case.name, r, rr["blocks_seen"])


@pytest.mark.parametrize("world", WORLDS)
def test_step_parts_match_rule(world):
    results = _results(world)
    for case in CASES:
        for r, res in enumerate(results):
            steps = res[case.name]["steps"]
            assert [s[1] for s in steps] == [(r - i) % world for i in range(world)]
            assert [s[2] for s in steps] == [
                step_part(r, i, world, case.causal, case.load_balance) for i in range(world)
            ]
            for s in steps:
                if s[2] == "skip":
                    assert s[3] is None and s[4] is None


def test_step_part_rule():
    # rank 1 of 4, causal: sources 1, 0, 3, 2
    assert [step_part(1, i, 4, True, False) for i in range(4)] == ["causal", "full", "skip", "skip"]
    assert [step_part(1, i, 4, True, True) for i in range(4)] == ["causal", "kv_head", "q_tail", "q_tail"]
    assert [step_part(3, i, 4, True, True) for i in range(4)] == ["causal", "kv_head", "kv_head", "kv_head"]
    assert [step_part(0, i, 4, False, False) for i in range(4)] == ["full"] * 4


@pytest.mark.parametrize("fused", [False, True], ids=["float32", "fused"])
def test_no_nan_with_empty_rows(fused):
    """A merge of -inf LSE rows (nothing seen yet / a skipped step) gives no NaN."""
    from cp_cache.engine.merge import merge_into

    was_installed = emulator_installed()
    if fused:
        install_npu_emulator(route_sdpa=False)
    try:
        _merges_without_nan(lambda *args: merge_into(*args, fused=fused))
    finally:
        if fused and not was_installed:
            uninstall_npu_emulator()


def _merges_without_nan(_merge):
    out = torch.zeros(1, 2, 3, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    _merge(out, lse, torch.zeros(1, 2, 3, 4), torch.full((1, 2, 3), float("-inf")), "BNSD", 2)
    assert not out.isnan().any() and torch.isneginf(lse).all()
    step = torch.ones(1, 2, 3, 4)
    _merge(out, lse, step, torch.zeros(1, 2, 3), "BNSD", 2)
    assert torch.equal(out, step) and torch.equal(lse, torch.zeros(1, 2, 3))
    _merge(out, lse, torch.full((1, 2, 3, 4), 7.0), torch.full((1, 2, 3), float("-inf")), "BNSD", 2)
    assert torch.equal(out, step)


def test_causal_skip_no_nan():
    """Causal without load balancing on W = 2 ranks: rank 0 skips a step; outputs finite."""
    for world in (2, 4):
        for res in _results(world):
            for case in CASES:
                rr = res[case.name]
                for key in ("out", "lse", "dq", "dk", "dv"):
                    assert torch.isfinite(rr[key].float()).all(), (case.name, key)


def _small(layout="BNSD", s=6, b=1, n=2, nkv=2, d=8):
    q = L.from_bnsd(torch.randn(b, n, s, d), layout)
    kv = L.from_bnsd(torch.randn(b, nkv, s, d), layout)
    return q, kv, kv.clone()


def _cfg(**kw):
    base = dict(world_size=1, rank=0, causal=True, load_balance=True, layout="BNSD",
                head_num=2, scale=0.3, keep_prob=1.0)
    base.update(kw)
    return ring_plan(**base)


def test_odd_local_length_with_load_balance():
    q, k, v = _small(s=5)
    with pytest.raises(ValueError, match="even local sequence length.*5"):
        run_forward(RING, _cfg(), q, k, v, groups=[None], kernel=ReferenceKernel())
    # fine without load balancing
    run_forward(RING, _cfg(load_balance=False), q, k, v, groups=[None], kernel=ReferenceKernel())


def test_steps_world_mismatch():
    q, k, v = _small()
    cfg = _cfg()
    fwd = run_forward(RING, cfg, q, k, v, groups=[None], kernel=ReferenceKernel())
    extra = fwd.steps + [RingStep(1, "full")]
    with pytest.raises(RuntimeError, match="2 ring steps where its forward makes 1"):
        run_backward(RING, cfg, q, q, k, v, fwd.out, fwd.lse, extra, groups=[None], kernel=ReferenceKernel())
    with pytest.raises(ValueError, match="world_size=2"):
        run_forward(RING, _cfg(world_size=2, rank=1), q, k, v, groups=[None], kernel=ReferenceKernel())


def test_bad_inputs():
    q, k, v = _small()
    ker = ReferenceKernel()
    with pytest.raises(ValueError, match=r"key .* and value .* disagree"):
        run_forward(RING, _cfg(), q, k, v[:, :, :4], groups=[None], kernel=ker)
    with pytest.raises(NotImplementedError, match="input_layout='TND'"):
        run_forward(RING, _cfg(layout="TND"), q, k, v, groups=[None], kernel=ker)
    with pytest.raises(ValueError, match="'XYZ'"):
        run_forward(RING, _cfg(layout="XYZ"), q, k, v, groups=[None], kernel=ker)
    with pytest.raises(ValueError, match="head_num=2"):
        run_forward(RING, _cfg(), q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1), groups=[None], kernel=ker)
    with pytest.raises(NotImplementedError, match="keep_prob"):
        run_forward(RING, _cfg(keep_prob=0.9), q, k, v, groups=[None], kernel=ker)


def test_get_kernel():
    assert get_kernel("reference").name == "reference"
    assert get_kernel("npu").name == "npu"
    with pytest.raises(ValueError, match="'nope'"):
        get_kernel("nope")
    assert get_kernel().name in ("npu", "torch")  # "torch" where the NPU op does not exist


def test_run_ranks_reports_failure():
    with pytest.raises(RuntimeError, match="rank 1"):
        run_ranks(_fail_on_rank1, 2, timeout=60.0)


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_run_ranks_timeout_kills_ranks():
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        run_ranks(_hang, 1, timeout=8.0)
    assert time.monotonic() - start < 30.0


def _hang(rank, world):
    import time

    time.sleep(600)
