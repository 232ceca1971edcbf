"""One recurrent mixer layer of each kind under CP against one process, forward and backward: Gated DeltaNet's delta
rule, Mamba-2's SSD scan and Mamba-1's selective scan, each in its two forms (the chunks' state summaries chained,
and the head all-to-all), and the short causal convolution, over seeded random layouts at W = 2, 3 and 4:
contiguous and head-tail shards of one sequence, packed documents under the balanced and the per-document
head-tail placements, with a document shorter than a rank's chunk, one spanning three or more ranks and chunks
that start inside a document. The truth is a float64 one-process computation per document; every bound is a
multiple of the float32 one-process error against it (same inputs, same run)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import cp_cache
from cp_cache.mixers import sequence
from cp_cache.mixers.delta_rule import chunk_gated_delta_rule
from cp_cache.mixers.gated_delta import delta_rule_under_cp
from cp_cache.mixers.mamba1 import selective_scan_under_cp
from cp_cache.mixers.mamba2 import ssd_under_cp
from cp_cache.mixers.selective_scan import selective_scan
from cp_cache.mixers.short_conv import causal_conv_documents, causal_conv_under_cp
from cp_cache.mixers.ssd import ssd_scan
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import error_bound, rel_err

WORLDS = (2, 3, 4)
K_HEADS, V_HEADS, K_DIM, V_DIM, CHANNELS, KERNEL = 2, 4, 8, 12, 6, 4
SSD_HEADS, SSD_GROUPS, SSD_DIM, SSD_STATE = 4, 2, 6, 5  # Mamba-2: heads, B/C groups, head dim, state
SCAN_CHANNELS, SCAN_STATE = 8, 4  # Mamba-1


@dataclass(frozen=True)
class Layout:
    name: str
    documents: tuple[int, ...] | None  # document lengths (None: one sequence)
    load_balance: bool = True
    placement: str = "balanced"


def _layouts(world: int) -> list[Layout]:
    """Seeded: lengths divisible as each layout needs; a long document over >= 3 ranks, short ones, cut ones."""
    rng = random.Random(world)
    seq = 24 * world
    long = 2 * world * rng.randint(6, 9)  # head_tail placement: every document a multiple of 2W
    short = [2 * world * rng.randint(1, 2) for _ in range(3)]
    return [Layout("contiguous", None, load_balance=False), Layout("head_tail", None),
            Layout("documents_balanced", (rng.randint(1, 3), long + 1, *short, rng.randint(5, 9))),
            Layout("documents_head_tail", (long, *short), placement="head_tail"),
            Layout("documents_in_contiguous_shards", (5, seq - 12, 7), load_balance=False)]


def _total(layout: Layout, world: int) -> int:
    return sum(layout.documents) if layout.documents else 24 * world


def _inputs(total: int, seed: int) -> dict[str, torch.Tensor]:
    """Every per-token input and output gradient, whole (the sequence dim: ``SEQ_DIMS``)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)
    return {"query": randn(1, total, K_HEADS, K_DIM), "key": randn(1, total, K_HEADS, K_DIM),
            "value": randn(1, total, V_HEADS, V_DIM), "g": -torch.rand(1, total, V_HEADS, generator=g) * 0.5,
            "beta": torch.rand(1, total, V_HEADS, generator=g), "conv": randn(1, CHANNELS, total),
            "x": randn(1, total, SSD_HEADS, SSD_DIM), "dt": F.softplus(randn(1, total, SSD_HEADS)),
            "B": randn(1, total, SSD_GROUPS, SSD_STATE), "C": randn(1, total, SSD_GROUPS, SSD_STATE),
            "u": randn(1, SCAN_CHANNELS, total), "delta": randn(1, SCAN_CHANNELS, total),
            "B1": randn(1, SCAN_STATE, total), "C1": randn(1, SCAN_STATE, total), "z": randn(1, SCAN_CHANNELS, total),
            "grad_out": randn(1, total, V_HEADS, V_DIM), "grad_conv": randn(1, CHANNELS, total),
            "grad_ssd": randn(1, total, SSD_HEADS, SSD_DIM), "grad_scan": randn(1, SCAN_CHANNELS, total)}


SEQ_DIMS = {"conv": 2, "u": 2, "delta": 2, "B1": 2, "C1": 2, "z": 2, "grad_conv": 2, "grad_scan": 2}  # else 1
LEAVES = ("query", "key", "value", "g", "beta", "conv", "x", "dt", "B", "C", "u", "delta", "B1", "C1", "z")
DELTA = ("query", "key", "value", "g", "beta")


def _parameters(dtype) -> dict[str, torch.Tensor]:
    """What every rank holds whole: the conv's weights, the SSD's A and D, the scan's A, D and delta bias."""
    g = torch.Generator().manual_seed(0)
    made = {"weight": torch.randn(CHANNELS, KERNEL, generator=g), "bias": torch.randn(CHANNELS, generator=g),
            "A": -torch.rand(SSD_HEADS, generator=g) - 0.1, "D": torch.randn(SSD_HEADS, generator=g),
            "A1": -torch.rand(SCAN_CHANNELS, SCAN_STATE, generator=g) * 4,
            "D1": torch.randn(SCAN_CHANNELS, generator=g), "delta_bias": torch.randn(SCAN_CHANNELS, generator=g)}
    return {k: v.to(dtype) for k, v in made.items()}


def _mixers(t: dict, w: dict, delta_rule, conv, ssd, scan) -> torch.Tensor:
    """The four mixers on ``t``'s tensors, and their loss against the output gradients in ``t``."""
    out = delta_rule(*(t[n] for n in DELTA))
    convolved = conv(t["conv"], w["weight"], w["bias"])
    y = ssd(t["x"], t["dt"], w["A"], t["B"], t["C"], w["D"])
    scanned = scan(t["u"], t["delta"], w["A1"], t["B1"], t["C1"], w["D1"], t["z"], w["delta_bias"])
    outputs = {"out": out, "conv": convolved, "ssd": y, "scan": scanned}
    loss = sum((o * t["grad_" + n]).sum() for n, o in outputs.items())
    return outputs, loss


def _one_process(x: dict, documents, dtype) -> dict:
    """Each document on its own: the four mixers' outputs and their inputs' gradients."""
    lengths = list(documents or [x["query"].size(1)])
    leaves = {n: x[n].to(dtype).requires_grad_() for n in LEAVES}
    w = _parameters(dtype)
    parts, at = [], 0
    for n in lengths:
        given = {**{k: v.to(dtype) for k, v in x.items() if k.startswith("grad_")}, **leaves}
        part = {k: v.narrow(SEQ_DIMS.get(k, 1), at, n) for k, v in given.items()}
        parts.append(_mixers(part, w, lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm=True)[0],
                             lambda t, weight, bias: causal_conv_documents(t, weight, bias, (n,), "silu"),
                             lambda *a: ssd_scan(*a[:5], D=a[5])[0],
                             lambda u, d, A, B, C, D, z, bias: selective_scan(u, d, A, B, C, D=D, z=z, delta_bias=bias,
                                                                              delta_softplus=True)[0]))
        at += n
    outputs = {k: torch.cat([p[0][k] for p in parts], dim=-1 if k in ("conv", "scan") else 1) for k in parts[0][0]}
    sum(p[1] for p in parts).backward()
    return {**{k: v.detach() for k, v in outputs.items()}, **{f"d{n}": t.grad for n, t in leaves.items()}}


def _under_cp(mesh, layout: Layout, x: dict, algorithm: str) -> dict:
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    before, _cp_options.enable_load_balance = _cp_options.enable_load_balance, layout.load_balance
    cp_cache.enable(documents=layout.placement, algorithm=algorithm)
    try:
        local = {n: x[n].clone() for n in x}
        ends = None if layout.documents is None else [sum(layout.documents[:i + 1])
                                                      for i in range(len(layout.documents))]
        region = {} if layout.documents is None or not layout.load_balance else {"documents": ends}
        with cp_cache.context_parallel(mesh, buffers=list(local.values()),
                                       buffer_seq_dims=[SEQ_DIMS.get(n, 1) for n in local], **region):
            seq = sequence.current(local["query"].size(1), ends)
            leaves = {n: local[n].clone().requires_grad_() for n in LEAVES}
            outputs, loss = _mixers(
                {**local, **leaves}, _parameters(torch.float32),
                lambda *a: delta_rule_under_cp(*a, seq, algorithm=algorithm, use_qk_l2norm=True),
                lambda t, weight, bias: causal_conv_under_cp(t, weight, bias, seq, "silu"),
                lambda *a: ssd_under_cp(*a, seq, algorithm),
                lambda u, d, A, B, C, D, z, bias: selective_scan_under_cp(
                    u, d, A, B, C, seq, D=D, z=z, delta_bias=bias, delta_softplus=True, algorithm=algorithm))
            loss.backward()
            held = torch.cat([torch.arange(c.start, c.start + c.length) for c in seq.mine])
        return {"held": held, **{k: v.detach() for k, v in outputs.items()},
                **{f"d{n}": t.grad for n, t in leaves.items()}}
    finally:
        cp_cache.disable()
        _cp_options.enable_load_balance = before


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    res = {}
    for i, layout in enumerate(_layouts(world)):
        x = _inputs(_total(layout, world), seed=10 * world + i)
        for algorithm in ("ring", "ulysses") if V_HEADS % world == 0 else ("ring",):
            res[(layout.name, algorithm)] = _under_cp(mesh, layout, x, algorithm)
    res["registered"] = _registered_kernels(mesh, world)
    return res


def _registered_kernels(mesh, world: int) -> dict:
    """Kernels registered for each kind and named by CP_CACHE_MIXER_KERNELS serve the CP forms: each counts its
    calls and runs cp_cache's own."""
    import os
    from cp_cache.mixers import kernels
    calls = {kind: 0 for kind in ("gated_delta", "ssd", "selective")}

    def counting(kind):
        own = kernels.kernel(kind)

        def run(*args, **kwargs):
            calls[kind] += 1
            return own(*args, **kwargs)
        return run

    for kind in calls:
        kernels.register(kind, "counting", counting(kind), replace=True)
    os.environ["CP_CACHE_MIXER_KERNELS"] = "gated_delta=counting,ssd=counting,selective=counting"
    try:
        layout = _layouts(world)[1]
        result = _under_cp(mesh, layout, _inputs(_total(layout, world), seed=10 * world + 1), "ring")
    finally:
        del os.environ["CP_CACHE_MIXER_KERNELS"]
    return {"calls": calls, "result": result}


_RESULTS: dict[int, list] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank, world, timeout=600.0)
    return _RESULTS[world]


LAYOUTS = ("contiguous", "head_tail", "documents_balanced", "documents_head_tail", "documents_in_contiguous_shards")
# the head all-to-all where W divides the value heads
CASES = [(w, i, a) for w in WORLDS for i in range(len(LAYOUTS)) for a in ("ring", "ulysses")
         if a == "ring" or V_HEADS % w == 0]


@pytest.mark.parametrize("world, layout, algorithm", CASES, ids=[f"W{w}-{LAYOUTS[i]}-{a}" for w, i, a in CASES])
def test_layer_under_cp_equals_one_process(world, layout, algorithm):
    case = _layouts(world)[layout]
    x = _inputs(_total(case, world), seed=10 * world + layout)
    truth, single = _one_process(x, case.documents, torch.float64), _one_process(x, case.documents, torch.float32)
    per_rank = [res[(case.name, algorithm)] for res in _results(world)]
    held = torch.cat([r["held"] for r in per_rank])
    assert sorted(held.tolist()) == list(range(held.numel()))
    for name in truth:
        seq_dim = -1 if name in ("conv", "scan") or SEQ_DIMS.get(name[1:]) == 2 else 1
        got = torch.cat([r[name] for r in per_rank], dim=seq_dim)
        got = got.index_select(seq_dim, torch.argsort(held))
        error, bound = rel_err(got.double(), truth[name]), error_bound(rel_err(single[name].double(), truth[name]))
        assert error <= bound, (case, name, error, bound)


@pytest.mark.parametrize("world", WORLDS)
def test_registered_kernels_serve_the_cp_forms(world):
    for rank, res in enumerate(_results(world)):
        got, own = res["registered"], res[("head_tail", "ring")]
        assert all(n > 0 for n in got["calls"].values()), (rank, got["calls"])
        for name in own:
            assert torch.equal(got["result"][name], own[name]), (rank, name)


def test_kernel_registry_refuses_what_it_cannot_serve(monkeypatch):
    from cp_cache.mixers import kernels
    with pytest.raises(ValueError, match="kind='mamba3'"):
        kernels.register("mamba3", "x", lambda *a: a)
    with pytest.raises(ValueError, match="named 'torch' exists"):
        kernels.register("ssd", "torch", lambda *a: a)
    monkeypatch.setenv("CP_CACHE_MIXER_KERNELS", "ssd=missing")
    with pytest.raises(ValueError, match="names the ssd kernel 'missing'; registered: torch"):
        kernels.kernel("ssd")
