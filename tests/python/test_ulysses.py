"""Ulysses and hybrid (Ulysses x ring) CP attention, and meshes with more than one dimension,
through the DTensor handlers of npu_fusion_attention_v3 / _grad_v3, against dense float64.

One spawned gloo run per world size (W = 2, 4) executes every case on the ranks; each rank
compares its local pieces of the output and of dq/dk/dv with the dense float64 reference
(the same pieces of the full-sequence result) and returns the relative errors; the tests
read them. The cases are those that check more than the numbers (dropout's seeds, a switch of
algorithm between forward and backward, the K/V heads repeated, the 2-D meshes with a data- or
tensor-parallel dimension); packed documents (TND) under Ulysses and hybrid, every placement, with
their layout and refusals; then checkpointing, refusals, the sharding helpers, the memory floor
and a model. The numbers of Ulysses, hybrid and "auto" over the argument space are drawn by the
random net, test_random_configs.py.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import zlib
from dataclasses import dataclass

import pytest
import torch

import cp_cache
from cp_cache import layout as L
from cp_cache.step_cache import plan_of
from cp_cache.testing.multiprocess import capture, cp_region, run_ranks
from cp_cache.testing.reference import band_masked, dense_attention, error_bound, rel_err

MASK = 2048


@pytest.fixture(autouse=True)
def no_live_caches():
    yield
    assert cp_cache.stats()["live_entries"] == 0


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    algorithm: str  # ring | ulysses | hybrid | auto
    layout: str
    mode: str  # causal_lb | causal | full | band | band_lb | given | given_lb | givenband_lb
    nq: int
    nkv: int
    mesh: tuple = (0,)  # sizes; 0 = the world size
    # per mesh dim: "seq" (CP), "head" (tensor parallel), "rep" (data parallel: data differs per index)
    dims: tuple = ("seq",)
    keep_prob: float = 1.0
    policy: str = "handle"
    switch: str = ""  # enable(algorithm=switch) between forward and backward
    B: int = 2
    D: int = 8
    S: int = 16  # global sequence length

    @property
    def name(self) -> str:
        mesh = "x".join(f"{d}{s or 'W'}" for d, s in zip(self.dims, self.mesh))
        parts = [self.algorithm, mesh, self.layout, self.mode, f"q{self.nq}kv{self.nkv}"]
        if self.keep_prob < 1:
            parts.append(f"drop{self.keep_prob}")
        if self.policy != "handle":
            parts.append(self.policy)
        if self.switch:
            parts.append(f"then{self.switch}")
        return "-".join(parts)

    @property
    def causal(self) -> bool:
        return self.mode.startswith("causal")

    @property
    def band(self) -> bool:
        return self.mode.startswith("band")

    @property
    def given(self) -> bool:
        return self.mode.startswith("given")

    @property
    def load_balance(self) -> bool:
        return self.mode.endswith("_lb")


def _given_mask(case: Case) -> torch.Tensor:
    """A random mask over the whole sequence (True = masked out; the diagonal kept, so no row is
    wholly masked): [S, S], or [B, 1, S, S] with the band (sparse_mode 0)."""
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    shape = (case.B, 1, case.S, case.S) if "band" in case.mode else (case.S, case.S)
    mask = torch.rand(shape, generator=g) < 0.3
    return mask & ~torch.eye(case.S, dtype=torch.bool)


PRE, NXT = 5, 0  # the band cases: a causal window of 6 tokens


def _matrix(world: int) -> list[Case]:
    """The cases that check more than the numbers: dropout's seeds per rank and the RNG left in
    step, the backward running what its forward ran after enable(algorithm=...), the log of K/V
    heads repeated, and the 2-D meshes with a data-parallel or tensor-parallel dimension (W = 4).
    The numbers of Ulysses, hybrid and "auto" in every layout, mask, load balancing, head split
    and policy are drawn by the random net (test_random_configs.py), which also checks the
    algorithm each call ran, the placements and the step caches alive."""
    out = [
        Case("ulysses", "BNSD", "causal_lb", 4, 4, keep_prob=0.8),
        Case("ulysses", "SBH", "full", 8, 2, keep_prob=0.75),
        Case("ulysses", "SBH", "givenband_lb", 4, 2, keep_prob=0.8),
        Case("ulysses", "BSND", "causal_lb", 4, 2, switch="ring"),  # backward runs what forward ran
    ]
    if world == 4:
        out.append(Case("ulysses", "BNSD", "causal", 8, 1))  # Nkv < W: K/V heads repeated (logged)
        for alg in ("ring", "ulysses"):
            out.append(Case(alg, "BNSD", "causal_lb", 4, 2, mesh=(2, 2), dims=("rep", "seq")))
            out.append(Case(alg, "BSH", "causal", 8, 4, mesh=(2, 2), dims=("seq", "head")))
            out.append(Case(alg, "BSND", "full", 4, 4, mesh=(2, 2), dims=("head", "seq")))
        out.append(Case("hybrid", "BSH", "causal", 4, 4, mesh=(2, 2), dims=("seq", "seq"), keep_prob=0.8))
    return out


CASES = {w: _matrix(w) for w in (2, 4)}


# ---------------------------------------------------------------- rank side: pieces of the full problem


def _sizes(case: Case, world: int) -> tuple:
    return tuple(s or world for s in case.mesh)


def _coords(case: Case, world: int, rank: int) -> tuple:
    sizes, coords = _sizes(case, world), []
    for s in reversed(sizes):
        coords.append(rank % s)
        rank //= s
    return tuple(reversed(coords))


def _nested(case: Case, sizes, coords, kind: str) -> tuple[int, int]:
    """(index, count) of this rank among the mesh dims of ``kind``, outer first."""
    index, count = 0, 1
    for d, s, c in zip(case.dims, sizes, coords):
        if d == kind:
            index, count = index * s + c, count * s
    return index, count


def _full(case: Case, data_index: int) -> list[torch.Tensor]:
    """q, k, v, dout: [B, N, S, D] float64 with float32 values (per data-parallel index)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{data_index}".encode()))
    q, dout = (torch.randn(case.B, case.nq, case.S, case.D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(case.B, case.nkv, case.S, case.D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.float().double() for t in (q, k, v, dout)]


def _seq_positions(case: Case, sizes, coords) -> torch.Tensor:
    from cp_cache.documents import sequence_positions as positions

    c, count = _nested(case, sizes, coords, "seq")
    return positions(c, count, case.S // count, case.load_balance)


def _piece(x: torch.Tensor, case: Case, sizes, coords) -> torch.Tensor:
    """This rank's piece of a full [B, N, S, D] tensor, still [B, N', s, D]."""
    x = x.index_select(2, _seq_positions(case, sizes, coords))
    t, tp = _nested(case, sizes, coords, "head")
    n = x.size(1) // tp
    return x[:, t * n:(t + 1) * n]


def _placements(case: Case):
    from torch.distributed.tensor import Replicate, Shard

    head = {"BNSD": 1, "BSND": 2, "BSH": 2, "SBH": 2}[case.layout]
    kinds = {"seq": Shard(L.seq_dim(case.layout)), "head": Shard(head), "rep": Replicate()}
    return [kinds[d] for d in case.dims]


_MESHES: dict = {}


def _mesh(case: Case, world: int):
    """One mesh per shape on each rank (creating its process groups once)."""
    return _mesh_of(_sizes(case, world))


def _mesh_of(sizes: tuple):
    from torch.distributed.device_mesh import init_device_mesh

    if sizes not in _MESHES:
        _MESHES[sizes] = init_device_mesh("cpu", sizes, mesh_dim_names=tuple(f"d{i}" for i in range(len(sizes))))
    return _MESHES[sizes]


def _op_kwargs(case: Case) -> dict:
    causal_mask = torch.ones(MASK, MASK, dtype=torch.bool).triu(1)
    if case.causal:
        return dict(atten_mask=causal_mask, sparse_mode=2, next_tockens=0)
    if case.band:
        return dict(atten_mask=causal_mask, sparse_mode=4, pre_tockens=PRE, next_tockens=NXT)
    if case.given:
        if "band" in case.mode:
            return dict(atten_mask=_given_mask(case), sparse_mode=0, pre_tockens=PRE, next_tockens=NXT)
        return dict(atten_mask=_given_mask(case), sparse_mode=1)
    return {}


def _forward(case: Case, params, mesh):
    from torch.distributed.tensor import DTensor

    q, k, v = (DTensor.from_local(L.from_bnsd(t, case.layout), mesh, _placements(case)) for t in params)
    return torch.ops.npu.npu_fusion_attention_v3(q, k, v, case.nq, case.layout, scale=1.0 / math.sqrt(case.D),
                                                 keep_prob=case.keep_prob, **_op_kwargs(case))


def _set_lb(value: bool) -> None:
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    _cp_options.enable_load_balance = value


def _run_case(case: Case, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    cp_cache.enable(case.policy, algorithm=case.algorithm)
    _set_lb(case.load_balance)
    mesh = _mesh(case, world)
    sizes, coords = _sizes(case, world), _coords(case, world, rank)
    data_index, _ = _nested(case, sizes, coords, "rep")
    full = _full(case, data_index)
    local = [_piece(t, case, sizes, coords).float() for t in full]
    placements = _placements(case)
    leaves = [DTensor.from_local(L.from_bnsd(t, case.layout), mesh, placements).requires_grad_() for t in local[:3]]
    torch.manual_seed(1234)  # the same RNG state on every rank, as in training
    out = torch.ops.npu.npu_fusion_attention_v3(*leaves, case.nq, case.layout, scale=1.0 / math.sqrt(case.D),
                                                keep_prob=case.keep_prob, **_op_kwargs(case))
    res = {"live_after_forward": cp_cache.stats()["live_entries"]}
    if case.policy == "handle":
        cache = cp_cache.store().resolve(out[4])
        res["algorithm"] = plan_of(cache).algorithm
        res["seeds"] = [[int(t.reshape(-1)[0]) for t in owned] for _, owned in cache.steps]
        del cache
    res["rng_after"] = float(torch.rand(1))
    res["placements"] = [tuple(o.placements) for o in out[:3]]
    res["expected_placements"] = tuple(placements)
    if case.switch:
        cp_cache.enable(case.policy, algorithm=case.switch)
    lse_local = (out[1].to_local()[..., 0].double() + torch.log(out[2].to_local()[..., 0].double())).detach()
    out[0].backward(DTensor.from_local(L.from_bnsd(local[3], case.layout), mesh, placements))
    res["grad_placements"] = [tuple(t.grad.placements) for t in leaves]
    nq_local = local[0].size(1)
    nkv_local = local[1].size(1)
    got = {"out": L.to_bnsd(out[0].to_local().detach(), case.layout, nq_local).double(), "lse": lse_local}
    for key, leaf, heads in (("dq", leaves[0], nq_local), ("dk", leaves[1], nkv_local), ("dv", leaves[2], nkv_local)):
        got[key] = L.to_bnsd(leaf.grad.to_local(), case.layout, heads).double()
    del out
    res["live_after_backward"] = cp_cache.stats()["live_entries"]
    calls = cp_cache.call_stats()
    res["bytes_sent"] = calls["forward"]["bytes_sent"] + calls["backward"]["bytes_sent"]
    res["stack_depth"] = cp_cache.stats()["stack_depth"]
    if case.keep_prob < 1:
        keep = _keep_mask(case, res.get("seeds"), world, rank, sizes, coords)
        res["kept"] = float(keep.float().mean()) if keep is not None else None
    else:
        keep = None
    masked = band_masked(case.S, PRE, NXT) if case.band or "band" in case.mode else None
    if case.given:
        masked = _given_mask(case) if masked is None else _given_mask(case) | masked
    if case.keep_prob == 1 or keep is not None:
        ref, low = (dense_attention(*full, causal=case.causal, keep=keep, keep_prob=case.keep_prob, masked=masked,
                                    dtype=dt) for dt in (torch.float64, torch.float32))
        res["errors"], res["dense_errors"] = {}, {}  # dense torch in float32 on the same rows: the bounds' reference
        for key in ("out", "lse", "dq", "dk", "dv"):
            r = ref[key] if key != "lse" else ref[key].unsqueeze(-1)
            piece = _piece(r, case, sizes, coords)
            r32 = low[key] if key != "lse" else low[key].unsqueeze(-1)
            piece32 = _piece(r32, case, sizes, coords).double()
            if key == "lse":
                piece, piece32 = piece.squeeze(-1), piece32.squeeze(-1)
            res["errors"][key] = rel_err(got[key], piece)
            res["dense_errors"][key] = rel_err(piece32, piece)
        if keep is not None:  # and not the computation without dropout
            plain = dense_attention(*full, causal=case.causal, masked=masked)
            res["differs_without_dropout"] = rel_err(got["out"], _piece(plain["out"], case, sizes, coords))
    if case.keep_prob < 1:
        res["directional"] = _directional(case, mesh, local, sizes, coords)
    dist.barrier()
    _set_lb(True)
    return res


def _keep_mask(case: Case, seeds, world: int, rank: int, sizes, coords):
    """The [B, Nq, S, S] keep mask of a 1-D Ulysses call, from every rank's (seed, offset);
    None for the other cases (checked by directional derivatives only)."""
    import torch.distributed as dist

    from cp_cache.testing import dropout_keep_mask

    if case.algorithm != "ulysses" or case.dims != ("seq",) or seeds is None:
        return None
    mine = torch.tensor(seeds[0], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    n = case.nq // world
    return torch.cat([dropout_keep_mask(int(g[0]), int(g[1]), (case.B, n, case.S, case.S), case.keep_prob)
                      for g in gathered], dim=1)


def _directional(case: Case, mesh, local, sizes, coords) -> list[tuple[float, float]]:
    """Model-free dropout check: autograd's slope of sum(out * proj) against central
    differences along random directions, the RNG reset per forward (same masks); (error, bound)
    per direction, the bound measured from the differences themselves (steps eps and eps/2)."""
    import torch.distributed as dist

    from cp_cache.testing.reference import directional_derivative_check

    params = [t.clone().requires_grad_() for t in local[:3]]
    proj = torch.randn(local[0].shape, generator=torch.Generator().manual_seed(7 + sum(coords)))

    def loss():
        torch.manual_seed(99)
        out = _forward(case, params, mesh)[0]
        return (L.to_bnsd(out.to_local(), case.layout, local[0].size(1)) * proj).sum()

    def total(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    return directional_derivative_check(loss, params, directions=2, eps=5e-2, reduce=total)


def _checkpointing(rank: int, world: int) -> dict:
    """Ulysses with dropout under non-reentrant and reentrant checkpointing, both policies:
    the same gradients as without, nothing alive between forward and backward (handle)."""
    from torch.utils.checkpoint import checkpoint

    case = Case("ulysses", "BSND", "causal_lb", 4, 2, keep_prob=0.8)
    _set_lb(True)
    mesh = _mesh(case, world)
    sizes, coords = _sizes(case, world), _coords(case, world, rank)
    local = [_piece(t, case, sizes, coords).float() for t in _full(case, 0)]
    out = {}
    for policy in ("handle", "stack"):
        cp_cache.enable(policy, algorithm="ulysses")
        grads = {}
        for mode in ("none", "non_reentrant", "reentrant"):
            params = [t.clone().requires_grad_() for t in local[:3]]
            torch.manual_seed(5)

            def f(q, k, v):
                return _forward(case, (q, k, v), mesh)[0].to_local()

            y = f(*params) if mode == "none" else checkpoint(f, *params, use_reentrant=mode == "reentrant")
            live = cp_cache.stats()["live_entries"]
            (L.to_bnsd(y, case.layout, case.nq // world) * local[3]).sum().backward()
            grads[mode] = [p.grad.clone() for p in params]
            out[(policy, mode, "live_between")] = live
            del y
        for mode in ("non_reentrant", "reentrant"):
            out[(policy, mode, "grad_diff")] = max(float((a - b).abs().max())
                                                   for a, b in zip(grads[mode], grads["none"]))
        out[(policy, "stack_depth")] = cp_cache.stats()["stack_depth"]
    cp_cache.enable("handle")
    return out


def _rejections(rank: int, world: int) -> dict:
    got = {}
    cp_cache.enable(algorithm="ulysses")
    bad = [Case("ulysses", "BNSD", "full", 3, 3), Case("ulysses", "BSND", "causal", 12, 6),
           Case("ulysses", "BNSD", "full", 6, 3)]
    for case in bad:
        mesh = _mesh(case, world)
        sizes, coords = _sizes(case, world), _coords(case, world, rank)
        local = [_piece(t, case, sizes, coords).float() for t in _full(case, 0)]
        got[(case.nq, case.nkv)] = capture(lambda: _forward(case, local[:3], mesh))
    # two CP dims need hybrid; hybrid needs two
    two = Case("ulysses", "BNSD", "full", 4, 4, mesh=(2, 2), dims=("seq", "seq"))
    if world == 4:
        mesh = _mesh(two, world)
        sizes, coords = _sizes(two, world), _coords(two, world, rank)
        local = [_piece(t, two, sizes, coords).float() for t in _full(two, 0)]
        got["two_cp_dims"] = capture(lambda: _forward(two, local[:3], mesh))
        cp_cache.enable(algorithm="hybrid")
        _set_lb(True)
        lb = Case("hybrid", "BNSD", "causal_lb", 4, 4, mesh=(2, 2), dims=("seq", "seq"))
        got["hybrid_lb"] = capture(lambda: _forward(lb, local[:3], mesh))
    cp_cache.enable(algorithm="ulysses")
    per_head = Case("ulysses", "BNSD", "full", 4, 4)
    mesh = _mesh(per_head, world)
    sizes, coords = _sizes(per_head, world), _coords(per_head, world, rank)
    local = [_piece(t, per_head, sizes, coords).float() for t in _full(per_head, 0)]
    from torch.distributed.tensor import DTensor

    q, k, v = (DTensor.from_local(t, mesh, _placements(per_head)) for t in local[:3])
    heads_mask = torch.zeros(2, 4, 16, 16, dtype=torch.bool)
    got["per_head_mask"] = capture(lambda: torch.ops.npu.npu_fusion_attention_v3(
        q, k, v, 4, "BNSD", atten_mask=heads_mask, sparse_mode=1))
    cp_cache.enable(algorithm="hybrid")
    one = Case("hybrid", "BNSD", "full", 4, 4)
    mesh = _mesh(one, world)
    sizes, coords = _sizes(one, world), _coords(one, world, rank)
    local = [_piece(t, one, sizes, coords).float() for t in _full(one, 0)]
    got["hybrid_one_dim"] = capture(lambda: _forward(one, local[:3], mesh))
    cp_cache.enable()
    return got


def _model_step(rank: int, world: int) -> dict:
    """TinyDecoder (SDPA, causal, GQA) under cp_cache.context_parallel(algorithm="ulysses"):
    loss and gradients of one step against the single-process run in float64, next to the
    single-process run in float32 (whose error sets the bound)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.testing.models import ModelConfig, TinyDecoder, loss_fn, make_batch

    cp_cache.disable()
    _set_lb(True)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyDecoder(ModelConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, max_seq=16))
    reference = TinyDecoder(ModelConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, max_seq=16))
    reference.load_state_dict(model.state_dict())
    truth = copy.deepcopy(reference).double()
    tokens, labels, positions = make_batch(2, 16, 64, seed=3)
    ref_loss = loss_fn(reference(tokens, positions), labels)
    ref_loss.backward()
    truth_loss = torch.nn.functional.cross_entropy(truth(tokens, positions).flatten(0, 1), labels.flatten())
    truth_loss.backward()
    calls = cp_cache.call_stats()["forward"]["calls"]
    with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1],
                                   algorithm="ulysses"):
        inside = cp_cache.active_config().algorithm
        loss = loss_fn(model(tokens, positions), labels)
        loss.backward()
    out = {"inside": inside, "enabled_after": cp_cache.enabled(),
           "calls": cp_cache.call_stats()["forward"]["calls"] - calls}
    loss = loss.detach()
    dist.all_reduce(loss)
    out["loss_err"] = abs(float(loss) / world - float(truth_loss.detach()))
    out["ref_loss_err"] = abs(float(ref_loss.detach()) - float(truth_loss.detach()))
    out["loss_scale"] = abs(float(truth_loss.detach()))
    errs, ref_errs = [], []
    for p, r, t in zip(model.parameters(), reference.parameters(), truth.parameters()):
        dist.all_reduce(p.grad)
        errs.append(rel_err((p.grad / world).double(), t.grad))
        ref_errs.append(rel_err(r.grad.double(), t.grad))
    out["grad_err"], out["ref_grad_err"] = max(errs), max(ref_errs)
    # enabled outside with another algorithm: inside runs the argument's, the outer one comes back
    cp_cache.enable("stack", algorithm="ring")
    with cp_cache.context_parallel(mesh, algorithm="ulysses"):
        out["nested_inside"] = (cp_cache.active_config().policy, cp_cache.active_config().algorithm)
    out["nested_after"] = (cp_cache.active_config().policy, cp_cache.active_config().algorithm)
    cp_cache.enable()
    return out


def _memory_floor(rank: int, world: int) -> dict:
    """What one call keeps from forward to backward (the memory floor): the distinct storages
    autograd saves (inputs and mask excluded) plus the store's live bytes, per algorithm."""
    from cp_cache.cli._measure import SavedStorages

    kept = {}
    cases = [Case("ulysses", "BNSD", "causal_lb", 4, 2, keep_prob=0.9)]
    if world == 4:
        cases.append(Case("hybrid", "BNSD", "causal", 4, 2, mesh=(2, 2), dims=("seq", "seq"), keep_prob=0.9))
    for case in cases:
        cp_cache.enable(algorithm=case.algorithm)
        _set_lb(case.load_balance)
        mesh = _mesh(case, world)
        sizes, coords = _sizes(case, world), _coords(case, world, rank)
        local = [_piece(t, case, sizes, coords).float() for t in _full(case, 0)]
        from torch.distributed.tensor import DTensor

        leaves = [DTensor.from_local(t, mesh, _placements(case)).requires_grad_() for t in local[:3]]
        store_before = cp_cache.stats()["live_bytes"]
        kwargs = _op_kwargs(case)
        with SavedStorages(exclude=(*leaves, kwargs["atten_mask"])) as saved:
            out = torch.ops.npu.npu_fusion_attention_v3(*leaves, case.nq, case.layout, keep_prob=case.keep_prob,
                                                        scale=0.25, **kwargs)[0]
        kept[case.algorithm] = (saved.nbytes + cp_cache.stats()["live_bytes"] - store_before,
                                out.to_local().nbytes, local[0].numel() // case.D * 4)
        out.backward(DTensor.from_local(local[3], mesh, _placements(case)))
        del out
    _set_lb(True)
    kept.update(_packed_floor(world))
    cp_cache.enable()
    return kept


def _packed_floor(world: int) -> dict:
    """``_memory_floor`` of packed documents under Ulysses and hybrid (uneven shards, dropout)."""
    from cp_cache.cli._measure import SavedStorages

    kept = {}
    packed = [PackedCase("ulysses", "balanced", True)] + ([PackedCase("hybrid", "balanced", True, mesh=(2, 2))]
                                                          if world == 4 else [])
    for case in packed:
        cp_cache.enable(algorithm=case.algorithm)
        mesh = _mesh_of(case.sizes(world))
        full = _packed_inputs(case)
        local = [cp_cache.shard_documents(t, case.cu, mesh).float() for t in full]
        leaves = [_packed_dtensor(mesh, t, w).requires_grad_() for t, w in zip(local[:3], full[:3])]
        kwargs = _packed_kwargs(case, case.cu)
        store_before = cp_cache.stats()["live_bytes"]
        with SavedStorages(exclude=(*leaves, kwargs["atten_mask"])) as saved:
            out = torch.ops.npu.npu_fusion_attention_v3(*leaves, case.nq, "TND", keep_prob=0.9, **kwargs)[0]
        kept["tnd-" + case.algorithm] = (saved.nbytes + cp_cache.stats()["live_bytes"] - store_before,
                                         out.to_local().nbytes, local[0].numel() // 8 * 4)
        out.backward(_packed_dtensor(mesh, local[3], full[3]))
        del out
    return kept


def _sharding_helpers(rank: int, world: int) -> dict:
    """cp_cache.shard_sequence / unshard_sequence: head-tail on one CP dim, nested contiguous
    chunks on two (hybrid)."""
    from cp_cache.documents import sequence_positions as positions

    x = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)  # [B, S, H]
    got = {}
    one = _mesh(Case("ring", "BSH", "full", 1, 1), world)
    d = cp_cache.shard_sequence(x, one, 1, load_balance=True)
    got["lb_local"] = torch.equal(d.to_local(), x.index_select(1, positions(rank, world, 16 // world, True)))
    got["lb_back"] = torch.equal(cp_cache.unshard_sequence(d, 1, load_balance=True), x)
    if world == 4:
        two = _mesh(Case("hybrid", "BSH", "full", 1, 1, mesh=(2, 2), dims=("seq", "seq")), world)
        d = cp_cache.shard_sequence(x, two, 1)
        got["nested_local"] = torch.equal(d.to_local(), x[:, rank * 4:(rank + 1) * 4])
        got["nested_back"] = torch.equal(cp_cache.unshard_sequence(d, 1), x)
        got["nested_lb"] = capture(lambda: cp_cache.shard_sequence(x, two, 1, load_balance=True))
    return got


# ---------------------------------------------------------------- packed documents (TND)


PACKED_MIX = (5, 13, 9, 21, 3, 30, 7, 40)  # any lengths: the balanced placement's uneven shards
PACKED_EVEN = (8, 24, 16, 16, 32, 32)  # multiples of 8: per-document head-tail over up to 4 ranks


@dataclass(frozen=True)
class PackedCase:
    """TND under Ulysses (a 1-D mesh) or hybrid (a 2 x 2 mesh), placed by ``placement``
    ("contiguous": load balancing off)."""

    algorithm: str
    placement: str
    causal: bool
    nq: int = 4
    nkv: int = 4
    mesh: tuple = (0,)  # sizes; 0 = the world size
    band: tuple = ()  # (pre_tockens, next_tockens): a band inside each document (sparse_mode 4)
    band_mode: int = 4  # 7 / 8: the band in the last / first document only, the others causal

    @property
    def name(self) -> str:
        mesh = "x".join(str(s or "W") for s in self.mesh)
        mask = "causal" if self.causal else "full"
        if self.band:
            mask = f"band{self.band[0]}x{self.band[1]}m{self.band_mode}"
        return f"tnd-{self.algorithm}-{mesh}-{self.placement}-{mask}-q{self.nq}kv{self.nkv}"

    @property
    def cu(self) -> list[int]:
        docs = PACKED_EVEN if self.placement == "head_tail" else PACKED_MIX
        return torch.tensor(docs).cumsum(0).tolist()

    def sizes(self, world: int) -> tuple:
        return tuple(s or world for s in self.mesh)

    def ran(self) -> str:
        """The algorithm the call runs ("auto" on packed documents: ring on one CP dimension, hybrid on two)."""
        if self.algorithm != "auto":
            return self.algorithm
        return "hybrid" if len(self.mesh) == 2 else "ring"


def _packed_matrix(world: int) -> list[PackedCase]:
    """Every placement, causal and full, with GQA (K/V heads repeated where Nkv < W): Ulysses at
    W = 2 and 4, hybrid on the 2 x 2 mesh; bands inside the documents (a causal window of 12,
    5 back and 3 ahead); "auto" on both meshes."""
    placements = ("balanced", "head_tail", "contiguous")
    out = [PackedCase("ulysses", p, causal, nkv=2 if causal else 4) for p in placements for causal in (True, False)]
    out += [PackedCase("ulysses", "balanced", False, band=(5, 3)),
            PackedCase("ulysses", "head_tail", False, band=(11, 0)),
            PackedCase("ulysses", "balanced", False, band=(5, 3), band_mode=7)]
    if world == 4:
        out += [PackedCase("hybrid", p, causal, nkv=2 if causal else 4, mesh=(2, 2))
                for p in placements for causal in (True, False)]
        out += [PackedCase("hybrid", "balanced", False, nkv=2, mesh=(2, 2), band=(5, 3)),
                PackedCase("hybrid", "contiguous", False, mesh=(2, 2), band=(11, 0)),
                PackedCase("hybrid", "balanced", False, mesh=(2, 2), band=(5, 3), band_mode=8)]
        out.append(PackedCase("auto", "balanced", True, mesh=(2, 2)))
    else:
        out.append(PackedCase("auto", "balanced", True))
    return out


PACKED_CASES = {w: _packed_matrix(w) for w in (2, 4)}


def _packed_inputs(case: PackedCase) -> list[torch.Tensor]:
    """q, k, v, dout: [T, N, D] float64 with float32 values."""
    T = case.cu[-1]
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    q, dout = (torch.randn(T, case.nq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, case.nkv, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.float().double() for t in (q, k, v, dout)]


def _packed_dtensor(mesh, local, whole):
    """A shard of ``shard_documents`` as the op's input (local lengths may differ: the global
    shape is given)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, shape=whole.shape, stride=whole.stride())


def _packed_kwargs(case: PackedCase, cu) -> dict:
    kw = dict(scale=8 ** -0.5, actual_seq_qlen=torch.tensor(cu), actual_seq_kvlen=torch.tensor(cu))
    if case.causal:
        kw.update(atten_mask=torch.ones(MASK, MASK, dtype=torch.bool).triu(1), sparse_mode=3, next_tockens=0)
    elif case.band:
        kw.update(atten_mask=torch.ones(MASK, MASK, dtype=torch.bool).triu(1), sparse_mode=case.band_mode,
                  pre_tockens=case.band[0], next_tockens=case.band[1])
    return kw


def _packed_call(case: PackedCase, mesh, full, local, cu):
    """The TND call on DTensors laid out by ``shard_documents``: the leaves and the op's outputs."""
    leaves = [_packed_dtensor(mesh, t.clone(), w).requires_grad_() for t, w in zip(local[:3], full[:3])]
    return leaves, torch.ops.npu.npu_fusion_attention_v3(*leaves, case.nq, "TND", **_packed_kwargs(case, cu))


def _run_packed(case: PackedCase, rank: int, world: int) -> dict:
    from cp_cache.testing.varlen_reference import band_modes, dense_tnd_attention

    _set_lb(case.placement != "contiguous")
    documents = "balanced" if case.placement == "contiguous" else case.placement  # contiguous: load balancing off
    cp_cache.enable(algorithm=case.algorithm, documents=documents)
    sizes, cu = case.sizes(world), case.cu
    mesh = _mesh_of(sizes)
    full = _packed_inputs(case)
    local = [cp_cache.shard_documents(t, cu, mesh).float() for t in full]
    res = {"layout": torch.equal(local[0].double(), full[0].index_select(0, cp_cache.document_layout(cu, sizes)[rank])),
           "local_rows": local[0].size(0)}
    leaves, out = _packed_call(case, mesh, full, local, cu)
    cache = cp_cache.store().resolve(out[4])
    res["algorithm"] = plan_of(cache).algorithm
    del cache
    res["placements"] = [tuple(o.placements) for o in out[:3]]
    out[0].backward(_packed_dtensor(mesh, local[3], full[3]))
    res["grad_placements"] = [tuple(t.grad.placements) for t in leaves]
    got = {"out": out[0], "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    got = {n: cp_cache.unshard_documents(t.to_local(), cu, mesh).double() for n, t in got.items()}
    lse = (out[1].to_local()[..., 0].double() + out[2].to_local()[..., 0].double().log()).contiguous()
    got["lse"] = cp_cache.unshard_documents(lse, cu, mesh)
    mode = band_modes(len(cu), case.band_mode) if case.band else "left_up" if case.causal else "full"
    band = dict(pre_tockens=case.band[0], next_tockens=case.band[1]) if case.band else {}
    ref = dense_tnd_attention(*full, cu, cu, mode, **band)
    low = dense_tnd_attention(*full, cu, cu, mode, dtype=torch.float32, **band)  # the bounds' reference error
    res["errors"] = {n: (rel_err(got[n], ref[n]), rel_err(low[n].double(), ref[n])) for n in ("out", "dq", "dk", "dv")}
    res["errors"]["lse"] = (float((got["lse"] - ref["lse"]).abs().max()),
                            float((low["lse"].double() - ref["lse"]).abs().max()))
    res["lse_scale"] = float(ref["lse"].abs().max())
    del out, leaves
    res["live"] = cp_cache.stats()["live_entries"]
    _set_lb(True)
    cp_cache.enable()
    return res


def _packed_rejections(rank: int, world: int) -> dict:
    """What packed documents refuse on Ulysses and two-dimensional meshes, on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    got = {}
    _set_lb(True)
    for name, case, algorithm in (("heads", PackedCase("ulysses", "balanced", True, nq=3, nkv=3), "ulysses"),
                                  ("hybrid_one_dim", PackedCase("hybrid", "balanced", True), "hybrid")):
        cp_cache.enable(algorithm=algorithm)
        mesh = _mesh_of(case.sizes(world))
        full = _packed_inputs(case)
        local = [cp_cache.shard_documents(t, case.cu, mesh).float() for t in full]
        got[name] = capture(lambda: _packed_call(case, mesh, full, local, case.cu))
    case = PackedCase("ulysses", "balanced", True)  # a document capacity runs on the ring only
    cp_cache.enable(algorithm="ulysses", document_capacity=72)
    mesh = _mesh_of(case.sizes(world))
    full = _packed_inputs(case)
    local = [cp_cache.shard_documents(t, case.cu, mesh).float() for t in full]
    got["capacity"] = capture(lambda: _packed_call(case, mesh, full, local, case.cu))
    if world == 4:
        case = PackedCase("ring", "balanced", True, mesh=(2, 2))
        cp_cache.enable(algorithm="ring")
        mesh = _mesh_of((2, 2))
        full = _packed_inputs(case)
        local = [cp_cache.shard_documents(t, case.cu, mesh).float() for t in full]
        got["ring_two_dims"] = capture(lambda: _packed_call(case, mesh, full, local, case.cu))
        cp_cache.enable(algorithm="hybrid")
        q, k, v = (DTensor.from_local(t[:16].float(), mesh, [Replicate(), Shard(0)]) for t in full[:3])
        lengths = torch.tensor([32])
        got["replicate_dim"] = capture(lambda: torch.ops.npu.npu_fusion_attention_v3(
            q, k, v, 4, "TND", actual_seq_qlen=lengths, actual_seq_kvlen=lengths))
    cp_cache.enable()
    return got


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _ranks(rank: int, world: int, cases: list[Case]) -> dict:
    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=True)
    logger, messages = logging.getLogger("cp_cache"), _Messages()
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    with cp_region(world):
        results = {case.name: _run_case(case, rank, world) for case in cases}
        results["log"] = [m for m in messages.messages if "Ulysses" in m]
        results["checkpointing"] = _checkpointing(rank, world)
        results["errors"] = _rejections(rank, world)
        results["sharding"] = _sharding_helpers(rank, world)
        results["floor"] = _memory_floor(rank, world)
        results["packed"] = {case.name: _run_packed(case, rank, world) for case in PACKED_CASES[world]}
        results["packed_errors"] = _packed_rejections(rank, world)
    if world == 2:
        results["model"] = _model_step(rank, world)
    results["live_entries"] = cp_cache.stats()["live_entries"]
    return results


_RESULTS: dict = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_ranks, world, CASES[world], timeout=600)
    return _RESULTS[world]


ALL = [(w, c) for w in (2, 4) for c in CASES[w]]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world, case", ALL, ids=[f"W{w}-{c.name}" for w, c in ALL])
def test_matches_dense_float64(world, case):
    for rank, res in enumerate(_results(world)):
        r = res[case.name]
        if "errors" in r:
            for key, err in r["errors"].items():
                bound = error_bound(r["dense_errors"][key])  # 20x dense float32 + 32 eps
                assert err <= bound, (case.name, rank, key, err, bound)
        else:  # dropout off the 1-D Ulysses path: directional derivatives only
            assert case.keep_prob < 1
        assert r["live_after_forward"] == 1, (case.name, rank)  # the graph holds the handle, or the stack the entry
        assert r["live_after_backward"] == 0 and r["stack_depth"] == 0, (case.name, rank)
        assert r["placements"][0] == r["expected_placements"], (case.name, r["placements"])
        assert r["grad_placements"] == [r["expected_placements"]] * 3, (case.name, r["grad_placements"])
        expected = {"auto": "hybrid" if "seq" in case.dims[1:] else "ulysses"}.get(case.algorithm, case.algorithm)
        if case.policy == "handle":
            assert r["algorithm"] == expected, (case.name, r["algorithm"])


FULL = [(w, c) for w, c in ALL if c.mode == "full" and c.dims.count("seq") == 1 and c.algorithm != "auto"]


@pytest.mark.parametrize("world, case", FULL, ids=[f"W{w}-{c.name}" for w, c in FULL])
def test_bytes_sent_match_the_formula_auto_reads(world, case):
    from cp_cache.plan import bytes_per_rank

    sizes = _sizes(case, world)
    cp = math.prod(s for d, s in zip(case.dims, sizes) if d == "seq")
    heads = math.prod(s for d, s in zip(case.dims, sizes) if d == "head")
    expected = bytes_per_rank(case.algorithm, nq=case.nq // heads, nkv=case.nkv // heads, world=cp, batch=case.B,
                              local_seq=case.S // cp, head_dim=case.D, itemsize=4)
    for rank, res in enumerate(_results(world)):
        assert res[case.name]["bytes_sent"] == expected, (case.name, rank)


@pytest.mark.parametrize("world, case", [(w, c) for w, c in ALL if c.keep_prob < 1],
                         ids=[f"W{w}-{c.name}" for w, c in ALL if c.keep_prob < 1])
def test_dropout(world, case):
    results = _results(world)
    for rank, res in enumerate(results):
        r = res[case.name]
        checks = r["directional"]
        assert all(err <= bound for err, bound in checks), (case.name, rank, checks)
        assert min(bound for _, bound in checks) < 0.1, checks  # some direction resolves a 10 % wrong slope
        if "kept" in r and r["kept"] is not None:
            assert abs(r["kept"] - case.keep_prob) < 0.1, r["kept"]
            assert r["differs_without_dropout"] > error_bound(r["dense_errors"]["out"])  # beyond the bound
    # every rank of a Ulysses group (hybrid: the ranks sharing a ring position) drew its own
    # seed/offset from the same RNG state, and the ranks leave the generator in the same state
    group = world if case.dims == ("seq",) else 2
    for start in range(0, world, group):
        seeds = {tuple(map(tuple, res[case.name]["seeds"])) for res in results[start:start + group]}
        assert len(seeds) == group, (case.name, seeds)
        # (a causal ring skips kernel calls, so only the ranks of a Ulysses group end in step)
        assert len({res[case.name]["rng_after"] for res in results[start:start + group]}) == 1


def test_kv_heads_repeated_when_fewer_than_w_and_logged():
    for res in _results(4):
        assert "cp_cache Ulysses: 1 K/V heads over 4 ranks: each K/V head repeated 4 times" in res["log"], res["log"]
        assert "cp_cache Ulysses: 2 K/V heads over 4 ranks: each K/V head repeated 2 times" in res["log"]
    for res in _results(2):
        assert not any("repeated" in m for m in res["log"]), res["log"]  # Nkv = 2, 4 divide by W = 2


@pytest.mark.parametrize("world", (2, 4))
def test_checkpointing_and_policies(world):
    for rank, res in enumerate(_results(world)):
        c = res["checkpointing"]
        for policy in ("handle", "stack"):
            for mode in ("non_reentrant", "reentrant"):
                assert c[(policy, mode, "grad_diff")] == 0.0, (rank, policy, mode, c)
            assert c[(policy, "stack_depth")] == 0
        assert c[("handle", "non_reentrant", "live_between")] == 0
        assert c[("handle", "reentrant", "live_between")] == 0
        assert c[("handle", "none", "live_between")] == 1
        assert res["live_entries"] == 0


@pytest.mark.parametrize("world", (2, 4))
def test_bad_head_counts_raise_on_every_rank(world):
    for rank, res in enumerate(_results(world)):
        e = res["errors"]
        kind, message = e[(3, 3)]
        assert kind == "ValueError" and f"N=3, Nkv=3, W={world}" in message, message
        kind, message = e[(12, 6)]
        if world == 4:
            assert kind == "ValueError" and "N=12, Nkv=6, W=4" in message, message
        else:
            assert kind == "no error", message
        kind, message = e[(6, 3)]
        if world == 4:
            assert kind == "ValueError" and "N=6, Nkv=3, W=4" in message, message
        kind, message = e["per_head_mask"]
        assert kind == "NotImplementedError" and "not a per-head mask of shape (2, 4, 16, 16)" in message, message
        kind, message = e["hybrid_one_dim"]
        assert kind == "NotImplementedError" and "algorithm='hybrid' runs over 2" in message, message
        if world == 4:
            kind, message = e["two_cp_dims"]
            assert kind == "NotImplementedError" and "use algorithm='hybrid'" in message, message
            kind, message = e["hybrid_lb"]
            assert kind == "NotImplementedError" and re.search("load balancing.*not supported", message), message


def test_context_parallel_algorithm_trains_like_single_process():
    for rank, res in enumerate(_results(2)):
        m = res["model"]
        assert m["inside"] == "ulysses" and not m["enabled_after"], m
        assert m["calls"] == 2, m  # two layers, one CP attention call each
        # 20x the float32 single process's error against the float64 model, + 32 eps
        assert m["loss_err"] <= error_bound(m["ref_loss_err"], scale=m["loss_scale"]), m
        assert m["grad_err"] <= error_bound(m["ref_grad_err"]), m
        assert m["nested_inside"] == ("stack", "ulysses") and m["nested_after"] == ("stack", "ring"), m


@pytest.mark.parametrize("world", (2, 4))
def test_sharding_helpers_lay_out_what_the_handlers_expect(world):
    for rank, res in enumerate(_results(world)):
        got = res["sharding"]
        assert got["lb_local"] and got["lb_back"], (rank, got)
        if world == 4:
            assert got["nested_local"] and got["nested_back"], (rank, got)
            kind, message = got["nested_lb"]
            assert kind == "NotImplementedError" and "two CP mesh dimensions" in message, message


@pytest.mark.parametrize("world", (2, 4))
def test_memory_floor_output_plus_lse(world):
    """Ulysses and hybrid keep, between forward and backward, the output, the LSE and the
    step cache's few bytes (the seed/offset of the calls): nothing of the head shards; packed
    documents too."""
    for rank, res in enumerate(_results(world)):
        assert "tnd-ulysses" in res["floor"] and ("tnd-hybrid" in res["floor"]) == (world == 4), res["floor"]
        for algorithm, (kept, output, lse) in res["floor"].items():
            assert output + lse <= kept <= output + lse + 1024, (rank, algorithm, kept, output, lse)


PACKED = [(w, c) for w in (2, 4) for c in PACKED_CASES[w]]


@pytest.mark.parametrize("world, case", PACKED, ids=[f"W{w}-{c.name}" for w, c in PACKED])
def test_packed_documents_match_dense_float64(world, case):
    """TND under Ulysses and hybrid, every placement, causal and full: output, LSE, dq, dk, dv
    within ``error_bound`` of one process's float32 error against float64 (the same run)."""
    results = _results(world)
    for rank, res in enumerate(results):
        r = res["packed"][case.name]
        for name, (err, dense) in r["errors"].items():
            bound = error_bound(dense, scale=r["lse_scale"]) if name == "lse" else error_bound(dense)
            assert err <= bound, (case.name, rank, name, err, bound)
        assert r["algorithm"] == case.ran(), (case.name, rank, r["algorithm"])
        assert r["layout"], (case.name, rank)  # shard_documents gave this rank its positions of document_layout
        expected = _shard0(len(case.sizes(world)))
        assert r["placements"][0] == expected and r["grad_placements"] == [expected] * 3, (case.name, r)
        assert r["live"] == 0, (case.name, rank)
    rows = [res["packed"][case.name]["local_rows"] for res in results]
    assert sum(rows) == case.cu[-1]
    if case.placement == "balanced" and case.mesh == (0,):
        assert len(set(rows)) > 1, rows  # uneven shards: the all-to-alls carried uneven splits


def _shard0(ndim: int) -> tuple:
    from torch.distributed.tensor import Shard

    return (Shard(0),) * ndim


@pytest.mark.parametrize("world", (2, 4))
def test_packed_documents_refusals_name_the_values(world):
    for rank, res in enumerate(_results(world)):
        e = res["packed_errors"]
        kind, message = e["heads"]
        assert kind == "ValueError" and f"N=3, Nkv=3, W={world}" in message, message
        kind, message = e["hybrid_one_dim"]
        assert kind == "NotImplementedError" and "algorithm='hybrid' runs over 2" in message, message
        kind, message = e["capacity"]
        assert kind == "NotImplementedError" and "document_capacity=72" in message, message
        assert "algorithm='ulysses'" in message, message
        if world == 4:
            kind, message = e["ring_two_dims"]
            assert kind == "NotImplementedError" and "use algorithm='hybrid'" in message, message
            kind, message = e["replicate_dim"]
            assert kind == "NotImplementedError" and "sharded on T on every mesh dimension" in message, message
            assert "placements=(Replicate(), Shard(dim=0))" in message, message


def test_packed_layout_on_two_dimensions():
    """On a (W0, W1) mesh the placement is over W0 and each outer share is cut into W1 contiguous
    slices (sizes differing by at most one): rank i*W1 + j holds slice j of share i."""
    cu = torch.tensor(PACKED_MIX).cumsum(0).tolist()
    for placement in ("balanced", "contiguous"):
        for outer, inner in ((2, 2), (2, 3), (1, 4), (4, 2)):
            shares = cp_cache.document_layout(cu, outer, placement=placement)
            nested = cp_cache.document_layout(cu, (outer, inner), placement=placement)
            assert len(nested) == outer * inner
            for i, share in enumerate(shares):
                pieces = nested[i * inner:(i + 1) * inner]
                assert torch.equal(torch.cat(pieces), share), (placement, outer, inner, i)
                assert max(p.numel() for p in pieces) - min(p.numel() for p in pieces) <= 1
    with pytest.raises(ValueError, match=r"gives them \[2, 2\] tokens; each is cut over 3 inner ranks"):
        cp_cache.document_layout([4], (2, 3), placement="contiguous")
    with pytest.raises(ValueError, match=r"world=\(2, 2, 2\)"):
        cp_cache.document_layout(cu, (2, 2, 2))
    with pytest.raises(ValueError, match=r"document capacity=72 .* the 2-D \(hybrid\) layout over 2x2 ranks"):
        cp_cache.document_layout(cu, (2, 2), capacity=72)


# ---------------------------------------------------------------- no ranks: selection


def test_auto_rule():
    from cp_cache.plan import bytes_per_rank, choose_algorithm

    for world in (2, 4, 8):  # MHA: Ulysses (the ring's backward sends W-1 float32 dK/dV blocks)
        assert choose_algorithm(nq=8, nkv=8, world=world, given_mask=False) == "ulysses"
    assert choose_algorithm(nq=8, nkv=8, world=1, given_mask=False) == "ring"
    assert choose_algorithm(nq=6, nkv=6, world=4, given_mask=False) == "ring"  # heads do not split
    assert choose_algorithm(nq=8, nkv=8, world=4, given_mask=True) == "ring"  # given masks: ring only
    assert choose_algorithm(nq=32, nkv=4, world=4, given_mask=False) == "ring"  # few K/V heads: ring
    assert choose_algorithm(nq=32, nkv=16, world=4, given_mask=False) == "ulysses"
    shape = dict(nq=32, nkv=4, world=4, batch=1, local_seq=1, head_dim=128, itemsize=2)
    assert bytes_per_rank("ring", **shape) == 192 * 128  # 3 * 2 blocks bf16 + 3 float32 dK/dV
    assert bytes_per_rank("ring", exchange="ring", **shape) == 224 * 128  # whole-block ring: 4 float32 dK/dV
    assert bytes_per_rank("ulysses", **shape) > bytes_per_rank("ring", **shape)


def test_algorithm_from_argument_and_environment(monkeypatch):
    from cp_cache.config import resolve_config

    monkeypatch.delenv("CP_CACHE_ALGORITHM", raising=False)
    assert resolve_config().algorithm == "ring"
    monkeypatch.setenv("CP_CACHE_ALGORITHM", "ulysses")
    assert resolve_config().algorithm == "ulysses"
    assert resolve_config(algorithm="hybrid").algorithm == "hybrid"
    monkeypatch.setenv("CP_CACHE_ALGORITHM", "spiral")
    with pytest.raises(ValueError, match="CP_CACHE_ALGORITHM='spiral'"):
        resolve_config()
    with pytest.raises(ValueError, match="algorithm='spiral' is not a cp_cache algorithm"):
        resolve_config(algorithm="spiral")
