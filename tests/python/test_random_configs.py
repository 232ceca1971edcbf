"""A seeded random net over the argument space of the CP attention op.

Each draw is one ``torch.ops.npu.npu_fusion_attention_v3`` call, forward and backward, on
DTensors laid out by the public helpers (``shard_sequence`` / ``shard_documents``) inside
``cp_cache.context_parallel(mesh)``, drawn from: W = 1, 2, 3, 4 and 8; the layouts BNSD,
BSND, BSH, SBH and TND (random document mixes under the "balanced", "head_tail" and
contiguous placements); MHA and GQA (down to one K/V head); MLA head sizes (V's smaller or
larger than Q/K's); every mask kind: none (whatever sparse_mode says), causal sparse_mode 2
and 3 with the compressed mask, a band (sparse_mode 4, random pre/next_tockens: inside a
shard, across shards, beside the diagonal, the whole sequence; TND: inside each document,
or with 7 / 8 inside the last / first document, the others causal), given masks (sparse_mode 1,
or 0 with a band) as [S, S] bool or uint8, [B, 1, S, S], [B, N, S, S] or sharded on the query
dimension, with and without fully masked rows; torch's load balancing on and off; uneven
shards; the algorithms ring / ulysses / hybrid (a 2 x 2 mesh at W = 4, 4 x 2 at W = 8) /
auto (packed documents: on one CP dimension, and on the 2 x 2 mesh in the corners); the
exchanges "direct" and "ring" (direct with and without keep_kv, dK/dV partials in float32
or the input dtype); attention sinks (a plain tensor or a replicated
DTensor); dropout; float32 and bfloat16; the step kernels npu and reference, the fused and
the float32 merge; both step-cache policies; eager or under torch.utils.checkpoint; the
arguments by name or positionally; contiguous inputs or strided views as models pass them
(``views``: BNSD over [B, S, N, D] memory); q/k/v of two dtypes (a refusal drawn from the seed).

A draw either runs and is checked against dense attention in float64 on the full sequence
(output, LSE, dq, dk, dv and dsink, each within ``error_bound`` of the same dense attention
computed by one process in the draw's dtype, measured in this run: 20x + 32 eps in float32,
4x + eps/2 in bfloat16, as the other modules), or it breaks exactly one documented rule
(``REFUSALS``) and must be refused on every rank with the same exception type and a message
naming the offending argument. Dropout draws are compared under the keep masks the call
drew: the forward again from the same RNG state with V replaced by the one-hot of each key
position returns P * keep / keep_prob on every (query, key) pair (the masks of every ring
step, Ulysses head shard or hybrid piece), so the float64 reference applies the very masks
the call used, forward and backward (under checkpointing: the recompute's); the kept fraction
must be keep_prob's and the output must differ from the dropout-free one. Besides the
numbers: the output dtype, placements and global shape, the gradients' placements, the
algorithm the call ran ("auto" by ``plan.choose_algorithm``), the step caches alive between
forward and backward and none after, and the traffic: the ring on one mesh dimension with the
direct exchange sends and receives exactly the K/V rows other ranks' queries may attend to
(counted here from the mask; backward: those again plus their float32 dK/dV partials), full
attention on the ring or Ulysses ``plan.bytes_per_rank``.

One spawned rank group per W serves all of that W's draws: every rank builds every draw's
inputs from the draw's seed, runs it and returns what it saw; the checks run here. Every
failure message prints the draw (its seed and configuration; ``_draw(seed, world)`` rebuilds a
random one). ``CP_CACHE_NET_SEED`` changes the base seed (default 0: the draws CI runs),
``CP_CACHE_NET_SCALE`` multiplies the number of random draws. ``CORNERS`` are draws with some
fields fixed, drawn whatever the seed (the rest of each random from its own seed): one per
refusal and the configurations of the hand-written cases this net replaced.

``KNOWN`` lists what the net found the product does not do yet, each with the draws it
shows in: those draws are expected failures (pytest's xfail, with the reason), and one that
would leave the ranks out of step is not run. A draw whose rank group is lost (a collective
timed out) fails, and a new group runs the draws after it.
"""

from __future__ import annotations

import math
import os
import random
import re
import zlib
from dataclasses import dataclass, fields, replace

import pytest
import torch

from cp_cache import layout as L
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import band_masked, dense_attention, error_bound, rel_err

BASE_SEED = int(os.environ.get("CP_CACHE_NET_SEED", "0"))
SCALE = float(os.environ.get("CP_CACHE_NET_SCALE", "1"))
DRAWS = {1: 8, 2: 28, 3: 28, 4: 28, 8: 4}  # random draws per W, besides the corners
WORLDS = tuple(DRAWS)
INT_MAX = 2147483647
PG_TIMEOUT = 30.0  # a draw that leaves the ranks out of step fails its collectives within this, not the run


def _hybrid_sizes(world: int):
    from cp_cache.cli.selftest import hybrid_sizes

    return hybrid_sizes(world)


# ---------------------------------------------------------------- the draw


@dataclass(frozen=True)
class Draw:
    """One CP attention call. ``refusal``: the one rule of ``REFUSALS`` the draw breaks ("" for
    none: it must run and match dense float64)."""

    seed: int
    world: int
    refusal: str = ""
    algorithm: str = "ring"  # ring | ulysses | hybrid | auto
    mesh2d: bool = False  # a 2-D CP mesh (hybrid_sizes(W)), both dims sharded on the sequence
    layout: str = "BNSD"
    mask: str = "none"  # none | causal | band | given | given_band
    sparse_mode: int = 0
    pre: int = INT_MAX
    nxt: int = INT_MAX
    mask_form: str = "SS"  # given masks: SS | SS_uint8 | B1SS | BNSS | sharded | rows (a refusal)
    dead_rows: bool = False  # given masks: some query rows see no key
    lb: bool = False  # torch's _cp_options.enable_load_balance
    placement: str = ""  # TND: balanced | head_tail | contiguous
    docs: tuple = ()  # TND: document lengths
    B: int = 1
    nq: int = 2
    nkv: int = 2
    d: int = 8
    dv: int = 8
    S: int = 8  # global sequence length (TND: tokens)
    sink: str = ""  # "" | plain | dtensor | bad (a refusal)
    keep_prob: float = 1.0
    dtype: str = "float32"
    exchange: str = "direct"
    keep_kv: bool = False  # the ring's forward keeps the K/V rows it received (direct exchange)
    grad_partials: str = "float32"  # or "input": the dK/dV partials go home in the input dtype
    policy: str = "handle"
    kernel: str = "npu"
    fused_merge: bool = True
    positional: bool = False
    run: str = "eager"  # eager | checkpoint (torch.utils.checkpoint, non-reentrant)
    views: bool = False  # the local q/k/v/dout strided as models pass them (BNSD over BSND memory)

    @property
    def tnd(self) -> bool:
        return self.layout == L.TND

    @property
    def cu(self) -> tuple:
        out, total = [], 0
        for n in self.docs:
            total += n
            out.append(total)
        return tuple(out)

    @property
    def uneven(self) -> bool:
        return not self.tnd and self.S % self.world != 0

    @property
    def given(self) -> bool:
        return self.mask in ("given", "given_band")

    @property
    def mesh_sizes(self) -> tuple:
        return _hybrid_sizes(self.world) if self.mesh2d else (self.world,)

    @property
    def shard_lb(self) -> bool:
        """Whether the dense inputs are laid out head-tail (else contiguous)."""
        return self.lb and not self.mesh2d and not self.tnd and self.S % (2 * self.world) == 0

    @property
    def shard_placement(self) -> str:
        """TND: the placement the inputs are laid out by (a refusal's: one the op must refuse)."""
        return {"tnd_head_tail": "contiguous", "tnd_contiguous": "balanced"}.get(self.refusal, self.placement)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def resolved(self) -> str:
        """The algorithm the call runs: ``plan.choose_algorithm`` for "auto" on one CP mesh
        dimension, hybrid on two; packed documents run the ring for "auto" on one dimension."""
        from cp_cache.plan import choose_algorithm

        if self.tnd and self.algorithm == "auto":
            return "hybrid" if self.mesh2d else "ring"
        if self.tnd:
            return self.algorithm
        if self.algorithm != "auto":
            return self.algorithm
        if self.mesh2d:
            return "hybrid"
        return choose_algorithm(nq=self.nq, nkv=self.nkv, world=self.world, given_mask=self.given, batch=self.B,
                                local_seq=self.S // self.world, head_dim=self.d,
                                itemsize=torch.empty((), dtype=self.torch_dtype).element_size(), v_head_dim=self.dv,
                                keep_kv=self.keep_kv, grad_partials=self.grad_partials)

    def __str__(self) -> str:
        base = Draw(self.seed, self.world)
        changed = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                            if f.name not in ("seed", "world") and getattr(self, f.name) != getattr(base, f.name))
        return f"Draw(seed={self.seed}, world={self.world}, {changed})"


# the rules a refusal draw breaks, one each: the exception every rank must raise, and a pattern
# its message must match (naming the argument)
REFUSALS = {
    "ulysses_heads": ("ValueError", r"Ulysses .* splits the heads .*got N=\d+, Nkv=\d+, W=\d+"),
    "hybrid_lb": ("NotImplementedError", r"load balancing \(torch's _cp_options.enable_load_balance\)"),
    "algorithm_mesh": ("NotImplementedError", r"algorithm='(ring|ulysses|hybrid)' runs over \d mesh dimension"),
    "lb_length": ("ValueError", r"load balancing .* query sequence length \d+ is not divisible by \d+"),
    "uneven_positional": ("RuntimeError", r"disagree on local query shape.*only for full or causal attention "
                                          r"without load balancing"),
    "tnd_mask": ("NotImplementedError", r"input_layout='TND' supports .*not sparse_mode=[01] with "
                                        r"atten_mask=<tensor of shape \(\d+, \d+\)"),
    "tnd_head_tail": ("ValueError", r"document \d+ of actual_seq_qlen has length \d+, not divisible by 2\*W"),
    "tnd_contiguous": ("ValueError", r"(actual_seq_qlen=\[.*does not divide into W=\d contiguous slices|"
                                     r"input_layout='TND' without load balancing .* T=\d+ tokens do not divide by W)"),
    "sink_shape": ("ValueError", r"sink must be a floating tensor of shape \[head_num\] = \[\d+\]"),
    "mask_rows": ("ValueError", r"atten_mask .*(square over the global sequence|must be \[S, S\])"),
    "per_head_mask": ("NotImplementedError", r"Ulysses .* not a per-head mask of shape"),
    "sparse_mode": ("NotImplementedError", r"not sparse_mode=[5-8]"),
    "band_uncompressed": ("NotImplementedError", r"sparse_mode=4 needs the compressed 2048x2048 mask"),
    "reference_dropout": ("NotImplementedError", r"(reference step kernel does not implement dropout \(keep_prob=0|"
                                                 r"dropout on CPU \(SDPA's dropout_p=0\.\d+, the op's keep_prob=0)"),
}
TND_REFUSALS = ("tnd_mask", "tnd_head_tail", "tnd_contiguous")
# refusals drawn from the seed, not the stream (every other draw stays as it was): q/k/v of two
# dtypes, as a model under autocast passes them (RoPE's float32 q/k beside a bfloat16 v)
SEEDED_REFUSALS = {"mixed_dtypes": ("TypeError", r"query torch\.\w+, key torch\.\w+, value torch\.\w+: the op "
                                                 r"takes one dtype")}


def _possible(refusal: str, world: int) -> bool:
    """Whether a draw at ``world`` ranks can break ``refusal``'s rule (and only it)."""
    if refusal == "hybrid_lb":
        return _hybrid_sizes(world) is not None
    if refusal in ("ulysses_heads", "uneven_positional", "tnd_contiguous", "per_head_mask"):
        return world > 1
    return True


class _Picker:
    """rng.choices, unless the name is forced."""

    def __init__(self, rng: random.Random, force: dict):
        self.rng, self.force = rng, force

    def __call__(self, name: str, options, weights=None):
        value = self.rng.choices(list(options), weights)[0]  # drawn anyway: forcing keeps the others' draws
        return self.force.get(name, value)


def _split_heads(rng: random.Random, split: int) -> tuple[int, list[int]]:
    """Nq and the Nkv that split over a Ulysses group of ``split`` ranks (Nq divisible by it, Nkv
    divisible by it or dividing it); any Nq and its divisors for ``split`` 1."""
    if split > 1:
        nq = split * rng.choice((1, 2)) if split < 8 else split
        return nq, [n for n in range(1, nq + 1) if nq % n == 0 and (n % split == 0 or split % n == 0)]
    nq = rng.randint(1, 6)
    return nq, [n for n in range(1, nq + 1) if nq % n == 0]


def _documents(rng: random.Random, world: int, placement: str) -> tuple:
    """A random mix of document lengths that ``placement`` can lay out over ``world`` ranks."""
    count = rng.randint(1, 6)
    if placement == "head_tail":  # every length a multiple of 2W
        return tuple(2 * world * rng.randint(1, 3 if world < 8 else 1) for _ in range(count))
    if placement == "contiguous":  # any lengths, T a multiple of W: documents cross rank boundaries
        total = world * rng.randint(3, 10 if world < 8 else 4)
        cuts = sorted(rng.sample(range(1, total), min(count - 1, total - 1)))
        return tuple(b - a for a, b in zip([0] + cuts, cuts + [total]))
    lengths = [rng.choice((1, 2, 3, 5, 7, 9, 12, 16, 21)) for _ in range(count)]
    while sum(lengths) < 3 * world:  # enough tokens for every rank
        lengths.append(rng.randint(1, 2 * world))
    return tuple(lengths)


def _uneven_length(rng: random.Random, world: int) -> int:
    """A length torch.chunk splits unevenly over ``world`` ranks, every rank holding a token."""
    while True:
        s = world * rng.randint(2, 8) + rng.randint(1, world - 1)
        if s - (world - 1) * -(-s // world) >= 1:
            return s


def _draw(seed: int, world: int, **force) -> Draw:
    """The draw of ``seed`` at ``world`` ranks; ``force``: fields or choices fixed."""
    rng = random.Random(seed)
    pick = _Picker(rng, force)
    refusal = pick("refusal", ("",) + tuple(REFUSALS), [84] + [1] * len(REFUSALS))
    while not _possible(refusal, world):
        refusal = rng.choice(tuple(REFUSALS))
    if refusal in TND_REFUSALS:
        tnd = True
    elif refusal in ("", "sink_shape", "reference_dropout"):
        tnd = pick("tnd", (False, True), [3, 1])
    else:
        tnd = False
    two_d = _hybrid_sizes(world) is not None and not tnd
    if refusal == "hybrid_lb":
        mesh2d = True
    elif refusal == "algorithm_mesh":
        mesh2d = two_d and pick("mesh2d", (False, True))
    elif refusal in ("ulysses_heads", "per_head_mask", "uneven_positional", "lb_length"):
        mesh2d = False
    else:
        mesh2d = two_d and pick("mesh2d", (False, True))
    if refusal == "algorithm_mesh":
        algorithm = rng.choice(("ring", "ulysses")) if mesh2d else "hybrid"
    elif refusal in ("ulysses_heads", "per_head_mask"):
        algorithm = "ulysses"
    elif refusal == "uneven_positional":
        algorithm = "ring"
    elif mesh2d:
        algorithm = pick("algorithm", ("hybrid", "auto"))
    else:
        algorithm = pick("algorithm", ("ring", "ulysses", "auto"), [5, 3, 2])
    split = 2 if mesh2d else world if algorithm == "ulysses" or (algorithm == "auto" and rng.random() < 0.7) else 1
    if refusal == "ulysses_heads":
        nq = rng.choice([n for n in range(1, 8) if n % world])
        options = [n for n in range(1, nq + 1) if nq % n == 0]
    else:
        nq, options = _split_heads(rng, split)
    gqa = pick("gqa", (False, True)) and len(options) > 1
    nkv = rng.choice([n for n in options if n < nq]) if gqa else nq
    d = pick("d", (4, 6, 8, 16))
    dv = pick("dv", (max(2, d // 2), d + 4)) if pick("mla", (False, True), [3, 1]) else d
    kernel = "reference" if refusal == "reference_dropout" else pick("kernel", ("npu", "reference"), [6, 1])
    dropout = refusal == "reference_dropout" or (kernel == "npu" and pick("dropout", (False, True), [4, 1]))
    f = dict(seed=seed, world=world, refusal=refusal, algorithm=algorithm, mesh2d=mesh2d, nq=pick("nq", (nq,)),
             nkv=pick("nkv", (nkv,)), d=d, dv=dv, kernel=kernel,
             keep_prob=pick("keep_prob", (0.7, 0.8, 0.9)) if dropout else 1.0,
             dtype=pick("dtype", ("float32", "bfloat16"), [7, 1]),
             exchange=pick("exchange", ("direct", "ring")), policy=pick("policy", ("handle", "stack"), [3, 1]),
             positional=pick("positional", (False, True), [4, 1]),
             fused_merge=pick("fused_merge", (True, False), [2, 1]),
             run=pick("run", ("eager", "checkpoint"), [4, 1]),
             sink="bad" if refusal == "sink_shape" else pick("sink", ("", "plain", "dtensor"), [4, 1, 1]))
    f.update(_draw_tnd(pick, rng, world, refusal, seed) if tnd else _draw_dense(pick, rng, world, refusal, f))
    # keep_kv from the seed, not the stream: every other dimension draws as before it existed
    direct = force.get("exchange", f["exchange"]) == "direct"
    f["keep_kv"] = direct and seed % 3 == 0
    f["grad_partials"] = "input" if direct and seed // 3 % 2 else "float32"
    f["views"] = seed // 6 % 2 == 1
    if f["kernel"] == "reference" and "kernel" not in force and seed % 2:  # torch's fused CPU attention as the step kernel
        f["kernel"] = "torch"
    if f["refusal"] == "" and "refusal" not in force and seed % 13 == 5:
        f["refusal"] = "mixed_dtypes"
    return _settle(Draw(**{k: force.get(k, v) for k, v in f.items()}))


def _draw_tnd(pick: _Picker, rng: random.Random, world: int, refusal: str, seed: int) -> dict:
    lb = {"tnd_head_tail": True, "tnd_contiguous": False}.get(refusal, pick("lb", (True, False)))
    placement = pick("placement", ("balanced", "head_tail")) if lb else "contiguous"
    if refusal == "tnd_head_tail":
        placement = "head_tail"
        # multiples of 2W but two that sum to one: T divides by W, a document does not by 2W
        a = rng.randint(1, 2 * world - 1)
        docs = tuple(2 * world * rng.randint(1, 2) for _ in range(rng.randint(0, 3))) + (a, 2 * world * 2 - a)
    elif refusal == "tnd_contiguous":
        docs = _documents(rng, world, "balanced")
        if sum(docs) % world == 0:
            docs = docs + (1,)
    else:
        docs = _documents(rng, world, placement)
    mask = pick("mask", ("none", "causal"), [1, 2])
    sparse_mode = pick("sparse_mode", (2, 3)) if mask == "causal" else pick("sparse_mode", (0, 1, 2, 3))
    pre = nxt = INT_MAX
    # a band inside each document (sparse_mode 4) in some causal draws (not those forced causal), from
    # the seed's own stream: the draws that stay causal draw what they drew before bands existed
    band = random.Random(zlib.crc32(f"tnd-band/{seed}".encode()))
    if mask == "band" or (mask == "causal" and "mask" not in pick.force and not refusal and band.random() < 0.4):
        longest = max(docs)
        pre = band.choice((0, 1, 2, 3, longest // 3, longest - 1, longest + 2, INT_MAX))
        nxt = band.choice((0, 0, 1, 3, longest // 2, INT_MAX))
        if pre == INT_MAX and nxt == INT_MAX:
            nxt = 0
        if band.random() < 0.15:  # a band beside the diagonal: some rows see no key
            pre, nxt = band.choice(((-1, 3), (4, -2), (-2, 2)))
        # 7 / 8: the band in the last / first document, the others causal
        mask, sparse_mode = "band", band.choice((4, 4, 7, 8))
    if refusal == "tnd_mask":  # explicit masks stay refused with packed documents
        mask, sparse_mode = "given", rng.choice((0, 1))
    return dict(layout=L.TND, lb=lb, placement=placement, docs=docs, S=sum(docs), mask=mask,
                sparse_mode=sparse_mode, pre=pre, nxt=nxt)


def _draw_dense(pick: _Picker, rng: random.Random, world: int, refusal: str, f: dict) -> dict:
    layout = pick("layout", L.LAYOUTS)
    mask = pick("mask", ("none", "causal", "band", "given", "given_band"), [2, 3, 2, 2, 1])
    if refusal in ("mask_rows", "per_head_mask"):
        mask = "given"
    elif refusal == "band_uncompressed":
        mask = "band"
    elif refusal in ("hybrid_lb", "lb_length", "sparse_mode") and mask == "none":
        mask = rng.choice(("causal", "band", "given"))
    if refusal == "uneven_positional":
        mask = rng.choice(("band", "given", "given_band"))
    lb = pick("lb", (True, False))
    if f["mesh2d"] and mask != "none":
        lb = False  # hybrid refuses load balancing with a mask: hybrid_lb's rule
    lb = {"hybrid_lb": True, "lb_length": True, "uneven_positional": False}.get(refusal, lb)
    uneven = refusal == "uneven_positional" or (
        not refusal and world > 1 and f["algorithm"] == "ring" and not f["mesh2d"]
        and (mask == "none" or (mask == "causal" and not lb)) and pick("uneven", (False, True), [3, 1]))
    if uneven:
        seq = _uneven_length(rng, world)
    elif refusal == "lb_length":  # divisible by W but not by 2W, or uneven
        seq = world * (2 * rng.randint(1, 4) + 1)
        if world > 1 and rng.random() < 0.5:
            seq = _uneven_length(rng, world)
            while seq % (2 * world) == 0:
                seq = _uneven_length(rng, world)
    else:
        unit = 2 * world if lb and not f["mesh2d"] else world
        seq = unit * rng.randint(max(1, 6 // unit), max(2, 32 // unit))
    out = dict(layout=layout, mask=mask, lb=lb, S=seq, B=pick("B", (1, 2)))
    if mask == "causal":
        out["sparse_mode"] = pick("sparse_mode", (2, 3))
    elif mask == "band":
        pre = rng.choice((0, 1, 2, seq // 3, seq // 2, seq - 1, seq + 3, INT_MAX))
        nxt = rng.choice((0, 0, 1, 3, seq // 2, seq, INT_MAX))
        if pre == INT_MAX and nxt == INT_MAX:
            nxt = 0
        if rng.random() < 0.15 and pre not in (0, INT_MAX):
            pre, nxt = -min(pre, 2), max(nxt, 2) if nxt != INT_MAX else nxt  # a band beside the diagonal
        if refusal:  # a rule of positional masks: not a band that covers the whole sequence (full or causal)
            pre, nxt = rng.randint(0, seq - 2), rng.choice((0, 1))
        out.update(sparse_mode=4, pre=pre, nxt=nxt)
    elif mask == "given":
        out["sparse_mode"] = pick("given_mode", (1, 0))
    elif mask == "given_band":
        out.update(sparse_mode=0, pre=rng.choice((0, 2, seq // 2, INT_MAX)), nxt=rng.choice((0, 1, seq // 3)))
    else:
        out["sparse_mode"] = pick("sparse_mode", (0, 1, 2, 3, 4))  # no mask: full attention whatever the mode
    if refusal == "sparse_mode":
        out["sparse_mode"] = rng.choice((5, 6, 7, 8))
    if mask in ("given", "given_band"):
        ring = f["algorithm"] == "ring" and not f["mesh2d"]
        out["mask_form"] = pick("mask_form", ("SS", "SS_uint8", "B1SS") + (("BNSS", "sharded") if ring else ()))
        out["dead_rows"] = pick("dead_rows", (False, True), [3, 1])
        if refusal == "mask_rows":
            out["mask_form"] = "rows"
        if refusal == "per_head_mask":
            out["mask_form"] = "BNSS"
    return out


def _settle(draw: Draw) -> Draw:
    """The constraints that depend on what "auto" resolves to: a valid draw stays valid."""
    if draw.refusal or draw.tnd or draw.algorithm != "auto" or draw.mesh2d or draw.resolved() == "ring":
        return draw
    changes = {}
    if draw.uneven:  # Ulysses needs even shards
        changes["S"] = draw.world * (draw.S // draw.world + 1)
    if draw.mask_form in ("BNSS", "sharded"):
        changes["mask_form"] = "SS"
    return replace(draw, **changes) if changes else draw


# Draws with some fields fixed, at their W; the rest of each random from its own seed. One per
# refusal, then the configurations of the hand-written cases the net replaced (the modules
# named), so that they are drawn whatever the base seed.
CORNERS = [
    *[(w, dict(refusal=r)) for r, w in zip(REFUSALS, (2, 4, 3, 1, 3, 2, 4, 3, 1, 2, 4, 3, 2, 1))],
    # torch's fused CPU attention as the step kernel at W = 3 (the seeds draw it at the other W)
    (3, dict(refusal="", tnd=False, algorithm="ring", mask="band", kernel="torch", gqa=True)),
    (3, dict(refusal="", tnd=True, placement="balanced", lb=True, mask="causal", kernel="torch")),
    # test_uneven_shards: W = 3 and 4 uneven, causal and full, the reference kernel
    (3, dict(refusal="", tnd=False, algorithm="ring", mask="causal", lb=False, uneven=True, kernel="npu")),
    (4, dict(refusal="", tnd=False, algorithm="ring", mesh2d=False, mask="none", uneven=True, kernel="reference")),
    # test_sinks: a window with sinks; a DTensor sink; hybrid with sinks; TND with sinks; Ulysses with sinks
    (2, dict(refusal="", tnd=False, algorithm="ring", mask="band", sink="plain", lb=False)),
    (4, dict(refusal="", tnd=False, algorithm="ring", mesh2d=False, mask="band", sink="dtensor", lb=True,
             exchange="ring")),
    (4, dict(refusal="", tnd=False, mesh2d=True, algorithm="hybrid", mask="causal", sink="plain")),
    (8, dict(refusal="", tnd=False, mesh2d=True, algorithm="hybrid", mask="causal", sink="plain", mla=True)),
    (8, dict(refusal="", tnd=False, mesh2d=False, algorithm="ulysses", mask="causal", lb=True, sink="dtensor")),
    (3, dict(refusal="", tnd=True, placement="balanced", lb=True, mask="causal", sink="plain", mla=True)),
    (2, dict(refusal="", tnd=False, algorithm="ulysses", mask="none", dropout=True, sink="plain", kernel="npu")),
    # test_ulysses / test_mla_head_dims: hybrid with a given mask and dropout; Nkv < W; MLA on Ulysses
    (4, dict(refusal="", tnd=False, mesh2d=True, algorithm="hybrid", mask="given", dropout=True, kernel="npu")),
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ulysses", mask="causal", lb=True, nq=8, nkv=1)),
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ulysses", mask="none", mla=True, uneven=False)),
    (8, dict(refusal="", tnd=False, mesh2d=False, algorithm="ring", mask="band", mla=True, lb=True)),
    (2, dict(refusal="", tnd=False, algorithm="ring", mask="none", mla=True, exchange="direct")),
    # test_varlen_ring / test_document_layout: TND head_tail with dropout, checkpointed under both policies;
    # contiguous with the reference kernel; balanced uneven shards with GQA
    (4, dict(refusal="", tnd=True, placement="head_tail", lb=True, mask="causal", dropout=True, kernel="npu",
             run="checkpoint", policy="stack")),
    (2, dict(refusal="", tnd=True, placement="head_tail", lb=True, mask="causal", run="checkpoint",
             policy="handle")),
    (1, dict(refusal="", tnd=True, lb=False, mask="none", kernel="reference", gqa=True)),
    (4, dict(refusal="", tnd=True, placement="balanced", lb=True, mask="causal", gqa=True, dtype="bfloat16")),
    # test_windows_masks: a window inside a shard on contiguous shards; a sharded given mask with a band
    # and dropout; per-head masks with GQA; fully masked rows
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ring", mask="band", lb=False, S=32, pre=2, nxt=0)),
    (2, dict(refusal="", tnd=False, algorithm="ring", mask="given_band", lb=True, dropout=True, kernel="npu",
             mask_form="sharded")),
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ring", mask="given", mask_form="BNSS", gqa=True,
             dead_rows=True)),
    (1, dict(refusal="", tnd=False, algorithm="ring", mask="given", mask_form="SS_uint8", dead_rows=True)),
    # test_handlers / test_ring: bf16 by position through the whole-block ring; causal sparse_mode 3 with dropout
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ring", mask="causal", lb=True, dtype="bfloat16",
             positional=True, exchange="ring")),
    (3, dict(refusal="", tnd=False, algorithm="ring", mask="causal", sparse_mode=3, lb=True, dropout=True,
             kernel="npu", gqa=True)),
    # more of test_sinks, test_mla_head_dims, test_windows_masks and test_ulysses
    (2, dict(refusal="", tnd=False, algorithm="ring", layout="BSH", mask="none", sink="dtensor")),
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ring", layout="BSH", mask="causal", lb=True, mla=True,
             gqa=True)),
    (2, dict(refusal="", tnd=False, algorithm="ring", layout="BSND", mask="causal", lb=True, mla=True,
             fused_merge=False)),
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ulysses", layout="BSH", mask="causal", lb=True, mla=True,
             gqa=True)),
    (3, dict(refusal="", tnd=True, placement="head_tail", lb=True, mask="none", mla=True, fused_merge=False)),
    (3, dict(refusal="", tnd=False, algorithm="ring", mask="band", lb=False, S=24, pre=13, nxt=0)),
    (2, dict(refusal="", tnd=False, algorithm="ulysses", layout="BSND", mask="causal", lb=True)),
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ulysses", layout="BSND", mask="none")),
    (3, dict(refusal="", tnd=False, algorithm="ulysses", layout="BSH", mask="causal", lb=False)),
    (2, dict(refusal="", tnd=False, algorithm="ulysses", layout="SBH", mask="causal", lb=False)),
    (4, dict(refusal="", tnd=False, mesh2d=True, algorithm="hybrid", mask="band")),
    # two bugs the net found, drawn whatever the seed: one K/V head's gradient on uneven shards (its
    # DTensor strides differed from the key's), and full attention on uneven shards (a step took the
    # whole K/V block where its segments cover every query row)
    (2, dict(refusal="", tnd=True, lb=True, placement="balanced", docs=(1, 16, 12, 21), S=50, mask="causal",
             nq=2, nkv=1, sink="plain", run="eager")),
    (4, dict(refusal="", tnd=True, lb=True, placement="balanced", docs=(1, 7, 3, 3), S=14, mask="none",
             algorithm="ring", exchange="direct")),
    # test_sinks' ring-causal-contiguous-gqa at W >= 2
    (4, dict(refusal="", tnd=False, mesh2d=False, algorithm="ring", layout="BSND", mask="causal", lb=False,
             sink="plain", gqa=True)),
    # packed documents with a band (sparse_mode 4) inside each document: every placement at W = 2, 3, 4,
    # with dropout, sinks, MLA and GQA
    (2, dict(refusal="", tnd=True, placement="head_tail", lb=True, mask="band", dropout=True, kernel="npu")),
    (3, dict(refusal="", tnd=True, placement="balanced", lb=True, mask="band", sink="plain", mla=True)),
    (4, dict(refusal="", tnd=True, lb=False, mask="band", exchange="direct", dropout=True, kernel="npu",
             sink="dtensor")),
    (4, dict(refusal="", tnd=True, placement="head_tail", lb=True, mask="band", gqa=True, exchange="direct")),
    (3, dict(refusal="", tnd=True, lb=False, mask="band", mla=True, run="checkpoint")),
    (2, dict(refusal="", tnd=True, placement="balanced", lb=True, mask="band", exchange="direct", kernel="reference")),
    # sparse_mode 7 / 8 (the band in the last / first document, the others causal)
    (3, dict(refusal="", tnd=True, placement="head_tail", lb=True, mask="band", sparse_mode=7, exchange="direct")),
    (4, dict(refusal="", tnd=True, placement="balanced", lb=True, mask="band", sparse_mode=8, dropout=True,
             kernel="npu", exchange="direct")),
    # packed documents under Ulysses and hybrid (test_ulysses has the placements' numbers without the rest):
    # dropout, sinks, the reference kernel, checkpointing under the stack policy, bfloat16
    (4, dict(refusal="", tnd=True, mesh2d=False, algorithm="ulysses", placement="balanced", lb=True, mask="causal",
             dropout=True, kernel="npu", nq=4, nkv=2)),
    (4, dict(refusal="", tnd=True, mesh2d=True, algorithm="hybrid", placement="balanced", lb=True, mask="causal",
             dropout=True, kernel="npu", nq=4, nkv=2, run="eager")),
    (4, dict(refusal="", tnd=True, mesh2d=True, algorithm="auto", placement="head_tail", lb=True, mask="none",
             sink="plain", kernel="reference", nq=4, nkv=2)),
    (4, dict(refusal="", tnd=True, mesh2d=True, algorithm="hybrid", lb=False, mask="causal", run="checkpoint",
             policy="stack", dtype="bfloat16", nq=2, nkv=2, sink="dtensor")),
]


def _draws(world: int) -> list[Draw]:
    seeds = [zlib.crc32(f"net/{BASE_SEED}/{world}/{i}".encode()) for i in range(round(DRAWS[world] * SCALE))]
    out = [_draw(seed, world) for seed in seeds]
    for i, (w, force) in enumerate(CORNERS):
        if w == world:
            out.append(_draw(zlib.crc32(f"corner/{i}".encode()), world, **force))
    return out


# ---------------------------------------------------------------- the problem of a draw (ranks and here alike)


def _problem(draw: Draw) -> dict:
    """The draw's full-sequence inputs (float64 [B, N, S, D] with values of the draw's dtype;
    TND: batch 1), the given mask, the reference's mask (True = masked out, broadcastable to
    [B, N, S, S]) and the sinks, all from the draw's seed."""
    from cp_cache.testing.varlen_reference import band_modes, document_masked

    g = torch.Generator().manual_seed(draw.seed)
    B, S = (1 if draw.tnd else draw.B), draw.S
    q = torch.randn(B, draw.nq, S, draw.d, generator=g, dtype=torch.float64)
    k = torch.randn(B, draw.nkv, S, draw.d, generator=g, dtype=torch.float64)
    v = torch.randn(B, draw.nkv, S, draw.dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, draw.nq, S, draw.dv, generator=g, dtype=torch.float64)
    q, k, v, dout = (t.to(draw.torch_dtype).double() for t in (q, k, v, dout))
    sink = (torch.randn(draw.nq, generator=g, dtype=torch.float64) * 2).float().double() if draw.sink else None
    given = masked = None
    if draw.tnd:
        mode = band_modes(len(draw.docs), draw.sparse_mode) if draw.mask == "band" else (
            "left_up" if draw.mask == "causal" else "full")
        masked = document_masked(draw.cu, draw.cu, mode, draw.pre, draw.nxt)
    elif draw.mask == "causal":
        masked = torch.ones(S, S, dtype=torch.bool).triu(1)
    elif draw.given:
        shape = {"B1SS": (B, 1, S, S), "BNSS": (B, draw.nq, S, S)}.get(draw.mask_form, (S, S))
        given = torch.rand(shape, generator=g) < 0.3 + 0.3 * torch.rand((), generator=g)
        given &= ~torch.eye(S, dtype=torch.bool)  # the diagonal kept, but for the dead rows
        if draw.dead_rows:
            given[..., torch.randperm(S, generator=g)[: max(1, S // 5)], :] = True
        masked = given
    if draw.mask in ("band", "given_band") and not draw.tnd:
        band = band_masked(S, draw.pre, draw.nxt)
        masked = band if masked is None else masked | band
    return dict(q=q, k=k, v=v, dout=dout, sink=sink, given=given, masked=masked)


def _op_kwargs(draw: Draw, mask_arg) -> dict:
    """The op's keyword arguments (but the sink): the causal and band ones from
    ``npu_ops.causal_arguments`` / ``band_arguments``."""
    from cp_cache.npu_ops import band_arguments, causal_arguments

    kw = dict(scale=1.0 / math.sqrt(draw.d), keep_prob=draw.keep_prob)
    if draw.tnd:
        cu = torch.tensor(draw.cu)
        kw.update(actual_seq_qlen=cu, actual_seq_kvlen=cu)
    if draw.mask == "causal":
        kw.update(causal_arguments("cpu", right_down=draw.sparse_mode == 3))
    elif draw.mask == "band":
        kw.update(band_arguments("cpu", draw.pre, draw.nxt))
        if draw.refusal == "band_uncompressed":
            kw["atten_mask"] = torch.ones(draw.S, draw.S, dtype=torch.bool).triu(1)
    elif draw.given:
        kw["atten_mask"] = mask_arg if mask_arg is not None else torch.zeros(draw.S, draw.S, dtype=torch.bool)
        if draw.pre != INT_MAX:
            kw["pre_tockens"] = draw.pre
        if draw.nxt != INT_MAX:
            kw["next_tockens"] = draw.nxt
    kw["sparse_mode"] = draw.sparse_mode
    return kw


# ---------------------------------------------------------------- rank side


def _positions(draw: Draw, rank: int) -> torch.Tensor:
    """The global positions ``rank`` holds, in local order."""
    import cp_cache
    from cp_cache.documents import sequence_positions

    if draw.tnd:
        return cp_cache.document_layout(draw.cu, draw.mesh_sizes, placement=draw.shard_placement)[rank]
    if draw.S % draw.world:  # torch.chunk's uneven shards
        return torch.arange(draw.S).chunk(draw.world)[rank]
    return sequence_positions(rank, draw.world, draw.S // draw.world, draw.shard_lb)


class _Layout:
    """The draw's tensors on this rank: full [B, N, S, D] -> local DTensors (the public sharding
    helpers) and back to full float64 (their gathering counterparts). Hybrid's two CP dims:
    nested contiguous chunks."""

    def __init__(self, draw: Draw, mesh):
        self.draw, self.mesh = draw, mesh
        self.lb = None if draw.mesh2d else draw.shard_lb

    def shard(self, x):
        import cp_cache
        from cp_cache.cli.selftest.problems import to_layout
        from torch.distributed.tensor import DTensor, Shard

        full = to_layout(x.to(self.draw.torch_dtype), self.draw.layout).contiguous()
        if self.draw.tnd:  # local lengths may differ: the global shape is given
            local = cp_cache.shard_documents(full, self.draw.cu, self.mesh, placement=self.draw.shard_placement)
            return DTensor.from_local(_strided(local, self.draw), self.mesh, [Shard(0)] * self.mesh.ndim,
                                      shape=full.shape, stride=full.stride())
        sharded = cp_cache.shard_sequence(full, self.mesh, L.seq_dim(self.draw.layout), load_balance=self.lb)
        if not self.draw.views:
            return sharded
        return DTensor.from_local(_strided(sharded.to_local(), self.draw), self.mesh, sharded.placements,
                                  shape=sharded.shape, stride=sharded.stride())

    def unshard(self, x, heads: int):
        import cp_cache
        from cp_cache.cli.selftest.problems import from_layout

        if self.draw.tnd:
            full = cp_cache.unshard_documents(x, self.draw.cu, self.mesh, placement=self.draw.shard_placement)
        else:
            full = cp_cache.unshard_sequence(x, L.seq_dim(self.draw.layout), load_balance=self.lb)
        return from_layout(full, self.draw.layout, heads)

    def unshard_lse(self, smax, ssum):
        import cp_cache
        from cp_cache.npu_ops import lse_from_stats

        if self.draw.tnd:  # statistics [T, N, 8], sharded on the tokens
            local = lse_from_stats(smax.to_local(), ssum.to_local()).contiguous()
            full = cp_cache.unshard_documents(local, self.draw.cu, self.mesh, placement=self.draw.shard_placement)
            return full.detach().double().T.unsqueeze(0)
        full = [cp_cache.unshard_sequence(s, 2, load_balance=self.lb) for s in (smax, ssum)]
        return lse_from_stats(*full).detach().double()


def _strided(local, draw: Draw):
    """``local`` with its values, in the memory order a model's view has (the draw's ``views``): the
    second and third dimensions swapped in memory (BNSD from a [B, S, N, D] projection; 3-D: the
    first two), non-contiguous."""
    if not draw.views:
        return local
    dims = (1, 2) if local.dim() == 4 else (0, 1)
    return local.transpose(*dims).contiguous().transpose(*dims)


def _call(draw: Draw, q, k, v, kwargs):
    """The op, its arguments by name or all positionally (in the schema's order)."""
    op = torch.ops.npu.npu_fusion_attention_v3
    if not draw.positional:
        return op(q, k, v, draw.nq, draw.layout, **kwargs)
    named = dict(kwargs, query=q, key=k, value=v, head_num=draw.nq, input_layout=draw.layout)
    return op(*[named.get(a.name, a.default_value) for a in op.default._schema.arguments if not a.kwarg_only])


def _any_failed(failed: bool) -> bool:
    """Whether any rank failed (every rank learns it: none waits in a gather alone)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if failed else 0])
    dist.all_reduce(flag)
    return bool(flag.item())


def _mask_arg(draw: Draw, given, rank: int, mesh):
    """The given mask as the op takes it: whole, as uint8, or its rows of this rank's queries
    sharded on the query dimension (the refusal "rows": half its rows)."""
    from torch.distributed.tensor import DTensor, Shard

    if given is None:
        return None
    if draw.mask_form == "SS_uint8":
        return given.to(torch.uint8)
    if draw.mask_form == "rows":
        return given[: draw.S // 2]
    if draw.mask_form == "sharded":
        rows = given.index_select(given.dim() - 2, _positions(draw, rank))
        return DTensor.from_local(rows, mesh, [Shard(given.dim() - 2)])
    return given


def _run_draw(draw: Draw, rank: int, mesh) -> dict:
    """The draw's forward and backward on this rank: what it saw, its error if refused, and (rank
    0) the results on the full sequence."""
    import traceback

    import cp_cache
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.step_cache import plan_of

    result: dict = {"error": None}
    documents = draw.placement if draw.placement in ("balanced", "head_tail") else None  # contiguous: lb off
    cp_cache.enable(draw.policy, kernel=draw.kernel, fused_merge=draw.fused_merge, algorithm=draw.algorithm,
                    exchange=draw.exchange, documents=documents, keep_kv=draw.keep_kv,
                    grad_partials=draw.grad_partials)
    _cp_options.enable_load_balance = draw.lb
    prob = _problem(draw)
    where = _Layout(draw, mesh)
    outs = leaves = sink = None
    try:
        with cp_cache.context_parallel(mesh):
            leaves = [where.shard(prob[n]).detach().requires_grad_() for n in ("q", "k", "v")]
            if draw.refusal == "mixed_dtypes":  # v in the other dtype
                other = torch.float32 if draw.dtype == "bfloat16" else torch.bfloat16
                leaves[2] = leaves[2].detach().to(other).requires_grad_()
            dout = where.shard(prob["dout"])
            if draw.sink == "bad":
                sink = torch.zeros(draw.nq + 1)
            elif draw.sink:
                sink = prob["sink"].float()
                if draw.sink == "dtensor":
                    sink = DTensor.from_local(sink, mesh, [Replicate()] * mesh.ndim)
                sink.requires_grad_()
            kwargs = _op_kwargs(draw, _mask_arg(draw, prob["given"], rank, mesh))

            def attend(q, k, v, s):
                return _call(draw, q, k, v, dict(kwargs, sink=s) if s is not None else kwargs)

            torch.manual_seed(draw.seed)
            if draw.run == "checkpoint":
                outs = torch.utils.checkpoint.checkpoint(lambda *a: attend(*a)[:3], *leaves, sink,
                                                         use_reentrant=False)
            else:
                outs = attend(*leaves, sink)
                if draw.policy == "handle":
                    cache = cp_cache.store().resolve(outs[4])
                    result["algorithm"] = plan_of(cache).algorithm
                    del cache
            stats = cp_cache.call_stats()
            result["forward"] = {n: stats["forward"][n] for n in ("bytes_sent", "bytes_received", "calls",
                                                                  "fused_merge", "kept_bytes")}
            result["between"] = {n: cp_cache.stats()[n] for n in ("live_entries", "stack_depth", "live_bytes")}
            result["out"] = (str(outs[0].dtype), tuple(outs[0].shape), tuple(outs[0].placements))
            result["query"] = tuple(leaves[0].placements)
            outs[0].backward(dout)
            stats = cp_cache.call_stats()
            result["backward"] = {n: stats["backward"][n] for n in ("bytes_sent", "bytes_received", "calls")}
            result["grad_placements"] = [tuple(t.grad.placements) for t in leaves]
    except Exception as exc:  # noqa: BLE001 - a refusal is the result; checked in the parent
        result["error"] = (type(exc).__name__, str(exc))
        result["trace"] = "".join(traceback.format_exc().splitlines(True)[-12:])
    if not _any_failed(result["error"] is not None):
        with cp_cache.context_parallel(mesh):
            got = {"out": where.unshard(outs[0], draw.nq), "lse": where.unshard_lse(outs[1], outs[2])}
            for key, leaf, heads in zip(("dq", "dk", "dv"), leaves, (draw.nq, draw.nkv, draw.nkv)):
                got[key] = where.unshard(leaf.grad, heads)
            if isinstance(sink, DTensor):  # the ranks' shares, Partial on the CP dims
                result["sink_grad"] = str(sink.grad.placements)
                got["dsink"] = sink.grad.full_tensor().detach().double()
            elif sink is not None:  # this rank's share: their sum is the gradient
                got["dsink"] = sink.grad.detach().double().clone()
                dist.all_reduce(got["dsink"])
            outs = None
            if draw.keep_prob < 1:
                got["probe"] = _keep_probe(draw, prob, where, leaves, sink, rank, mesh)
        result["got"] = got if rank == 0 else None
    del outs, leaves, sink
    result["after"] = {n: cp_cache.stats()[n] for n in ("live_entries", "stack_depth")}
    return result


def _keep_probe(draw: Draw, prob: dict, where: _Layout, leaves, sink, rank: int, mesh) -> torch.Tensor:
    """The forward again from the draw's RNG state with V the one-hot of each key position:
    [B, Nq, S, S] = P * keep / keep_prob of every (query, key) pair, 0 where dropped."""
    import cp_cache

    S = draw.S
    onehot = torch.eye(S, dtype=torch.float64).expand(prob["v"].size(0), draw.nkv, S, S)
    probe = _Layout(replace(draw, dv=S), mesh)
    kwargs = _op_kwargs(draw, _mask_arg(draw, prob["given"], rank, mesh))
    if sink is not None:
        kwargs["sink"] = sink.detach()
    config = cp_cache.active_config()  # the stack policy would keep this forward's entry: no backward follows
    cp_cache.enable("handle", kernel=config.kernel, fused_merge=config.fused_merge, algorithm=config.algorithm,
                    exchange=config.exchange, documents=config.documents, keep_kv=config.keep_kv,
                    grad_partials=config.grad_partials)
    v = probe.shard(onehot)
    torch.manual_seed(draw.seed)
    with torch.no_grad():
        out = _call(draw, leaves[0].detach(), leaves[1].detach(), v, kwargs)[0]
    return probe.unshard(out, draw.nq)


def _net_rank(rank: int, world: int, draws: list[Draw]) -> list[dict]:
    """Every draw on this rank, in order, until one leaves the group unusable (a collective timed
    out: the ranks are out of step): that draw's result says so and the rest are left to a new group."""
    import cp_cache
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    meshes: dict = {}
    results = []
    for draw in draws:
        sizes = draw.mesh_sizes
        try:
            if sizes not in meshes:
                meshes[sizes] = init_device_mesh("cpu", sizes, mesh_dim_names=("ring", "ulysses")[: len(sizes)]
                                                 if len(sizes) == 2 else ("cp",))
            results.append(_run_draw(draw, rank, meshes[sizes]))
        except Exception as exc:  # noqa: BLE001 - reported as the draw's result
            results.append({"lost": f"{type(exc).__name__}: {exc}"})
            break
    cp_cache.disable()
    _cp_options.enable_load_balance = True
    return results


_RESULTS: dict = {}


def _results(world: int) -> list[list[dict]]:
    """For each of W's draws, every rank's result. One rank group runs them all; a draw after
    which the group is lost is reported as such, and a new group runs the draws after it."""
    if world not in _RESULTS:
        draws = _draws(world)
        runnable = [i for i, d in enumerate(draws) if not _hangs(d)]
        out: list = [None] * len(draws)
        while runnable:
            try:
                per_rank = run_ranks(_net_rank, world, [draws[i] for i in runnable], timeout=900.0,
                                     pg_timeout=PG_TIMEOUT)
            except RuntimeError as exc:  # the group died outright: the remaining draws fail with it
                for i in runnable:
                    out[i] = [{"lost": str(exc)}] * world
                break
            done = max(len(r) for r in per_rank)  # a rank that lost the group stopped there; the others soon after
            for j in range(done):
                out[runnable[j]] = [r[j] if j < len(r) else {"lost": "stopped before this draw"} for r in per_rank]
            runnable = runnable[done:]
        _RESULTS[world] = out
    return _RESULTS[world]


# ---------------------------------------------------------------- the checks, here


def _error(a: torch.Tensor, b: torch.Tensor, magnitude: float) -> float:
    """``rel_err`` over the entries where the reference ``b`` is finite (rows that see nothing:
    LSE -inf). A reference that is zero up to one float32 rounding of ``magnitude`` (the size of the
    terms it is computed from: a gradient through a softmax over one key is exactly 0) is measured
    against ``magnitude`` instead of itself."""
    keep = torch.isfinite(b)
    if not bool(keep.any()):
        return 0.0
    a, b = a[keep], b[keep]
    scale = float(b.abs().max())
    if scale < torch.finfo(torch.float32).eps * magnitude:
        scale = magnitude
    return float((a - b).abs().max()) / max(scale, 1e-30)


def _magnitudes(draw: Draw, q, k, v, dout) -> dict:
    """The size of the terms each result is a sum of (``_error``)."""
    m = {n: float(t.abs().max()) for n, t in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    scale = 1.0 / math.sqrt(draw.d)
    return {"out": m["v"], "lse": 1.0, "dv": m["dout"], "dsink": m["dout"] * m["v"],
            "dq": scale * m["k"] * m["dout"] * m["v"], "dk": scale * m["q"] * m["dout"] * m["v"]}


def _check_numbers(draw: Draw, got: dict) -> list[str]:
    prob = _problem(draw)
    q, k, v, dout, masked, sink = (prob[n] for n in ("q", "k", "v", "dout", "masked", "sink"))
    keep, problems = None, []
    if draw.keep_prob < 1:
        keep = got["probe"] > 0
        allowed = torch.ones_like(keep) if masked is None else ~masked.bool().expand_as(keep)
        n = int(allowed.sum())
        kept = float(keep[allowed].float().mean())
        spread = 5 * math.sqrt(draw.keep_prob * (1 - draw.keep_prob) / n) + 1.0 / n
        if abs(kept - draw.keep_prob) > spread:
            problems.append(f"dropout kept {kept:.3f} of {n} pairs, keep_prob {draw.keep_prob} (+- {spread:.3f})")
    ref = dense_attention(q, k, v, dout, False, keep, draw.keep_prob, masked=masked, sink=sink)
    low = dense_attention(q, k, v, dout, False, keep, draw.keep_prob, dtype=draw.torch_dtype, masked=masked,
                          sink=sink)
    # float32: 20x + 32 eps; bf16 (computed in float32, rounded once; dense bf16 rounds every op): 4x + eps/2
    factor, floor = (20.0, 32.0) if draw.dtype == "float32" else (4.0, 0.5)
    bounds, magnitude = {}, _magnitudes(draw, q, k, v, dout)
    for key in ref:
        truth = ref[key].double()
        bounds[key] = error_bound(_error(low[key].double(), truth, magnitude[key]), dtype=draw.torch_dtype,
                                  factor=factor, floor=floor)
        err = _error(got[key], truth, magnitude[key])
        if not err <= bounds[key]:
            problems.append(f"{key}: relative error {err:.3g} > bound {bounds[key]:.3g}")
    dead = torch.isneginf(ref["lse"])
    if bool((got["lse"][dead] > -1e30).any()):
        problems.append("lse: a row that sees no key got a finite LSE")
    if keep is not None:
        plain = dense_attention(q, k, v, dout, False, masked=masked, sink=sink)["out"]
        if not rel_err(got["out"], plain) > bounds["out"]:
            problems.append("dropout: the output is the dropout-free one")
    return problems


def _rows_needed(draw: Draw) -> tuple[list[int], list[int]]:
    """(K/V rows each rank must send, rows each must receive): the rows of its block that some
    query of another rank may attend to (a row any head or batch may see)."""
    from cp_cache.testing.reference import exchanged_rows

    S, masked = draw.S, _problem(draw)["masked"]
    masked = torch.zeros(S, S, dtype=torch.bool) if masked is None else masked.bool().reshape(-1, S, S).all(0)
    return exchanged_rows(masked, [_positions(draw, r) for r in range(draw.world)])


def _check_traffic(draw: Draw, per_rank: list[dict]) -> list[str]:
    from cp_cache.plan import bytes_per_rank

    problems = []
    item = torch.empty((), dtype=draw.torch_dtype).element_size()
    batch = 1 if draw.tnd else draw.B
    resolved = draw.resolved()
    if resolved == "ring" and draw.exchange == "direct":
        sent, received = _rows_needed(draw)
        row = batch * draw.nkv * (draw.d + draw.dv) * item
        for r, res in enumerate(per_rank):
            # backward: the K/V rows again (unless the forward kept them) and the float32 partials back
            partial = item if draw.grad_partials == "input" else 4
            want = (sent[r] * row, received[r] * row,
                    (0 if draw.keep_kv else sent[r] * row) + received[r] * row // item * partial)
            have = (res["forward"]["bytes_sent"], res["forward"]["bytes_received"], res["backward"]["bytes_sent"])
            if have != want:
                problems.append(f"rank {r}: (forward sent, forward received, backward sent) = {have}; the rows "
                                f"other ranks need give {want}")
            kept = res["forward"]["kept_bytes"]
            if kept != (received[r] * row if draw.keep_kv else 0):
                problems.append(f"rank {r}: call_stats kept_bytes={kept}, received {received[r] * row} "
                                f"(keep_kv={draw.keep_kv})")
            if draw.run == "eager" and res["between"]["live_bytes"] < kept:
                problems.append(f"rank {r}: the store holds {res['between']['live_bytes']} bytes between forward "
                                f"and backward, less than the {kept} kept")
    if draw.mask == "none" and not draw.mesh2d and not draw.tnd and not draw.uneven and resolved in ("ring", "ulysses"):
        expected = bytes_per_rank(resolved, nq=draw.nq, nkv=draw.nkv, world=draw.world, batch=batch,
                                  local_seq=draw.S // draw.world, head_dim=draw.d, itemsize=item,
                                  v_head_dim=draw.dv, exchange=draw.exchange, keep_kv=draw.keep_kv,
                                  grad_partials=draw.grad_partials)
        for r, res in enumerate(per_rank):
            have = res["forward"]["bytes_sent"] + res["backward"]["bytes_sent"]
            if have != expected:
                problems.append(f"rank {r}: sent {have} bytes, plan.bytes_per_rank gives {expected}")
    return problems


def _expected_out_shape(draw: Draw) -> tuple:
    from cp_cache.cli.selftest.problems import to_layout

    return tuple(to_layout(torch.empty(1 if draw.tnd else draw.B, draw.nq, draw.S, draw.dv), draw.layout).shape)


def _check(draw: Draw, per_rank: list[dict]) -> list[str]:
    """What is wrong with the draw's results (empty: nothing)."""
    lost = [f"rank {r}: lost its process group: {res['lost'][:2000]}" for r, res in enumerate(per_rank)
            if "lost" in res]
    if lost:
        return lost
    errors = [res["error"] for res in per_rank]
    problems = [f"rank {r}: {res['after']} step caches alive or stacked after the draw"
                for r, res in enumerate(per_rank) if any(res["after"].values())]
    if draw.refusal:
        kind, pattern = {**REFUSALS, **SEEDED_REFUSALS}[draw.refusal]
        for r, error in enumerate(errors):
            if error is None:
                problems.append(f"rank {r}: ran, but the draw breaks rule {draw.refusal!r} ({kind} expected)")
            elif error[0] != kind or not re.search(pattern, error[1], re.S):
                problems.append(f"rank {r}: expected {kind} matching {pattern!r}, got {error[0]}: {error[1]}")
        return problems
    failed = [r for r, error in enumerate(errors) if error is not None]
    for r in failed:
        trace = per_rank[r].get("trace", "") if r == failed[0] else ""
        problems.append(f"rank {r}: refused a valid call: {errors[r][0]}: {errors[r][1]}\n{trace}")
    if failed:
        return problems
    dtype, shape, placements = per_rank[0]["out"]
    if dtype != str(draw.torch_dtype) or shape != _expected_out_shape(draw):
        problems.append(f"output {dtype} of shape {shape}, expected {draw.torch_dtype} {_expected_out_shape(draw)}")
    for r, res in enumerate(per_rank):
        if res["out"][2] != res["query"] or any(p != res["query"] for p in res["grad_placements"]):
            problems.append(f"rank {r}: placements: out {res['out'][2]}, grads {res['grad_placements']}, "
                            f"query {res['query']}")
        if res["forward"]["calls"] < 1 or res["backward"]["calls"] < 1:
            problems.append(f"rank {r}: call_stats counted no call")
        if res["forward"]["fused_merge"] != draw.fused_merge:  # the emulator has npu_ring_attention_update
            problems.append(f"rank {r}: call_stats says fused_merge={res['forward']['fused_merge']}")
        if "algorithm" in res and res["algorithm"] != draw.resolved():
            problems.append(f"rank {r}: ran {res['algorithm']!r}, expected {draw.resolved()!r}")
        between = {n: res["between"][n] for n in ("live_entries", "stack_depth")}
        if draw.run == "eager":  # the graph holds the handle, or the stack the entry
            want = {"live_entries": 1, "stack_depth": int(draw.policy == "stack")}
        elif draw.policy == "handle":  # the checkpoint dropped the forward's cache at once
            want = {"live_entries": 0, "stack_depth": 0}
        else:  # torch_npu's discipline: the original forward's entry waits on the stack
            want = {"live_entries": 1, "stack_depth": 1}
        if between != want:
            problems.append(f"rank {r}: between forward and backward {between}, expected {want}")
    if draw.sink == "dtensor" and "Partial" not in per_rank[0].get("sink_grad", ""):
        problems.append(f"a replicated DTensor sink's gradient came back {per_rank[0].get('sink_grad')}")
    return problems + _check_numbers(draw, per_rank[0]["got"]) + _check_traffic(draw, per_rank)


def _uneven_shards(draw: Draw) -> bool:
    """Whether the ranks hold local sequences of different lengths."""
    if not draw.tnd:
        return draw.uneven
    import cp_cache

    try:
        held = cp_cache.document_layout(draw.cu, draw.mesh_sizes, placement=draw.shard_placement)
    except ValueError:
        return False
    return len({len(p) for p in held}) > 1


# What the net found that the product does not do yet: (predicate on the draw, pattern of the
# problems it causes, what, whether it leaves the ranks out of step). Those problems are an
# expected failure, any other fails the draw; a draw that would cost the rank group is not run.
KNOWN = [
]


def _hangs(draw: Draw):
    """What a draw that would leave the ranks out of step (and cost the group) is known to do, or None."""
    return next((why for predicate, _, why, hangs in KNOWN if hangs and predicate(draw)), None)


def _known(draw: Draw, problems: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(problems a KNOWN entry of the draw explains, the others), and the entries that apply."""
    entries = [(pattern, why) for predicate, pattern, why, _ in KNOWN if predicate(draw)]
    known = [p for p in problems if any(re.search(pattern, p) for pattern, _ in entries)]
    return known, [p for p in problems if p not in known], [why for _, why in entries]


def _id(world: int, index: int, draw: Draw) -> str:
    what = draw.refusal or "-".join(filter(None, (
        draw.algorithm + ("2d" if draw.mesh2d else ""), draw.layout, draw.mask, "lb" if draw.lb else "",
        "drop" if draw.keep_prob < 1 else "", "sink" if draw.sink else "", "keep" if draw.keep_kv else "",
        "partials16" if draw.grad_partials == "input" and draw.dtype != "float32" else "",
        "ckpt" if draw.run != "eager" else "")))
    return f"W{world}-{index:02d}-{what}"


SLOW_WORLDS = (8,)  # eight ranks on a few cores: left out of make matrix's fast subset
ALL = [pytest.param(w, i, d, id=_id(w, i, d), marks=[pytest.mark.slow] if w in SLOW_WORLDS else [])
       for w in WORLDS for i, d in enumerate(_draws(w))]


@pytest.mark.parametrize("world, index, draw", ALL)
def test_draw(world, index, draw):
    if _hangs(draw):
        pytest.xfail(f"not run: {_hangs(draw)}")
    problems = _check(draw, _results(world)[index])
    known, others, entries = _known(draw, problems)
    assert not others, f"{draw}\n  " + "\n  ".join(others)
    if known:
        pytest.xfail(f"{entries}: {known[0]}")


def test_the_net_covers_the_space():
    """Every value of every dimension is drawn, and every refusal (the base seed's draws with the
    corners: whatever CP_CACHE_NET_SEED, the corners alone cover the refusals)."""
    draws = [d for w in WORLDS for d in _draws(w)]
    ran = [d for d in draws if not d.refusal]
    want = {
        "world": set(WORLDS), "layout": set(L.ALL_LAYOUTS), "mask": {"none", "causal", "band", "given", "given_band"},
        "algorithm": {"ring", "ulysses", "hybrid", "auto"}, "exchange": {"direct", "ring"}, "lb": {True, False},
        "keep_kv": {True, False}, "grad_partials": {"float32", "input"},
        "sink": {"", "plain", "dtensor"}, "dtype": {"float32", "bfloat16"}, "kernel": {"npu", "reference", "torch"},
        "placement": {"", "balanced", "head_tail", "contiguous"}, "policy": {"handle", "stack"},
        "positional": {True, False}, "fused_merge": {True, False}, "mesh2d": {True, False},
        "run": {"eager", "checkpoint"}, "mask_form": {"SS", "SS_uint8", "B1SS", "BNSS", "sharded"},
    }
    for name, values in want.items():
        seen = {getattr(d, name) for d in ran}
        assert values <= seen, (name, values - seen)
    assert {d.sparse_mode for d in ran if d.mask == "causal"} == {2, 3}
    assert {d.placement for d in ran if d.tnd and d.mask == "band"} == {"balanced", "head_tail", "contiguous"}
    assert {d.sparse_mode for d in ran if d.tnd and d.mask == "band"} == {4, 7, 8}
    assert {d.resolved() for d in ran if d.algorithm == "auto"} >= {"ring", "ulysses", "hybrid"}
    assert any(d.keep_prob < 1 for d in ran) and any(d.dv < d.d for d in ran) and any(d.dv > d.d for d in ran)
    assert any(d.nkv == 1 < d.nq for d in ran) and any(1 < d.nkv < d.nq for d in ran)
    assert any(d.uneven for d in ran) and any(d.dead_rows for d in ran)
    assert {d.refusal for d in draws} == {""} | set(REFUSALS) | set(SEEDED_REFUSALS)
    assert {d.views for d in ran} == {True, False}
    assert {d.views for d in ran if d.tnd} == {True, False} and {d.views for d in ran if d.layout == "BNSD"} == {
        True, False}
