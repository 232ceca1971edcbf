"""The CP group carries only payload tensors: metadata (agreement signatures, refusal
messages, anything integer) goes over cp_cache's CPU side group.

On a cluster the CP group is usually accelerator-only (HCCL, NCCL): it refuses CPU
tensors and object collectives. Each rank here stands such a group in for its CP mesh
groups: every torch.distributed collective and point-to-point call made on one of them
is refused when it carries an integer or bool tensor or Python objects, and recorded.
Ring, Ulysses, hybrid and packed documents then run forward and backward, and refusals
and mismatches fail on every rank; nothing may be refused on the CP groups.
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
    # a refusal on one rank only (its own arguments): every rank fails, the refusing one first
    bad = dict(pse=torch.zeros(1)) if rank == world - 1 else {}
    results["refusal"] = capture(lambda: _attention(*leaves(flat, [Shard(2)]), **bad))
    # ranks that disagree (the scale): the same RuntimeError on every rank
    results["mismatch"] = capture(lambda: _attention(*leaves(flat, [Shard(2)]), scale=0.3 + 0.1 * (rank == 0)))
    return results


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


@pytest.mark.parametrize("case", ["ring", "ulysses", "hybrid", "packed"])
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
