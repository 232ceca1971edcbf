"""Side by side: the context-parallel (CP) attention systems an Ascend user can run, on the
same emulated NPU kernels (the CPU emulator of ``npu_fusion_attention_v3`` and its grad),
at W = 2 and 4 gloo ranks over loopback.

Systems:

* ``cp_cache`` (handle policy) and ``cp_cache-stack`` (stack policy): the v3 op on DTensors
  inside ``cp_cache.context_parallel(mesh)``;
* ``torch_npu 2.13.0`` and ``torch_npu 2.12.0``: torch_npu's own CP handlers, loaded from
  the wheels' Python files over the emulator (``cp_cache.testing.torch_npu_wheel``), called
  the same way inside torch's CP dispatcher;
* ``torch_npu 2.13.0 (guard lifted)``: 2.13.0 with its dropout refusal lifted *for this
  measurement only* (a monkeypatch inside this file, see ``_lift_dropout_guard``), to
  measure the gradients it would compute under dropout;
* ``torch ring (all-gather)`` / ``torch ring (all-to-all)``: torch's own
  ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with
  ``_cp_options.rotate_method`` ALL_GATHER / ALL_TO_ALL, driven on local tensors with a
  step wrapper (here) around the emulator's v3 op.

Per system and W: (a) acceptance and error versus a dense float64 reference for layouts,
GQA, causal with and without load balancing, full attention, sparse_mode 1/2/3, and a
model-free directional-derivative check of the gradients under dropout; (b) peak bytes
during forward and backward (torch profiler memory events), bytes kept from forward to
backward (autograd's saved storages + cp_cache's store + torch_npu 2.12's stack), with and
without activation checkpointing, and stack entries left by eval forwards; (c) seconds per
forward and backward (medians) as a ratio to cp_cache; (d) bytes sent per rank per call.

Writes ``compare.json`` and ``compare.png`` under ``--out`` and prints tables. On CPU every
kernel is the emulator (plain torch): times compare the systems' structure, not NPU speed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import statistics
import time
import zlib
from pathlib import Path

from ._common import fmt_bytes, launch, table, under_torchrun
from ._measure import SavedStorages, distinct_storage_bytes, peak_bytes, storage_key, tensors_in, trace_memory

NAME = "compare"
HELP = "cp_cache vs torch_npu 2.13.0 / 2.12.0 vs torch's ring: correctness, memory, time, traffic (JSON + PNG)"

log = logging.getLogger("cp_cache")

CP_CACHE = "cp_cache"
CP_CACHE_STACK = "cp_cache-stack"
NPU_213 = "torch_npu 2.13.0"
NPU_213_LIFTED = "torch_npu 2.13.0 (guard lifted)"
NPU_212 = "torch_npu 2.12.0"
TORCH_AG = "torch ring (all-gather)"
TORCH_A2A = "torch ring (all-to-all)"
SYSTEMS = (CP_CACHE, CP_CACHE_STACK, NPU_213, NPU_213_LIFTED, NPU_212, TORCH_AG, TORCH_A2A)
SHORT = {CP_CACHE: "cp_cache", CP_CACHE_STACK: "cp_cache-stack", NPU_213: "npu-2.13", NPU_213_LIFTED: "npu-2.13-lifted",
         NPU_212: "npu-2.12", TORCH_AG: "torch-AG", TORCH_A2A: "torch-A2A"}
# the lifted variant differs from 2.13.0 only under dropout: it runs the dropout check only
DROPOUT_ONLY = (NPU_213_LIFTED,)

# (a) the cases: mask "causal" = the compressed 2048x2048 triu mask, "all_false" = a full
# [S, S] bool mask with nothing masked (the right answer is full attention)
CASES = (
    dict(name="causal_lb", layout="BNSD", gqa=False, mask="causal", mode=2, lb=True,
         what="BNSD, sparse_mode 2 (compressed mask), load balancing (head-tail)"),
    dict(name="causal", layout="BNSD", gqa=False, mask="causal", mode=2, lb=False,
         what="BNSD, sparse_mode 2, contiguous shards"),
    dict(name="full", layout="BNSD", gqa=False, mask=None, mode=0, lb=False, what="BNSD, no mask (full attention)"),
    dict(name="gqa_causal_lb", layout="BNSD", gqa=True, mask="causal", mode=2, lb=True, what="GQA Nkv = N/2"),
    dict(name="bsnd_causal_lb", layout="BSND", gqa=False, mask="causal", mode=2, lb=True, what="layout BSND"),
    dict(name="bsh_causal_lb", layout="BSH", gqa=False, mask="causal", mode=2, lb=True, what="layout BSH"),
    dict(name="sbh_causal_lb", layout="SBH", gqa=False, mask="causal", mode=2, lb=True, what="layout SBH"),
    dict(name="sparse1_all_false_mask", layout="BNSD", gqa=False, mask="all_false", mode=1, lb=False,
         what="sparse_mode 1, full [S, S] mask all False (= full attention)"),
    dict(name="sparse3_causal_lb", layout="BNSD", gqa=False, mask="causal", mode=3, lb=True,
         what="sparse_mode 3 (right-down causal), compressed mask"),
)
DROPOUT_CASE = dict(name="dropout_causal_lb", layout="BNSD", gqa=False, mask="causal", mode=2, lb=True,
                    keep_prob=0.9, what="keep_prob 0.9, causal, load balancing")
WRONG_ABOVE = 1e-3  # an accepted case with a larger max relative error is silently wrong (fp32 inputs)
DROPOUT_OK_BELOW = 1e-2  # directional-derivative error of a right gradient (validated on one process)
RNG_SEED = 1000  # dropout draws: torch.manual_seed(RNG_SEED + rank) before each forward


# ---------------------------------------------------------------- command line


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text!r}") from None
    if value < 2 or value > 16:
        raise argparse.ArgumentTypeError(f"must be between 2 and 16 (ranks spawned on this machine), got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results/compare"),
                   help="results folder for compare.json and compare.png (default results/compare)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, W=2 only, one repeat (for tests)")
    p.add_argument("--worlds", type=_world_size, nargs="+", default=None,
                   help="CP world sizes (default 2 4; --quick: 2)")
    p.add_argument("--repeats", type=_positive, default=None,
                   help="timed forward+backward repeats per system after one warm-up (default 3; --quick: 1)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None, metavar="SYSTEM",
                   help="run only these systems (default all: " + ", ".join(repr(s) for s in SYSTEMS) + ")")
    p.add_argument("--timeout", type=_positive, default=None,
                   help="seconds allowed per world size (default 900; --quick: 240)")


def _plan(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    if quick:
        plan = dict(worlds=[2], cases=dict(heads=4, s_local=16, head_dim=8),
                    resources=dict(batch=1, heads=2, seq=256, head_dim=16), repeats=1, warmup=0, directions=2,
                    timeout=240)
    else:
        plan = dict(worlds=[2, 4], cases=dict(heads=4, s_local=32, head_dim=16),
                    resources=dict(batch=1, heads=8, seq=4096, head_dim=64), repeats=3, warmup=0, directions=4,
                    timeout=900)
    if args.worlds:
        plan["worlds"] = sorted(set(args.worlds))
    if under_torchrun():  # the launcher fixed the world size
        plan["worlds"] = [int(os.environ["WORLD_SIZE"])]
    if args.repeats:
        plan["repeats"] = args.repeats
    if args.timeout:
        plan["timeout"] = args.timeout
    plan["systems"] = [s for s in SYSTEMS if s in (args.systems or SYSTEMS)]
    plan["quick"] = quick
    # the finite-difference step of the dropout check: with fp32 kernels eps = 1e-2 leaves
    # rounding noise of 1e-3..6e-3 (too close to the 1e-2 threshold); 1e-1 gives ~1e-4
    plan["eps"] = 1e-1
    plan["keep_prob"] = DROPOUT_CASE["keep_prob"]
    seq = plan["resources"]["seq"]
    for w in plan["worlds"]:
        if seq % (2 * w):
            raise SystemExit(f"compare: --worlds {w}: the sequence length {seq} must divide by 2*W = {2 * w}")
    return plan


# ---------------------------------------------------------------- measuring helpers (any process)


class _SentCounter:
    """Sums the bytes this rank hands to torch.distributed's sending calls while active.

    Counted: ``send``/``isend`` (tensor bytes; ``batch_isend_irecv`` runs its P2P ops through
    ``isend``), ``all_gather``/``all_gather_into_tensor`` and functional ``all_gather_single``/
    (input bytes x (W-1), i.e. (W-1)/W of the gathered output),
    ``all_to_all``/``all_to_all_single`` (classic and functional; the parts addressed to other
    ranks; the functional ``permute_tensor`` that torch's ring uses goes through it).
    Set ``phase`` to also sum by phase (``by_phase``, ``calls_by_phase``).
    """

    def __init__(self):
        self.bytes = 0
        self.calls: dict[str, int] = {}
        self.phase: str | None = None
        self.by_phase: dict[str, int] = {}
        self.calls_by_phase: dict[str, dict[str, int]] = {}
        self._saved: list = []

    def _add(self, name: str, n: int) -> None:
        self.bytes += int(n)
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.phase is not None:
            self.by_phase[self.phase] = self.by_phase.get(self.phase, 0) + int(n)
            calls = self.calls_by_phase.setdefault(self.phase, {})
            calls[name] = calls.get(name, 0) + 1

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as ft_c
        import torch.distributed.distributed_c10d as c10d

        counter = self

        def world(group) -> int:
            try:
                return dist.get_world_size(group)
            except Exception:  # noqa: BLE001 - a functional-collective group spec
                from torch.distributed._functional_collectives import _resolve_group

                return c10d._get_group_size_by_name(_resolve_group(group, ""))

        def rank_in(group) -> int:
            try:
                return dist.get_rank(group)
            except Exception:  # noqa: BLE001
                return dist.get_rank()

        def wrap(module, name, count):
            original = getattr(module, name)

            def wrapper(*a, **k):
                count(*a, **k)
                return original(*a, **k)

            wrapper.__name__ = name
            self._saved.append((module, name, original))
            return wrapper

        def p2p(tensor, *a, **k):
            counter._add("send", tensor.nbytes)

        def gather_list(tensor_list, tensor, group=None, *a, **k):
            counter._add("all_gather", tensor.nbytes * (world(group) - 1))

        def gather_into(output, tensor, group=None, *a, **k):
            counter._add("all_gather_into_tensor", tensor.nbytes * (world(group) - 1))

        def gather_single(tensor, gather_dim, group, *a, **k):
            counter._add("all_gather_single", tensor.nbytes * (world(group) - 1))

        def a2a_list(outputs, inputs, group=None, *a, **k):
            me = rank_in(group)
            counter._add("all_to_all", sum(t.nbytes for i, t in enumerate(inputs) if i != me))

        def a2a_single_classic(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                               *a, **k):
            counter._add("all_to_all_single", _a2a_bytes(tensor, input_split_sizes, world(group), rank_in(group)))

        def a2a_single_functional(tensor, output_split_sizes, input_split_sizes, group, *a, **k):
            counter._add("all_to_all_single", _a2a_bytes(tensor, input_split_sizes, world(group), rank_in(group)))

        # isend: the same wrapper in both namespaces (P2POp checks op is c10d.isend)
        isend = wrap(c10d, "isend", p2p)
        self._saved.append((dist, "isend", dist.isend))
        c10d.isend = dist.isend = isend
        send = wrap(c10d, "send", p2p)
        self._saved.append((dist, "send", dist.send))
        c10d.send = dist.send = send
        for module, name, count in (
            (dist, "all_gather", gather_list), (dist, "all_gather_into_tensor", gather_into),
            (dist, "all_to_all", a2a_list), (dist, "all_to_all_single", a2a_single_classic),
            (ft_c, "all_gather_single", gather_single), (ft_c, "all_to_all_single", a2a_single_functional),
        ):
            setattr(module, name, wrap(module, name, count))
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
        return False


def _a2a_bytes(tensor, input_split_sizes, world: int, me: int) -> int:
    """Bytes of an all_to_all_single input addressed to other ranks."""
    if not input_split_sizes:
        return tensor.nbytes * (world - 1) // world
    row = tensor.nbytes // max(tensor.shape[0], 1) if tensor.dim() else tensor.element_size()
    return sum(int(n) * row for i, n in enumerate(input_split_sizes) if i != me)


# ---------------------------------------------------------------- the systems (on one rank)


class Unsupported(Exception):
    """The system has no way to express this input (recorded as "not supported", not run)."""


def _op_kwargs(spec: dict, mask) -> dict:
    from ..npu_ops import INT_MAX

    kw = dict(atten_mask=mask, scale=1.0 / math.sqrt(spec["head_dim"]), keep_prob=spec.get("keep_prob", 1.0),
              sparse_mode=spec["mode"])
    kw["next_tockens"] = 0 if spec["mode"] in (2, 3) else INT_MAX
    return kw


class _System:
    """What every system answers besides ``attention``: the state it keeps outside autograd
    (none by default), read around a forward."""

    def held_tensors(self) -> list:
        return []

    def store_bytes(self) -> int:
        return 0

    def stack_entries(self) -> int | None:
        return None

    def clear_stack(self) -> None:
        pass


class _DTensorSystem(_System):
    """A system reached by calling the v3 op on DTensors sharded on the sequence (cp_cache,
    torch_npu): the handler found in DTensor's table runs."""

    name = ""

    def __init__(self, mesh):
        self.mesh = mesh

    def attention(self, q, k, v, spec: dict, mask):
        import torch
        from torch.distributed.tensor import DTensor, Shard

        from .. import layout as L

        sd = L.seq_dim(spec["layout"])
        qd, kd, vd = (DTensor.from_local(t, self.mesh, [Shard(sd)], run_check=False) for t in (q, k, v))
        out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, spec["heads"], spec["layout"], **_op_kwargs(spec, mask))
        out = out[0]
        return out.to_local() if isinstance(out, DTensor) else out



class CpCacheSystem(_DTensorSystem):
    def __init__(self, mesh, policy: str):
        super().__init__(mesh)
        self.policy = policy
        self.name = CP_CACHE if policy == "handle" else CP_CACHE_STACK

    @contextlib.contextmanager
    def session(self):
        import cp_cache

        cp_cache.enable(policy=self.policy)
        try:
            with cp_cache.context_parallel(self.mesh):
                yield self
        finally:
            cp_cache.disable()

    def store_bytes(self) -> int:
        import cp_cache

        return int(cp_cache.stats()["live_bytes"])

    def stack_entries(self) -> int | None:
        import cp_cache

        return int(cp_cache.stats()["stack_depth"]) if self.policy == "stack" else None

    def clear_stack(self) -> None:
        import cp_cache

        cp_cache.store().clear()


@contextlib.contextmanager
def _lift_dropout_guard(cp_module):
    """MEASUREMENT HACK, torch_npu 2.13.0 only, in this process only, undone on exit.

    torch_npu 2.13.0's CP sharding strategies withhold the sequence-sharded strategy when
    keep_prob < 1, so its handler refuses dropout ("inputs need to be redistributed"). To
    measure the gradients its ring would compute under dropout, the strategies' argument
    reader is wrapped so that keep_prob reads as 1.0 *for the strategies only*; the
    handlers read keep_prob with another function and still apply dropout. The sharding
    propagation caches are cleared on entry and exit so no cached decision leaks across.
    """
    original = cp_module._get_kw

    def _get_kw_keep_prob_one(args, kwargs, ix, name, default=None):
        value = original(args, kwargs, ix, name, default)
        return 1.0 if name == "keep_prob" else value

    cp_module._get_kw = _get_kw_keep_prob_one
    _clear_sharding_caches()
    try:
        yield
    finally:
        cp_module._get_kw = original
        _clear_sharding_caches()


def _clear_sharding_caches() -> None:
    try:
        from torch.distributed.tensor.debug import (
            _clear_fast_path_sharding_prop_cache,
            _clear_python_sharding_prop_cache,
        )
    except ImportError:  # pragma: no cover - other torch versions
        return
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()


class TorchNpuSystem(_DTensorSystem):
    def __init__(self, mesh, version: str, lifted: bool = False):
        super().__init__(mesh)
        self.version, self.lifted = version, lifted
        self.name = NPU_213_LIFTED if lifted else (NPU_213 if version == "2.13.0" else NPU_212)
        self.loaded = None

    @contextlib.contextmanager
    def session(self):
        import cp_cache
        from torch.distributed.tensor.experimental._context_parallel import _attention as att

        from ..testing.torch_npu_wheel import load_torch_npu_cp

        if cp_cache.enabled():
            cp_cache.disable()  # torch_npu's handlers must run, not cp_cache's
        with load_torch_npu_cp(self.version) as npu:
            self.loaded = npu
            lift = _lift_dropout_guard(npu.cp_module) if self.lifted else contextlib.nullcontext()
            with lift:
                att._dispatch_mode = att._DispatchMode.MONKEY_PATCH
                att._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=self.mesh)
                try:
                    yield self
                finally:
                    att._disable_context_parallel_dispatcher_impl()
                    self.loaded = None

    def held_tensors(self) -> list:
        stack = self.loaded.step_cache_stack if self.loaded is not None else None
        return tensors_in(list(stack), []) if stack is not None else []

    def stack_entries(self) -> int | None:
        stack = self.loaded.step_cache_stack if self.loaded is not None else None
        return None if stack is None else len(stack)

    def clear_stack(self) -> None:
        if self.loaded is not None and self.loaded.step_cache_stack is not None:
            self.loaded.step_cache_stack.clear()


def _ring_step_forward(query, key, value, *, is_causal, scale):
    """One block of one ring step for torch's ``_templated_ring_attention``: the emulator's v3
    op on BNSD tensors; returns (out, LSE [B, N, S]) as torch's merger expects."""
    import torch

    from ..npu_ops import INT_MAX, causal_mask, lse_from_stats

    res = torch.ops.npu.npu_fusion_attention_v3(
        query, key, value, query.size(1), "BNSD", atten_mask=causal_mask(query.device) if is_causal else None,
        scale=scale, sparse_mode=2 if is_causal else 0, next_tockens=0 if is_causal else INT_MAX)
    return res[0], lse_from_stats(res[1], res[2])


def _ring_step_backward(*, query, key, value, out, logsumexp, is_causal, grad_out, scale):
    """One block's gradients for ``_templated_ring_attention_backward`` (the emulator's grad_v3,
    the merged LSE given as softmax_max = LSE, softmax_sum = 1)."""
    import torch

    from ..npu_ops import INT_MAX, causal_mask, stats_from_lse

    smax, ssum = stats_from_lse(logsumexp)
    g = torch.ops.npu.npu_fusion_attention_grad_v3(
        query, key, value, grad_out, query.size(1), "BNSD",
        atten_mask=causal_mask(query.device) if is_causal else None, softmax_max=smax, softmax_sum=ssum,
        attention_in=out, scale_value=scale, sparse_mode=2 if is_causal else 0,
        next_tockens=0 if is_causal else INT_MAX)
    return g[0], g[1], g[2]


def _torch_ring_function():
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    class TorchRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, group, causal, scale):
            out, lse = _templated_ring_attention(group, 2, _ring_step_forward, q, k, v, is_causal=causal,
                                                 scale=scale)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.group, ctx.causal, ctx.scale = group, causal, scale
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = _templated_ring_attention_backward(
                ctx.group, 2, _ring_step_backward, dout.contiguous(), "grad_out", q, k, v, out, lse, ctx.causal,
                scale=ctx.scale)[:3]
            return dq, dk, dv, None, None, None

    return TorchRing


class TorchRingSystem(_System):
    """torch's templated ring (the one torch_npu 2.13.0 also drives) on local BNSD tensors."""

    def __init__(self, mesh, rotate: str):
        self.mesh, self.rotate = mesh, rotate
        self.name = TORCH_AG if rotate == "allgather" else TORCH_A2A
        self.fn = _torch_ring_function()

    @contextlib.contextmanager
    def session(self):
        from torch.distributed.tensor.experimental._context_parallel import _attention as att

        before = att._cp_options.rotate_method
        att._cp_options.rotate_method = (att._RotateMethod.ALL_GATHER if self.rotate == "allgather"
                                         else att._RotateMethod.ALL_TO_ALL)
        try:
            yield self
        finally:
            att._cp_options.rotate_method = before

    def attention(self, q, k, v, spec: dict, mask):
        if spec["layout"] != "BNSD":
            raise Unsupported("torch's ring chunks the sequence on dim 2: BNSD only")
        if spec.get("keep_prob", 1.0) < 1.0:
            raise Unsupported("torch's ring has no per-step dropout state (SDPA dropout_p unsupported under CP)")
        if spec["mask"] == "all_false" or spec["mode"] not in (0, 2, 3):
            raise Unsupported("torch's ring takes is_causal only, no attention mask")
        return self.fn.apply(q, k, v, self.mesh.get_group(), spec["mask"] == "causal",
                             1.0 / math.sqrt(spec["head_dim"]))



def _make_system(name: str, mesh):
    if name == CP_CACHE:
        return CpCacheSystem(mesh, "handle")
    if name == CP_CACHE_STACK:
        return CpCacheSystem(mesh, "stack")
    if name == NPU_213:
        return TorchNpuSystem(mesh, "2.13.0")
    if name == NPU_213_LIFTED:
        return TorchNpuSystem(mesh, "2.13.0", lifted=True)
    if name == NPU_212:
        return TorchNpuSystem(mesh, "2.12.0")
    if name == TORCH_AG:
        return TorchRingSystem(mesh, "allgather")
    if name == TORCH_A2A:
        return TorchRingSystem(mesh, "alltoall")
    raise ValueError(f"unknown system {name!r}")


# ---------------------------------------------------------------- inputs


def _case_spec(case: dict, plan_cases: dict) -> dict:
    heads = plan_cases["heads"]
    return dict(case, heads=heads, kv_heads=heads // 2 if case["gqa"] else heads, head_dim=plan_cases["head_dim"],
                s_local=plan_cases["s_local"], keep_prob=case.get("keep_prob", 1.0))


def full_inputs(spec: dict, world: int):
    """Full-sequence q, k, v, dout [B, N, S, D] float64 (values rounded to float32), seeded by case and W."""
    import torch

    S = spec["s_local"] * world
    g = torch.Generator().manual_seed(zlib.crc32(f"compare/{spec['name']}/{world}".encode()))
    q = torch.randn(1, spec["heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    k = torch.randn(1, spec["kv_heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    v = torch.randn(1, spec["kv_heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    dout = torch.randn(1, spec["heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    return [t.float().double() for t in (q, k, v, dout)]


def _mask_for(spec: dict, world: int):
    import torch

    from ..npu_ops import causal_mask

    if spec["mask"] == "causal":
        return causal_mask(torch.device("cpu"))
    if spec["mask"] == "all_false":
        S = spec["s_local"] * world
        return torch.zeros(S, S, dtype=torch.bool)
    return None


def _local(x_bnsd, spec: dict, pos, requires_grad: bool):
    from .. import layout as L

    t = L.from_bnsd(x_bnsd.index_select(2, pos), spec["layout"]).float().contiguous()
    return t.requires_grad_(requires_grad)


def _set_load_balance(on: bool) -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention as att

    att._cp_options.enable_load_balance = bool(on)


def _refusal(e: BaseException) -> dict:
    text = str(e).strip().splitlines()
    return dict(status="refused", error_type=type(e).__name__, message=(text[0] if text else "")[:240])


# ---------------------------------------------------------------- (a) cases on one rank


def _run_case(system, spec: dict, rank: int, world: int) -> dict:
    from .. import layout as L
    from ..testing.reference import rank_positions

    _set_load_balance(spec["lb"])
    pos = rank_positions(world, rank, spec["s_local"], spec["lb"])
    q, k, v, dout = full_inputs(spec, world)
    ql, kl, vl = (_local(t, spec, pos, True) for t in (q, k, v))
    dl = _local(dout, spec, pos, False)
    mask = _mask_for(spec, world)
    try:
        out = system.attention(ql, kl, vl, spec, mask)
        out.backward(dl)
    except Unsupported as e:
        return dict(status="not supported", message=str(e))
    except Exception as e:  # noqa: BLE001 - a refusal is a result
        return _refusal(e)
    finally:
        system.clear_stack()
    heads = {"out": spec["heads"], "dq": spec["heads"], "dk": spec["kv_heads"], "dv": spec["kv_heads"]}
    local = {name: L.to_bnsd(t.detach(), spec["layout"], heads[name]).double()
             for name, t in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
    return dict(status="accepted", pos=pos, local=local)


def _all_reduce_sum(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _run_dropout(system, spec: dict, rank: int, world: int, plan: dict) -> dict:
    import torch

    from ..testing.reference import directional_derivative_errors, rank_positions

    _set_load_balance(spec["lb"])
    pos = rank_positions(world, rank, spec["s_local"], spec["lb"])
    q, k, v, _ = full_inputs(spec, world)
    params = [_local(t, spec, pos, True) for t in (q, k, v)]
    mask = _mask_for(spec, world)
    g = torch.Generator().manual_seed(77 + rank)
    projection = None

    def loss_fn():
        nonlocal projection
        torch.manual_seed(RNG_SEED + rank)
        out = system.attention(*params, spec, mask)
        if projection is None:
            projection = torch.randn(out.shape, generator=g, dtype=torch.float64)
        return (out.double() * projection).sum()

    try:
        errors = directional_derivative_errors(loss_fn, params, directions=plan["directions"], eps=plan["eps"],
                                               reduce=_all_reduce_sum)
    except Unsupported as e:
        return dict(status="not supported", message=str(e))
    except Exception as e:  # noqa: BLE001
        return _refusal(e)
    finally:
        left = system.stack_entries()
        system.clear_stack()
    return dict(status="accepted", errors=errors, max_error=max(errors), stack_entries_left=left,
                ok=max(errors) < DROPOUT_OK_BELOW)


# ---------------------------------------------------------------- (b, c, d) resources on one rank


def _resource_inputs(plan: dict, rank: int, world: int):
    import torch

    r = plan["resources"]
    s_local = r["seq"] // world
    g = torch.Generator().manual_seed(4242 + rank)
    shape = (r["batch"], r["heads"], s_local, r["head_dim"])
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=g)
    spec = dict(name="resources", layout="BNSD", gqa=False, mask="causal", mode=2, lb=True, heads=r["heads"],
                kv_heads=r["heads"], head_dim=r["head_dim"], s_local=s_local, keep_prob=1.0)
    return q, k, v, dout, spec


def _memory_pass(system, q, k, v, dout, spec, mask, checkpointed: bool) -> dict:
    from torch.utils.checkpoint import checkpoint

    for t in (q, k, v):
        t.grad = None
    state: dict = {}
    exclude = {k_[0] for k_ in map(storage_key, (q, k, v, mask)) if k_}
    recorder = SavedStorages(exclude=(q, k, v, mask))
    saved = recorder.storages

    def call(a, b, c):
        return system.attention(a, b, c, spec, mask)

    sent = _SentCounter()

    def forward():
        state["store_before"] = system.store_bytes()
        sent.phase = "forward"
        with recorder:
            if checkpointed:
                state["out"] = checkpoint(call, q, k, v, use_reentrant=False)
            else:
                state["out"] = call(q, k, v)
        sent.phase = None

    def between():
        held = {}
        for t in system.held_tensors():
            key = storage_key(t)
            if key and key[0] not in exclude:
                held[key[0]] = key[1]
        union = dict(saved)
        union.update(held)
        state["kept"] = dict(
            autograd_saved_bytes=sum(saved.values()),
            stack_bytes=sum(held.values()),
            store_bytes=system.store_bytes() - state["store_before"],
            stack_entries=system.stack_entries(),
        )
        state["kept"]["total_bytes"] = sum(union.values()) + state["kept"]["store_bytes"]

    def backward():
        sent.phase = "backward"
        state.pop("out").backward(dout)
        sent.phase = None

    def collect():
        gc.collect()

    net: dict = {}
    gc.collect()  # start from a collected heap: garbage of earlier calls is not freed inside the windows
    with sent:
        peaks = trace_memory([("forward", forward), ("between", between), ("backward", backward),
                              ("gc", collect)], net)
    state["traffic"] = dict(forward_bytes=sent.by_phase.get("forward", 0),
                            backward_bytes=sent.by_phase.get("backward", 0),
                            forward_calls=sent.calls_by_phase.get("forward", {}),
                            backward_calls=sent.calls_by_phase.get("backward", {}),
                            cp_cache_reported=_cp_cache_reported() if isinstance(system, CpCacheSystem) else None)
    result = dict(state["kept"], traffic=state["traffic"], forward_peak_bytes=peaks["forward"],
                  backward_peak_bytes=peaks["backward"],
                  freed_by_gc_after_backward=-net["gc"],
                  stack_entries_after_backward=system.stack_entries(),
                  store_bytes_after_backward=system.store_bytes() - state["store_before"])
    system.clear_stack()
    return result


def _eval_pass(system, q, k, v, spec, mask, forwards: int = 3) -> dict:
    import torch

    store_before = system.store_bytes()
    with torch.no_grad():
        for _ in range(forwards):
            system.attention(q, k, v, spec, mask)
    held = system.held_tensors()
    result = dict(forwards=forwards, stack_entries_left=system.stack_entries(),
                  stack_bytes_left=distinct_storage_bytes(held, exclude=(q, k, v, mask)),
                  store_bytes_left=system.store_bytes() - store_before)
    system.clear_stack()
    return result


def _cp_cache_reported() -> dict | None:
    import cp_cache

    if not cp_cache.enabled():
        return None
    calls = cp_cache.call_stats()
    return {d: calls[d]["bytes_sent"] for d in ("forward", "backward")}


def _resources(system, plan: dict, rank: int, world: int) -> dict:
    """(b) memory with and without checkpointing, (d) traffic (in the first memory pass), eval entries."""
    q, k, v, dout, spec = _resource_inputs(plan, rank, world)
    _set_load_balance(True)
    mask = _mask_for(spec, world)
    out = {}
    for _ in range(plan["warmup"]):  # extra warm-up calls (the cases have already run the system)
        system.attention(q, k, v, spec, mask).backward(dout)
        system.clear_stack()
    # (b) memory
    out["memory"] = _memory_pass(system, q, k, v, dout, spec, mask, checkpointed=False)
    out["traffic"] = out["memory"].pop("traffic")  # (d): bytes sent during that forward and backward
    out["memory_checkpoint"] = _memory_pass(system, q, k, v, dout, spec, mask, checkpointed=True)
    out["eval"] = _eval_pass(system, q, k, v, spec, mask)
    return out


def _timed_call(system, plan: dict, inputs) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one call at the resource shape, ranks started together."""
    import torch.distributed as dist

    q, k, v, dout, spec = inputs
    _set_load_balance(True)
    mask = _mask_for(spec, 0)
    for t in (q, k, v):
        t.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    o = system.attention(q, k, v, spec, mask)
    t1 = time.perf_counter()
    o.backward(dout)
    t2 = time.perf_counter()
    system.clear_stack()
    return t1 - t0, t2 - t1


# ---------------------------------------------------------------- one rank


def compare_rank(rank: int, world: int, plan: dict) -> dict:
    """Every system of ``plan`` on this rank: cases, dropout check, resources."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ..emulator import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    result: dict = dict(rank=rank, world=world, torch=torch.__version__, systems={})
    for name in plan["systems"]:
        system = _make_system(name, mesh)
        started = time.perf_counter()
        entry: dict = {}
        try:
            with system.session():
                cases = {}
                if name not in DROPOUT_ONLY:
                    for case in CASES:
                        cases[case["name"]] = _run_case(system, _case_spec(case, plan["cases"]), rank, world)
                entry["cases"] = cases
                entry["dropout"] = _run_dropout(system, _case_spec(DROPOUT_CASE, plan["cases"]), rank, world, plan)
                if name not in DROPOUT_ONLY:
                    entry.update(_resources(system, plan, rank, world))
        except Exception as e:  # noqa: BLE001 - a system that cannot even start is reported
            log.exception("compare: %s failed on rank %d", name, rank)
            entry["session_error"] = _refusal(e)
        finally:
            _set_load_balance(True)
        entry["seconds"] = round(time.perf_counter() - started, 2)
        log.info("compare W=%d rank %d: %s took %.1f s", world, rank, name, entry["seconds"])
        result["systems"][name] = entry
    # (c) time: rounds over the systems (one call each per round), so that a change in the
    # machine's load during the run spreads over every system instead of a few
    timed = [n for n in plan["systems"] if n not in DROPOUT_ONLY and "session_error" not in result["systems"][n]]
    inputs = _resource_inputs(plan, rank, world)
    samples = {n: ([], []) for n in timed}
    for _ in range(plan["repeats"]):
        for name in timed:
            system = _make_system(name, mesh)
            with system.session():
                f, b = _timed_call(system, plan, inputs)
            samples[name][0].append(f)
            samples[name][1].append(b)
    for name, (fwd, bwd) in samples.items():
        result["systems"][name]["time"] = dict(forward_s=fwd, backward_s=bwd, forward_median_s=statistics.median(fwd),
                                               backward_median_s=statistics.median(bwd))
    _set_load_balance(True)
    return result


# ---------------------------------------------------------------- the driver: validation, errors, report


def validate_directional_check(plan: dict) -> dict:
    """The dropout check on one process (no CP): the emulator's op with its own derivative
    (errors must be small) and a deliberately wrong backward (another dropout mask; errors
    must be large)."""
    import torch

    from ..emulator import install_npu_emulator
    from ..testing.reference import directional_derivative_errors

    install_npu_emulator(route_sdpa=False)
    spec = _case_spec(dict(DROPOUT_CASE, lb=False), plan["cases"])
    q, k, v, _ = full_inputs(spec, 2)
    params = [t.float().requires_grad_() for t in (q, k, v)]
    mask = _mask_for(spec, 2)
    kw = _op_kwargs(spec, mask)
    projection = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    class WrongBackward(torch.autograd.Function):
        """The op forward; backward with a different dropout mask (seed + 1)."""

        @staticmethod
        def forward(ctx, a, b, c):
            res = torch.ops.npu.npu_fusion_attention_v3(a, b, c, spec["heads"], "BNSD", **kw)
            ctx.save_for_backward(a, b, c, res[0], res[1], res[2], res[4], res[5])
            return res[0]

        @staticmethod
        def backward(ctx, dy):
            a, b, c, out, smax, ssum, seed, offset = ctx.saved_tensors
            g = torch.ops.npu.npu_fusion_attention_grad_v3(
                a, b, c, dy, spec["heads"], "BNSD", atten_mask=mask, softmax_max=smax, softmax_sum=ssum,
                attention_in=out, scale_value=kw["scale"], keep_prob=kw["keep_prob"], sparse_mode=kw["sparse_mode"],
                next_tockens=kw["next_tockens"], seed=seed + 1, offset=offset)
            return g[0], g[1], g[2]

    def loss(fn):
        def f():
            torch.manual_seed(RNG_SEED)
            return (fn(*params).double() * projection).sum()
        return f

    right = directional_derivative_errors(
        loss(lambda a, b, c: torch.ops.npu.npu_fusion_attention_v3(a, b, c, spec["heads"], "BNSD", **kw)[0]),
        params, directions=plan["directions"], eps=plan["eps"])
    wrong = directional_derivative_errors(loss(WrongBackward.apply), params, directions=plan["directions"],
                                          eps=plan["eps"])
    return dict(dense_op_errors=right, dense_op_max=max(right), wrong_backward_errors=wrong,
                wrong_backward_max=max(wrong), passes=max(right) < DROPOUT_OK_BELOW < max(wrong),
                threshold=DROPOUT_OK_BELOW,
                note="one process, the emulator's op on the full sequence (no CP); the negative control "
                     "replays the backward with seed + 1 (another dropout mask)")


def validate_memory_helper(nbytes: int = 8 << 20) -> dict:
    """``peak_bytes`` of a known allocation."""
    import torch

    def alloc():
        x = torch.empty(nbytes, dtype=torch.uint8)
        x.fill_(1)
        del x

    measured = peak_bytes(alloc)
    return dict(allocated=nbytes, measured_peak=measured, ok=nbytes <= measured <= nbytes + (64 << 10))


def _errors(per_rank: list[dict], spec: dict, world: int, reference: dict) -> dict:
    import torch

    from ..testing.reference import rel_err

    S = spec["s_local"] * world
    errors = {}
    for name in ("out", "dq", "dk", "dv"):
        heads = per_rank[0]["local"][name].size(1)
        full = torch.zeros(1, heads, S, spec["head_dim"], dtype=torch.float64)
        for r in per_rank:
            full[:, :, r["pos"]] = r["local"][name]
        errors[name] = rel_err(full, reference[name])
    return errors


def _summarise(plan: dict, per_world: dict[int, list[dict]]) -> dict:
    from ..testing.reference import dense_attention

    results: dict = {}
    for world, ranks in per_world.items():
        refs = {}
        for case in CASES:
            spec = _case_spec(case, plan["cases"])
            q, k, v, dout = full_inputs(spec, world)
            refs[case["name"]] = dense_attention(q, k, v, dout, causal=spec["mask"] == "causal")
        by_system = {}
        for name in plan["systems"]:
            entries = [r["systems"][name] for r in ranks]
            first = entries[0]
            row: dict = dict(seconds=max(e["seconds"] for e in entries))
            if "session_error" in first:
                row["session_error"] = first["session_error"]
                by_system[name] = row
                continue
            cases = {}
            for case in CASES:
                if case["name"] not in first["cases"]:
                    continue
                spec = _case_spec(case, plan["cases"])
                per_rank = [e["cases"][case["name"]] for e in entries]
                statuses = {p["status"] for p in per_rank}
                if statuses == {"accepted"}:
                    errs = _errors(per_rank, spec, world, refs[case["name"]])
                    worst = max(errs.values())
                    cases[case["name"]] = dict(status="accepted", errors=errs, max_error=worst,
                                               silently_wrong=worst > WRONG_ABOVE)
                else:
                    p = next(p for p in per_rank if p["status"] != "accepted")
                    cases[case["name"]] = {k: v for k, v in p.items() if k not in ("pos", "local")}
                    if len(statuses) > 1:
                        cases[case["name"]]["note"] = f"ranks disagree: {sorted(statuses)}"
            row["cases"] = cases
            drop = first["dropout"]
            if drop["status"] == "accepted":
                drop = dict(drop, stack_entries_left=[e["dropout"].get("stack_entries_left") for e in entries])
            row["dropout"] = drop
            if "memory" in first:
                row["memory"] = {"no_checkpoint": first["memory"], "checkpoint": first["memory_checkpoint"],
                                 "no_checkpoint_all_ranks": [e["memory"] for e in entries],
                                 "checkpoint_all_ranks": [e["memory_checkpoint"] for e in entries]}
                row["eval_no_grad"] = first["eval"]
                row["traffic"] = first["traffic"]
                row["traffic_all_ranks"] = [e["traffic"] for e in entries]
                row["time"] = dict(
                    forward_median_s=max(e["time"]["forward_median_s"] for e in entries),
                    backward_median_s=max(e["time"]["backward_median_s"] for e in entries),
                    per_rank=[e["time"] for e in entries],
                    note="max over ranks of each rank's median")
            by_system[name] = row
        base = by_system.get(CP_CACHE, {}).get("time")
        for row in by_system.values():
            if base and "time" in row:
                row["time"]["forward_ratio_to_cp_cache"] = row["time"]["forward_median_s"] / base["forward_median_s"]
                row["time"]["backward_ratio_to_cp_cache"] = (row["time"]["backward_median_s"]
                                                             / base["backward_median_s"])
        results[str(world)] = by_system
    return results


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    if c["status"] == "accepted":
        e = c["max_error"]
        return f"WRONG {e:.2g}" if c.get("silently_wrong") else f"ok {e:.0e}"
    if c["status"] == "refused":
        return "refused"
    return "n/s"


def _dropout_cell(d: dict | None) -> str:
    if d is None:
        return "-"
    if d["status"] == "accepted":
        return ("ok " if d["ok"] else "WRONG ") + f"{d['max_error']:.2g}"
    return "refused" if d["status"] == "refused" else "n/s"


def _print_report(report: dict) -> None:
    systems = report["meta"]["plan"]["systems"]
    for world, by_system in report["results"].items():
        print(f"\n== W = {world}: acceptance and max relative error vs dense float64 (out/dq/dk/dv) ==")
        headers = ["case"] + [SHORT[s] for s in systems]
        rows = []
        for case in CASES:
            rows.append([case["name"]] + [
                "(=2.13)" if s in DROPOUT_ONLY else _cell(by_system[s].get("cases", {}).get(case["name"]))
                for s in systems])
        rows.append([DROPOUT_CASE["name"] + " (dir. deriv.)"] + [_dropout_cell(by_system[s].get("dropout"))
                                                                   for s in systems])
        print(table(headers, rows))
        r = report["meta"]["plan"]["resources"]
        print(f"\n== W = {world}: resources, B={r['batch']} N={r['heads']} S={r['seq']} D={r['head_dim']} fp32 causal "
              "load-balanced (rank 0; time: max over ranks of medians) ==")
        headers = ["system", "kept fwd->bwd", "kept (ckpt)", "fwd peak", "bwd peak", "fwd peak (ckpt)",
                   "bwd peak (ckpt)", "eval entries", "fwd s", "bwd s", "fwd x", "bwd x", "sent fwd", "sent bwd"]
        rows = []
        for s in systems:
            row = by_system[s]
            if "memory" not in row:
                continue
            m, mc, t, tr = row["memory"]["no_checkpoint"], row["memory"]["checkpoint"], row["time"], row["traffic"]
            ev = row["eval_no_grad"]["stack_entries_left"]
            rows.append([SHORT[s], fmt_bytes(m["total_bytes"]), fmt_bytes(mc["total_bytes"]),
                         fmt_bytes(m["forward_peak_bytes"]), fmt_bytes(m["backward_peak_bytes"]),
                         fmt_bytes(mc["forward_peak_bytes"]), fmt_bytes(mc["backward_peak_bytes"]),
                         "n/a" if ev is None else ev, f"{t['forward_median_s']:.3f}", f"{t['backward_median_s']:.3f}",
                         f"{t.get('forward_ratio_to_cp_cache', float('nan')):.2f}",
                         f"{t.get('backward_ratio_to_cp_cache', float('nan')):.2f}",
                         fmt_bytes(tr["forward_bytes"]), fmt_bytes(tr["backward_bytes"])])
        print(table(headers, rows))
        errors = [f"{s}: {by_system[s]['session_error']}" for s in systems if "session_error" in by_system[s]]
        for line in errors:
            print("SESSION ERROR " + line)
    v = report["validation"]
    d = v["directional_check"]
    print(f"\ndropout check validated on one process: dense op max error {d['dense_op_max']:.2g}, "
          f"wrong backward (negative control) {d['wrong_backward_max']:.2g} (threshold {d['threshold']})")
    m = v["memory_helper"]
    print(f"memory helper: {fmt_bytes(m['allocated'])} allocated, peak measured {m['measured_peak']} B "
          f"({'ok' if m['ok'] else 'OFF'})")


def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    started = time.perf_counter()
    print(f"compare: systems {', '.join(plan['systems'])}; W = {plan['worlds']}", flush=True)
    validation = dict(directional_check=validate_directional_check(plan), memory_helper=validate_memory_helper())
    per_world = {}
    for world in plan["worlds"]:
        t0 = time.perf_counter()
        print(f"compare: W={world} ...", flush=True)
        ranks = launch(compare_rank, world, plan, timeout=float(plan["timeout"]))
        if ranks is None:
            return 0  # torchrun rank > 0
        per_world[world] = ranks
        print(f"compare: W={world} took {time.perf_counter() - t0:.1f} s", flush=True)
    results = _summarise(plan, per_world)
    report = dict(
        meta=dict(
            python=platform.python_version(), machine=platform.machine(),
            torch=per_world[plan["worlds"][0]][0]["torch"], plan=plan,
            cases={c["name"]: c["what"] for c in CASES + (DROPOUT_CASE,)},
            repeats=dict(warmup=plan["warmup"], timed=plan["repeats"], eval_forwards=3,
                         directions=plan["directions"]),
            thresholds=dict(silently_wrong_above=WRONG_ABOVE, dropout_ok_below=DROPOUT_OK_BELOW),
            notes=dict(
                kernels="every system runs the CPU emulator of npu_fusion_attention_v3 / _grad_v3",
                errors="max|x - ref| / max|ref| per tensor vs dense float64 attention (fp32 inputs); "
                       "max_error = max over out, dq, dk, dv",
                dropout="directional-derivative check (cp_cache.testing.reference): |g.d - fd| / max(|g.d|, |fd|), "
                        f"max over directions; eps {plan['eps']} (with fp32 kernels 1e-2 leaves 1e-3..6e-3 of rounding "
                        f"noise); RNG reset with torch.manual_seed({RNG_SEED} + rank) per forward",
                kept="bytes kept from forward to backward: distinct storages saved by autograd during the "
                     "attention forward (saved_tensors_hooks; q, k, v and the mask excluded; a DTensor counts "
                     "its local tensor), union the storages held by torch_npu 2.12.0's _step_cache_stack "
                     "entries, plus cp_cache's store live bytes",
                peaks="allocation/free events of torch.profiler (profile_memory=True) summed in time order; "
                      "peak above the level at the phase's start; fwd and bwd in one profile, after gc.collect(); "
                      "freed_by_gc_after_backward: bytes a gc.collect() right after backward frees (garbage "
                      "held in reference cycles)",
                traffic="bytes handed to torch.distributed sending calls during the forward and the backward of "
                        "the first memory pass; all_gather counted as "
                        "input bytes x (W-1) (= (W-1)/W of the gathered output); all_to_all: the parts "
                        "for other ranks; cp_cache_reported = cp_cache.call_stats()",
                time="CPU, one thread per rank; W ranks share the machine's cores (oversubscribed when W > cores); "
                     "timed in rounds (each round calls every system once, in its own session) after every "
                     "system has run its cases and memory passes in the same process; per-rank samples kept",
                guard_lifted="torch_npu 2.13.0 (guard lifted): its CP strategies read keep_prob as 1.0 "
                             "(monkeypatch in cli/compare.py, this process only) so its handler runs under "
                             "dropout; measured for the dropout check only",
                torch_ring="torch's _templated_ring_attention(_backward) driven with a step wrapper around the "
                           "emulator op (cli/compare.py); BNSD, is_causal only, no dropout",
            ),
        ),
        validation=validation,
        systems=list(plan["systems"]),
        results=results,
    )
    report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "compare.json"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    _print_report(report)
    png_path = args.out / "compare.png"
    plotted = _plot(report, png_path)
    print(f"\nwritten: {json_path}")
    print(f"written: {png_path}" if plotted else "no plot (matplotlib missing: run make build)")
    print(f"compare took {report['meta']['seconds']:.1f} s")
    return 0


# ---------------------------------------------------------------- the plot


def _paired_bars(ax, systems: list, worlds: list, value, keys: tuple, suffixes: tuple, ylabel: str,
                 title: str) -> None:
    """One group of bars per system: for each W, a plain and a hatched bar, ``value(W, system,
    key)`` for the two ``keys`` (None: no bar)."""
    import numpy as np

    x = np.arange(len(systems))
    width = 0.8 / (2 * len(worlds))
    for k, wk in enumerate(worlds):
        for off, (key, suffix, hatch) in enumerate(zip(keys, suffixes, (None, "//"))):
            vals = [value(wk, s, key) for s in systems]
            vals = [np.nan if v is None else v for v in vals]
            ax.bar(x + (2 * k + off - (2 * len(worlds) - 1) / 2) * width, vals, width, hatch=hatch,
                   label=f"W={wk}{suffix}")
    ax.set_xticks(x, [SHORT[s] for s in systems], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    systems = report["systems"]
    worlds = list(report["results"])
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    (ax_acc, ax_kept, ax_peak), (ax_time, ax_sent, ax_drop) = axes

    # correctness heatmap at the largest W
    w = worlds[-1]
    res = report["results"][w]
    names = [c["name"] for c in CASES] + [DROPOUT_CASE["name"]]
    grid = np.full((len(names), len(systems)), np.nan)
    labels = [["" for _ in systems] for _ in names]
    for j, s in enumerate(systems):
        for i, case in enumerate(names):
            c = res[s].get("dropout") if case == DROPOUT_CASE["name"] else res[s].get("cases", {}).get(case)
            if c is None:
                labels[i][j] = "(=2.13)" if s in DROPOUT_ONLY else "-"
                continue
            if c["status"] == "accepted" and case == DROPOUT_CASE["name"]:  # pass/fail of the check
                grid[i, j] = -7.0 if c["ok"] else 0.0
                labels[i][j] = ("ok " if c["ok"] else "WRONG ") + f"{c['max_error']:.0e}"
            elif c["status"] == "accepted":
                grid[i, j] = math.log10(max(c["max_error"], 1e-12))
                labels[i][j] = f"{c['max_error']:.0e}"
            else:
                labels[i][j] = "refused" if c["status"] == "refused" else "n/s"
    im = ax_acc.imshow(grid, cmap="RdYlGn_r", vmin=-8, vmax=0, aspect="auto")
    for i in range(len(names)):
        for j in range(len(systems)):
            ax_acc.text(j, i, labels[i][j], ha="center", va="center", fontsize=6)
    ax_acc.set_xticks(range(len(systems)), [SHORT[s] for s in systems], rotation=35, ha="right", fontsize=7)
    ax_acc.set_yticks(range(len(names)), names, fontsize=7)
    ax_acc.set_title(f"max rel. error vs dense (log10), W={w}; last row: dropout check (pass/fail)", fontsize=9)
    fig.colorbar(im, ax=ax_acc, fraction=0.04)

    measured = [s for s in systems if any("memory" in report["results"][wk][s] for wk in worlds)]
    width = 0.8 / max(len(worlds), 1)

    mib = 1 << 20
    results = report["results"]

    def memory(wk, s, key):
        return results[wk][s]["memory"][key] if "memory" in results[wk][s] else None

    def traffic(wk, s, key):
        return results[wk][s]["traffic"][key] / mib if "traffic" in results[wk][s] else None

    def kept(wk, s, key):
        m = memory(wk, s, key)
        return None if m is None else m["total_bytes"] / mib

    def peak(wk, s, key):
        m = memory(wk, s, "no_checkpoint")
        return None if m is None else m[key] / mib

    def time_ratio(wk, s, key):
        return results[wk][s].get("time", {}).get(key)

    _paired_bars(ax_kept, measured, worlds, kept, ("no_checkpoint", "checkpoint"), ("", " checkpointed"),
                 "MiB kept from forward to backward (rank 0)", "bytes kept between forward and backward")
    _paired_bars(ax_peak, measured, worlds, peak, ("forward_peak_bytes", "backward_peak_bytes"),
                 (" forward", " backward"), "MiB above the starting level (rank 0)",
                 "peak allocated during forward / backward")
    _paired_bars(ax_time, measured, worlds, time_ratio, ("forward_ratio_to_cp_cache", "backward_ratio_to_cp_cache"),
                 (" forward", " backward"), "median time / cp_cache's",
                 "time per call relative to cp_cache (CPU, emulator)")
    ax_time.axhline(1.0, color="k", lw=0.8)
    _paired_bars(ax_sent, measured, worlds, traffic, ("forward_bytes", "backward_bytes"), (" forward", " backward"),
                 "MiB sent per rank per call (rank 0)", "communication")

    xs = np.arange(len(systems))
    for k, wk in enumerate(worlds):
        vals = []
        for s in systems:
            d = report["results"][wk][s].get("dropout") or {}
            vals.append(d["max_error"] if d.get("status") == "accepted" else np.nan)
        ax_drop.bar(xs + (k - (len(worlds) - 1) / 2) * width, vals, width, label=f"W={wk}")
        for j, s in enumerate(systems):
            d = report["results"][wk][s].get("dropout") or {}
            if d.get("status") in ("refused", "not supported"):
                ax_drop.text(xs[j] + (k - (len(worlds) - 1) / 2) * width, 1e-6,
                             "refused" if d["status"] == "refused" else "n/s", rotation=90, fontsize=7,
                             ha="center", va="bottom")
    v = report["validation"]["directional_check"]
    ax_drop.axhline(v["dense_op_max"], color="g", ls=":", label="dense op (control)")
    ax_drop.axhline(v["wrong_backward_max"], color="r", ls=":", label="wrong backward (control)")
    ax_drop.axhline(DROPOUT_OK_BELOW, color="k", lw=0.8, label="threshold")
    ax_drop.set_yscale("log")
    ax_drop.set_ylim(1e-6, 5)
    ax_drop.set_xticks(xs, [SHORT[s] for s in systems], rotation=35, ha="right", fontsize=7)
    ax_drop.set_ylabel("max directional-derivative error")
    ax_drop.set_title(f"gradients under dropout (keep_prob {DROPOUT_CASE['keep_prob']})", fontsize=9)
    ax_drop.legend(fontsize=7)

    r = report["meta"]["plan"]["resources"]
    fig.suptitle(f"CP attention systems on the NPU emulator (torch {report['meta']['torch']}"
                 + (", quick" if report["meta"]["plan"]["quick"] else "")
                 + f"); resources at B={r['batch']} N={r['heads']} S={r['seq']} D={r['head_dim']} fp32 causal")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
