"""Band (sliding-window) attention and explicit masks through the CP handlers,
against dense float64 at W = 1, 2, 4: windows smaller than, equal to and larger than the local
length, with and without load balancing, GQA; random masks (with and without fully masked
rows), bool and uint8, [S, S] / [B, 1, S, S] / [B, N, S, S], replicated or sharded on the query
dimension; sparse_mode 0 with a band; bytes sent against the rows other ranks need (the direct exchange); dropout by a
directional-derivative check; and the emulator's sparse_mode 4 pinned to the band rule.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from cp_cache.npu_ops import INT_MAX, causal_mask
from cp_cache.engine.steps import hops_needed, plan_step
from cp_cache.plan import MaskSpec
from cp_cache.testing import install_npu_emulator
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import band_masked, dense_attention, error_bound, exchanged_rows, rank_positions

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

WORLDS = (1, 2, 4)
B, N, D, S_LOCAL = 2, 4, 8, 8


@dataclass(frozen=True)
class MaskCase:
    name: str
    lb: bool
    sparse_mode: int
    pre: int = INT_MAX
    nxt: int = INT_MAX
    given: str = ""  # "" (no mask), "random", "dead_rows"
    mask_shape: str = "SS"  # SS | B1SS | BNSS
    mask_dtype: str = "bool"
    sharded_mask: bool = False
    gqa: bool = False

    @property
    def nkv(self) -> int:
        return N // 2 if self.gqa else N


def _window_cases() -> list[MaskCase]:
    cases = []
    for lb in (False, True):
        tag = "lb" if lb else "contig"
        for w in (S_LOCAL // 2, S_LOCAL, 2 * S_LOCAL + 3, 10**6):  # smaller, equal, larger, whole
            cases.append(MaskCase(f"window{w}-{tag}", lb, 4, pre=w - 1, nxt=0))
        cases.append(MaskCase(f"band3x2-{tag}-gqa", lb, 4, pre=3, nxt=2, gqa=True))
        cases.append(MaskCase(f"band0x5-{tag}", lb, 4, pre=0, nxt=5))
    return cases


def _mask_cases() -> list[MaskCase]:
    cases = []
    for lb in (False, True):
        tag = "lb" if lb else "contig"
        cases += [
            MaskCase(f"random-SS-bool-{tag}", lb, 1, given="random"),
            MaskCase(f"random-B1SS-uint8-{tag}", lb, 1, given="random", mask_shape="B1SS", mask_dtype="uint8"),
            MaskCase(f"random-BNSS-{tag}-gqa", lb, 1, given="random", mask_shape="BNSS", gqa=True),
            MaskCase(f"dead-rows-{tag}", lb, 1, given="dead_rows"),
            MaskCase(f"sharded-{tag}", lb, 1, given="random", sharded_mask=True),
            MaskCase(f"mode0-band-{tag}", lb, 0, pre=5, nxt=1, given="random"),
        ]
    return cases


CASES = _window_cases() + _mask_cases()


def _inputs(case: MaskCase, world: int):
    S = S_LOCAL * world
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))
    q, dout = (torch.randn(B, N, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, case.nkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    q, k, v, dout = (t.float().double() for t in (q, k, v, dout))
    if not case.given:
        return q, k, v, dout, None
    heads = {"SS": (), "B1SS": (B, 1), "BNSS": (B, N)}[case.mask_shape]
    masked = torch.rand(*heads, S, S, generator=g) < 0.4
    if case.given == "dead_rows":
        masked[..., ::5, :] = True  # every 5th query sees nothing
    if case.mask_dtype == "uint8":
        masked = masked.to(torch.uint8)
    return q, k, v, dout, masked


def _reference_mask(case: MaskCase, world: int, given):
    masked = band_masked(S_LOCAL * world, case.pre, case.nxt) if case.pre < INT_MAX or case.nxt < INT_MAX else None
    if given is not None:
        masked = given.bool() if masked is None else (given.bool() | masked)
    return masked


def _op_kwargs(case: MaskCase, mask_arg) -> dict:
    kw = dict(scale=1.0 / math.sqrt(D), sparse_mode=case.sparse_mode, pre_tockens=case.pre, next_tockens=case.nxt)
    kw["atten_mask"] = causal_mask("cpu") if case.sparse_mode == 4 else mask_arg
    return kw


def _run_case(case: MaskCase, rank: int, world: int, mesh) -> dict:
    import cp_cache
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    _cp_options.enable_load_balance = case.lb
    q, k, v, dout, given = _inputs(case, world)
    pos = rank_positions(world, rank, S_LOCAL, case.lb)
    local = [t.index_select(2, pos).float() for t in (q, k, v, dout)]
    qd, kd, vd = (DTensor.from_local(t.clone(), mesh, [Shard(2)]).requires_grad_() for t in local[:3])
    mask_arg = given
    if given is not None and case.sharded_mask:
        rows = given.index_select(given.dim() - 2, pos)
        mask_arg = DTensor.from_local(rows, mesh, [Shard(given.dim() - 2)])
    out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, N, "BNSD", **_op_kwargs(case, mask_arg))
    fwd_bytes = cp_cache.call_stats()["forward"]["bytes_sent"]
    out[0].backward(DTensor.from_local(local[3], mesh, [Shard(2)]))
    ref, low = (dense_attention(q, k, v, dout, causal=False, masked=_reference_mask(case, world, given), dtype=dt)
                for dt in (torch.float64, torch.float32))
    errors = {}
    for name, got in (("out", out[0]), ("dq", qd.grad), ("dk", kd.grad), ("dv", vd.grad)):
        want = ref[name].index_select(2, pos)
        got = got.to_local().double()
        errors[name] = float((got - want).abs().max() / ref[name].abs().max())
        errors[f"{name}_finite"] = bool(torch.isfinite(got).all())
        # dense torch in float32 on the same inputs and rows: the reference error of the bound
        errors[f"{name}_dense"] = float((low[name].index_select(2, pos).double() - want).abs().max()
                                        / ref[name].abs().max())
    block = 2 * local[1].nbytes
    return dict(errors=errors, fwd_bytes=fwd_bytes, block_bytes=block, live=cp_cache.stats()["live_entries"])


def _ranks(rank: int, world: int) -> dict:
    import cp_cache
    from torch.distributed.device_mesh import init_device_mesh

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    with cp_cache.context_parallel(mesh):
        results = {case.name: _run_case(case, rank, world, mesh) for case in CASES}
        results["dropout"] = {name: _dropout_check(name, rank, world, mesh) for name in ("band", "mask")}
    return results


def _dropout_check(kind: str, rank: int, world: int, mesh) -> list[tuple[float, float]]:
    """Model-free: the slope of sum(out * proj) along random directions of the local q/k/v,
    autograd against central differences, the RNG reset per forward (same masks); (error, bound)
    per direction, the bound from the differences' own truncation (steps eps and eps/2)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.testing.reference import directional_derivative_check

    _cp_options.enable_load_balance = True
    case = MaskCase("drop", True, 4, pre=S_LOCAL + 2, nxt=0) if kind == "band" else \
        MaskCase("drop", True, 1, given="random")
    q, k, v, _, given = _inputs(case, world)
    pos = rank_positions(world, rank, S_LOCAL, True)
    params = [t.index_select(2, pos).float().requires_grad_() for t in (q, k, v)]
    proj = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(rank))
    kwargs = _op_kwargs(case, given)

    def loss():
        torch.manual_seed(99 + rank)
        qd, kd, vd = (DTensor.from_local(t, mesh, [Shard(2)]) for t in params)
        out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, N, "BNSD", keep_prob=0.8, **kwargs)[0]
        return (out.to_local() * proj).sum()

    def total(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    return directional_derivative_check(loss, params, directions=3, eps=5e-2, reduce=total)


_RESULTS: dict = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_ranks, world, timeout=600)
    return _RESULTS[world]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_dense_float64(world, case):
    for rank, res in enumerate(_results(world)):
        errors = res[case.name]["errors"]
        for name in ("out", "dq", "dk", "dv"):
            assert errors[f"{name}_finite"], (case.name, rank, name)
            bound = error_bound(errors[f"{name}_dense"])  # 20x dense float32 + 32 eps
            assert errors[name] <= bound, (case.name, rank, name, errors[name], bound)
        assert res[case.name]["live"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_bytes_sent_are_the_rows_others_need(world):
    """Each rank sends the rows of its K/V block that other ranks' queries may attend to (the
    band, the given mask, both), counted here from the mask: never more than the whole-block
    ring's (W-1) blocks, and for a window on contiguous shards only the band's reach."""
    for case in CASES:
        held = [rank_positions(world, r, S_LOCAL, case.lb) for r in range(world)]
        _, _, _, _, given = _inputs(case, world)
        masked = _reference_mask(case, world, given)
        sent, _ = exchanged_rows(torch.zeros(S_LOCAL * world, S_LOCAL * world, dtype=torch.bool) if masked is None
                                 else masked.reshape(-1, *masked.shape[-2:]).all(0), held)
        for rank, res in enumerate(_results(world)):
            rr = res[case.name]
            row = rr["block_bytes"] // S_LOCAL
            assert rr["fwd_bytes"] == sent[rank] * row, (case.name, rank, rr["fwd_bytes"], sent[rank] * row)
            assert rr["fwd_bytes"] <= (world - 1) * rr["block_bytes"], (case.name, rank)


def test_window_hops_closed_form():
    for world in (2, 4, 8):
        for w in range(1, 9 * S_LOCAL):
            spec = MaskSpec(window=True, pre_tockens=w - 1, next_tockens=0)
            assert hops_needed(world, False, spec, S_LOCAL) == min(world - 1, -(-(w - 1) // S_LOCAL)), (world, w)
            # head-tail: a rank's tail chunk needs the tail chunk of the next rank, which comes last
            assert hops_needed(world, True, spec, S_LOCAL) == (world - 1 if w > 1 else 0), (world, w)


def test_blocks_outside_the_band_are_skipped():
    spec = MaskSpec(window=True, pre_tockens=S_LOCAL - 1, next_tockens=0)
    # contiguous, W=4: rank 3 sees its own block (band) and rank 2's (band); nothing further
    parts = [plan_step(3, i, 4, False, spec, S_LOCAL, S_LOCAL)[0] for i in range(4)]
    assert parts == ["band", "band", "skip", "skip"]
    # a block wholly inside the band is computed without a mask
    wide = MaskSpec(window=True, pre_tockens=10 * S_LOCAL, next_tockens=0)
    _, tasks = plan_step(3, 1, 4, False, wide, S_LOCAL, S_LOCAL)
    assert [t.mask.kind for t in tasks] == ["none"]


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("kind", ("band", "mask"))
def test_dropout_directional_derivative(world, kind):
    for rank, res in enumerate(_results(world)):
        checks = res["dropout"][kind]
        assert all(err <= bound for err, bound in checks), (kind, rank, checks)
        assert min(bound for _, bound in checks) < 0.1, checks  # some direction resolves a 10 % wrong slope


# ---------------------------------------------------------------- the emulator's sparse_mode 4


@pytest.mark.parametrize("sq, skv", [(8, 8), (6, 10), (10, 6)])
@pytest.mark.parametrize("pre, nxt", [(2, 0), (0, 3), (4, 4), (-2, 5), (5, -1)])
def test_emulator_band_mode_is_pinned(sq, skv, pre, nxt):
    """sparse_mode 4: with d = Skv - Sq (0 for the square global call),
    query i sees key j iff i - pre + d <= j <= i + next + d."""
    install_npu_emulator(route_sdpa=False)
    g = torch.Generator().manual_seed(sq * 100 + skv)
    q = torch.randn(1, 2, sq, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, skv, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", atten_mask=causal_mask("cpu"), scale=0.5,
                                                sparse_mode=4, pre_tockens=pre, next_tockens=nxt)[0]
    d = skv - sq
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    masked = (j - i > nxt + d) | (i - j > pre - d)
    s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(masked, float("-inf"))
    dead = masked.all(-1, keepdim=True)
    want = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0) @ v
    # float64 both: a few roundings of eps 2.2e-16 at the largest value (a wrong band misses by O(1))
    assert torch.allclose(out, want, rtol=0, atol=256 * torch.finfo(torch.float64).eps * float(want.abs().max()))


def test_band_over_the_whole_sequence_runs_as_causal_or_full():
    seq = 32
    assert MaskSpec(window=True, pre_tockens=seq - 1, next_tockens=0).simplified(seq) == MaskSpec(causal=True)
    assert MaskSpec(window=True, pre_tockens=10**6, next_tockens=seq).simplified(seq) == MaskSpec()
    narrower = MaskSpec(window=True, pre_tockens=seq - 2, next_tockens=0)
    assert narrower.simplified(seq) == narrower
    given = MaskSpec(given=True, window=True, pre_tockens=seq, next_tockens=seq)
    assert given.simplified(seq) == given
