"""Check every CP algorithm and feature on this machine's devices against one-device attention.

The first command to run on a new cluster. Launched by torchrun it runs in the launched
processes on whatever they find: NPUs with torch_npu (hccl), CUDA GPUs with the plain-torch
step kernel (nccl), else CPUs with the emulator (gloo). Not launched, it spawns ``--ranks`` CPU
ranks (default 2) with the emulator, gloo on loopback.

Every case runs through the public API (``cp_cache.enable(algorithm=...)``,
``torch.ops.npu.npu_fusion_attention_v3`` on DTensors laid out by ``shard_sequence`` /
``shard_documents``) at the launched world size, forward and backward. Its output, LSE and
gradients, gathered back on the full sequence, are compared with dense attention in float64;
the bound is 20x the error of the same attention on one device in float32 (the op on plain
tensors; on CUDA dense torch), measured in the same run, plus 32 eps. Dropout is checked by
directional derivatives, and its output must differ from the dropout-free one. Each row also reports the time per call (forward + backward) and the
forward's bytes sent against the least K/V traffic of the layout. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

from ._common import table, under_torchrun

NAME = "selftest"
HELP = "check every algorithm and feature on this machine's devices against one-device attention; exit 1 on failure"

B, D, S_LOCAL = 2, 8, 16  # batch, head size, tokens per rank
KEEP_PROB = 0.8
INJECTED = 1e-3  # --inject-error: every checked output off by this much of its largest value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks spawned with the emulator when not launched "
                   "by torchrun (default 2; 4 or more also runs hybrid)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case after the checked one (default 3)")
    p.add_argument("--cases", default="", metavar="TEXT",
                   help="run only the cases whose name contains TEXT (default: all)")
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)  # the failing verdict's test


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One CP attention call: algorithm, layout, mask, load balancing, heads, dropout, V's head size."""

    name: str
    algorithm: str = "ring"  # ring | ulysses | hybrid
    layout: str = "BNSD"  # BNSD | BSND | BSH | SBH | TND (packed documents)
    mask: str = "causal"  # causal | full | band | given | given_band
    lb: bool = True  # head-tail load balancing (torch's _cp_options.enable_load_balance)
    gqa: bool = False
    keep_prob: float = 1.0  # < 1: dropout, checked by directional derivatives
    mla: bool = False  # V's head size differs from Q/K's (MLA): D / 2
    sink: bool = False  # attention sinks (gpt-oss): the op's sink=, one logit per query head

    @property
    def dropout(self) -> bool:
        return self.keep_prob < 1.0


def hybrid_sizes(world: int) -> tuple[int, int] | None:
    """(ring, Ulysses) sizes of a 2-D CP mesh for hybrid, or None when ``world`` is prime or < 4."""
    for inner in range(2, world):
        if world % inner == 0 and world // inner >= 2:
            return world // inner, inner
    return None


def cases(world: int) -> list[Case]:
    """Every case the selftest runs at ``world`` ranks (hybrid only when the world size factors)."""
    out = [
        Case("ring causal, load balanced", "ring", "BNSD", "causal", True),
        Case("ring causal, contiguous, GQA", "ring", "BSND", "causal", False, gqa=True),
        Case("ring full, GQA", "ring", "BSH", "full", False, gqa=True),
        Case("ring window, contiguous", "ring", "SBH", "band", False),
        Case("ring window, load balanced, GQA", "ring", "BNSD", "band", True, gqa=True),
        Case("ring mask, load balanced", "ring", "BSND", "given", True),
        Case("ring mask + window, contiguous", "ring", "BNSD", "given_band", False, gqa=True),
        Case("ring causal, dropout", "ring", "BSND", "causal", True, keep_prob=KEEP_PROB),
        Case("ulysses causal, load balanced, GQA", "ulysses", "BSND", "causal", True, gqa=True),
        Case("ulysses full", "ulysses", "SBH", "full", False),
        Case("ulysses window, load balanced", "ulysses", "BSH", "band", True, gqa=True),
        Case("ulysses mask, contiguous", "ulysses", "BNSD", "given", False),
        Case("ulysses causal, dropout", "ulysses", "BNSD", "causal", True, keep_prob=KEEP_PROB),
    ]
    if hybrid_sizes(world):
        out += [
            Case("hybrid causal", "hybrid", "BNSD", "causal", False),
            Case("hybrid full, GQA", "hybrid", "BSND", "full", False, gqa=True),
            Case("hybrid window", "hybrid", "SBH", "band", False, gqa=True),
            Case("hybrid causal, dropout", "hybrid", "BSH", "causal", False, keep_prob=KEEP_PROB),
        ]
    out += [
        Case("TND causal, load balanced", "ring", "TND", "causal", True),
        Case("TND full, contiguous, GQA", "ring", "TND", "full", False, gqa=True),
        Case("TND causal, dropout", "ring", "TND", "causal", True, keep_prob=KEEP_PROB),
        Case("sinks", "ring", "BNSD", "causal", True, sink=True),
        Case("MLA (value head size != query's)", "ring", "BSND", "causal", True, mla=True),
    ]
    return out


# ---------------------------------------------------------------- where the ranks run


@dataclass
class Env:
    """One rank's device and how it calls the ops."""

    rank: int
    world: int
    device: object  # torch.device
    ops: str  # torch_npu | emulator
    kernel: str | None = None  # the step kernel cp_cache.enable() gets (CUDA: "reference")
    fused_merge: bool | None = None
    one_device: str = "op"  # the float32 reference: "op" (the op on plain tensors) or "dense" (torch)
    inject: bool = False
    repeats: int = 3
    meshes: dict = field(default_factory=dict)
    cpu_group: object = None  # the group that sums float64 values on the CPU (gloo); None: the default

    def mesh(self, case: Case):
        from torch.distributed.device_mesh import init_device_mesh

        sizes = hybrid_sizes(self.world) if case.algorithm == "hybrid" else (self.world,)
        if sizes not in self.meshes:
            names = ("ring", "ulysses") if len(sizes) == 2 else ("cp",)
            self.meshes[sizes] = init_device_mesh(self.device.type, sizes, mesh_dim_names=names)
        return self.meshes[sizes]


def pick_device(launched: bool) -> str:
    """npu (torch_npu sees an NPU), cuda, or cpu under torchrun; always cpu when spawned."""
    import torch

    from ._common import npu_present

    if not launched:
        return "cpu"
    if npu_present():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_env(rank: int, world: int, kind: str, opts: dict) -> Env:
    """Set this rank's device up (ops, emulator) and describe it."""
    import torch
    import torch.distributed as dist

    from ..emulator import install_npu_emulator

    local = int(os.environ.get("LOCAL_RANK", rank))
    cpu_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    common = dict(inject=opts["inject"], repeats=opts["repeats"], cpu_group=cpu_group)
    if kind == "npu":
        return Env(rank, world, torch.device("npu", local), "torch_npu", **common)
    install_npu_emulator(route_sdpa=False)
    if kind == "cuda":
        return Env(rank, world, torch.device("cuda", local), "emulator", kernel="reference", fused_merge=False,
                   one_device="dense", **common)
    return Env(rank, world, torch.device("cpu"), "emulator", **common)


# ---------------------------------------------------------------- one problem: inputs, mask, arguments


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

    from ..testing.reference import band_masked
    from ..testing.varlen_reference import document_masked

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

    from ..npu_ops import causal_mask

    case = prob.case
    kw = dict(scale=1.0 / math.sqrt(D), keep_prob=case.keep_prob)
    if case.layout == "TND":
        kw.update(actual_seq_qlen=torch.tensor(prob.cu), actual_seq_kvlen=torch.tensor(prob.cu))
        if case.mask == "causal":
            kw.update(atten_mask=causal_mask(device), sparse_mode=3, next_tockens=0)
    elif case.mask == "causal":
        kw.update(atten_mask=causal_mask(device), sparse_mode=2, next_tockens=0)
    elif case.mask == "band":
        kw.update(atten_mask=causal_mask(device), sparse_mode=4, pre_tockens=prob.window, next_tockens=0)
    elif case.mask == "given":
        kw.update(atten_mask=prob.given.to(device), sparse_mode=1)
    elif case.mask == "given_band":
        kw.update(atten_mask=prob.given.to(device), sparse_mode=0, pre_tockens=prob.window, next_tockens=2)
    return kw


# ---------------------------------------------------------------- sharding and gathering (the public helpers)


def _to_layout(x, layout: str):
    """A [B, N, S, D] tensor in ``layout`` (TND: [T, N, D] from batch 1)."""
    from .. import layout as L

    return x[0].permute(1, 0, 2).contiguous() if layout == "TND" else L.from_bnsd(x, layout).contiguous()


def _from_layout(x, layout: str, heads: int):
    """Back to [B, N, S, D], float64 on the CPU."""
    from .. import layout as L

    x = x.detach().cpu().double()
    return x.permute(1, 0, 2).unsqueeze(0) if layout == "TND" else L.to_bnsd(x, layout, heads)


def shard(prob: Problem, env: Env, x):
    """This rank's DTensor of a full [B, N, S, D] CPU tensor, laid out as the handlers expect."""
    import cp_cache
    from torch.distributed.tensor import DTensor, Shard

    from .. import layout as L

    case, mesh = prob.case, env.mesh(prob.case)
    full = _to_layout(x, case.layout).to(env.device)
    if case.layout == "TND":  # the placement's local lengths may differ between ranks: the global shape is given
        return DTensor.from_local(cp_cache.shard_documents(full, prob.cu, mesh), mesh, [Shard(0)], shape=full.shape,
                                  stride=full.stride())
    return cp_cache.shard_sequence(full, mesh, L.seq_dim(case.layout))


def unshard(prob: Problem, env: Env, x, heads: int):
    """The full [B, N, S, D] float64 CPU tensor of a DTensor laid out by ``shard`` (a collective)."""
    import cp_cache

    from .. import layout as L

    case = prob.case
    if case.layout == "TND":
        return _from_layout(cp_cache.unshard_documents(x, prob.cu, env.mesh(case)), "TND", heads)
    return _from_layout(cp_cache.unshard_sequence(x, L.seq_dim(case.layout)), case.layout, heads)


def unshard_lse(prob: Problem, env: Env, softmax_max, softmax_sum):
    """The full LSE [B, N, S] (float64, CPU) from the op's sharded statistics."""
    import cp_cache

    from ..npu_ops import lse_from_stats

    if prob.case.layout == "TND":  # statistics [T, N, 8], sharded on the tokens
        local = lse_from_stats(softmax_max.to_local(), softmax_sum.to_local()).contiguous()
        full = cp_cache.unshard_documents(local, prob.cu, env.mesh(prob.case))
        return full.detach().cpu().double().T.unsqueeze(0)
    full = [cp_cache.unshard_sequence(s, 2) for s in (softmax_max, softmax_sum)]
    return lse_from_stats(*full).detach().cpu().double()


# ---------------------------------------------------------------- the CP call


def cp_forward(prob: Problem, env: Env, q, k, v, sink=None):
    import torch

    return torch.ops.npu.npu_fusion_attention_v3(q, k, v, prob.nq, prob.case.layout, sink=sink,
                                                 **op_kwargs(prob, env.device))


def sink_leaf(prob: Problem, device):
    """The case's sink as a leaf that takes a gradient on ``device`` (None without a sink)."""
    return None if prob.sink is None else prob.sink.to(device).requires_grad_()


def _sync(env: Env) -> None:
    import torch

    if env.device.type != "cpu":
        getattr(torch, env.device.type).synchronize()


def _all_reduce(env: Env, values: list[float], op: str = "sum") -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=env.cpu_group)
    return [float(x) for x in t]


def cp_run(prob: Problem, env: Env) -> dict:
    """One checked CP call (forward, then backward by autograd), then ``repeats`` timed ones.
    Returns the outputs on the full sequence ([B, N, S, D] float64, CPU), the forward's bytes
    sent over all ranks and the median milliseconds per call (the slowest rank)."""
    import cp_cache
    import torch
    import torch.distributed as dist

    leaves = [shard(prob, env, t).detach().requires_grad_() for t in (prob.q, prob.k, prob.v)]
    sink = sink_leaf(prob, env.device)
    dout = shard(prob, env, prob.dout)
    out = cp_forward(prob, env, *leaves, sink=sink)
    sent = cp_cache.call_stats()["forward"]["bytes_sent"]
    grads = torch.autograd.grad(out[0], leaves + ([sink] if sink is not None else []), dout)
    got = {"out": unshard(prob, env, out[0], prob.nq), "lse": unshard_lse(prob, env, out[1], out[2])}
    for key, grad, heads in zip(("dq", "dk", "dv"), grads, (prob.nq, prob.nkv, prob.nkv)):
        got[key] = unshard(prob, env, grad, heads)
    if sink is not None:  # each rank's share of a plain tensor's gradient: their sum is the gradient
        got["dsink"] = torch.tensor(_all_reduce(env, grads[3].detach().cpu().double().tolist()))
    del out, grads
    times = []
    for _ in range(env.repeats):
        dist.barrier()
        started = time.perf_counter()
        torch.autograd.grad(cp_forward(prob, env, *leaves, sink=sink)[0], leaves, dout)
        _sync(env)
        times.append(time.perf_counter() - started)
    ms = 1e3 * statistics.median(times) if times else float("nan")
    total_sent, slowest = _all_reduce(env, [float(sent)])[0], _all_reduce(env, [ms], "max")[0]
    return dict(got=got, sent=total_sent, ms=slowest)


# ---------------------------------------------------------------- references


def dense_reference(prob: Problem, dtype, device="cpu") -> dict:
    """Dense attention on the full sequence in ``dtype`` on ``device``: float64 CPU is the truth."""
    from ..testing.reference import dense_attention

    q, k, v, dout = (t.to(device) for t in (prob.q, prob.k, prob.v, prob.dout))
    sink = None if prob.sink is None else prob.sink.to(device)
    res = dense_attention(q, k, v, dout, causal=False, dtype=dtype, masked=prob.masked.to(device), sink=sink)
    return {key: t.detach().cpu().double() for key, t in res.items()}


def one_device(prob: Problem, env: Env) -> dict:
    """The same attention on this rank's device alone, in float32: the op on plain full tensors
    (its own autograd for the gradients), or dense torch where the op has no kernel (CUDA)."""
    import torch

    from ..npu_ops import lse_from_stats

    if env.one_device == "dense":
        return dense_reference(prob, torch.float32, env.device)
    layout = prob.case.layout
    q, k, v = (_to_layout(t, layout).to(env.device).clone().requires_grad_() for t in (prob.q, prob.k, prob.v))
    sink = sink_leaf(prob, env.device)
    out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, prob.nq, layout, sink=sink, **op_kwargs(prob, env.device))
    grads = torch.autograd.grad(out[0], [q, k, v] + ([sink] if sink is not None else []),
                                _to_layout(prob.dout, layout).to(env.device))
    lse = lse_from_stats(out[1], out[2]).detach().cpu().double()
    res = {"out": _from_layout(out[0], layout, prob.nq), "lse": lse.T.unsqueeze(0) if layout == "TND" else lse}
    for key, grad, heads in zip(("dq", "dk", "dv"), grads, (prob.nq, prob.nkv, prob.nkv)):
        res[key] = _from_layout(grad, layout, heads)
    if sink is not None:
        res["dsink"] = grads[3].detach().cpu().double()
    return res


def kv_lower_bound(prob: Problem) -> int:
    """The least forward K/V traffic of the case's layout, summed over the ranks: rank r must
    receive the rows {j not held by r : some query i held by r may attend to j}, K and V, at
    the K/V heads, float32."""
    import cp_cache

    from ..testing.reference import rank_positions

    case, world = prob.case, prob.world
    allowed = ~prob.masked
    rows = 0
    for r in range(world):
        if case.layout == "TND":
            held = cp_cache.document_layout(prob.cu, world, load_balance=case.lb)[r]
        else:
            held = rank_positions(world, r, prob.seq // world, case.lb)
        need = allowed.index_select(0, held).any(0)
        need[held] = False
        rows += int(need.sum())
    batch, _, _, dim = prob.k.shape
    return rows * batch * prob.nkv * (dim + prob.v.size(-1)) * 4


# ---------------------------------------------------------------- checks


@dataclass
class Row:
    case: str
    check: str
    status: str = "ok"  # ok | FAIL | n/a
    error: float = float("nan")
    bound: float = float("nan")
    worst: str = ""  # the output whose error is nearest its bound
    ms: float = float("nan")
    sent: float = float("nan")
    lower: float = float("nan")
    note: str = ""


def compare(got: dict, truth: dict, reference: dict, inject: bool) -> tuple[float, float, str]:
    """(error, bound, key) of the output nearest its bound: each of out, lse, dq, dk, dv as
    max|x - truth| / max|truth|, bounded by 20x the one-device float32 reference's own + 32 eps
    (and dsink, with attention sinks)."""
    from ..testing.reference import error_bound, rel_err

    worst = None
    for key in ("out", "lse", "dq", "dk", "dv", "dsink"):
        if key not in truth:
            continue
        x = got[key]
        if inject:
            x = x + INJECTED * float(truth[key].abs().max())
        err, bound = rel_err(x, truth[key]), error_bound(rel_err(reference[key], truth[key]))
        if worst is None or err / bound > worst[0] / worst[1]:
            worst = (err, bound, key)
    return worst


def check_exact(prob: Problem, env: Env, row: Row) -> None:
    import torch

    run = cp_run(prob, env)
    row.ms, row.sent = run["ms"], run["sent"]
    if env.rank != 0:
        return
    truth, reference = dense_reference(prob, torch.float64), one_device(prob, env)
    row.error, row.bound, row.worst = compare(run["got"], truth, reference, env.inject)
    row.status = "ok" if row.error <= row.bound else "FAIL"


def check_dropout(prob: Problem, env: Env, row: Row) -> None:
    """Model-free: autograd's slope of sum(out * proj) along random directions of the local
    q/k/v against central differences, the RNG reset per forward so every call draws the same
    masks; each direction's bound measured from the differences at eps and eps/2."""
    import torch
    from torch.distributed.tensor import DTensor

    from ..testing.reference import directional_derivative_check

    run = cp_run(prob, env)
    row.ms, row.sent = run["ms"], run["sent"]
    shards = [shard(prob, env, t) for t in (prob.q, prob.k, prob.v)]
    mesh, placements = shards[0].device_mesh, shards[0].placements
    whole = [(s.shape, s.stride()) for s in shards]  # uneven shards (packed documents): the global shapes
    params = [s.to_local().detach().clone().requires_grad_() for s in shards]
    g = torch.Generator().manual_seed(7 + env.rank)
    proj = torch.randn(params[0].shape, generator=g).to(env.device)

    def loss():
        torch.manual_seed(99)
        out = cp_forward(prob, env, *(DTensor.from_local(t, mesh, placements, shape=shape, stride=stride)
                                      for t, (shape, stride) in zip(params, whole)))[0]
        return (out.to_local() * proj).sum()

    checks = directional_derivative_check(loss, params, directions=2, eps=5e-2,
                                          reduce=lambda x: _all_reduce(env, [x])[0])
    row.error, row.bound = max(checks, key=lambda c: c[0] / c[1])
    row.worst = "slope"
    row.status = "ok" if all(err <= bound for err, bound in checks) else "FAIL"
    if env.rank == 0:
        apart, bound = dropout_effect(prob, env, run["got"]["out"])
        if apart <= bound:
            row.status, row.note = "FAIL", f"the output is the dropout-free one ({apart:.1e} apart, bound {bound:.1e})"


def dropout_effect(prob: Problem, env: Env, out) -> tuple[float, float]:
    """How far the dropout output is from the dropout-free float64 one, and the bound of a
    dropout-free CP result (20x the one-device float32 error + 32 eps): dropout must exceed it."""
    import dataclasses

    import torch

    from ..testing.reference import error_bound, rel_err

    plain = dataclasses.replace(prob, case=dataclasses.replace(prob.case, keep_prob=1.0))
    truth = dense_reference(plain, torch.float64)["out"]
    return rel_err(out, truth), error_bound(rel_err(one_device(plain, env)["out"], truth))


def run_case(case: Case, env: Env) -> Row:
    """One case on this rank: set the algorithm and load balancing, run its check."""
    import cp_cache
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    check = "directional" if case.dropout else "fwd+bwd"
    row = Row(case.name, check)
    if case.dropout and env.kernel == "reference":
        row.status, row.note = "n/a", "the plain-torch step kernel (CUDA) has no dropout"
        return row
    try:
        cp_cache.enable(algorithm=case.algorithm, kernel=env.kernel, fused_merge=env.fused_merge)
        _cp_options.enable_load_balance = case.lb
        prob = make_problem(case, env.world)
        with cp_cache.context_parallel(env.mesh(case)):  # cp_cache takes the calls made in a CP region
            (check_dropout if case.dropout else check_exact)(prob, env, row)
        if env.rank == 0:
            row.lower = float(kv_lower_bound(prob))
    except Exception as exc:  # noqa: BLE001 - reported in the table; the other cases still run
        first = str(exc).splitlines()[0] if str(exc) else ""
        row.status, row.note = "FAIL", f"{type(exc).__name__}: {first[:160]}"
    return row


def selftest_rank(rank: int, world: int, kind: str, opts: dict) -> dict:
    """Every case on this rank; the rows (meaningful on rank 0) and what ran where."""
    import cp_cache
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    env = make_env(rank, world, kind, opts)
    load_balance = _cp_options.enable_load_balance
    started = time.perf_counter()
    try:
        rows = [run_case(case, env) for case in cases(world) if opts["cases"] in case.name]
    finally:
        _cp_options.enable_load_balance = load_balance
        cp_cache.disable()
    return dict(rows=rows, device=str(env.device), ops=env.ops, kernel=env.kernel or "npu",
                torch=torch.__version__, seconds=time.perf_counter() - started)


# ---------------------------------------------------------------- launching and reporting


def _launched(fn, kind: str, opts: dict) -> list | None:
    """Run ``fn`` in this torchrun process: hccl on NPUs, nccl on CUDA, gloo on CPUs; every
    rank's result on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    backend = {"npu": "hccl", "cuda": "nccl"}.get(kind, "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if kind == "npu":
        import torch_npu  # noqa: F401

        torch.npu.set_device(local)
    elif kind == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, timeout=timedelta(seconds=600))
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        value = fn(rank, size, kind, opts)
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
        return gathered
    finally:
        dist.destroy_process_group()


def _cell(x: float, fmt: str) -> str:
    return "-" if x != x else format(x, fmt)


def report(rows: list[Row]) -> str:
    """The table, one line per case, and the notes of the cases that have one below it."""
    headers = ["case", "check", "error", "bound", "ms/call", "sent", "K/V lower bound", "sent/bound", "result"]
    lines, notes = [], []
    for r in rows:
        error = "-" if r.error != r.error else f"{r.error:.1e}" + (f" ({r.worst})" if r.worst else "")
        ratio = "-" if r.lower != r.lower or r.lower <= 0 else f"{r.sent / r.lower:.2f}"
        if r.note:
            notes.append(f"[{len(notes) + 1}] {r.case}: {r.note}")
        mark = f" [{len(notes)}]" if r.note else ""
        lines.append([r.case, r.check, error, _cell(r.bound, ".1e"), _cell(r.ms, ".1f"), _fmt_bytes(r.sent),
                      _fmt_bytes(r.lower), ratio, r.status + mark])
    return "\n".join([table(headers, lines), *notes])


def _fmt_bytes(n: float) -> str:
    from ._common import fmt_bytes

    return "-" if n != n else fmt_bytes(n)


def verdict(rows: list[Row], world: int, info: dict) -> tuple[bool, str]:
    if not rows:
        return False, "FAIL: no case to run (see --cases)"
    failed = [r.case for r in rows if r.status == "FAIL"]
    checked = [r for r in rows if r.status == "ok"]
    skipped = [r.case for r in rows if r.status == "n/a"]
    where = f"{world} rank{'s' if world > 1 else ''} on {info['device'].split(':')[0]} ({info['ops']} ops, {info['kernel']} step kernel)"
    text = f"{len(checked)} of {len(rows)} cases passed on {where}"
    if skipped:
        text += f"; not run: {', '.join(skipped)}"
    if world == 1:
        text += " (one rank: nothing crossed ranks; launch two or more)"
    if failed:
        return False, f"FAIL: {len(failed)} failed ({', '.join(failed)}); {text}"
    return True, f"PASS: {text}"


LEGEND = """\
fwd+bwd: error = max|CP - float64| / max|float64| of the output (out, lse, dq, dk, dv) nearest its bound;
  bound = 20x the same error of one-device float32 attention on the same inputs + 32 eps
directional (dropout): |autograd slope - central difference| / slope, bound from the differences themselves
ms/call: one forward + backward (median of --repeats, slowest rank); sent: forward bytes, all ranks;
K/V lower bound: K/V rows that some query of a rank may attend to and the rank does not hold, summed
"""


def run(args: argparse.Namespace) -> int:
    from ..testing.multiprocess import run_ranks

    launched = under_torchrun()
    opts = dict(inject=args.inject_error, repeats=args.repeats, cases=args.cases)
    started = time.perf_counter()
    if launched:
        results = _launched(selftest_rank, pick_device(True), opts)
        if results is None:
            return 0
    else:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # spawned CPU ranks: no torch_npu
        results = run_ranks(selftest_rank, args.ranks, "cpu", opts, timeout=900.0)
    info, world = results[0], len(results)
    rows = info["rows"]
    how = "torchrun" if launched else "spawned, gloo on loopback"
    print(f"cp_cache selftest: {world} ranks on {info['device']} ({info['ops']} attention ops, "
          f"{info['kernel']} step kernel, torch {info['torch']}, {how})")
    print(LEGEND)
    print(report(rows))
    ok, text = verdict(rows, world, info)
    print(f"\nverdict: {text}")
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1
