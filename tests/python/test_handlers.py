"""The CP handlers of npu_fusion_attention_v3 / _grad_v3 on DTensors, against dense float64.

Each world size (W = 1, 2, 4) is one spawned gloo run (loopback) that executes the
whole case matrix through ``torch.ops.npu.npu_fusion_attention_v3`` on DTensors
sharded on the layout's sequence dimension, then the rejection checks; the ranks
return their local results and every test checks one aspect in this process.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import pytest
import torch

import cp_cache
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
from cp_cache.testing.multiprocess import capture, run_ranks

LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")
MODES = ("causal_lb", "causal", "full")
WORLDS = (1, 2, 4)
MASK = 2048


@pytest.fixture(autouse=True)
def no_live_caches():
    yield
    assert cp_cache.stats()["live_entries"] == 0


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case(AttentionCase):
    call: str = "kw"  # kw: every argument by name; pos: every argument positionally
    keep_prob: float = 1.0
    sparse_mode: int = 2  # for the causal modes: 2 (left-up) or 3 (right-down)
    flip_lb: bool = False  # toggle enable_load_balance between forward and backward
    B: int = 3
    D: int = 8
    s_local: int = 4

    @property
    def name(self) -> str:
        parts = [self.layout, self.mode, "gqa" if self.gqa else "mha", self.dtype, self.call]
        if self.keep_prob < 1:
            parts.append(f"drop{self.keep_prob}")
        if self.causal and self.sparse_mode != 2:
            parts.append(f"sm{self.sparse_mode}")
        if self.flip_lb:
            parts.append("fliplb")
        return "-".join(parts)

    @property
    def nq(self) -> int:
        return 6 if self.gqa else 3

    @property
    def nkv(self) -> int:
        return 2 if self.gqa else 3


def _cases() -> list[Case]:
    out = []
    i = 0
    for lay in LAYOUTS:
        for mode in MODES:
            for gqa in (False, True):
                out.append(Case(lay, mode, gqa, "float32", call=("kw", "pos")[i % 2],
                                sparse_mode=(2, 3)[(i // 2) % 2]))
                i += 1
    for j, lay in enumerate(LAYOUTS):
        for mode in MODES:
            out.append(Case(lay, mode, bool(j % 2), "bfloat16", call=("pos", "kw")[j % 2]))
    for mode in MODES:
        out.append(Case("BSND", mode, True, "float32", keep_prob=0.75))
        out.append(Case("SBH", mode, False, "float32", call="pos", keep_prob=0.8))
    out.append(Case("BNSD", "causal_lb", False, "float32", flip_lb=True))
    out.append(Case("BSH", "causal", True, "float32", flip_lb=True))
    return out


CASES = _cases()
DROPOUT_CASES = [c for c in CASES if c.keep_prob < 1]
EXACT_CASES = [c for c in CASES if c.keep_prob == 1]


# ---------------------------------------------------------------- rank side


def _setup(rank: int, world: int, policy: str = "handle"):
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=True)
    cp_cache.enable(policy)
    return init_device_mesh("cpu", (world,))


def _set_lb(value: bool) -> None:
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    _cp_options.enable_load_balance = value


def _call_forward(case: Case, q, k, v, *, scale):
    op = torch.ops.npu.npu_fusion_attention_v3
    mask = torch.ones(MASK, MASK, dtype=torch.bool).triu(1) if case.causal else None
    sparse = case.sparse_mode if case.causal else 0
    nxt = 0 if case.causal else 2147483647
    if case.call == "pos":
        return op(q, k, v, case.nq, case.layout, None, None, mask, scale, case.keep_prob,
                  2147483647, nxt, 0, None, None, None, sparse)
    return op(query=q, key=k, value=v, head_num=case.nq, input_layout=case.layout, atten_mask=mask,
              scale=scale, keep_prob=case.keep_prob, next_tockens=nxt, sparse_mode=sparse)


def _run_case(case: Case, rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Shard


    _set_lb(case.load_balance)
    q, k, v, dout = full_inputs(case, world)
    pos = case_positions(case, world, rank)
    ql, kl, vl, dl = (shard(t, case, pos) for t in (q, k, v, dout))
    placements = (Shard(L.seq_dim(case.layout)),)
    qd, kd, vd = (DTensor.from_local(t.clone(), mesh, placements).requires_grad_() for t in (ql, kl, vl))
    dd = DTensor.from_local(dl, mesh, placements)
    torch.manual_seed(1000 + rank)
    calls = cp_cache.call_stats()["forward"]["calls"]
    out = _call_forward(case, qd, kd, vd, scale=1.0 / math.sqrt(case.D))
    forward = cp_cache.call_stats()["forward"]
    res: dict = {"fwd_calls": forward["calls"] - calls,
                 "fwd_bytes": forward["bytes_sent"],
                 "block_bytes": kl.nbytes + vl.nbytes,
                 "live_after_forward": cp_cache.stats()["live_entries"]}
    res["types"] = [type(o).__name__ for o in out]
    res["placements"] = [tuple(o.placements) if isinstance(o, DTensor) else None for o in out[:3]]
    res["global_shapes"] = [tuple(o.shape) for o in out[:3]]
    res["expected_placements"] = (placements, (Shard(2),), (Shard(2),))
    res["expected_shapes"] = (tuple(qd.shape), (case.B, case.nq, case.s_local * world, 8),
                              (case.B, case.nq, case.s_local * world, 8))
    smax, ssum = out[1].to_local().detach(), out[2].to_local().detach()
    res["stats_replicated"] = bool((smax == smax[..., :1]).all() and (ssum == ssum[..., :1]).all())
    res["lse"] = (smax[..., 0].double() + torch.log(ssum[..., 0].double()))
    res["out"] = out[0].to_local().detach()
    res["out_dtype"] = out[0].dtype
    if case.keep_prob < 1:
        cache = cp_cache.store().resolve(out[4])
        res["steps"] = [(part, [int(t.reshape(-1)[0]) for t in owned]) for part, owned in cache.steps]
        del cache
    if case.flip_lb:
        _set_lb(not case.load_balance)
    calls = cp_cache.call_stats()["backward"]["calls"]
    out[0].backward(dd)
    backward = cp_cache.call_stats()["backward"]
    res["bwd_calls"] = backward["calls"] - calls
    res["bwd_bytes"] = backward["bytes_sent"]
    res["grad_types"] = [type(t.grad).__name__ for t in (qd, kd, vd)]
    res["grad_placements"] = [tuple(t.grad.placements) for t in (qd, kd, vd)]
    res["dq"], res["dk"], res["dv"] = (t.grad.to_local().detach() for t in (qd, kd, vd))
    del out
    res["live_after_backward"] = cp_cache.stats()["live_entries"]
    _set_lb(True)
    return res


def _rejections(rank: int, world: int, mesh) -> dict:
    """Every rejected call, as (exception type, message)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    op = torch.ops.npu.npu_fusion_attention_v3
    grad = torch.ops.npu.npu_fusion_attention_grad_v3
    B, N, S, D = 1, 2, 4 * world, 8
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(B, N, S, D, generator=g) for _ in range(4)]
    q, k, v, dy = (distribute_tensor(t, mesh, [Shard(2)]) for t in full)
    causal = torch.ones(MASK, MASK, dtype=torch.bool).triu(1)
    small = torch.zeros(S, S, dtype=torch.bool)
    idx = torch.tensor([S], dtype=torch.int64)
    got = {}

    def fwd(**kw):
        return lambda: op(q, k, v, N, "BNSD", **kw)

    got["pse"] = capture(fwd(pse=torch.zeros(B, N, S, S)))
    got["padding_mask"] = capture(fwd(padding_mask=torch.zeros(B, N, S, S)))
    got["prefix"] = capture(fwd(prefix=[1]))
    got["actual_seq_qlen"] = capture(fwd(actual_seq_qlen=idx))
    got["actual_seq_kvlen"] = capture(fwd(actual_seq_kvlen=idx))
    got["sink"] = capture(fwd(sink=torch.zeros(N + 1)))  # a sink is taken; one of the wrong shape is not
    got["softmax_layout"] = capture(fwd(softmax_layout="TND"))
    for mode in range(5, 9):
        got[f"sparse_mode={mode}"] = capture(fwd(atten_mask=causal, sparse_mode=mode))
    got["mask_mode4_small"] = capture(fwd(atten_mask=small, sparse_mode=4))
    got["mask_mode0_rows"] = capture(fwd(atten_mask=small[: S // 2], sparse_mode=0))
    got["mask_mode1_3d"] = capture(fwd(atten_mask=small.unsqueeze(0), sparse_mode=1))
    got["mask_float"] = capture(fwd(atten_mask=small.float(), sparse_mode=1))
    got["mask_mode2_small"] = capture(fwd(atten_mask=small, sparse_mode=2))
    got["mask_mode3_batched"] = capture(fwd(atten_mask=causal.expand(2, 1, MASK, MASK), sparse_mode=3))
    qt, kt, vt = (distribute_tensor(t.transpose(1, 2).reshape(B * S, N, D), mesh, [Shard(0)]) for t in full[:3])
    got["TND"] = capture(lambda: op(qt, kt, vt, N, "TND"))
    qr, kr, vr = (distribute_tensor(t, mesh, [Replicate()]) for t in full[:3])
    got["replicate"] = capture(lambda: op(qr, kr, vr, N, "BNSD"))
    # sharded on another dim than the sequence's (BNSD: dim 2): the heads, tensor parallel
    qh, kh, vh = (distribute_tensor(t.repeat(1, world, 1, 1), mesh, [Shard(1)]) for t in full[:3])
    got["wrong_shard_dim"] = capture(lambda: op(qh, kh, vh, N * world, "BNSD"))
    got["local_key"] = capture(lambda: op(q, full[1], v, N, "BNSD"))

    # a 2-D mesh (W x 1) whose second dim shards the head size (neither Replicate nor heads),
    # and a 1-rank mesh per rank for a backward on another mesh size
    mesh2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("cp", "one"))
    q2, k2, v2 = (distribute_tensor(t, mesh2d, [Shard(2), Shard(3)]) for t in full[:3])
    got["mesh_2d"] = capture(lambda: op(q2, k2, v2, N, "BNSD"))

    # odd local length under load balancing: S = 3W is not divisible by 2W
    odd = [torch.randn(B, N, 3 * world, D, generator=g) for _ in range(3)]
    qo, ko, vo = (distribute_tensor(t, mesh, [Shard(2)]) for t in odd)
    _set_lb(True)
    got["lb_odd"] = capture(lambda: op(qo, ko, vo, N, "BNSD", atten_mask=causal, sparse_mode=2, next_tockens=0))
    _set_lb(False)
    got["nolb_odd"] = capture(lambda: op(qo, ko, vo, N, "BNSD", atten_mask=causal, sparse_mode=2, next_tockens=0))
    _set_lb(True)

    # backward with a wrong seed, an expired handle, or on another mesh
    out = op(q, k, v, N, "BNSD", atten_mask=causal, sparse_mode=2, next_tockens=0, scale=0.5)

    def bwd(seed, tensors=(q, k, v, dy, out[0]), **kw):
        qq, kk, vv, dd, oo = tensors
        args = dict(softmax_max=out[1], softmax_sum=out[2], attention_in=oo, scale_value=0.5,
                    atten_mask=causal, sparse_mode=2, next_tockens=0, seed=seed, offset=out[5])
        args.update(kw)
        return lambda: grad(qq, kk, vv, dd, N, "BNSD", **args)

    got["seed_forged"] = capture(bwd(torch.tensor([int(out[4])], dtype=torch.int64)))
    got["seed_clone"] = capture(bwd(out[4].clone()))
    got["seed_none"] = capture(bwd(None))
    got["seed_dtensor"] = capture(bwd(DTensor.from_local(out[4], mesh, [Replicate()])))
    got["bwd_scale_mismatch"] = capture(bwd(out[4], scale_value=0.25))
    got["bwd_pse"] = capture(bwd(out[4], pse=torch.zeros(1)))
    got["bwd_causal_mismatch"] = capture(bwd(out[4], atten_mask=None, sparse_mode=0))
    one = mesh2d["one"]
    other = [DTensor.from_local(t.to_local(), one, [Shard(2)]) for t in (q, k, v, dy, out[0])]
    got["bwd_other_mesh"] = capture(bwd(out[4], tensors=other)) if world > 1 else ("skipped", "")
    got["bwd_ok"] = capture(bwd(out[4]))
    handle = out[4]
    del out
    got["live_after_drop"] = ("live", str(cp_cache.stats()["live_entries"]))
    del handle
    got["live_after_handle_drop"] = ("live", str(cp_cache.stats()["live_entries"]))

    # expired: a graph's backward released the cache; the handle kept by hand is dead
    qg = distribute_tensor(full[0], mesh, [Shard(2)]).requires_grad_()
    out = op(qg, k, v, N, "BNSD", scale=0.5)
    handle, kept = out[4], (out[1], out[2], out[0])
    out[0].backward(dy)
    got["seed_expired"] = capture(lambda: grad(
        q, k, v, dy, N, "BNSD", softmax_max=kept[0], softmax_sum=kept[1], attention_in=kept[2],
        scale_value=0.5, seed=handle, offset=out[5]))
    del out, handle, kept

    # stack policy: a forged pairing key is a mis-pairing, then the right one pops
    cp_cache.enable("stack")
    out = op(q, k, v, N, "BNSD", atten_mask=causal, sparse_mode=2, next_tockens=0, scale=0.5)
    got["stack_forged"] = capture(bwd(torch.tensor([12345], dtype=torch.int64)))
    got["stack_ok"] = capture(bwd(out[4]))
    got["stack_second"] = capture(bwd(out[4]))
    del out
    cp_cache.enable("handle")
    got["live_end"] = ("live", str(cp_cache.stats()["live_entries"]))
    return got


def _handlers_rank(rank: int, world: int, cases: list[Case]) -> dict:
    mesh = _setup(rank, world)
    with cp_cache.context_parallel(mesh):
        results = {case.name: _run_case(case, rank, world, mesh) for case in cases}
        results["errors"] = _rejections(rank, world, mesh)
    results["live_entries"] = cp_cache.stats()["live_entries"]
    return results


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_handlers_rank, world, CASES, timeout=240.0)
    return _RESULTS[world]


# ---------------------------------------------------------------- dropout masks on the full sequence


def _keep_mask(results: list[dict], case: Case, world: int) -> torch.Tensor:
    """The full keep mask from every rank's steps, recorded as (part, [seed, offset]) ([] when
    skipped); step i of rank r used rank (r-i)%W's block."""
    steps = []
    for r, res in enumerate(results):
        recorded = res[case.name]["steps"]
        steps.append([((r - i) % world, part, *(owned or (None, None))) for i, (part, owned) in enumerate(recorded)])
    return keep_mask(steps, case, world)


# errors measured per (world, dtype, key); reported by test_report_max_errors
MEASURED: dict = {}


# ---------------------------------------------------------------- tests: numbers


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: c.name)
def test_matches_dense(world, case):
    results = _results(world)
    q, k, v, dout = full_inputs(case, world)
    ref = case_dense(q, k, v, dout, case)
    # a multiple of dense torch's error in the case dtype (float32: 20x + 32 eps; bf16, computed in
    # float32 and rounded once: 4x + eps/2)
    bound = case_bounds(q, k, v, dout, case, ref, **({} if case.dtype == "float32" else dict(factor=4.0, floor=0.5)))
    got = gather([res[case.name] for res in results], case, world)
    for key in ("out", "lse", "dq", "dk", "dv"):
        err = rel_err(got[key], ref[key])
        slot = MEASURED.setdefault((world, case.dtype, key), [0.0, ""])
        if err > slot[0]:
            slot[:] = [err, case.name]
        assert err <= bound[key], f"{case.name} W={world} {key}: relative error {err:.3g} > {bound[key]:.3g}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: c.name)
def test_dropout_matches_dense_under_same_masks(world, case):
    results = _results(world)
    q, k, v, dout = full_inputs(case, world)
    keep = _keep_mask(results, case, world)
    # the masks really drop something (over the pairs attention sees), and differ between steps
    S = keep.shape[-1]
    seen = torch.ones(S, S, dtype=torch.bool).tril() if case.causal else torch.ones(S, S, dtype=torch.bool)
    kept = keep[:, :, seen].float().mean()
    assert abs(kept - case.keep_prob) < 0.1, kept
    seeds = {tuple(owned) for res in results for part, owned in res[case.name]["steps"] if part != "skip"}
    assert len(seeds) == sum(1 for res in results for part, _ in res[case.name]["steps"] if part != "skip")
    ref = case_dense(q, k, v, dout, case, keep)
    bound = case_bounds(q, k, v, dout, case, ref, keep)
    got = gather([res[case.name] for res in results], case, world)
    for key in ("out", "lse", "dq", "dk", "dv"):
        err = rel_err(got[key], ref[key])
        assert err <= bound[key], f"{case.name} W={world} {key}: relative error {err:.3g} > {bound[key]:.3g}"
    # and not equal to the dense computation without dropout: further from it than the bound allows
    assert rel_err(got["out"], case_dense(q, k, v, dout, case)["out"]) > bound["out"]


@pytest.mark.parametrize("world", WORLDS)
def test_outputs_are_dtensors_with_query_placements(world):
    for r, res in enumerate(_results(world)):
        for case in CASES:
            rr = res[case.name]
            assert rr["fwd_calls"] == 1 and rr["bwd_calls"] == 1, (case.name, r)
            assert rr["types"][:3] == ["DTensor"] * 3, (case.name, rr["types"])
            assert rr["types"][3:] == ["Tensor"] * 3, (case.name, rr["types"])
            assert tuple(rr["placements"]) == tuple(rr["expected_placements"]), case.name
            assert tuple(rr["global_shapes"]) == tuple(rr["expected_shapes"]), case.name
            assert rr["stats_replicated"], case.name
            assert rr["out_dtype"] == case.torch_dtype
            assert rr["grad_types"] == ["DTensor"] * 3, case.name
            assert rr["grad_placements"] == [rr["expected_placements"][0]] * 3, case.name
            assert rr["dq"].dtype == rr["dk"].dtype == case.torch_dtype


@pytest.mark.parametrize("world", WORLDS)
def test_bytes_sent_is_ring_minimum(world):
    """Forward sends (W-1) local K/V blocks (GQA: the Nkv-head blocks, not repeated); backward
    adds W float32 dK/dV blocks."""
    for r, res in enumerate(_results(world)):
        for case in CASES:
            rr = res[case.name]
            B, S, D = case.B, case.s_local, case.D
            item = torch.empty((), dtype=case.torch_dtype).element_size()
            block = 2 * B * case.nkv * S * D * item
            assert rr["block_bytes"] == block
            assert rr["fwd_bytes"] == (world - 1) * block, (case.name, r, rr["fwd_bytes"])
            dkv = block // item * 4
            assert rr["bwd_bytes"] == (world - 1) * block + (world * dkv if world > 1 else 0), case.name


@pytest.mark.parametrize("world", WORLDS)
def test_no_live_caches_in_ranks(world):
    for r, res in enumerate(_results(world)):
        assert res["live_entries"] == 0, r
        for case in CASES:
            rr = res[case.name]
            assert rr["live_after_forward"] == 1, (case.name, r)  # the graph holds the handle
            assert rr["live_after_backward"] == 0, (case.name, r)


# ---------------------------------------------------------------- tests: rejections


def _errors(world: int, rank: int = 0) -> dict:
    return _results(world)[rank]["errors"]


REJECTED = [
    ("pse", "NotImplementedError", r"pse=<tensor of shape \(1, 2, \d+, \d+\)"),
    ("padding_mask", "NotImplementedError", r"padding_mask=<tensor"),
    ("prefix", "NotImplementedError", r"prefix=\[1\]"),
    ("actual_seq_qlen", "NotImplementedError", r"actual_seq_qlen=<tensor of shape \(1,\)"),
    ("actual_seq_kvlen", "NotImplementedError", r"actual_seq_kvlen=<tensor"),
    ("sink", "ValueError", r"shape \[head_num\] = \[2\].*sink=<tensor of shape \(3,\)"),
    ("softmax_layout", "NotImplementedError", r"softmax_layout='TND'"),
    *[(f"sparse_mode={m}", "NotImplementedError", f"sparse_mode={m}") for m in range(5, 9)],
    ("mask_mode4_small", "NotImplementedError", r"sparse_mode=4 needs the compressed 2048x2048"),
    ("mask_mode0_rows", "ValueError", r"square over the global sequence"),
    ("mask_mode1_3d", "ValueError", r"atten_mask for sparse_mode 0/1 must be \[S, S\]"),
    ("mask_float", "ValueError", r"atten_mask must be bool or uint8"),
    ("mask_mode2_small", "NotImplementedError", r"sparse_mode=2 needs the compressed 2048x2048.*shape \(\d+, \d+\)"),
    ("mask_mode3_batched", "NotImplementedError", r"sparse_mode=3 needs.*shape \(2, 1, 2048, 2048\)"),
    ("TND", "ValueError", r"input_layout='TND' needs actual_seq_qlen"),
    # not context parallel (no Shard(seq) mesh dim): served as without cp_cache, by DTensor's own
    # sharding propagation, which has no strategy for the emulated op (test_non_cp_calls.py)
    ("replicate", "NotImplementedError", r"npu_fusion_attention_v3.default does not have a sharding strategy"),
    ("wrong_shard_dim", "NotImplementedError", r"npu_fusion_attention_v3.default does not have a sharding strategy"),
    ("local_key", "TypeError", r"key as a DTensor.*got Tensor"),
    ("mesh_2d", "NotImplementedError", r"Replicate\(\) or Shard\(1\) \(heads\).*placements=\(Shard\(dim=2\), Shard\(dim=3\)\)"),
    ("seed_forged", "RuntimeError", r"expected a step-cache handle.*no handle created"),
    ("seed_clone", "RuntimeError", r"expected a step-cache handle.*clone"),
    ("seed_none", "RuntimeError", r"seed=None"),
    # a DTensor seed is not cp_cache's forward's: the backward of a forward served elsewhere, by
    # DTensor itself, which refuses the plain tensors among the arguments
    ("seed_dtensor", "RuntimeError", r"npu_fusion_attention_grad_v3.default: got mixed torch.Tensor and DTensor"),
    ("seed_expired", "RuntimeError", r"has expired"),
    ("bwd_scale_mismatch", "RuntimeError", r"backward called with .*'scale': 0.25.*ran with .*'scale': 0.5"),
    ("bwd_pse", "NotImplementedError", r"pse=<tensor"),
    ("bwd_causal_mismatch", "RuntimeError", r"backward called with .*MaskSpec\(causal=False.*ran with .*MaskSpec\(causal=True"),
    ("stack_forged", "RuntimeError", r"mis-pairing: backward expected key 12345"),
    ("stack_second", "RuntimeError", r"pop from an empty step-cache stack"),
]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("label, kind, pattern", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected(world, label, kind, pattern):
    import re

    for r in range(world):
        got_kind, message = _errors(world, r)[label]
        assert got_kind == kind, (label, got_kind, message)
        assert re.search(pattern, message, re.S), (label, message)


@pytest.mark.parametrize("world", WORLDS)
def test_load_balance_needs_length_divisible_by_2w(world):
    kind, message = _errors(world)["lb_odd"]
    if world == 1:
        # S = 3: one chunk per rank is 3, odd
        assert kind == "ValueError" and "length 3 is not divisible by 2" in message, message
    else:
        assert kind == "ValueError", message
        assert f"2*W = {2 * world}" in message and f"length {3 * world} is not divisible by {2 * world}" in message
    assert _errors(world)["nolb_odd"] == ("no error", "")


@pytest.mark.parametrize("world", (2, 4))
def test_backward_on_another_mesh_size(world):
    for r in range(world):
        kind, message = _errors(world, r)[label := "bwd_other_mesh"]
        assert kind == "RuntimeError", (label, message)
        assert f"rank 0 of 1 but its forward ran on rank {r} of {world}" in message, message


@pytest.mark.parametrize("world", WORLDS)
def test_valid_backward_and_stack_after_rejections(world):
    for r in range(world):
        e = _errors(world, r)
        assert e["bwd_ok"] == ("no error", "")
        assert e["stack_ok"] == ("no error", "")
        # a direct grad call (no graph task) resolves without releasing: the handle held by
        # hand keeps the cache alive until it is dropped
        assert e["live_after_drop"] == ("live", "1")
        assert e["live_after_handle_drop"] == ("live", "0")
        assert e["live_end"] == ("live", "0")
