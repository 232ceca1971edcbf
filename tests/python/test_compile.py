"""torch.compile under cp_cache's context parallelism.

A compiled model (each TinyDecoder block compiled, as torchtitan does; and a single
compiled block) trains under ``cp_cache.context_parallel`` at W = 1 and 2 with the loss
and gradients of the same model run eagerly under CP (same dropout draws) and, without
dropout, of one process on the whole sequence. The compiled graphs call the ring
through the ``cp_cache::ring_forward`` / ``ring_backward`` ops; the step cache's handle
travels through the compiled graph's saved tensors, so lifetime is eager's: nothing
alive after a step, nothing between forward and backward under full checkpointing.
Under fake tensors the handlers give outputs of the right shapes and placements
without touching the store. One spawned pair of ranks does every rank-side check: the
W = 2 checks on the pair's mesh, then the W = 1 checks on a one-rank mesh of each rank
(each rank takes every other W = 1 item: the two halves run at once); the tests read
its results.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import cp_cache
from cp_cache.testing.multiprocess import run_ranks
from cp_cache.testing.reference import error_bound

WORLDS = (1, 2)
SEQ = 16  # divisible by 2W for W = 1, 2
BATCH = 2
STEPS = 3
LAYERS = 2
HEADS, KV_HEADS, DIM = 4, 2, 32
DROPOUT = 0.25


@dataclass(frozen=True)
class Case:
    dropout: float = 0.0
    checkpoint: str = "none"
    policy: str = "handle"
    backend: str = "aot_eager"
    whole: bool = False  # compile the whole model (checkpointing inside the compiled region), not each block
    kernel: str = "npu"

    @property
    def name(self) -> str:
        return (f"{self.backend}-{self.policy}-{self.checkpoint}-p{self.dropout}" + ("-whole" if self.whole else "")
                + ("" if self.kernel == "npu" else f"-{self.kernel}"))


CASES = [
    Case(),
    Case(dropout=DROPOUT),
    Case(checkpoint="non_reentrant"),
    Case(dropout=DROPOUT, checkpoint="non_reentrant"),
    Case(checkpoint="reentrant", dropout=DROPOUT),
    Case(policy="stack"),
    Case(policy="stack", dropout=DROPOUT, checkpoint="non_reentrant"),
    Case(backend="inductor", dropout=DROPOUT),
    # torchtitan's order: checkpoint, then compile; the compiled backward recomputes the ring
    Case(dropout=DROPOUT, checkpoint="non_reentrant", whole=True),
    Case(dropout=DROPOUT, checkpoint="non_reentrant", policy="stack", whole=True),
    Case(dropout=DROPOUT, checkpoint="non_reentrant", backend="inductor", whole=True),
    # the NPU op's handler on torch's kernel: inductor checks the outputs' strides against the op's fake
    Case(checkpoint="non_reentrant", backend="inductor", whole=True, kernel="torch"),
]


@pytest.fixture(autouse=True)
def no_live_caches():
    yield
    assert cp_cache.stats()["live_entries"] == 0


# ---------------------------------------------------------------- rank side


def _quiet_compile():
    import torch._functorch.config as functorch_config

    # torch's AOTAutograd cache can crash (SIGSEGV in pickle) saving a backward that calls a
    # custom op (pytorch/pytorch#177442); the graphs here are compiled once per run anyway
    functorch_config.enable_autograd_cache = False
    torch._dynamo.reset()


def _model(dropout: float, checkpoint: str):
    from cp_cache.testing.models import ModelConfig, TinyDecoder

    torch.manual_seed(0)  # the same init on every rank and in the references
    config = ModelConfig(vocab=64, dim=DIM, heads=HEADS, kv_heads=KV_HEADS, layers=LAYERS, max_seq=SEQ,
                         dropout=dropout)
    return TinyDecoder(config, checkpoint=checkpoint)


def _compile_blocks(model, backend):
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, backend=backend)
    return model


def _cp_step(model, mesh, batch, world: int, rng_seed: int) -> dict:
    """One CP training step's loss (mean over ranks), gradients (averaged) and live caches."""
    import torch.distributed as dist

    from cp_cache.testing.models import loss_fn

    tokens, labels, positions = (t.clone() for t in batch)
    torch.manual_seed(rng_seed)  # the same dropout draws eagerly and compiled
    with cp_cache.context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 1]):
        loss = loss_fn(model(tokens, positions), labels)
        live_fwd = cp_cache.stats()["live_entries"]
        loss.backward()
    loss = loss.detach()
    group = mesh.get_group()  # the CP ranks (at W = 1 a rank's own mesh, not the pair)
    dist.all_reduce(loss, group=group)
    grads = []
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        grads.append(p.grad / world)
    stats = cp_cache.stats()
    return dict(loss=float(loss) / world, grads=grads, live_fwd=live_fwd, live_after=stats["live_entries"],
                bytes_after=stats["live_bytes"], stack_depth=stats["stack_depth"])


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _train_case(case: Case, mesh, world: int) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend

    from cp_cache.testing.models import loss_fn, make_batch

    _quiet_compile()
    cp_cache.enable(case.policy, kernel=case.kernel)
    eager = _model(case.dropout, case.checkpoint)
    compiled = copy.deepcopy(eager)
    reference = copy.deepcopy(eager)  # one process, whole sequence, dropout off
    for module in reference.modules():
        if hasattr(module, "dropout") and isinstance(module.dropout, float):
            module.dropout = 0.0
    truth = copy.deepcopy(reference).double()  # the same in float64: what the float32 runs are measured against
    counter = CompileCounterWithBackend(case.backend)
    if case.whole:
        compiled = torch.compile(compiled, backend=counter)
    else:
        _compile_blocks(compiled, counter)
    models = dict(eager=eager, compiled=compiled, reference=reference, truth=truth)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.5) for name, m in models.items()}
    out = {k: [] for k in ("loss", "eager_loss", "ref_loss", "truth_loss", "grad_vs_eager", "grad_vs_truth",
                           "ref_grad_err", "live_fwd", "eager_live_fwd", "live_after", "bytes_after", "stack_depth",
                           "frames")}
    for step in range(STEPS):
        batch = make_batch(BATCH, SEQ, 64, seed=step)
        e = _cp_step(eager, mesh, batch, world, rng_seed=100 + step)
        c = _cp_step(compiled, mesh, batch, world, rng_seed=100 + step)
        out["frames"].append(counter.frame_count)
        ref_loss = loss_fn(reference(batch[0], batch[2]), batch[1])
        ref_loss.backward()
        truth_loss = torch.nn.functional.cross_entropy(truth(batch[0], batch[2]).flatten(0, 1), batch[1].flatten())
        truth_loss.backward()
        out["loss"].append(c["loss"])
        out["eager_loss"].append(e["loss"])
        out["ref_loss"].append(float(ref_loss.detach()))
        out["truth_loss"].append(float(truth_loss.detach()))
        out["grad_vs_eager"].append(max(_rel(a, b) for a, b in zip(c["grads"], e["grads"])))
        out["grad_vs_truth"].append(max(_rel(a.double(), p.grad) for a, p in zip(c["grads"], truth.parameters())))
        out["ref_grad_err"].append(max(_rel(r.grad.double(), p.grad)
                                       for r, p in zip(reference.parameters(), truth.parameters())))
        out["live_fwd"].append(c["live_fwd"])
        out["eager_live_fwd"].append(e["live_fwd"])
        for key in ("live_after", "bytes_after", "stack_depth"):
            out[key].append(max(e[key], c[key]))
        for name, model in models.items():
            if name in ("eager", "compiled"):
                for p, g in zip(model.parameters(), (e if name == "eager" else c)["grads"]):
                    p.grad = g
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
    cp_cache.enable("handle")
    return out


def _single_block(mesh, world: int, rank: int) -> dict:
    """One compiled block, fullgraph=True, default (inductor) backend when asked: output and
    input/parameter gradients against eager CP and one process; graph breaks and recompiles."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from cp_cache.testing.models import Block, ModelConfig
    from cp_cache.testing.reference import rank_positions

    _quiet_compile()
    torch.manual_seed(0)
    block = Block(ModelConfig(vocab=64, dim=DIM, heads=HEADS, kv_heads=KV_HEADS, layers=1, max_seq=SEQ))
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(6))
    pos = rank_positions(world, rank, SEQ // world, load_balance=True)
    res = {}

    def calls():
        stats = cp_cache.call_stats()
        return stats["forward"]["calls"], stats["backward"]["calls"]

    def run(fn):
        block.zero_grad(set_to_none=True)
        xl = x[:, pos].clone().requires_grad_()
        before = calls()
        with cp_cache.context_parallel(mesh):
            y = fn(xl)
            live = cp_cache.stats()["live_entries"]
            y.backward(dy[:, pos])
        grads = [p.grad.clone() for p in block.parameters()]
        ring_calls = tuple(now - then for now, then in zip(calls(), before))
        return y.detach(), xl.grad, grads, live, ring_calls

    with cp_cache.context_parallel(mesh), torch.no_grad():
        explained = torch._dynamo.explain(block)(x[:, pos].clone())
    res["graph_breaks"], res["graphs"] = explained.graph_break_count, explained.graph_count
    del explained
    torch._dynamo.reset()

    eager = run(block)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(block, backend=counter, fullgraph=True)
        outs = [run(compiled) for _ in range(2)]
        res[backend] = dict(
            frames=counter.frame_count,
            out_err=max(_rel(o[0], eager[0]) for o in outs),
            dx_err=max(_rel(o[1], eager[1]) for o in outs),
            dparam_err=max(_rel(a, b) for o in outs for a, b in zip(o[2], eager[2])),
            live_fwd=[o[3] for o in outs],
            ring_calls=[o[4] for o in outs],
        )
    # one process, the whole sequence, in float32 and float64: the eager CP rows of this rank against
    # float64, and the float32 rounding of the block on this machine (output, input and parameter gradients)
    block.zero_grad(set_to_none=True)
    xf = x.clone().requires_grad_()
    yf = block(xf)
    yf.backward(dy)
    block64 = copy.deepcopy(block).double()
    block64.zero_grad(set_to_none=True)
    x64 = x.double().requires_grad_()
    y64 = block64(x64)
    y64.backward(dy.double())
    res["eager_vs_truth"] = max(_rel(eager[0].double(), y64.detach()[:, pos]),
                                _rel(eager[1].double(), x64.grad[:, pos]))
    res["rounding"] = max(_rel(yf.detach().double(), y64.detach()), _rel(xf.grad.double(), x64.grad),
                          *(_rel(a.grad.double(), b.grad) for a, b in zip(block.parameters(), block64.parameters())))
    res["live"] = cp_cache.stats()["live_entries"]
    return res


def _fake_tracing(mesh, world: int) -> dict:
    """The handlers under FakeTensorMode and on meta tensors: shapes, dtypes, devices and
    placements, and nothing run (no cache created, no ring call counted)."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.tensor import DTensor, Shard

    from cp_cache.npu_ops import causal_mask

    B, N, S, D = 2, 4, 4 * world, 8
    before_stats, before_calls = cp_cache.stats(), cp_cache.call_stats()
    results = {}
    for kind in ("fake", "meta"):
        mode = FakeTensorMode() if kind == "fake" else None
        with mode if mode is not None else contextlib.nullcontext():
            if mode is not None:
                local = [mode.from_tensor(torch.randn(B, N, S // world, D)) for _ in range(4)]
                mask = mode.from_tensor(causal_mask("cpu"))
            else:
                local = [torch.empty(B, N, S // world, D, device="meta") for _ in range(4)]
                mask = causal_mask("meta")
            q, k, v, dy = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in local)
            out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, "BNSD", atten_mask=mask, sparse_mode=2,
                                                        next_tockens=0, scale=0.5, keep_prob=0.9)
            grads = torch.ops.npu.npu_fusion_attention_grad_v3(
                q, k, v, dy, N, "BNSD", atten_mask=mask, sparse_mode=2, next_tockens=0, scale_value=0.5,
                keep_prob=0.9, softmax_max=out[1], softmax_sum=out[2], attention_in=out[0], seed=out[4],
                offset=out[5])

        def describe(t):
            local_t = t.to_local() if isinstance(t, DTensor) else t
            return dict(type=type(t).__name__, shape=tuple(t.shape), dtype=t.dtype, device=str(t.device),
                        placements=tuple(t.placements) if isinstance(t, DTensor) else None,
                        fake=isinstance(local_t, FakeTensor) if kind == "fake" else local_t.is_meta)

        results[kind] = dict(forward=[describe(t) for t in out], backward=[describe(t) for t in grads[:3]])
        with mode if mode is not None else contextlib.nullcontext():
            tnd_out, tnd_grads = _fake_tnd_call(mesh, world, mode)
        results[kind].update(tnd_forward=[describe(t) for t in tnd_out], tnd_backward=[describe(t) for t in tnd_grads])
    after_stats, after_calls = cp_cache.stats(), cp_cache.call_stats()
    results.update(
        created=after_stats["created"] - before_stats["created"],
        pushed=after_stats["pushed"] - before_stats["pushed"],
        calls=(after_calls["forward"]["calls"] - before_calls["forward"]["calls"],
               after_calls["backward"]["calls"] - before_calls["backward"]["calls"]),
    )
    return results


def _fake_tnd_call(mesh, world: int, mode):
    """Packed documents (TND) through the handlers with fake (``mode``) or meta tensors, the lengths
    tensors included: their values are not read. (forward outputs, (dq, dk, dv))."""
    from torch.distributed.tensor import DTensor, Shard

    from cp_cache.npu_ops import causal_mask

    T, N, D = 8 * world, 4, 8
    if mode is not None:
        local = [mode.from_tensor(torch.randn(T // world, N, D)) for _ in range(4)]
        mask, cu = mode.from_tensor(causal_mask("cpu")), mode.from_tensor(torch.tensor([4 * world, T]))
    else:
        local = [torch.empty(T // world, N, D, device="meta") for _ in range(4)]
        mask, cu = causal_mask("meta"), torch.empty(2, dtype=torch.int64, device="meta")
    q, k, v, dy = (DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in local)
    lengths = dict(actual_seq_qlen=cu, actual_seq_kvlen=cu)
    out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, "TND", atten_mask=mask, sparse_mode=3, scale=0.5,
                                                **lengths)
    grads = torch.ops.npu.npu_fusion_attention_grad_v3(
        q, k, v, dy, N, "TND", atten_mask=mask, sparse_mode=3, scale_value=0.5, softmax_max=out[1],
        softmax_sum=out[2], attention_in=out[0], seed=out[4], offset=out[5], **lengths)
    return out, grads[:3]


MASK_KINDS = ("band", "given", "given-sharded", "causal-contiguous")


def _masks_compiled(mesh, world: int, rank: int) -> dict:
    """The v3 op on DTensors in a compiled function (fullgraph), for windows and given masks,
    against the same call run eagerly: output and q/k/v gradients."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.npu_ops import causal_mask
    from cp_cache.testing.reference import rank_positions

    B, N, s_local, D = 2, 2, 4, 8
    S = s_local * world
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(B, N, S, D, generator=g) for _ in range(4))
    given = torch.rand(S, S, generator=g) < 0.4
    res = {}
    for kind in MASK_KINDS:
        _quiet_compile()
        _cp_options.enable_load_balance = kind != "causal-contiguous"
        pos = rank_positions(world, rank, s_local, _cp_options.enable_load_balance)
        mask, kw = given, dict(sparse_mode=1)
        if kind == "band":
            mask, kw = causal_mask("cpu"), dict(sparse_mode=4, pre_tockens=s_local + 2, next_tockens=0)
        elif kind == "given-sharded":
            mask, kw = DTensor.from_local(given[pos], mesh, [Shard(0)]), dict(sparse_mode=0)
        elif kind == "causal-contiguous":
            mask, kw = causal_mask("cpu"), dict(sparse_mode=2, next_tockens=0)

        def attend(q, k, v, mask):
            return torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, "BNSD", atten_mask=mask, scale=0.3, **kw)[0]

        runs = []
        for fn in (attend, torch.compile(attend, backend="aot_eager", fullgraph=True)):
            qd, kd, vd = (DTensor.from_local(t[:, :, pos].clone(), mesh, [Shard(2)]).requires_grad_() for t in (q, k, v))
            out = fn(qd, kd, vd, mask)
            out.backward(DTensor.from_local(dout[:, :, pos], mesh, [Shard(2)]))
            runs.append([t.to_local().detach() for t in (out, qd.grad, kd.grad, vd.grad)])
        res[kind] = max(_rel(a, b) for a, b in zip(runs[1], runs[0]))
    _cp_options.enable_load_balance = True
    return res


def _algorithms_compiled(mesh, world: int, rank: int) -> dict:
    """Ulysses (1-D mesh) and packed documents (TND) in a compiled function, against the same
    call run eagerly; the graphs and graph breaks Dynamo makes of the call."""
    import torch._dynamo
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.npu_ops import causal_mask
    from cp_cache.testing.reference import rank_positions

    _cp_options.enable_load_balance = True
    g = torch.Generator().manual_seed(5)
    B, N, s_local, D = 1, 4, 4, 8
    S = s_local * world
    bnsd = [torch.randn(B, N, S, D, generator=g) for _ in range(4)]
    pos = rank_positions(world, rank, s_local, True)

    def ulysses(q, k, v):
        return torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, "BNSD", atten_mask=causal_mask("cpu"), sparse_mode=2,
                                                     scale=0.3)[0]

    def local_bnsd(t):
        return DTensor.from_local(t[:, :, pos].clone(), mesh, [Shard(2)])

    cp_cache.enable("handle", algorithm="ulysses")
    _quiet_compile()
    runs = []
    for f in (ulysses, torch.compile(ulysses, backend="aot_eager")):
        qd, kd, vd = (local_bnsd(t).requires_grad_() for t in bnsd[:3])
        out = f(qd, kd, vd)
        out.backward(local_bnsd(bnsd[3]))
        runs.append([t.to_local().detach() for t in (out, qd.grad, kd.grad, vd.grad)])
        del out
    torch._dynamo.reset()
    explained = torch._dynamo.explain(ulysses)(*(local_bnsd(t) for t in bnsd[:3]))
    res = {"ulysses": dict(err=max(_rel(a, b) for a, b in zip(runs[1], runs[0])), graphs=explained.graph_count,
                           graph_breaks=explained.graph_break_count, live=cp_cache.stats()["live_entries"],
                           rounding=_one_device_rounding(ulysses, bnsd))}
    # per-document head-tail: equal local shapes for both documents, so the second call reuses the
    # first compile (the balanced placement's local lengths follow the documents)
    cp_cache.enable("handle", algorithm="ring", documents="head_tail")
    res["tnd"] = _packed_compiled(mesh, world)
    cp_cache.enable("handle")
    return res


def _packed_compiled(mesh, world: int) -> dict:
    """Packed documents (TND, lengths as a tensor argument) compiled with aot_eager and inductor,
    fullgraph: against eager for the documents traced with and for other documents of the same
    count (the compiled graph reads each call's lengths: no recompile); Dynamo's graphs and breaks."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.tensor import DTensor, Shard

    from cp_cache.npu_ops import causal_mask

    g = torch.Generator().manual_seed(7)
    N, D, T = 4, 8, 8 * world
    tnd = [torch.randn(T, N, D, generator=g) for _ in range(4)]
    documents = (torch.tensor([4 * world, T]), torch.tensor([2 * world, T]))  # every length divides by 2W

    def packed(q, k, v, cu):
        return torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, "TND", atten_mask=causal_mask("cpu"), sparse_mode=3,
                                                     scale=0.3, actual_seq_qlen=cu, actual_seq_kvlen=cu)[0]

    def run(fn, cu):
        def local(t):
            return DTensor.from_local(cp_cache.shard_documents(t, cu, mesh), mesh, [Shard(0)])

        qd, kd, vd = (local(t).requires_grad_() for t in tnd[:3])
        out = fn(qd, kd, vd, cu)
        out.backward(local(tnd[3]))
        return [t.to_local().detach() for t in (out, qd.grad, kd.grad, vd.grad)]

    _quiet_compile()
    eager = [run(packed, cu) for cu in documents]
    res = {}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(packed, backend=counter, fullgraph=True)
        errs = [max(_rel(a, b) for a, b in zip(run(compiled, cu), want)) for cu, want in zip(documents, eager)]
        res[backend] = dict(errs=errs, frames=counter.frame_count)
    torch._dynamo.reset()
    q, k, v = (DTensor.from_local(cp_cache.shard_documents(t, documents[0], mesh), mesh, [Shard(0)]) for t in tnd[:3])
    explained = torch._dynamo.explain(packed)(q, k, v, documents[0])
    res.update(graphs=explained.graph_count, graph_breaks=explained.graph_break_count,
               live=cp_cache.stats()["live_entries"],
               rounding=max(_one_device_rounding(lambda q, k, v, cu=cu: packed(q, k, v, cu), tnd) for cu in documents))
    return res


def _one_device_rounding(fn, tensors) -> float:
    """The float32 rounding of ``fn`` (the op call) on this machine: run on one device (plain tensors,
    the whole sequence) in float32 against float64, the worst ``_rel`` of the output and q/k/v gradients."""
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in tensors[:3]]
        out = fn(*leaves)
        out.backward(tensors[3].to(dtype))
        runs.append([out.detach(), *(t.grad for t in leaves)])
    return max(_rel(a.double(), b) for a, b in zip(*runs))


def _world_checks(mesh, world: int, rank: int, items) -> dict:
    """The rank-side checks named in ``items`` on ``mesh`` (W = ``world``, this rank ``rank`` of it):
    "block", "traced" (fake tensors, masks, Ulysses and TND) and the training cases."""
    results: dict = {"train": {}}
    for item in items:
        if item == "block":
            results["block"] = _single_block(mesh, world, rank)
        elif item == "traced":
            with cp_cache.context_parallel(mesh):
                results.update(fake=_fake_tracing(mesh, world), masks=_masks_compiled(mesh, world, rank),
                               algorithms=_algorithms_compiled(mesh, world, rank))
        else:
            results["train"][item.name] = _train_case(item, mesh, world)
    results["live_entries"] = cp_cache.stats()["live_entries"]
    return results


# W = 1: the single block, the traced calls, and the training cases that between them take every
# value of each case dimension once (checkpoint none / non-reentrant / reentrant, dropout, both
# policies, both backends, blocks and the whole model compiled). What W = 1 changes is the plan
# (no peers: no exchange), the same for every case; the cases' combinations run in full at W = 2.
# Ordered so that every other item (one rank's half) costs about as much as the rest.
W1_CASES = [Case(policy="stack"), Case(dropout=DROPOUT, checkpoint="non_reentrant", backend="inductor", whole=True),
            Case(checkpoint="reentrant", dropout=DROPOUT)]
W1_ITEMS = ["block", "traced", *W1_CASES]


# ---------------------------------------------------------------- one graph for every sequence length

# A block calling the v3 op on DTensors sharded on the sequence, compiled with dynamic=True, run at
# six local lengths in a row: the handler reads the call from symbolic sizes (layout.dims keeps them
# symbolic; the plan holds no length), so Dynamo compiles it once, where it compiled one graph per
# length before. The same for packed documents (TND, causal) under the balanced placement, six
# document sets of one total length whose local lengths differ (before: one graph for even local
# lengths, one for uneven ones). At a capacity (every rank padded to the same rows), static shapes
# with only the lengths tensor's size marked dynamic: one graph for six document sets that change
# count and total. Output and gradients equal the eager block's bit for bit (the same custom op on
# the same shards).
LOCAL_LENGTHS = (6, 8, 10, 12, 14, 16)  # head-tail needs even local lengths; none equals N or D
LENGTH_HEADS, LENGTH_HEAD_DIM = 4, 16
LENGTH_ALGORITHMS = ("ring", "ulysses")
DOCUMENT_SETS = ((10, 20, 34), (5, 30, 29), (40, 8, 16), (3, 3, 58), (16, 16, 32), (7, 50, 7))  # 64 tokens each
# at a capacity of 40 rows per rank: documents that change count and total (48 to 72 tokens)
CAPACITY, CAPACITY_DOCUMENT_SETS = 40, ((10, 20, 34), (5, 30, 29, 6), (40, 8), (3, 3, 58, 2, 4), (16, 16, 32),
                                        (7, 50, 7, 3, 1, 2))


def _dense_lengths(algorithm: str, mesh, placements: list, load_balance: bool, rank: int) -> dict:
    """The dense causal BNSD block under ``algorithm`` over ``LOCAL_LENGTHS``, eager and compiled
    with dynamic=True."""
    import torch._dynamo
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.npu_ops import causal_arguments

    causal = causal_arguments("cpu")

    def block(q, k, v):
        qd, kd, vd = (DTensor.from_local(t, mesh, placements) for t in (q, k, v))
        out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, LENGTH_HEADS, "BNSD", scale=LENGTH_HEAD_DIM ** -0.5,
                                                    **causal)[0]
        return out.to_local()

    cp_cache.enable("handle", algorithm=algorithm)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, dynamic=True, backend="aot_eager")
    differing = []
    with cp_cache.context_parallel(mesh):
        _cp_options.enable_load_balance = load_balance
        for s in LOCAL_LENGTHS:
            g = torch.Generator().manual_seed(s * 10 + rank)
            x = [torch.randn(1, LENGTH_HEADS, s, LENGTH_HEAD_DIM, generator=g) for _ in range(4)]
            got = []
            for fn in (block, compiled):
                q, k, v = (t.clone().requires_grad_() for t in x[:3])
                out = fn(q, k, v)
                out.backward(x[3])
                got.append((out.detach(), q.grad, k.grad, v.grad))
            differing += [(s, name) for name, a, b in zip(("out", "dq", "dk", "dv"), *got) if not torch.equal(a, b)]
    return dict(graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"], differing=differing,
                live=cp_cache.stats()["live_entries"])


def _lengths_compiled(mesh, rank: int, grid=None) -> dict:
    """Every length check on the 1-D ``mesh`` (head-tail); with a 2-D ``grid``, hybrid over it too
    (contiguous shards: hybrid takes no head-tail)."""
    import torch._dynamo
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    balance = _cp_options.enable_load_balance
    results = {}
    try:
        for algorithm in LENGTH_ALGORITHMS:
            results[algorithm] = _dense_lengths(algorithm, mesh, [Shard(2)], True, rank)
        if grid is not None:
            results["hybrid"] = _dense_lengths("hybrid", grid, [Shard(2), Shard(2)], False, rank)
        _cp_options.enable_load_balance = True
        results["packed"] = _documents_compiled(mesh, rank)
        results["packed_capacity"] = _documents_compiled(mesh, rank, CAPACITY)
    finally:
        _cp_options.enable_load_balance = balance
        torch._dynamo.reset()
        cp_cache.enable("handle")
    return results


def _documents_compiled(mesh, rank: int, capacity: Optional[int] = None) -> dict:
    """The balanced placement's TND block over ``DOCUMENT_SETS``, eager and compiled with dynamic=True;
    with a ``capacity``, over ``CAPACITY_DOCUMENT_SETS`` at that capacity, compiled with static shapes
    (the lengths tensor's size, the number of documents, marked dynamic)."""
    import itertools

    import torch._dynamo
    from torch.distributed.tensor import DTensor, Shard

    from cp_cache.npu_ops import causal_mask

    sets = DOCUMENT_SETS if capacity is None else CAPACITY_DOCUMENT_SETS
    total = sum(DOCUMENT_SETS[0])
    shape = torch.Size((total, LENGTH_HEADS, LENGTH_HEAD_DIM))
    given = {} if capacity else dict(shape=shape, stride=(shape[1] * shape[2], shape[2], 1))  # uneven shards

    def block(q, k, v, cu):
        qd, kd, vd = (DTensor.from_local(t, mesh, [Shard(0)], **given) for t in (q, k, v))
        return torch.ops.npu.npu_fusion_attention_v3(
            qd, kd, vd, LENGTH_HEADS, "TND", scale=LENGTH_HEAD_DIM ** -0.5, atten_mask=causal_mask("cpu"),
            sparse_mode=3, next_tockens=0, actual_seq_qlen=cu, actual_seq_kvlen=cu)[0].to_local()

    cp_cache.enable("handle", documents="balanced", document_capacity=capacity)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, dynamic=True if capacity is None else None, backend="aot_eager")
    differing, lengths = [], []
    with cp_cache.context_parallel(mesh):
        for docs in sets:
            cu = list(itertools.accumulate(docs))
            g = torch.Generator().manual_seed(len(lengths))
            local = [cp_cache.shard_documents(torch.randn(cu[-1], *shape[1:], generator=g), cu, mesh) for _ in range(4)]
            lengths.append(local[0].size(0))
            got = []
            for fn in (block, compiled):
                q, k, v = (t.clone().requires_grad_() for t in local[:3])
                cu_tensor = torch.tensor(cu)
                if capacity:
                    torch._dynamo.mark_dynamic(cu_tensor, 0)
                out = fn(q, k, v, cu_tensor)
                out.backward(local[3])
                got.append((out.detach(), q.grad, k.grad, v.grad))
            differing += [(docs, name) for name, a, b in zip(("out", "dq", "dk", "dv"), *got) if not torch.equal(a, b)]
    return dict(graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"], differing=differing,
                live=cp_cache.stats()["live_entries"], lengths=lengths)


def _compile_rank(rank: int, world: int, cases: list[Case]) -> dict:
    """Both world sizes on one pair of ranks (one process start and one first compile for both):
    W = 2 on the pair, then W = 1 on a one-rank mesh of each rank, every other item of
    ``W1_ITEMS`` on each (CP of degree 1 in a larger world, as data parallel over CP would make it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.testing import install_npu_emulator

    assert world == 2, world
    install_npu_emulator(route_sdpa=True)
    pair = init_device_mesh("cpu", (world,))
    alone = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pair", "cp"))["cp"]
    assert alone.size() == 1
    cp_cache.enable("handle")
    results = {2: _world_checks(pair, 2, rank, ["block", "traced", *cases])}
    results[1] = _world_checks(alone, 1, 0, W1_ITEMS[rank::world])
    results[2]["lengths"] = _lengths_compiled(pair, rank)
    cp_cache.disable()
    return results


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    """W = 2: each rank's results; W = 1: one result, the two ranks' halves together."""
    if not _RESULTS:
        ranks = run_ranks(_compile_rank, 2, CASES, timeout=600.0)
        _RESULTS[2] = [r[2] for r in ranks]
        merged: dict = {"train": {}, "live_entries": 0}
        for r in ranks:
            half = r[1]
            merged["train"].update(half.pop("train"))
            merged["live_entries"] += half.pop("live_entries")
            merged.update(half)
        assert set(merged["train"]) == {c.name for c in W1_CASES} and {"block", "fake"} <= set(merged), sorted(merged)
        _RESULTS[1] = [merged]
    return _RESULTS[world]


# ---------------------------------------------------------------- tests

assert all(case in CASES for case in W1_CASES)
WORLD_CASES = [(2, case) for case in CASES] + [(1, case) for case in W1_CASES]


@pytest.mark.parametrize("world,case", WORLD_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_compiled_training_matches_eager_cp_and_one_process(world, case):
    """Bounds: 20x the float32 rounding of the model on one process (the dropout-free single process
    in float32 against float64, worst so far: the steps compound it) + 32 eps."""
    for rank, res in enumerate(_results(world)):
        t = res["train"][case.name]
        for step in range(STEPS):
            loss_rounding = max(abs(a - b) for a, b in zip(t["ref_loss"][:step + 1], t["truth_loss"][:step + 1]))
            loss_bound = error_bound(loss_rounding, scale=abs(t["truth_loss"][step]))
            grad_bound = error_bound(max(t["ref_grad_err"][:step + 1]))
            # compiled CP against eager CP with the same dropout draws: the same computation, up to rounding
            assert abs(t["loss"][step] - t["eager_loss"][step]) <= loss_bound, (rank, step, t)
            assert t["grad_vs_eager"][step] <= grad_bound, (rank, step, t["grad_vs_eager"], grad_bound)
            if case.dropout == 0:  # and against the float64 model
                assert abs(t["loss"][step] - t["truth_loss"][step]) <= loss_bound, (rank, step, t)
                assert t["grad_vs_truth"][step] <= grad_bound, (rank, step, t["grad_vs_truth"], grad_bound)
            else:  # dropout is on: the losses differ from the dropout-free reference
                assert t["loss"][step] != t["ref_loss"][step]


@pytest.mark.parametrize("world,case", WORLD_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_compiled_lifetime_is_eagers(world, case):
    for res in _results(world):
        t = res["train"][case.name]
        assert t["live_fwd"] == t["eager_live_fwd"], t
        if case.policy == "handle":
            # full checkpointing: the original forward's caches die with its discarded saved tensors
            expected = 0 if case.checkpoint != "none" else LAYERS
            assert t["live_fwd"] == [expected] * STEPS, t["live_fwd"]
        assert t["live_after"] == [0] * STEPS and t["bytes_after"] == [0] * STEPS, t
        assert t["stack_depth"] == [0] * STEPS, t
        assert res["live_entries"] == 0


@pytest.mark.parametrize("world,case", WORLD_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_no_recompile_per_step(world, case):
    for res in _results(world):
        frames = res["train"][case.name]["frames"]
        # one compile serves every block (their parameters are graph inputs); two under a reentrant
        # checkpoint (its forward runs without grad, its recompute with)
        expected = 2 if case.checkpoint == "reentrant" else 1
        assert frames == [expected] * STEPS, frames


@pytest.mark.parametrize("world", WORLDS)
def test_single_compiled_block_fullgraph(world):
    for res in _results(world):
        b = res["block"]
        assert (b["graph_breaks"], b["graphs"]) == (0, 1), b
        bound = error_bound(b["rounding"])  # 20x the block's float32 rounding on one process + 32 eps
        assert b["eager_vs_truth"] <= bound, (b, bound)
        for backend in ("aot_eager", "inductor"):
            r = b[backend]
            assert r["frames"] == 1, (backend, r)  # the second call reuses the first compile
            assert max(r["out_err"], r["dx_err"], r["dparam_err"]) <= bound, (backend, r, bound)
            assert r["live_fwd"] == [1, 1], (backend, r)  # the block's one attention call
            assert r["ring_calls"] == [(1, 1), (1, 1)], (backend, r)  # the compiled graphs ran the ring
        assert b["live"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_ulysses_and_packed_documents_compiled(world):
    """The other paths through the same ops, each in one graph: Ulysses; packed documents with
    their lengths tensor (traced from its shape, read by the compiled op on each call)."""
    for res in _results(world):
        ulysses, tnd = res["algorithms"]["ulysses"], res["algorithms"]["tnd"]
        # compiled against eager: 20x the call's float32 rounding on one device + 32 eps
        assert ulysses["err"] <= error_bound(ulysses["rounding"]), res["algorithms"]
        assert (ulysses["graphs"], ulysses["graph_breaks"]) == (1, 0), ulysses
        assert (tnd["graphs"], tnd["graph_breaks"]) == (1, 0), tnd
        for backend in ("aot_eager", "inductor"):
            r = tnd[backend]
            # fullgraph; the second documents (same count, other values) reuse the first compile
            assert r["frames"] == 1, (backend, r)
            assert max(r["errs"]) <= error_bound(tnd["rounding"]), (backend, r, tnd["rounding"])
        assert ulysses["live"] == tnd["live"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_compiled_windows_and_masks_match_eager(world):
    """The v3 op in a compiled function (aot_eager, fullgraph) for a window, a given mask
    (replicated and sequence-sharded) and contiguous causal, against the same call run eagerly:
    the same kernels on the same inputs, so equal up to 32 eps (measured: equal)."""
    for res in _results(world):
        assert set(res["masks"]) == set(MASK_KINDS), res["masks"]
        assert max(res["masks"].values()) <= error_bound(0.0), res["masks"]


@pytest.mark.parametrize("world", WORLDS)
def test_handlers_under_fake_tensors(world):
    from torch.distributed.tensor import Shard

    for res in _results(world):
        f = res["fake"]
        assert (f["created"], f["pushed"], f["calls"]) == (0, 0, (0, 0)), f
        B, N, S, D = 2, 4, 4 * world, 8
        for kind, device in (("fake", "cpu"), ("meta", "meta")):
            out, smax, ssum, softmax_out, seed, offset = f[kind]["forward"]
            assert out == dict(type="DTensor", shape=(B, N, S, D), dtype=torch.float32, device=device,
                               placements=(Shard(2),), fake=True), (kind, out)
            for stats in (smax, ssum):
                assert stats == dict(type="DTensor", shape=(B, N, S, 8), dtype=torch.float32, device=device,
                                     placements=(Shard(2),), fake=True), (kind, stats)
            assert (seed["shape"], seed["dtype"], seed["placements"], seed["fake"]) == ((1,), torch.int64, None, True)
            assert softmax_out["fake"] and offset["fake"], (kind, softmax_out, offset)
            for grad in f[kind]["backward"]:
                assert grad == dict(type="DTensor", shape=(B, N, S, D), dtype=torch.float32, device=device,
                                    placements=(Shard(2),), fake=True), (kind, grad)
            # packed documents (TND): from shapes, the lengths tensors unread
            T = 8 * world
            out, smax, ssum, softmax_out, seed, offset = f[kind]["tnd_forward"]
            tnd = dict(type="DTensor", dtype=torch.float32, device=device, placements=(Shard(0),), fake=True)
            assert out == dict(tnd, shape=(T, N, D)), (kind, out)
            for stats in (smax, ssum):
                assert stats == dict(tnd, shape=(T, N, 8)), (kind, stats)
            assert (seed["shape"], seed["dtype"], seed["placements"], seed["fake"]) == ((1,), torch.int64, None, True)
            for grad in f[kind]["tnd_backward"]:
                assert grad == dict(tnd, shape=(T, N, D)), (kind, grad)


def test_demo_compile_runs(tmp_path, capsys, monkeypatch):
    """``cp-cache demo --compile`` (small and with aot_eager: compile time), through the CLI's
    ``main`` in this process: the demo's ranks are spawned processes either way (here forked from
    the suite's forkserver); ``python -m cp_cache`` itself is run by test_cli.py."""
    import json

    from cp_cache.cli import main
    from demo_reference import demo_rounding

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CP_CACHE_POLICY"):
        monkeypatch.delenv(name, raising=False)  # spawned ranks, whatever launched pytest
    out = tmp_path / "demo.json"
    code = main(["demo", "--compile", "--compile-backend", "aot_eager", "--steps", "3", "--ranks", "2",
                 "--seq-len", "16", "--layers", "2", "--dim", "32", "--policy", "handle", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "blocks compiled (torch.compile, backend aot_eager)" in stdout, stdout
    assert "training step (compiled (aot_eager)" in stdout, stdout
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    # 20x the float32 rounding of the same model on one process (against float64) + 32 eps
    rounding = demo_rounding(seq_len=16, layers=2, dim=32)
    assert run["grad_diff"] <= error_bound(rounding["grad"], scale=rounding["grad_scale"]), (run, rounding)
    for row in run["rows"]:
        assert row["parity"] <= error_bound(rounding["loss"], scale=abs(row["eval_one"])), (row, rounding)
        # full checkpointing (the demo's default): nothing held from forward to backward or after
        assert (row["live_fwd"], row["live_bwd"], row["live_eval"]) == (0, 0, 0), row



def _lengths_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=True)
    grid = init_device_mesh("cpu", (2, world // 2)) if world == 4 else None
    return _lengths_compiled(init_device_mesh("cpu", (world,)), rank, grid)


_LENGTHS: dict[int, list[dict]] = {}


def _length_results(world: int) -> list[dict]:
    """W = 2: from the pair of ranks that does every other check; W = 4: a group of its own."""
    if world == 2:
        return [res["lengths"] for res in _results(2)]
    if world not in _LENGTHS:
        _LENGTHS[world] = run_ranks(_lengths_rank, world, timeout=600.0)
    return _LENGTHS[world]


@pytest.mark.parametrize("world,algorithm", [(w, a) for w in (2, 4) for a in (*LENGTH_ALGORITHMS, "packed",
                                                                              "packed_capacity")] + [(4, "hybrid")])
def test_one_graph_for_every_length(algorithm, world):
    """``dynamic=True``: dense causal head-tail at six local lengths (ring, Ulysses; at W = 4 hybrid
    on a 2 x 2 mesh too, contiguous), packed
    documents at six document sets (local lengths that differ between sets and ranks): one graph
    each (before: one per length; packed: one for even and one for uneven local lengths), equal to
    eager, no cache left alive. At a capacity, static shapes (only the lengths tensor's size marked
    dynamic): one graph for six document sets of different counts and totals."""
    results = _length_results(world)
    for rank, res in enumerate(results):
        r = res[algorithm]
        assert r["graphs"] == 1, (rank, algorithm, r)
        assert r["differing"] == [], (rank, algorithm, r)
        assert r["live"] == 0, (rank, algorithm, r)
    if algorithm == "packed":  # the document sets did change the local lengths
        assert len({n for res in results for n in res["packed"]["lengths"]}) > 1
    if algorithm == "packed_capacity":  # one local shape for every document set
        assert {n for res in results for n in res[algorithm]["lengths"]} == {CAPACITY}
