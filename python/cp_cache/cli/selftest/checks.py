"""Running one case: the CP call, its one-device and float64 references, the checks and the row."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from .cases import Case, cases
from .environment import Env, make_env
from .problems import Problem, from_layout, kv_lower_bound, make_problem, op_kwargs, shard, to_layout, unshard, unshard_lse


INJECTED = 1e-3  # --inject-error: every checked output off by this much of its largest value


# ---------------------------------------------------------------- the CP call


def attention_op(env: Env):
    """The op a user of this path calls: cp_cache's own (what SDPA and transformers reach without an NPU) or the
    NPU v3 op (torch_npu's, or the emulator's)."""
    import torch

    return torch.ops.cp_cache.fusion_attention if env.ops == "cp_cache" else torch.ops.npu.npu_fusion_attention_v3


def cp_forward(prob: Problem, env: Env, q, k, v, sink=None):
    return attention_op(env)(q, k, v, prob.nq, prob.case.layout, sink=sink, **op_kwargs(prob, env.device))


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
    from ...testing.reference import dense_attention

    q, k, v, dout = (t.to(device) for t in (prob.q, prob.k, prob.v, prob.dout))
    sink = None if prob.sink is None else prob.sink.to(device)
    res = dense_attention(q, k, v, dout, causal=False, dtype=dtype, masked=prob.masked.to(device), sink=sink)
    return {key: t.detach().cpu().double() for key, t in res.items()}


def one_device(prob: Problem, env: Env) -> dict:
    """The same attention on this rank's device alone, in float32: the op on plain full tensors
    (its own autograd for the gradients), or dense torch where the op has no kernel (CUDA)."""
    import torch

    from ...npu_ops import lse_from_stats

    if env.one_device == "dense":
        return dense_reference(prob, torch.float32, env.device)
    layout = prob.case.layout
    q, k, v = (to_layout(t, layout).to(env.device).clone().requires_grad_() for t in (prob.q, prob.k, prob.v))
    sink = sink_leaf(prob, env.device)
    out = attention_op(env)(q, k, v, prob.nq, layout, sink=sink, **op_kwargs(prob, env.device))
    grads = torch.autograd.grad(out[0], [q, k, v] + ([sink] if sink is not None else []),
                                to_layout(prob.dout, layout).to(env.device))
    lse = lse_from_stats(out[1], out[2]).detach().cpu().double()
    res = {"out": from_layout(out[0], layout, prob.nq), "lse": lse.T.unsqueeze(0) if layout == "TND" else lse}
    for key, grad, heads in zip(("dq", "dk", "dv"), grads, (prob.nq, prob.nkv, prob.nkv)):
        res[key] = from_layout(grad, layout, heads)
    if sink is not None:
        res["dsink"] = grads[3].detach().cpu().double()
    return res


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
    from ...testing.reference import error_bound, rel_err

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

    from ...testing.reference import directional_derivative_check

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

    from ...testing.reference import error_bound, rel_err

    plain = dataclasses.replace(prob, case=dataclasses.replace(prob.case, keep_prob=1.0))
    truth = dense_reference(plain, torch.float64)["out"]
    return rel_err(out, truth), error_bound(rel_err(one_device(plain, env)["out"], truth))


def run_case(case: Case, env: Env) -> Row:
    """One case on this rank: set the algorithm and load balancing, run its check."""
    import cp_cache
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    check = "directional" if case.dropout else "fwd+bwd"
    row = Row(case.name, check)
    if case.dropout and (env.kernel == "reference" or (env.kernel == "torch" and env.device.type == "cpu")):
        row.status, row.note = "n/a", f"the {env.kernel} step kernel has no dropout on {env.device.type} (refused)"
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
