"""Refusals in the caller's words, on the path a user without an NPU gets (torch's kernels, no emulator):
SDPA's ``dropout_p`` on CPU under CP is refused on every rank naming ``dropout_p`` and the ways out on that
machine, and the way out named (the emulator) then runs the same call; a transformers model's attention dropout
gets the same message, naming ``attention_dropout``; ``enable(kernel="npu")`` without the NPU op is refused
at once, naming the ways to get it. (A length that fits none of the region's buffers, naming the
buffers and their sequence dims: tests/python/test_region_guard.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_cache.testing.multiprocess import run_ranks

WORLD = 2


def _message(call) -> str:
    try:
        call()
    except NotImplementedError as e:
        return str(e)
    return "not refused"


def _rank(rank: int, world: int) -> dict:
    import cp_cache
    from torch.distributed.device_mesh import init_device_mesh

    assert not hasattr(torch.ops.npu, "npu_fusion_attention_v3"), "these processes run without the NPU op"
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16 * world, 8) for _ in range(3))

    def sdpa():
        with cp_cache.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)

    out = {"sdpa": _message(sdpa)}
    try:
        cp_cache.enable(kernel="npu")  # no NPU op here: refused at once, not at the first call
        out["npu_kernel"] = "not refused"
    except RuntimeError as error:
        out["npu_kernel"] = str(error)
    from transformers import LlamaConfig, LlamaForCausalLM
    from cp_cache.integrations.transformers import register

    register()
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1, use_cache=False)
    model = LlamaForCausalLM._from_config(config, attn_implementation="cp_cache").train()
    ids, positions = torch.randint(0, 32, (1, 16 * world)), torch.arange(16 * world)[None]

    def transformers_step():
        with cp_cache.context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1]):
            model(input_ids=ids, position_ids=positions).logits.sum().backward()

    out["transformers"] = _message(transformers_step)
    cp_cache.emulator.install_npu_emulator()  # the way out the message names: the same call now runs
    with cp_cache.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        for t in (q, k, v):
            t.requires_grad_()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1).sum().backward()
        out["after_install"] = (tuple(q.grad.shape), bool(torch.isfinite(q.grad).all()))
        for t in (q, k, v):
            t.requires_grad_(False)
    return out


@pytest.fixture(scope="module")
def results() -> list:
    return run_ranks(_rank, WORLD, timeout=300.0)


def test_sdpa_dropout_on_cpu_is_refused_naming_dropout_p_and_the_way_out(results):
    for rank, res in enumerate(results):
        message = res["sdpa"]
        for words in ("dropout_p=0.1", "dropout_p=0.0", "cp_cache.emulator.install_npu_emulator()", "on CPU"):
            assert words in message, (rank, words, message)


def test_transformers_attention_dropout_is_named(results):
    for rank, res in enumerate(results):
        assert "attention_dropout=0.0" in res["transformers"], (rank, res["transformers"])


def test_the_way_out_runs(results):
    for rank, res in enumerate(results):
        assert res["after_install"] == ((1, 2, 16, 8), True), (rank, res["after_install"])


def test_the_kernel_says_it_to_a_direct_caller():
    """Called as a step kernel (keep_prob, no SDPA), the message gives both names."""
    from cp_cache.kernels import get_kernel
    from cp_cache.masks import StepMask

    q = torch.randn(1, 2, 8, 8)
    message = _message(lambda: get_kernel("torch").forward(q, q, q, layout="BNSD", head_num=2, scale=0.3,
                                                           keep_prob=0.75, mask=StepMask("none")))
    assert "keep_prob=0.75" in message and "dropout_p=0.25" in message, message


def test_the_npu_kernel_without_its_op_is_refused_by_enable(results):
    for rank, res in enumerate(results):
        message = res["npu_kernel"]
        assert "kernel='npu'" in message and "install_npu_emulator()" in message, (rank, message)
