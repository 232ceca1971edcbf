"""One recurrent mixer layer under CP against one process, forward and backward: Gated DeltaNet's delta rule in its
two forms (the chunks' state summaries chained, and the head all-to-all) and the short causal convolution, over
seeded random layouts at W = 2, 3 and 4: contiguous and head-tail shards of one sequence, packed documents under
the balanced and the per-document head-tail placements, with a document shorter than a rank's chunk, one spanning
three or more ranks and chunks that start inside a document. The truth is a float64 one-process computation per
document; every bound is a multiple of the float32 one-process error against it (same inputs, same run)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import cp_cache
from cp_cache.mixers import sequence
from cp_cache.mixers.delta_rule import chunk_gated_delta_rule
from cp_cache.mixers.gated_delta import delta_rule_under_cp
from cp_cache.mixers.short_conv import causal_conv_documents, causal_conv_under_cp
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import error_bound, rel_err

WORLDS = (2, 3, 4)
K_HEADS, V_HEADS, K_DIM, V_DIM, CHANNELS, KERNEL = 2, 4, 8, 12, 6, 4


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
    g = torch.Generator().manual_seed(seed)
    return {"query": torch.randn(1, total, K_HEADS, K_DIM, generator=g),
            "key": torch.randn(1, total, K_HEADS, K_DIM, generator=g),
            "value": torch.randn(1, total, V_HEADS, V_DIM, generator=g),
            "g": -torch.rand(1, total, V_HEADS, generator=g) * 0.5,
            "beta": torch.rand(1, total, V_HEADS, generator=g),
            "conv": torch.randn(1, CHANNELS, total, generator=g),
            "dout": torch.randn(1, total, V_HEADS, V_DIM, generator=g),
            "dconv": torch.randn(1, CHANNELS, total, generator=g)}


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CHANNELS, KERNEL, generator=g), torch.randn(CHANNELS, generator=g)


DELTA = ("query", "key", "value", "g", "beta")


def _one_process(x: dict, documents, dtype) -> dict:
    """Each document on its own: the delta rule and the conv, their outputs and input gradients."""
    lengths = list(documents or [x["query"].size(1)])
    leaves = {n: x[n].to(dtype).requires_grad_() for n in (*DELTA, "conv")}
    weight, bias = (t.to(dtype) for t in _weights(0))
    outs, convs, at = [], [], 0
    for n in lengths:
        part = {k: v[:, at:at + n] for k, v in leaves.items() if k in DELTA}
        outs.append(chunk_gated_delta_rule(**part, use_qk_l2norm=True)[0])
        convs.append(causal_conv_documents(leaves["conv"][..., at:at + n], weight, bias, (n,), "silu"))
        at += n
    out, conv = torch.cat(outs, dim=1), torch.cat(convs, dim=-1)
    ((out * x["dout"].to(dtype)).sum() + (conv * x["dconv"].to(dtype)).sum()).backward()
    return {"out": out.detach(), "conv": conv.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _under_cp(mesh, layout: Layout, x: dict, algorithm: str) -> dict:
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    before, _cp_options.enable_load_balance = _cp_options.enable_load_balance, layout.load_balance
    cp_cache.enable(documents=layout.placement, algorithm=algorithm)
    try:
        names = (*DELTA, "conv", "dout", "dconv")
        local = {n: x[n].clone() for n in names}
        ends = None if layout.documents is None else [sum(layout.documents[:i + 1])
                                                      for i in range(len(layout.documents))]
        region = {} if layout.documents is None or not layout.load_balance else {"documents": ends}
        seq_dims = [1, 1, 1, 1, 1, 2, 1, 2]
        with cp_cache.context_parallel(mesh, buffers=[local[n] for n in names], buffer_seq_dims=seq_dims,
                                       **region):
            seq = sequence.current(local["query"].size(1), ends)
            leaves = {n: local[n].clone().requires_grad_() for n in (*DELTA, "conv")}
            out = delta_rule_under_cp(*(leaves[n] for n in DELTA), seq, algorithm=algorithm, use_qk_l2norm=True)
            conv = causal_conv_under_cp(leaves["conv"], *_weights(0), seq, "silu")
            ((out * local["dout"]).sum() + (conv * local["dconv"]).sum()).backward()
            held = torch.cat([torch.arange(c.start, c.start + c.length) for c in seq.mine])
        return {"held": held, "out": out.detach(), "conv": conv.detach(),
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
    return res


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
        seq_dim = -1 if name in ("conv", "dconv") else 1
        got = torch.cat([r[name] for r in per_rank], dim=seq_dim)
        got = got.index_select(seq_dim, torch.argsort(held))
        error, bound = rel_err(got.double(), truth[name]), error_bound(rel_err(single[name].double(), truth[name]))
        assert error <= bound, (case, name, error, bound)
