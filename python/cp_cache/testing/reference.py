"""Dense references for context-parallel attention, shared by the tests, the benchmarks and
the CLI: the case description, full-sequence inputs, head-tail sharding, the dense float64
reference, and reassembling per-rank results (and dropout masks) on the full sequence.

Tensors "on the full sequence" are [B, N, S, D] (attention probabilities and keep masks
[B, N, S, S]) with S = s_local * world. Rank ``r`` holds the positions
``rank_positions(world, r, s_local, load_balance)``.

Rank processes started by ``run_ranks`` (spawn) unpickle the cases and so import this
module too.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from .. import layout as L
from ..documents import sequence_order, sequence_positions
from ..npu_ops import INT_MAX
from ..plan import CallPlan, MaskSpec


@dataclass(frozen=True)
class AttentionCase:
    """One attention problem: layout, mask mode, MHA or GQA, dtype.

    Subclasses add the remaining fields and must provide ``name`` (unique; also seeds the
    inputs), ``nq`` / ``nkv`` (query and key/value heads), ``B``, ``D``, ``s_local`` (local
    sequence length per rank) and ``keep_prob``.
    """

    layout: str  # BNSD | BSND | BSH | SBH
    mode: str  # causal_lb | causal | full
    gqa: bool
    dtype: str  # float32 | bfloat16

    @property
    def causal(self) -> bool:
        return self.mode != "full"

    @property
    def load_balance(self) -> bool:
        return self.mode == "causal_lb"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# ---------------------------------------------------------------- inputs and sharding


def ring_plan(*, causal: bool = False, window: bool = False, pre_tockens: int = INT_MAX,
              next_tockens: int = INT_MAX, given_mask: bool = False, **fields) -> CallPlan:
    """A CallPlan for driving a strategy directly, from the mask's flat fields."""
    mask = MaskSpec(causal=causal, window=window, pre_tockens=pre_tockens, next_tockens=next_tockens,
                    given=given_mask)
    return CallPlan(mask=mask, **fields)


def full_inputs(case: AttentionCase, world: int) -> list[torch.Tensor]:
    """Full-sequence q, k, v, dout as float64 [B, N, S, D], values rounded to the case dtype.

    Seeded by the case name and the world size, so every rank and the reference draw the same.
    """
    S = case.s_local * world
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))
    q, dout = (torch.randn(case.B, case.nq, S, case.D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(case.B, case.nkv, S, case.D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.to(case.torch_dtype).double() for t in (q, k, v, dout)]


def rank_positions(world: int, rank: int, s_local: int, load_balance: bool) -> torch.Tensor:
    """Global sequence positions held by ``rank``, in local order.

    With load balancing: the head-tail chunks ``rank`` and ``2W-1-rank`` of length s_local/2;
    without: the contiguous block ``rank``.
    """
    return sequence_positions(rank, world, s_local, load_balance)


def head_tail_positions(seq: int, world: int) -> torch.Tensor:
    """Global positions in the order head-tail sharding lays them out over ``world`` ranks
    (rank 0's positions, then rank 1's, ...): the permutation ``context_parallel`` applies."""
    return sequence_order(world, seq // world, True)


def case_positions(case: AttentionCase, world: int, rank: int) -> torch.Tensor:
    """``rank_positions`` for the case's local length and load balancing."""
    return rank_positions(world, rank, case.s_local, case.load_balance)


def shard(x_bnsd: torch.Tensor, case: AttentionCase, pos: torch.Tensor) -> torch.Tensor:
    """The positions ``pos`` of a full-sequence [B, N, S, D] tensor, in the case layout and dtype."""
    return L.from_bnsd(x_bnsd.index_select(2, pos), case.layout).to(case.torch_dtype)


# ---------------------------------------------------------------- dense reference


def dense_attention(q, k, v, dout, causal: bool, keep=None, keep_prob: float = 1.0,
                    dtype=torch.float64, masked=None, sink=None) -> dict:
    """Single-process attention on the full sequence, forward and backward, in ``dtype``.

    q/dout [B, Nq, S, D], k/v [B, Nkv, S, D] (GQA: Nq a multiple of Nkv); scale 1/sqrt(D);
    ``causal``: the global lower-triangular mask; ``keep`` (optional [B, Nq, S, S] bool):
    dropout applied to the probabilities, scaled by 1/keep_prob; ``masked`` (optional bool,
    broadcastable to [B, Nq, S, S], True = masked out): an attention mask on top; rows with
    every key masked give 0. ``sink`` (optional [Nq]): attention sinks, one more column of
    logit sink[h] (not scaled) in every row's softmax, dropped before the product with V.
    Returns "out", "lse" (float64, [B, Nq, S], before dropout, the sink's column included),
    "dq", "dk", "dv" (and "dsink" [Nq] with a sink).
    """
    groups = q.size(1) // k.size(1)
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    s = qq @ kk.repeat_interleave(groups, 1).transpose(-1, -2) * (1.0 / math.sqrt(q.size(-1)))
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if masked is not None:
        s = s.masked_fill(masked.bool(), float("-inf"))
    inputs = [qq, kk, vv]
    if sink is not None:
        ss = sink.detach().to(dtype).requires_grad_(True)
        inputs.append(ss)
        s = torch.cat([s, ss.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    if sink is not None:
        p = p[..., :-1]
    if keep is not None:
        p = p * keep.to(dtype) / keep_prob
    out = p @ vv.repeat_interleave(groups, 1)
    grads = torch.autograd.grad(out, inputs, dout.to(dtype))
    res = {"out": out.detach(), "lse": torch.logsumexp(s.detach().double(), -1), "dq": grads[0], "dk": grads[1],
           "dv": grads[2]}
    if sink is not None:
        res["dsink"] = grads[3]
    return res


def case_dense(q, k, v, dout, case: AttentionCase, keep=None, dtype=torch.float64) -> dict:
    """``dense_attention`` with the case's causal mask and keep_prob."""
    return dense_attention(q, k, v, dout, case.causal, keep, case.keep_prob, dtype)


def band_masked(seq: int, pre_tockens: int, next_tockens: int) -> torch.Tensor:
    """The [S, S] mask (True = masked out) of band attention: query i sees key j iff
    i - pre_tockens <= j <= i + next_tockens."""
    i = torch.arange(seq).view(-1, 1)
    j = torch.arange(seq).view(1, -1)
    return (j - i > next_tockens) | (i - j > pre_tockens)


def exchanged_rows(masked: torch.Tensor, held: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(K/V rows each rank must send, rows each must receive) at the mask's lower bound: rank r
    receives the keys it does not hold that some query it holds may attend to. ``masked``: the
    [S, S] mask (True = masked out); ``held``: each rank's global positions."""
    allowed = ~masked.bool()
    owner = torch.empty(masked.size(-1), dtype=torch.int64)
    for rank, pos in enumerate(held):
        owner[pos] = rank
    sent, received = [0] * len(held), [0] * len(held)
    for rank, pos in enumerate(held):
        needed = allowed.index_select(0, pos).any(0)
        needed[pos] = False
        received[rank] = int(needed.sum())
        for source, count in enumerate(torch.bincount(owner[needed], minlength=len(held)).tolist()):
            sent[source] += count
    return sent, received


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (b: the reference)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# ---------------------------------------------------------------- error bounds measured on this machine
#
# A test never compares an error with a number tuned on one CPU. It measures, in the same run and
# on the same inputs, how far a plain reference computation in the same dtype (dense attention in
# torch, the single-process model) lands from the float64 truth, and accepts from the code under
# test ``FACTOR`` times that error plus a floor of a few eps of the dtype (times the scale the error
# is measured against), so that a reference that happens to round exactly cannot make the bound 0.
# Rounding differs from machine to machine (vector width, FMA, the BLAS), and it does so for the
# reference and for the code under test alike.
#
# FACTOR: the ring's kernels recompute the probabilities from the LSE and subtract
# rowsum(dout * out) in the backward (the flash-attention formulation), so in float32 they err up
# to ~10x as much as dense torch on the same inputs (measured: 9.5x on one gradient); 20 leaves
# room. A wrong result (a ring step dropped, a mask off by one) errs by 1e-2 or more.
# EPS_FLOOR: 32 eps of float32 is 3.8e-6 relative.

FACTOR = 20.0
EPS_FLOOR = 32.0


def eps(dtype: torch.dtype = torch.float32) -> float:
    """The machine epsilon of a floating dtype."""
    return float(torch.finfo(dtype).eps)


def error_bound(reference_error: float, *, scale: float = 1.0, dtype: torch.dtype = torch.float32,
                factor: float = FACTOR, floor: float = EPS_FLOOR) -> float:
    """The largest error accepted from the code under test: ``factor`` x ``reference_error``
    (the error of a reference computation of the same quantity in the same dtype, measured in
    this run against the same float64 truth), plus ``floor`` x eps(dtype) x ``scale`` (the
    magnitude the errors are measured against: 1 for ``rel_err``, max|truth| for absolute ones)."""
    return factor * float(reference_error) + floor * eps(dtype) * float(scale)


def dense_errors(q, k, v, dout, ref: dict, causal: bool, keep=None, keep_prob: float = 1.0,
                 dtype=torch.float32, masked=None, keys=("out", "lse", "dq", "dk", "dv"), sink=None) -> dict:
    """``rel_err`` of ``dense_attention`` computed in ``dtype`` against ``ref`` (its float64
    result on the same inputs), per key: how much plain torch errs in that dtype."""
    low = dense_attention(q, k, v, dout, causal, keep, keep_prob, dtype=dtype, masked=masked, sink=sink)
    return {key: rel_err(low[key].double(), ref[key]) for key in keys}


def dense_bounds(q, k, v, dout, ref: dict, causal: bool, keep=None, keep_prob: float = 1.0,
                 dtype=torch.float32, masked=None, keys=("out", "lse", "dq", "dk", "dv"),
                 factor: float = FACTOR, floor: float = EPS_FLOOR, sink=None) -> dict:
    """``error_bound`` of each key's ``dense_errors``: the bound on a ``rel_err`` against ``ref``."""
    errors = dense_errors(q, k, v, dout, ref, causal, keep, keep_prob, dtype, masked, keys, sink)
    return {key: error_bound(err, dtype=dtype, factor=factor, floor=floor) for key, err in errors.items()}


def case_bounds(q, k, v, dout, case: AttentionCase, ref: dict, keep=None, **kw) -> dict:
    """``dense_bounds`` with the case's causal mask, keep_prob and dtype."""
    return dense_bounds(q, k, v, dout, ref, case.causal, keep, case.keep_prob, dtype=case.torch_dtype, **kw)


def float32_model_error(model, tokens, labels, positions) -> dict:
    """The float32 rounding of a model on this machine: the loss (float32 cross-entropy, as
    ``models.loss_fn``) and the parameter gradients of one batch with the model as given
    (float32, evaluation mode: no dropout) against a float64 copy (float64 loss).

    Returns "loss" (|float32 - float64|), "loss_scale" (|float64 loss|), "grad" (max over the
    parameters of max|float32 grad - float64 grad|), "grad_scale" (max |float64 grad|) and
    "grad_rel" (max over the parameters of ``rel_err``).
    """
    import copy

    import torch.nn.functional as F

    runs = []
    for dtype in (torch.float32, torch.float64):
        m = copy.deepcopy(model).to(dtype).eval()
        logits = m(tokens, positions).flatten(0, 1)
        loss = F.cross_entropy(logits.float() if dtype == torch.float32 else logits, labels.flatten())
        loss.backward()
        runs.append((float(loss.detach()), [p.grad.detach().double() for p in m.parameters()]))
    (loss32, grads32), (loss64, grads64) = runs
    return dict(loss=abs(loss32 - loss64), loss_scale=abs(loss64),
                grad=max(float((a - b).abs().max()) for a, b in zip(grads32, grads64)),
                grad_scale=max(float(b.abs().max()) for b in grads64),
                grad_rel=max(rel_err(a, b) for a, b in zip(grads32, grads64)))


# ---------------------------------------------------------------- per-rank results on the full sequence


def gather(per_rank: list[dict], case: AttentionCase, world: int) -> dict:
    """Reassemble per-rank local results into full-sequence float64 tensors.

    ``per_rank[r]`` holds rank r's "out", "dq", "dk", "dv" in the case layout and its "lse"
    [B, Nq, s_local]; returns them as [B, N, S, D] / [B, Nq, S].
    """
    S = case.s_local * world
    full = {}
    for key, heads in (("out", case.nq), ("dq", case.nq), ("dk", case.nkv), ("dv", case.nkv)):
        t = torch.zeros(case.B, heads, S, case.D, dtype=torch.float64)
        for r, res in enumerate(per_rank):
            t[:, :, case_positions(case, world, r)] = L.to_bnsd(res[key], case.layout, heads).double()
        full[key] = t
    lse = torch.zeros(case.B, case.nq, S, dtype=torch.float64)
    for r, res in enumerate(per_rank):
        lse[:, :, case_positions(case, world, r)] = res["lse"].double()
    full["lse"] = lse
    return full


def keep_mask(steps_per_rank: list[list[tuple]], case: AttentionCase, world: int) -> torch.Tensor:
    """The full [B, Nq, S, S] dropout keep mask rebuilt from every rank's ring steps.

    ``steps_per_rank[r]`` lists rank r's steps as (source rank, part, seed, offset); the step
    covered rank r's queries against the source's keys, restricted by ``part`` ("skip": none,
    "q_tail": the query tail half, "kv_head": the key head half, otherwise all), with the mask
    ``cp_cache.testing.dropout_keep_mask(seed, offset, ...)``. Pairs no step covers stay True.
    """
    from ..emulator import dropout_keep_mask

    S = case.s_local * world
    keep = torch.ones(case.B, case.nq, S, S, dtype=torch.bool)
    for r, steps in enumerate(steps_per_rank):
        qpos = case_positions(case, world, r)
        for source, part, seed, offset in steps:
            if part == "skip":
                continue
            kpos = case_positions(case, world, source)
            if part == "q_tail":
                qpos_i, kpos_i = qpos[len(qpos) // 2:], kpos
            elif part == "kv_head":
                qpos_i, kpos_i = qpos, kpos[: len(kpos) // 2]
            else:
                qpos_i, kpos_i = qpos, kpos
            m = dropout_keep_mask(seed, offset, (case.B, case.nq, len(qpos_i), len(kpos_i)), case.keep_prob)
            keep[:, :, qpos_i.view(-1, 1), kpos_i.view(1, -1)] = m
    return keep


# ---------------------------------------------------------------- gradients under dropout, model-free


def directional_derivative_errors(loss_fn, params: list[torch.Tensor], *, directions: int = 4,
                                  eps: float = 1e-2, seed: int = 0, reduce=None) -> list[float]:
    """How far autograd's gradient is from the function's slope, along random directions.

    ``loss_fn()`` must compute a scalar from ``params`` (leaf tensors that require grad)
    deterministically: with dropout, reset the RNG inside it so every call draws the same
    masks. For each of ``directions`` random unit directions d (the same on every rank,
    from ``seed``), compares g.d (g from one backward) with the central difference
    (f(p + eps d) - f(p - eps d)) / (2 eps) (evaluated under no_grad) and returns |g.d - fd| / max(|g.d|, |fd|, 1e-12).
    ``reduce``: sums a float over ranks when the loss is a per-rank part (default: none).
    No model, no reference implementation: only the function and its gradient.
    """
    total = reduce or (lambda x: x)
    errors = []
    for d, slope in _directions(loss_fn, params, directions, seed, total):
        plus, minus = _loss_along(loss_fn, params, d, eps, total)
        fd = (plus - minus) / (2 * eps)
        errors.append(abs(slope - fd) / max(abs(slope), abs(fd), 1e-12))
    return errors


def _directions(loss_fn, params: list[torch.Tensor], directions: int, seed: int, total):
    """(d, g.d) for ``directions`` random unit directions d (float64 draws from ``seed``, the same
    on every rank), g the gradient of one backward of ``loss_fn()``."""
    grads = torch.autograd.grad(loss_fn(), params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    g = torch.Generator().manual_seed(seed)
    for _ in range(directions):
        d = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
        norm = math.sqrt(sum(float((x * x).sum()) for x in d))
        d = [(x / norm).to(p.dtype) for x, p in zip(d, params)]
        yield d, total(sum(float((gi.double() * di.double()).sum()) for gi, di in zip(grads, d)))


def _loss_along(loss_fn, params: list[torch.Tensor], d: list[torch.Tensor], step: float, total) -> tuple:
    """(f(p + step d), f(p - step d)) under no_grad, the parameters put back exactly after each."""
    saved = [p.detach().clone() for p in params]
    values = []
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for p, di in zip(params, d):
                p.add_(di, alpha=sign * step)
            values.append(total(float(loss_fn())))
            for p, x in zip(params, saved):
                p.copy_(x)
    return values[0], values[1]


def directional_derivative_check(loss_fn, params: list[torch.Tensor], *, directions: int = 4, eps: float = 1e-2,
                                 seed: int = 0, reduce=None, factor: float = 4.0,
                                 floor: float = EPS_FLOOR) -> list[tuple[float, float]]:
    """``directional_derivative_errors`` (same arguments, same directions, same error) with each
    direction's bound measured in the same run: ``[(error, bound), ...]``.

    The central difference at step eps misses the slope by its truncation (eps^2/6 times the third
    derivative along d) plus the loss's rounding divided by eps. A second difference at eps/2
    measures both: fd(eps) - fd(eps/2) is 3/4 of that truncation, plus the rounding of the two.
    The bound is ``factor`` x |fd(eps) - fd(eps/2)| + ``floor`` x eps(dtype) x max|f(p +- eps d)| / eps
    (the rounding of the loss values themselves), relative like the error to max(|g.d|, |fd|); a
    wrong gradient misses the slope by its own error, whatever the steps.
    """
    total = reduce or (lambda x: x)
    unit = eps_of(params)
    checks = []
    for d, slope in _directions(loss_fn, params, directions, seed, total):
        plus, minus = _loss_along(loss_fn, params, d, eps, total)
        plus_half, minus_half = _loss_along(loss_fn, params, d, eps / 2, total)
        fd = (plus - minus) / (2 * eps)
        fd_half = (plus_half - minus_half) / eps
        size = max(abs(slope), abs(fd), 1e-12)
        rounding = floor * unit * max(abs(plus), abs(minus)) / eps
        checks.append((abs(slope - fd) / size, (factor * abs(fd - fd_half) + rounding) / size))
    return checks


def eps_of(params: list[torch.Tensor]) -> float:
    """The largest machine epsilon among the parameters' dtypes."""
    return max(eps(p.dtype) for p in params)

