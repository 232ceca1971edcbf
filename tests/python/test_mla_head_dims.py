"""MLA: V's head dim differing from Q/K's (DeepSeek-V3: 192 / 128; here D_qk = 12, D_v = 8)
through the DTensor handlers, against dense float64 at W = 2, 4, 8: the ring (causal with and
without load balancing, full, a window; the fused and the float32 merge; the plain-torch step
kernel), Ulysses, hybrid (2 x W/2 CP mesh), packed documents (TND), in every layout, forward
and backward; bytes sent against ``plan.bytes_per_rank`` with V at D_v; one dropout case by
directional derivatives. One spawned rank group per world size. Then, on one process: K and
V that disagree on anything but the head size are refused, naming both shapes.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from cp_cache import layout as L
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import band_masked, dense_attention, error_bound, rel_err

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

B, D, DV, S_LOCAL = 1, 12, 8, 4  # batch, Q/K head dim, V head dim, tokens per rank
PRE = 5  # the window: query i sees keys i-5 .. i
MASK = 2048
WORLDS = (2, 4, 8)


@dataclass(frozen=True)
class Case:
    algorithm: str  # ring | ulysses | hybrid
    layout: str  # BNSD | BSND | BSH | SBH | TND (packed documents, on the ring)
    mode: str  # causal_lb | causal | full | band_lb
    nq: int = 4
    nkv: int = 2
    merge: str = "fused"  # fused | float32
    kernel: str = "npu"  # npu | reference

    @property
    def name(self) -> str:
        return "-".join([self.algorithm, self.layout, self.mode, f"q{self.nq}kv{self.nkv}", self.merge, self.kernel])

    @property
    def load_balance(self) -> bool:
        return self.mode.endswith("_lb")


CASES = [
    Case("ring", "BSH", "causal_lb"),
    Case("ring", "BNSD", "causal", nq=4, nkv=4),
    Case("ring", "SBH", "full"),
    Case("ring", "BSND", "band_lb"),
    Case("ring", "BSND", "causal_lb", merge="float32"),
    Case("ring", "BNSD", "causal_lb", merge="float32", kernel="reference"),
    Case("ulysses", "BSH", "causal_lb", nq=8, nkv=2),
    Case("ulysses", "SBH", "full", nq=8, nkv=8),
    Case("hybrid", "BSND", "causal", nq=8, nkv=2),
    Case("ring", "TND", "causal_lb"),
    Case("ring", "TND", "full", merge="float32"),
    Case("ring", "TND", "causal_lb", merge="float32", kernel="reference"),  # one call per document (BSND)
]
HYBRID_WORLDS = (4, 8)


def _cases(world: int) -> list[Case]:
    return [c for c in CASES if c.algorithm != "hybrid" or world in HYBRID_WORLDS]


ALL = [(w, c) for w in WORLDS for c in _cases(w)]


# ---------------------------------------------------------------- rank side


def _full(case: Case, world: int) -> list[torch.Tensor]:
    """q, k, v, dout [B, N, S, D or DV], float64 with float32 values (TND: batch 1)."""
    seq = S_LOCAL * world
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))
    shapes = ((case.nq, D), (case.nkv, D), (case.nkv, DV), (case.nq, DV))
    return [torch.randn(B, n, seq, d, generator=g, dtype=torch.float64).float().double() for n, d in shapes]


def _documents(world: int) -> list[int]:
    """Cumulative document ends: two documents of 2W tokens (load balancing needs multiples of 2W)."""
    return [2 * world, S_LOCAL * world]


def _masked(case: Case, world: int):
    """The reference's mask (True = masked out) on the full sequence."""
    from cp_cache.testing.varlen_reference import document_masked

    seq = S_LOCAL * world
    if case.layout == L.TND:
        cu = _documents(world)
        return document_masked(cu, cu, "full" if case.mode == "full" else "left_up")
    if case.mode.startswith("causal"):
        return torch.ones(seq, seq, dtype=torch.bool).triu(1)
    if case.mode.startswith("band"):
        return band_masked(seq, PRE, 0)
    return None


def _op_kwargs(case: Case, world: int) -> dict:
    causal = torch.ones(MASK, MASK, dtype=torch.bool).triu(1)
    kw = dict(scale=1.0 / math.sqrt(D))
    if case.layout == L.TND:
        cu = torch.tensor(_documents(world))
        kw.update(actual_seq_qlen=cu, actual_seq_kvlen=cu)
        if case.mode != "full":
            kw.update(atten_mask=causal, sparse_mode=3, next_tockens=0)
    elif case.mode.startswith("causal"):
        kw.update(atten_mask=causal, sparse_mode=2, next_tockens=0)
    elif case.mode.startswith("band"):
        kw.update(atten_mask=causal, sparse_mode=4, pre_tockens=PRE, next_tockens=0)
    return kw


_MESHES: dict = {}


def _mesh(case: Case, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (2, world // 2) if case.algorithm == "hybrid" else (world,)
    if sizes not in _MESHES:
        _MESHES[sizes] = init_device_mesh("cpu", sizes, mesh_dim_names=tuple(f"cp{i}" for i in range(len(sizes))))
    return _MESHES[sizes]


class _Sharding:
    """This rank's pieces of full [B, N, S, D] tensors as DTensors of the case's layout, and back."""

    def __init__(self, case: Case, world: int, rank: int):
        from cp_cache.documents import sequence_positions as positions

        self.case, self.world, self.mesh = case, world, _mesh(case, world)
        self.cu = _documents(world)
        self.pos = positions(rank, world, S_LOCAL, case.load_balance)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        import cp_cache

        if self.case.layout == L.TND:
            return cp_cache.shard_documents(x[0].permute(1, 0, 2).contiguous(), self.cu, self.mesh).float()
        return L.from_bnsd(x.index_select(2, self.pos), self.case.layout).float()

    def dtensor(self, local: torch.Tensor):
        from torch.distributed.tensor import DTensor, Shard

        dim = 0 if self.case.layout == L.TND else L.seq_dim(self.case.layout)
        return DTensor.from_local(local, self.mesh, [Shard(dim)] * self.mesh.ndim)

    def piece(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-sequence reference [B, N, S, X], as [B, N, s, X]."""
        if self.case.layout == L.TND:
            import cp_cache

            return cp_cache.shard_documents(x[0].permute(1, 0, 2).contiguous(), self.cu, self.mesh) \
                .permute(1, 0, 2).unsqueeze(0)
        return x.index_select(2, self.pos)

    def bnsd(self, local: torch.Tensor, heads: int) -> torch.Tensor:
        if self.case.layout == L.TND:
            return local.detach().double().permute(1, 0, 2).unsqueeze(0)
        return L.to_bnsd(local.detach(), self.case.layout, heads).double()


def _run_case(case: Case, rank: int, world: int) -> dict:
    import cp_cache
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.npu_ops import lse_from_stats

    cp_cache.enable(algorithm=case.algorithm, kernel=case.kernel, fused_merge=case.merge == "fused",
                    documents="head_tail")  # TND: per-document head-tail, even shards
    _cp_options.enable_load_balance = case.load_balance
    where = _Sharding(case, world, rank)
    full = _full(case, world)
    local = [where.local(t) for t in full]
    leaves = [where.dtensor(t.clone()).requires_grad_() for t in local[:3]]
    with cp_cache.context_parallel(where.mesh):  # cp_cache serves the calls made in a CP region
        out = torch.ops.npu.npu_fusion_attention_v3(*leaves, case.nq, case.layout, **_op_kwargs(case, world))
        sent = cp_cache.call_stats()["forward"]["bytes_sent"]
        out[0].backward(where.dtensor(local[3]))
        sent += cp_cache.call_stats()["backward"]["bytes_sent"]
    lse = lse_from_stats(out[1].to_local(), out[2].to_local()).detach().double()
    got = {"out": where.bnsd(out[0].to_local(), case.nq),
           "lse": lse.T.unsqueeze(0) if case.layout == L.TND else lse}
    for key, leaf, heads in (("dq", leaves[0], case.nq), ("dk", leaves[1], case.nkv), ("dv", leaves[2], case.nkv)):
        got[key] = where.bnsd(leaf.grad.to_local(), heads)
    masked = _masked(case, world)
    ref, low = (dense_attention(*full, causal=False, masked=masked, dtype=dt) for dt in (torch.float64, torch.float32))
    errors, dense = {}, {}
    for key in ("out", "lse", "dq", "dk", "dv"):
        want = ref[key] if key != "lse" else ref[key].unsqueeze(-1)
        want32 = low[key] if key != "lse" else low[key].unsqueeze(-1)
        want, want32 = where.piece(want), where.piece(want32).double()
        if key == "lse":
            want, want32 = want.squeeze(-1), want32.squeeze(-1)
        errors[key], dense[key] = rel_err(got[key], want), rel_err(want32, want)
    shapes = {"out": tuple(out[0].to_local().shape), "dv": tuple(leaves[2].grad.to_local().shape),
              "v": tuple(local[2].shape)}
    del out, leaves
    cp_cache.disable()
    _cp_options.enable_load_balance = True
    return dict(errors=errors, dense=dense, sent=sent, shapes=shapes, live=cp_cache.stats()["live_entries"])


def _dropout_check(rank: int, world: int) -> list[tuple[float, float]]:
    """The ring (causal, load balanced, BSND) with keep_prob 0.8, model-free: autograd's slope of
    sum(out * proj) against central differences along random directions of the local q/k/v, the
    RNG reset per forward (the same masks); (error, bound) per direction."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    import cp_cache
    from cp_cache.testing.reference import directional_derivative_check

    case = Case("ring", "BSND", "causal_lb")
    cp_cache.enable(algorithm="ring", documents="head_tail")
    _cp_options.enable_load_balance = True
    where = _Sharding(case, world, rank)
    params = [where.local(t).requires_grad_() for t in _full(case, world)[:3]]
    out_shape = (B, S_LOCAL, case.nq, DV)
    proj = torch.randn(out_shape, generator=torch.Generator().manual_seed(rank))

    def loss():
        torch.manual_seed(99 + rank)
        leaves = [where.dtensor(t) for t in params]
        out = torch.ops.npu.npu_fusion_attention_v3(*leaves, case.nq, case.layout, keep_prob=0.8,
                                                    **_op_kwargs(case, world))[0]
        return (out.to_local() * proj).sum()

    def total(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    with cp_cache.context_parallel(where.mesh):
        checks = directional_derivative_check(loss, params, directions=2, eps=5e-2, reduce=total)
    cp_cache.disable()
    return checks


def _ranks(rank: int, world: int) -> dict:
    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    results = {case.name: _run_case(case, rank, world) for case in _cases(world)}
    results["dropout"] = _dropout_check(rank, world)
    return results


_RESULTS: dict = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_ranks, world, timeout=300)
    return _RESULTS[world]


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("world, case", ALL, ids=[f"W{w}-{c.name}" for w, c in ALL])
def test_matches_dense_float64(world, case):
    for rank, res in enumerate(_results(world)):
        r = res[case.name]
        for key, err in r["errors"].items():
            bound = error_bound(r["dense"][key])  # 20x dense torch in float32 + 32 eps
            assert err <= bound, (case.name, rank, key, err, bound)
        assert r["shapes"]["out"][-1] == (case.nq * DV if case.layout in ("BSH", "SBH") else DV), r["shapes"]
        assert r["shapes"]["dv"] == r["shapes"]["v"], r["shapes"]
        assert r["live"] == 0


BYTES = [(w, c) for w, c in ALL if c.algorithm == "ulysses" or (c.algorithm == "ring" and c.mode == "full"
                                                                  and c.layout != L.TND)]


@pytest.mark.parametrize("world, case", BYTES, ids=[f"W{w}-{c.name}" for w, c in BYTES])
def test_bytes_sent_count_v_at_its_own_head_dim(world, case):
    from cp_cache.plan import bytes_per_rank

    shape = dict(nq=case.nq, nkv=case.nkv, world=world, batch=B, local_seq=S_LOCAL, head_dim=D, itemsize=4)
    expected = bytes_per_rank(case.algorithm, v_head_dim=DV, **shape)
    assert expected != bytes_per_rank(case.algorithm, **shape)  # V at D_qk would be another number
    for rank, res in enumerate(_results(world)):
        assert res[case.name]["sent"] == expected, (case.name, rank)


@pytest.mark.parametrize("world", WORLDS)
def test_dropout_directional_derivative(world):
    for rank, res in enumerate(_results(world)):
        checks = res["dropout"]
        assert all(err <= bound for err, bound in checks), (rank, checks)
        assert min(bound for _, bound in checks) < 0.1, checks  # some direction resolves a 10 % wrong slope


# ---------------------------------------------------------------- inconsistent K and V, one process


def _ring_call(layout: str, k_shape: tuple, v_shape: tuple, q_shape: tuple):
    from cp_cache.algorithms import PACKED, RING, run_forward
    from cp_cache.kernels import get_kernel
    from cp_cache.testing import install_npu_emulator
    from cp_cache.testing.reference import ring_plan

    install_npu_emulator(route_sdpa=False)
    q, k, v = (torch.randn(s) for s in (q_shape, k_shape, v_shape))
    packed = layout == L.TND
    plan = ring_plan(world_size=1, rank=0, layout=layout, head_num=4, scale=1.0, keep_prob=1.0,
                     documents=(q_shape[0],) if packed else ())
    return run_forward(PACKED if packed else RING, plan, q, k, v, kernel=get_kernel("npu"))


REFUSED = [  # layout, q, k, v: V disagrees with K on batch, heads or sequence length
    ("BNSD", (2, 4, 6, 12), (2, 2, 6, 12), (1, 2, 6, 8)),
    ("BSND", (2, 6, 4, 12), (2, 6, 2, 12), (2, 6, 4, 8)),
    ("BSH", (2, 6, 48), (2, 6, 24), (2, 5, 16)),
    ("SBH", (6, 2, 48), (6, 2, 24), (6, 2, 15)),  # hidden 15: not a whole number of heads of 2
    ("TND", (6, 4, 12), (6, 2, 12), (6, 4, 8)),
]


@pytest.mark.parametrize("layout, q, k, v", REFUSED, ids=[r[0] for r in REFUSED])
def test_key_and_value_that_disagree_beyond_the_head_dim_are_refused(layout, q, k, v):
    with pytest.raises(ValueError, match=r"(key .* and value .* disagree|value's hidden size)") as info:
        _ring_call(layout, k, v, q)
    assert str(tuple(v)) in str(info.value)


@pytest.mark.parametrize("layout", L.ALL_LAYOUTS)
def test_one_process_mla_runs_in_every_layout(layout):
    dims = {"BNSD": ((2, 4, 6, 12), (2, 2, 6, 12), (2, 2, 6, 8)), "BSND": ((2, 6, 4, 12), (2, 6, 2, 12), (2, 6, 2, 8)),
            "BSH": ((2, 6, 48), (2, 6, 24), (2, 6, 16)), "SBH": ((6, 2, 48), (6, 2, 24), (6, 2, 16)),
            "TND": ((6, 4, 12), (6, 2, 12), (6, 2, 8))}[layout]
    res = _ring_call(layout, dims[1], dims[2], dims[0])
    expected = list(dims[0])
    expected[-1] = 4 * 8 if layout in ("BSH", "SBH") else 8
    assert tuple(res.out.shape) == tuple(expected)


@pytest.mark.parametrize("layout", L.ALL_LAYOUTS)
def test_strategy_fakes_give_the_output_at_v_head_dim(layout):
    """What a traced graph records (``cp_cache::ring_forward``'s fake asks the strategy): from
    shapes alone, under FakeTensorMode, the output at V's head size and the LSE."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cp_cache.algorithms import HYBRID, PACKED, RING, ULYSSES
    from cp_cache.testing.reference import ring_plan

    dims = {"BNSD": ((2, 4, 6, 12), (2, 2, 6, 12), (2, 2, 6, 8), (2, 4, 6, 8)),
            "BSND": ((2, 6, 4, 12), (2, 6, 2, 12), (2, 6, 2, 8), (2, 6, 4, 8)),
            "BSH": ((2, 6, 48), (2, 6, 24), (2, 6, 16), (2, 6, 32)),
            "SBH": ((6, 2, 48), (6, 2, 24), (6, 2, 16), (6, 2, 32)),
            "TND": ((6, 4, 12), (6, 2, 12), (6, 2, 8), (6, 4, 8))}[layout]
    plan = ring_plan(world_size=2, rank=0, layout=layout, head_num=4, scale=1.0, keep_prob=1.0)
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(torch.empty(s)) for s in dims[:3])
        for strategy in ((PACKED,) if layout == L.TND else (RING, ULYSSES, HYBRID)):
            out, lse = strategy.fake(plan, q, k, v)
            assert tuple(out.shape) == dims[3], (strategy, tuple(out.shape))
            assert tuple(lse.shape) == L.lse_shape(q, layout, 4) and lse.dtype == torch.float32
