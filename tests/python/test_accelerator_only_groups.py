"""Ready for accelerator clusters: the CP group carries only payload tensors, and a call's
steady state reads no device value on the host.

Metadata (agreement signatures, refusal messages, anything integer) goes over cp_cache's
CPU side group.

On a cluster the CP group is usually accelerator-only (HCCL, NCCL): it refuses CPU
tensors and object collectives. Each rank here stands such a group in for its CP mesh
groups: every torch.distributed collective and point-to-point call made on one of them
is refused when it carries an integer or bool tensor or Python objects, and recorded.
Ring, Ulysses, hybrid and packed documents (on the ring, Ulysses and hybrid) then run forward
and backward, and refusals
and mismatches fail on every rank; nothing may be refused on the CP groups.

Host reads: a call's handlers (its second call: the first creates the side group) run
under a dispatch mode that sees inside cp_cache's custom ops (not inside the NPU ops: the
device's kernels) and records every read of a tensor's value on the host
(``aten._local_scalar_dense``: item, int, bool) and every copy to the host from another
device, with the cp_cache file that made it. The documented exceptions (docs/ascend.md): a given mask's blocks are classified on the
host (which kernel calls run), and the stack policy fingerprints the seeds.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cp_cache.testing.multiprocess import capture, run_ranks

WORLD = 4
B, N, D, S_LOCAL = 1, 4, 8, 4
# isend/irecv stay as they are (P2POp checks their identity): batch_isend_irecv is guarded
_TENSOR_CALLS = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "all_to_all_single",
                 "reduce_scatter_tensor", "send", "recv")
_OBJECT_CALLS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


class AcceleratorOnly:
    """torch.distributed's calls on the ``groups`` refuse integer tensors and objects, as an
    accelerator-only group would (here: refused, and recorded)."""

    def __init__(self, groups):
        import torch.distributed as dist

        self.dist, self.groups, self.refused, self._real = dist, list(groups), [], {}
        for name in _TENSOR_CALLS + _OBJECT_CALLS + ("batch_isend_irecv",):
            self._real[name] = getattr(dist, name)
            setattr(dist, name, functools.partial(self._guard, name))

    def close(self) -> None:
        for name, fn in self._real.items():
            setattr(self.dist, name, fn)

    def _on_cp_group(self, group) -> bool:
        group = self.dist.group.WORLD if group is None else group
        return any(group is g for g in self.groups)

    def _refuse(self, what: str):
        self.refused.append(what)
        raise RuntimeError(f"accelerator-only CP group: {what}")

    def _guard(self, name, *args, **kwargs):
        real = self._real[name]
        if name == "batch_isend_irecv":
            for op in args[0]:
                if self._on_cp_group(op.group) and not op.tensor.is_floating_point():
                    self._refuse(f"{op.op.__name__} of {op.tensor.dtype}")
            return real(*args, **kwargs)
        if not self._on_cp_group(kwargs.get("group")):
            return real(*args, **kwargs)
        if name in _OBJECT_CALLS:
            self._refuse(name)
        tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
        if any(not t.is_floating_point() for t in tensors):
            self._refuse(f"{name} of {[t.dtype for t in tensors]}")
        return real(*args, **kwargs)


# a tensor's value read on the host: item()/int()/float() (_local_scalar_dense), bool() (is_nonzero)
_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
               torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default)


class HostReads:
    """A dispatch mode recording host reads of tensor values made by cp_cache's code, inside
    its custom ops too (their Python implementation runs under the mode)."""

    def __new__(cls):
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        from cp_cache.handlers import attention as ops

        implementations = {"ring_forward": ops.ring_forward._init_fn, "ring_backward": ops.ring_backward._init_fn}

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.reads: list[str] = []
                self.calls = 0

            def _where(self) -> str:
                """The innermost cp_cache file on the stack ("" when the caller itself reads)."""
                frames = [f.filename for f in traceback.extract_stack() if "/cp_cache/" in f.filename
                          and "/emulator/" not in f.filename and "/testing/" not in f.filename]
                return frames[-1].split("/cp_cache/", 1)[1] if frames else ""

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace == "cp_cache":
                    self.calls += 1
                    with self:
                        return implementations[func.__name__.split(".")[0]](*args, **kwargs)
                if func in _HOST_READS and self._where():
                    self.reads.append(self._where())
                elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                    source = args[1] if func is torch.ops.aten.copy_.default else args[0]
                    target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
                    if target is not None and torch.device(target).type == "cpu" and source.device.type != "cpu":
                        self.reads.append("copy to host: " + (self._where() or "caller"))
                return func(*args, **kwargs)

        return _Mode()


def _host_reads(run) -> list[str]:
    """The host reads cp_cache's handlers make in ``run()``'s second call (the first may set
    things up): the handlers in DTensor's table run under the recording mode (a mode entered
    around ``run`` would see the op on DTensors and be popped before DTensor's dispatch)."""
    from torch.distributed.tensor import DTensor

    run()
    mode, table = HostReads(), DTensor._op_dispatcher._custom_op_handlers
    ops = (torch.ops.npu.npu_fusion_attention_v3.default, torch.ops.npu.npu_fusion_attention_grad_v3.default)
    handlers = {op: table[op] for op in ops}

    def recorded(handler):
        def run_handler(op_call, args, kwargs):
            with mode:
                return handler(op_call, args, kwargs)
        return run_handler

    table.update({op: recorded(h) for op, h in handlers.items()})
    try:
        run()
    finally:
        table.update(handlers)
    assert mode.calls >= 2, f"the recorder saw {mode.calls} cp_cache op calls"  # forward and backward
    return mode.reads


def _attention(q, k, v, layout="BNSD", **kw):
    from cp_cache.npu_ops import causal_mask

    kw = {"atten_mask": causal_mask("cpu"), "sparse_mode": 2, "next_tockens": 0, "scale": 0.3, **kw}
    return torch.ops.npu.npu_fusion_attention_v3(q, k, v, N, layout, **kw)[0]


def _run(q, k, v, **kw) -> None:
    """Forward and backward; ValueError unless the output and gradients are finite."""
    out = _attention(q, k, v, **kw)
    out.backward(torch.ones_like(out))
    if not all(bool(torch.isfinite(t.to_local()).all()) for t in (out, q.grad, k.grad, v.grad)):
        raise ValueError("not finite")


def _dense_leaves(mesh, placements, rank: int, shape):
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(11 + rank)
    return [DTensor.from_local(torch.randn(*shape, generator=g), mesh, placements).requires_grad_()
            for _ in range(3)]


def _cases(rank: int, world: int, flat, grid) -> dict:
    import cp_cache
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    leaves = functools.partial(_dense_leaves, rank=rank, shape=(B, N, S_LOCAL, D))
    cu = torch.tensor([4 * world, 8 * world])
    results = {}
    for name, algorithm, mesh, placements in (("ring", "ring", flat, [Shard(2)]),
                                              ("ulysses", "ulysses", flat, [Shard(2)]),
                                              ("hybrid", "hybrid", grid, [Shard(2), Shard(2)])):
        cp_cache.enable(algorithm=algorithm)
        _cp_options.enable_load_balance = algorithm != "hybrid"  # hybrid lays the sequence out contiguously
        results[name] = capture(lambda: _run(*leaves(mesh, placements)))
    _cp_options.enable_load_balance = True
    cp_cache.enable()
    tnd = _dense_leaves(flat, [Shard(0)], rank, (8, N, D))
    results["packed"] = capture(lambda: _run(*tnd, layout="TND", sparse_mode=3, actual_seq_qlen=cu,
                                             actual_seq_kvlen=cu))
    for name, algorithm, run in _packed_all_to_all(rank, flat, grid, cu):
        cp_cache.enable(algorithm=algorithm)
        results[name] = capture(run)
    cp_cache.enable()
    results["reads"] = _read_cases(rank, world, flat, grid, leaves, tnd, cu)
    # a refusal on one rank only (its own arguments): every rank fails, the refusing one first
    bad = dict(pse=torch.zeros(1)) if rank == world - 1 else {}
    results["refusal"] = capture(lambda: _attention(*leaves(flat, [Shard(2)]), **bad))
    # ranks that disagree (the scale): the same RuntimeError on every rank
    results["mismatch"] = capture(lambda: _attention(*leaves(flat, [Shard(2)]), scale=0.3 + 0.1 * (rank == 0)))
    return results


def _packed_all_to_all(rank, flat, grid, cu):
    """(name, algorithm, forward and backward) of packed documents under Ulysses (the flat mesh) and
    hybrid (the grid)."""
    from torch.distributed.tensor import Shard

    for name, algorithm, mesh in (("packed_ulysses", "ulysses", flat), ("packed_hybrid", "hybrid", grid)):
        tnd = _dense_leaves(mesh, [Shard(0)] * mesh.ndim, rank, (8, N, D))
        yield name, algorithm, functools.partial(_run, *tnd, layout="TND", sparse_mode=3, actual_seq_qlen=cu,
                                                 actual_seq_kvlen=cu)


def _read_cases(rank, world, flat, grid, leaves, tnd, cu) -> dict:
    import cp_cache
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    reads = {}
    for name, algorithm, mesh, placements in (("ring", "ring", flat, [Shard(2)]),
                                              ("ulysses", "ulysses", flat, [Shard(2)])):
        cp_cache.enable(algorithm=algorithm)
        reads[name] = _host_reads(lambda: _run(*leaves(mesh, placements)))
    cp_cache.enable()
    reads["packed"] = _host_reads(lambda: _run(*tnd, layout="TND", sparse_mode=3, actual_seq_qlen=cu,
                                               actual_seq_kvlen=cu))
    for name, algorithm, run in _packed_all_to_all(rank, flat, grid, cu):
        cp_cache.enable(algorithm=algorithm)
        reads[name] = _host_reads(run)
    cp_cache.enable()
    seq = S_LOCAL * world
    given = torch.rand(seq, seq, generator=torch.Generator().manual_seed(2)) < 0.3
    given = torch.distributed.tensor.distribute_tensor(given, flat, [Replicate()])
    reads["given_mask"] = _host_reads(lambda: _run(*leaves(flat, [Shard(2)]), atten_mask=given, sparse_mode=1))
    cp_cache.enable("stack")
    reads["stack"] = _host_reads(lambda: _run(*leaves(flat, [Shard(2)])))
    cp_cache.enable()
    _cp_options.enable_load_balance = True
    return reads


def _ranks(rank: int, world: int) -> dict:
    import cp_cache
    from torch.distributed.device_mesh import init_device_mesh

    from cp_cache.emulator import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, world // 2))
    cp_groups = [flat.get_group(), grid.get_group(0), grid.get_group(1)]
    guard = AcceleratorOnly(cp_groups)
    try:
        with cp_cache.context_parallel(flat):
            results = _cases(rank, world, flat, grid)
        results["guard_refuses"] = capture(lambda: torch.distributed.all_gather_object([None] * world, 1,
                                                                                          group=cp_groups[0]))
    finally:
        guard.close()
        cp_cache.disable()
    results["refused_on_cp_groups"] = guard.refused
    return results


@functools.lru_cache(maxsize=None)
def _results() -> tuple:
    return tuple(run_ranks(_ranks, WORLD, timeout=300))


@pytest.mark.parametrize("case", ["ring", "ulysses", "hybrid", "packed", "packed_ulysses", "packed_hybrid"])
def test_runs_with_metadata_off_the_cp_group(case):
    for rank, res in enumerate(_results()):
        assert res[case] == ("no error", ""), (rank, case, res[case])


def test_refusals_and_mismatches_fail_on_every_rank():
    for rank, res in enumerate(_results()):
        kind, message = res["refusal"]
        assert kind in ("NotImplementedError", "RuntimeError"), (rank, res["refusal"])
        assert "pse" in message or "refused" in message, (rank, message)
        kind, message = res["mismatch"]
        assert kind == "RuntimeError" and "disagree on scale" in message, (rank, message)


def test_nothing_but_payload_on_the_cp_groups():
    for rank, res in enumerate(_results()):
        assert res["refused_on_cp_groups"] == ["all_gather_object"], (rank, res["refused_on_cp_groups"])
        # the stand-in does refuse: the only refusal recorded is the check's own object collective
        assert res["guard_refuses"][0] == "RuntimeError", res["guard_refuses"]


@pytest.mark.parametrize("case", ["ring", "ulysses", "packed", "packed_ulysses", "packed_hybrid"])
def test_steady_state_reads_nothing_on_the_host(case):
    for rank, res in enumerate(_results()):
        assert res["reads"][case] == [], (rank, case, res["reads"][case])


def test_documented_host_reads_only():
    """A given mask's block classification and need set (masks/given.py reads the mask; the
    rows each stage moves are then counted on the host, in engine/exchange.py) and the stack
    policy's seed fingerprint (step_cache.py) are the documented host reads; they do happen
    (the recorder sees reads), and nowhere else."""
    for rank, res in enumerate(_results()):
        given, stack = res["reads"]["given_mask"], res["reads"]["stack"]
        assert given and "masks/given.py" in given and set(given) <= {"masks/given.py", "engine/exchange.py"}, \
            (rank, given)
        assert stack and set(stack) == {"step_cache.py"}, (rank, stack)

