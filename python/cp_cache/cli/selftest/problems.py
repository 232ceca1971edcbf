"""One case's problem: inputs, mask, the op's arguments, its layout over the ranks (the public
sharding helpers) and the least K/V traffic it needs."""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass

from .cases import B, D, S_LOCAL, Case, hybrid_sizes
from .environment import Env


@dataclass
class Problem:
    """A case's full-sequence inputs (float32 values, [B, N, S, D] on the CPU), its mask over
    the whole sequence ([S, S], True = masked out) and its documents (TND)."""

    case: Case
    world: int
    q: object
    k: object
    v: object
    dout: object
    masked: object
    given: object = None  # the mask passed to the op (given masks)
    sink: object = None  # the attention sinks [Nq] (float32, CPU), or None
    cu: tuple = ()  # TND: cumulative document ends
    nq: int = 0
    nkv: int = 0

    @property
    def seq(self) -> int:
        return self.q.size(2)

    @property
    def window(self) -> int:
        """pre_tockens of the band cases: a causal window smaller than a shard (contiguous), or
        larger (load balanced)."""
        return S_LOCAL // 2 if not self.case.lb else S_LOCAL + S_LOCAL // 2


def _documents(world: int, lb: bool) -> tuple:
    """Document ends over S_LOCAL * W tokens: lengths multiples of 2W (load balanced: per-document
    head-tail takes them too), or documents across shard boundaries (contiguous)."""
    lengths = (2, 6, 4, 4) if lb else (3, 6, 2, 5)  # in sixteenths of the sequence
    return tuple(itertools.accumulate(n * world * S_LOCAL // 16 for n in lengths))


def make_problem(case: Case, world: int) -> Problem:
    """The same full-sequence problem on every rank (seeded by the case and the world size)."""
    import torch

    from ...testing.reference import band_masked
    from ...testing.varlen_reference import document_masked

    nq = 2 * max(world, 2)  # Ulysses splits the heads: Nq and the GQA Nkv = Nq/2 divide by any CP size
    nkv = nq // 2 if case.gqa else nq
    tnd = case.layout == "TND"
    batch, seq = (1 if tnd else B), S_LOCAL * world
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))
    dv = D // 2 if case.mla else D
    q, dout = (torch.randn(batch, nq, seq, d, generator=g, dtype=torch.float64) for d in (D, dv))
    k = torch.randn(batch, nkv, seq, D, generator=g, dtype=torch.float64)
    v = torch.randn(batch, nkv, seq, dv, generator=g, dtype=torch.float64)
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    sink = torch.randn(nq, generator=g) if case.sink else None
    prob = Problem(case, world, q, k, v, dout, masked=None, nq=nq, nkv=nkv, sink=sink)
    if tnd:
        prob.cu = _documents(world, case.lb)
        prob.masked = document_masked(prob.cu, prob.cu, "left_up" if case.mask == "causal" else "full")
        return prob
    masked = {"causal": torch.ones(seq, seq, dtype=torch.bool).triu(1),
              "full": torch.zeros(seq, seq, dtype=torch.bool)}.get(case.mask)
    if case.mask.startswith("given"):  # random, the diagonal kept (no row wholly masked)
        prob.given = (torch.rand(seq, seq, generator=g) < 0.4) & ~torch.eye(seq, dtype=torch.bool)
        masked = prob.given
    if case.mask.endswith("band"):
        nxt = 2 if case.mask == "given_band" else 0
        band = band_masked(seq, prob.window, nxt)
        masked = band if masked is None else masked | band
    prob.masked = masked
    return prob


def op_kwargs(prob: Problem, device) -> dict:
    """The op's keyword arguments for the case (the same for the CP call and the one-device call)."""
    import torch

    from ...npu_ops import band_arguments, causal_arguments

    case = prob.case
    kw = dict(scale=1.0 / math.sqrt(D), keep_prob=case.keep_prob)
    if case.layout == "TND":
        kw.update(actual_seq_qlen=torch.tensor(prob.cu), actual_seq_kvlen=torch.tensor(prob.cu))
        if case.mask == "causal":
            kw.update(causal_arguments(device, right_down=True))
    elif case.mask == "causal":
        kw.update(causal_arguments(device))
    elif case.mask == "band":
        kw.update(band_arguments(device, prob.window))
    elif case.mask == "given":
        kw.update(atten_mask=prob.given.to(device), sparse_mode=1)
    elif case.mask == "given_band":
        kw.update(atten_mask=prob.given.to(device), sparse_mode=0, pre_tockens=prob.window, next_tockens=2)
    return kw


# ---------------------------------------------------------------- sharding and gathering (the public helpers)


def to_layout(x, layout: str):
    """A [B, N, S, D] tensor in ``layout`` (TND: [T, N, D] from batch 1)."""
    from ... import layout as L

    return x[0].permute(1, 0, 2).contiguous() if layout == "TND" else L.from_bnsd(x, layout).contiguous()


def from_layout(x, layout: str, heads: int):
    """Back to [B, N, S, D], float64 on the CPU."""
    from ... import layout as L

    x = x.detach().cpu().double()
    return x.permute(1, 0, 2).unsqueeze(0) if layout == "TND" else L.to_bnsd(x, layout, heads)


def shard(prob: Problem, env: Env, x):
    """This rank's DTensor of a full [B, N, S, D] CPU tensor, laid out as the handlers expect."""
    import cp_cache
    from torch.distributed.tensor import DTensor, Shard

    from ... import layout as L

    case, mesh = prob.case, env.mesh(prob.case)
    full = to_layout(x, case.layout).to(env.device)
    if case.layout == "TND":  # the placement's local lengths may differ between ranks: the global shape is given
        return DTensor.from_local(cp_cache.shard_documents(full, prob.cu, mesh), mesh, [Shard(0)] * mesh.ndim,
                                  shape=full.shape, stride=full.stride())
    return cp_cache.shard_sequence(full, mesh, L.seq_dim(case.layout))


def unshard(prob: Problem, env: Env, x, heads: int):
    """The full [B, N, S, D] float64 CPU tensor of a DTensor laid out by ``shard`` (a collective)."""
    import cp_cache

    from ... import layout as L

    case = prob.case
    if case.layout == "TND":
        return from_layout(cp_cache.unshard_documents(x, prob.cu, env.mesh(case)), "TND", heads)
    return from_layout(cp_cache.unshard_sequence(x, L.seq_dim(case.layout)), case.layout, heads)


def unshard_lse(prob: Problem, env: Env, softmax_max, softmax_sum):
    """The full LSE [B, N, S] (float64, CPU) from the op's sharded statistics."""
    import cp_cache

    from ...npu_ops import lse_from_stats

    if prob.case.layout == "TND":  # statistics [T, N, 8], sharded on the tokens
        local = lse_from_stats(softmax_max.to_local(), softmax_sum.to_local()).contiguous()
        full = cp_cache.unshard_documents(local, prob.cu, env.mesh(prob.case))
        return full.detach().cpu().double().T.unsqueeze(0)
    full = [cp_cache.unshard_sequence(s, 2) for s in (softmax_max, softmax_sum)]
    return lse_from_stats(*full).detach().cpu().double()


def kv_lower_bound(prob: Problem) -> int:
    """The least forward K/V traffic of the case's layout, summed over the ranks: rank r must
    receive the rows {j not held by r : some query i held by r may attend to j}, K and V, at
    the K/V heads, float32."""
    import cp_cache

    from ...testing.reference import rank_positions

    case, world = prob.case, prob.world
    allowed = ~prob.masked
    rows = 0
    for r in range(world):
        if case.layout == "TND":  # hybrid: the documents' two-dimensional layout
            sizes = hybrid_sizes(world) if case.algorithm == "hybrid" else world
            held = cp_cache.document_layout(prob.cu, sizes, load_balance=case.lb)[r]
        else:
            held = rank_positions(world, r, prob.seq // world, case.lb)
        need = allowed.index_select(0, held).any(0)
        need[held] = False
        rows += int(need.sum())
    batch, _, _, dim = prob.k.shape
    return rows * batch * prob.nkv * (dim + prob.v.size(-1)) * 4
