"""Packed documents: bad input raises, on every rank, with the values; never a wrong answer.
Also the helpers shard/unshard/pad_documents against their definition."""

from __future__ import annotations

import re

import pytest
import torch

from cp_cache.documents import cumulative_lengths, document_positions
from cp_cache.testing.multiprocess import capture, run_ranks

N, D = 2, 4


def _rank_errors(rank: int, world: int) -> dict:
    import cp_cache
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from cp_cache.npu_ops import causal_mask
    from cp_cache.testing import install_npu_emulator

    install_npu_emulator(route_sdpa=False)
    mesh = init_device_mesh("cpu", (world,))
    with cp_cache.context_parallel(mesh):
        cp_cache.enable(documents="head_tail")  # equal local lengths; the balanced placement's refusals at the end
        T = 16 * world
        g = torch.Generator().manual_seed(3)
        local = [torch.randn(T // world, N, D, generator=g) for _ in range(3)]
        q, k, v = (DTensor.from_local(t, mesh, [Shard(0)]) for t in local)
        causal = dict(atten_mask=causal_mask("cpu"), sparse_mode=3)

        def call(qlen, kvlen=None, **kw):
            kvlen = qlen if kvlen is None else kvlen
            as_tensor = (lambda x: x) if not isinstance(qlen, list) else torch.tensor
            return lambda: torch.ops.npu.npu_fusion_attention_v3(
                q, k, v, N, "TND", actual_seq_qlen=as_tensor(qlen), actual_seq_kvlen=as_tensor(kvlen), **{**causal, **kw})

        errors = {}
        _cp_options.enable_load_balance = True
        # document 1 has length 6: not a multiple of 2W (4 at W = 2, 8 at W = 4)
        errors["indivisible"] = capture(call([2 * world, 2 * world + 6, T]))
        errors["short_sum"] = capture(call([8, T - 2 * world]))
        errors["non_increasing"] = capture(call([8, 8, T]))
        errors["decreasing"] = capture(call([16, 8, T]))
        errors["q_kv_differ"] = capture(call([8, T], [16, T]))
        errors["missing_kvlen"] = capture(lambda: torch.ops.npu.npu_fusion_attention_v3(
            q, k, v, N, "TND", actual_seq_qlen=torch.tensor([T])))
        errors["float_lengths"] = capture(call(torch.tensor([8.0, T])))
        # a band takes the compressed mask, as for the other layouts; explicit masks are refused
        errors["band_uncompressed"] = capture(call([T], atten_mask=torch.zeros(T, T, dtype=torch.bool), sparse_mode=4))
        errors["explicit_mask"] = capture(call([T], atten_mask=torch.zeros(T, T, dtype=torch.bool), sparse_mode=1))
        # ranks that disagree on the documents (each list valid on its own): every rank refuses
        per_rank = [4 * world, T] if rank == 0 else [8 * world, T]
        errors["ranks_disagree"] = capture(call(per_rank))
        # a backward whose documents (read by the custom op) are not its forward's
        res = call([8 * world, T])()
        other = torch.tensor([4 * world, T])
        errors["backward_other_documents"] = capture(lambda: torch.ops.npu.npu_fusion_attention_grad_v3(
            q, k, v, res[0], N, "TND", softmax_max=res[1], softmax_sum=res[2], attention_in=res[0], seed=res[4],
            offset=res[5], actual_seq_qlen=other, actual_seq_kvlen=other, scale_value=1.0, **causal))
        del res
        _cp_options.enable_load_balance = False
        errors["contiguous_odd_ok"] = capture(call([3, 10, T]))  # any lengths without load balancing
        _cp_options.enable_load_balance = True
        cp_cache.enable(documents="balanced")
        # T/W local tokens on every rank, but the balanced placement of these documents is uneven
        errors["balanced_local_length"] = capture(call([T - 3, T]))
    errors["round_trip"] = _round_trip(mesh, world)  # the same group serves the helpers' check
    return errors


_RESULTS: dict = {}


def _errors(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank_errors, world, timeout=300)
    return _RESULTS[world]


EXPECTED = [
    ("indivisible", "ValueError", r"document 1 of actual_seq_qlen has length 6, not divisible by 2\*W = {2W}.*pad_documents"),
    ("short_sum", "ValueError", r"actual_seq_qlen=\[8, {Tm}\]: the document lengths sum to {Tm}, but the global sequence has T={T}"),
    ("non_increasing", "ValueError", r"actual_seq_qlen=\[8, 8, {T}\] must be strictly increasing.*entry 1 is 8 after 8"),
    ("decreasing", "ValueError", r"actual_seq_qlen=\[16, 8, {T}\] must be strictly increasing"),
    ("q_kv_differ", "ValueError", r"actual_seq_qlen=\[8, {T}\] and actual_seq_kvlen=\[16, {T}\] differ"),
    ("missing_kvlen", "ValueError", r"needs actual_seq_kvlen"),
    ("float_lengths", "ValueError", r"actual_seq_qlen must be a 1-D integer tensor.*torch.float32"),
    ("band_uncompressed", "NotImplementedError",
     r"input_layout='TND'.*not sparse_mode=4 with atten_mask=<tensor of shape \({T}, {T}\)"),
    ("explicit_mask", "NotImplementedError",
     r"input_layout='TND'.*not sparse_mode=1 with atten_mask=<tensor of shape \({T}, {T}\).*explicit masks"),
    ("ranks_disagree", "RuntimeError", r"ranks disagree on packed documents: rank 0 2 documents.*rank 1 2 documents"),
    ("backward_other_documents", "RuntimeError",
     r"backward called with .*'documents': \({4W}, {T}\).* but its forward ran with .*'documents': \({8W}, {T}\)"),
    ("contiguous_odd_ok", "no error", r""),
    # a rank whose shard is wrong raises its ValueError; one whose shard is right, the RuntimeError naming it
    ("balanced_local_length", "ValueError|RuntimeError",
     r"rank \d holds {Tw} local tokens, but placement 'balanced' of actual_seq_qlen=\[{Tm3}, {T}\] over W=\d "
     r"ranks gives it \d+"),
]


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("label, kind, pattern", EXPECTED, ids=[e[0] for e in EXPECTED])
def test_refused_on_every_rank(world, label, kind, pattern):
    T = 16 * world
    pattern = pattern.replace("{2W}", str(2 * world)).replace("{4W}", str(4 * world)).replace("{8W}", str(8 * world)).replace("{Tm}", str(T - 2 * world)).replace("{T}", str(T)).replace("{Tw}", str(T // world)).replace("{Tm3}", str(T - 3))
    for rank, errors in enumerate(_errors(world)):
        got_kind, message = errors[label]
        assert re.fullmatch(kind, got_kind), (label, rank, got_kind, message)
        assert re.search(pattern, message, re.S), (label, rank, message)


# ---------------------------------------------------------------- the helpers


class _Mesh:
    """The two things the helpers read from a 1-D DeviceMesh, for the single-process checks
    (the W-rank round trip runs on real process groups below)."""

    ndim = 1

    def __init__(self, rank, world):
        self._rank, self._world = rank, world

    def get_local_rank(self):
        return self._rank

    def size(self):
        return self._world


def test_shard_documents_is_per_document_head_tail():
    import cp_cache

    cu = [8, 24]  # documents of 8 and 16 tokens, W = 2: chunks of 2 and 4
    x = torch.arange(24)
    assert cp_cache.shard_documents(x, cu, _Mesh(0, 2), placement="head_tail").tolist() == \
        [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert cp_cache.shard_documents(x, cu, _Mesh(1, 2), placement="head_tail").tolist() == \
        [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19]
    assert cp_cache.shard_documents(x, cu, _Mesh(1, 2), load_balance=False).tolist() == list(range(12, 24))
    with pytest.raises(ValueError, match=r"document 0 of cu_seqlens has length 6, not divisible by 2\*W = 4"):
        cp_cache.shard_documents(torch.arange(12), [6, 12], _Mesh(0, 2), placement="head_tail")


def test_positions_partition_the_sequence():
    cu = [8, 32, 40, 64]
    for world in (1, 2, 4):
        for placement in ("balanced", "head_tail", "contiguous"):
            allpos = torch.cat([document_positions(cu, r, world, placement) for r in range(world)])
            assert sorted(allpos.tolist()) == list(range(64))


def test_pad_documents():
    import cp_cache

    x = torch.arange(1, 11, dtype=torch.float32).view(10, 1)  # documents of 3, 4, 3 tokens
    padded, cu, real = cp_cache.pad_documents(x, torch.tensor([3, 7, 10]), 4)
    assert cu.tolist() == [4, 8, 12]
    assert padded.view(-1).tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10, 0]
    assert real.tolist() == [True] * 3 + [False] + [True] * 4 + [True] * 3 + [False]
    assert torch.equal(padded[real], x)
    with pytest.raises(ValueError, match=r"cu_seqlens=\[3, 7, 9\] ends at 9, but the tensor has 10 tokens"):
        cp_cache.pad_documents(x, [3, 7, 9], 4)


def test_cumulative_lengths_errors():
    with pytest.raises(ValueError, match=r"must be strictly increasing.*entry 0 is 0 after 0"):
        cumulative_lengths([0, 4])
    with pytest.raises(ValueError, match=r"is empty"):
        cumulative_lengths([])


def _round_trip(mesh, world: int) -> bool:
    """shard_documents then unshard_documents gives the tensor back, under every placement."""
    import cp_cache

    cu = [8 * world, 24 * world, 32 * world]
    x = torch.randn(32 * world, 3, generator=torch.Generator().manual_seed(1))
    ok = True
    for placement in ("balanced", "head_tail", "contiguous"):
        local = cp_cache.shard_documents(x, cu, mesh, placement=placement)
        ok &= torch.equal(cp_cache.unshard_documents(local, cu, mesh, placement=placement), x)
    return ok


@pytest.mark.parametrize("world", (2, 4))
def test_shard_unshard_round_trip(world):
    assert all(errors["round_trip"] for errors in _errors(world))
