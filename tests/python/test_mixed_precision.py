"""What mixed precision and real batches hand cp_cache: a stage of two dtypes posted from strided
views (a run of rows narrowed out of a two-head K block beside a bfloat16 V) arrives whole; the
op refuses q/k/v of two dtypes naming them (the emulator, as the op's contract says); the SDPA
route under autocast equals aten's SDPA under the same autocast; a dense length torch's sharding
cannot cut is refused naming T, W and the fix; the Trainer mixin finds a packed batch's documents
from position ids that restart and shards every per-token entry with the tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_cache.testing import install_npu_emulator
from cp_cache.testing.multiprocess import capture, run_ranks
from cp_cache.testing.reference import error_bound, rel_err


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cp_cache
    from cp_cache.engine.transport import Transfer

    peer = 1 - rank
    g = torch.Generator().manual_seed(rank)
    block = torch.randn(1, 2, 256, 16, generator=g)  # [B, Nkv, S, D]: K float32, V bfloat16 beside it
    k_rows = block.narrow(2, 64, 128)  # strides (8192, 4096, 16, 1): not contiguous
    v_rows = block.to(torch.bfloat16).transpose(1, 2).narrow(1, 0, 128)  # [B, S, N, D] view
    target = torch.zeros(1, 128, 2, 16).transpose(1, 2)  # a strided receive target
    other = torch.zeros(1, 128, 2, 16, dtype=torch.bfloat16)
    received = Transfer([k_rows, v_rows], peer, [target, other], peer, dist.group.WORLD, tag=0).wait()
    peer_block = torch.randn(1, 2, 256, 16, generator=torch.Generator().manual_seed(peer))
    out = {"k": bool(torch.equal(received[0], peer_block.narrow(2, 64, 128))),
           "v": bool(torch.equal(received[1], peer_block.to(torch.bfloat16).transpose(1, 2).narrow(1, 0, 128))),
           "k_in_place": received[0] is target}
    install_npu_emulator()
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.arange(2 * 509).view(2, 509)
    out["length"] = capture(lambda: cp_cache.context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]).__enter__())
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank, 2, timeout=120.0)


def test_a_stage_of_strided_views_in_two_dtypes_arrives(ranks):
    for rank, res in enumerate(ranks):
        assert res["k"] and res["v"] and res["k_in_place"], (rank, res)


def test_a_dense_length_the_sharding_cannot_cut_is_refused(ranks):
    for res in ranks:
        kind, message = res["length"]
        assert kind == "ValueError", res["length"]
        for said in ("T=509", "W=2", "pad_to_multiple_of=4", "documents=cu_seq_lens_q"):
            assert said in message, (said, message)


def test_the_op_refuses_two_dtypes_naming_them():
    install_npu_emulator()
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    v = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    kind, message = capture(lambda: torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.5))
    assert kind == "TypeError", (kind, message)
    assert "query torch.float32, key torch.float32, value torch.bfloat16" in message, message


def test_sdpa_route_under_autocast_equals_aten_sdpa():
    """Under bf16 autocast, RoPE-like float32 q/k beside a bfloat16 v: the route casts them as
    aten's SDPA does (lower precision), and both equal float64 within the bound of aten's own error."""
    from cp_cache.emulator.sdpa_route import scaled_dot_product_attention as routed

    install_npu_emulator()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    truth = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        aten = torch._C._nn.scaled_dot_product_attention(q.float(), k.float(), v.bfloat16(), is_causal=True)
        ours = routed(q.float(), k.float(), v.bfloat16(), is_causal=True)
    assert ours.dtype == aten.dtype == torch.bfloat16
    bound = error_bound(rel_err(aten.double(), truth), dtype=torch.bfloat16, factor=4.0, floor=0.5)
    assert rel_err(ours.double(), truth) <= bound


def test_mixin_reads_documents_from_restarting_positions():
    from cp_cache.integrations.trainer import _documents, _per_token

    ids = torch.arange(9).view(1, 9)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    inputs = {"input_ids": ids, "position_ids": positions, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])}
    documents = _documents(inputs)
    assert documents.tolist() == [0, 3, 5, 9] and inputs["cu_seq_lens_q"] is inputs["cu_seq_lens_k"] is documents
    assert _per_token("seq_idx", inputs["seq_idx"], ids) and not _per_token("cu_seq_lens_q", documents, ids)
    dense = {"input_ids": ids, "position_ids": torch.arange(9).view(1, 9)}
    assert _documents(dense) is None and "cu_seq_lens_q" not in dense
    kind, message = capture(lambda: _documents({"input_ids": ids, "position_ids": positions + 1}))
    assert kind == "ValueError" and "restart at 0" in message, message
