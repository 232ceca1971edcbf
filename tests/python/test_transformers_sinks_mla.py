"""cp_cache.integrations.transformers on the models that need sinks and MLA: tiny gpt-oss
(attention sinks on every layer, sliding window 5 on the first) and DeepSeek-V3 (MLA: q/k head
dim 12, v head dim 6; packed too) train 2 AdamW steps with attn_implementation="cp_cache"
under cp_cache.context_parallel at W = 2 and 4 with the loss and the gradients of one process
with "eager" (float32, within error_bound of eager's own float32 error), and equal "eager"
outside a CP region. The same checks as test_transformers_cp.py (transformers_cases.py).

Packed gpt-oss (sinks with documents and a window: the explicit-mask path) has no eager
reference: transformers 5.24's gpt-oss builds its eager masks without the position ids, so its
eager attention crosses the documents of a packed batch (flash attention and cp_cache follow
cu_seq_lens). Its CP run is held against "cp_cache" in one process instead (float32 and
float64), whose sinks, documents and windows the other cases hold against eager.
"""

from __future__ import annotations

import pytest

import cp_cache
from cp_cache.integrations.transformers import register
from cp_cache.testing import install_npu_emulator
from cp_cache.testing.multiprocess import run_ranks

import transformers_cases as tc

WORLDS = (2, 4)
CASES = [
    tc.Case("gpt_oss", "gpt_oss"),
    tc.Case("packed_gpt_oss", "gpt_oss", packed=True, reference="cp_cache"),
    tc.Case("deepseek_v3", "deepseek_v3"),
    tc.Case("packed_deepseek_v3", "deepseek_v3", packed=True, load_balance=False),
]


@pytest.fixture(scope="module", autouse=True)
def emulator():
    install_npu_emulator()
    register()
    yield


@pytest.fixture(autouse=True)
def no_live_caches():
    yield
    assert cp_cache.stats()["live_entries"] == 0


def _rank(rank: int, world: int, cases: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    install_npu_emulator()
    register()
    mesh = init_device_mesh("cpu", (world,))
    return {"train": {case.name: tc.train_cp(case, mesh) for case in cases}}


_RESULTS: dict[int, list[dict]] = {}
_SINGLE: dict[str, dict] = {}


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank, world, CASES, timeout=420.0)
    return _RESULTS[world]


def _single(case: tc.Case) -> dict:
    if case.name not in _SINGLE:
        _SINGLE[case.name] = tc.train_single(case)
    return _SINGLE[case.name]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_training_matches_eager(world, case):
    rows = tc.check_training(_results(world), case, _single(case))
    print(f"{case.name} W={world}: " + "; ".join(
        f"step {i}: loss {r['loss']:.2e} <= {r['loss_bound']:.2e}, grad {r['grad']:.2e} <= {r['grad_bound']:.2e}"
        for i, r in enumerate(rows)))


@pytest.mark.parametrize("case", [c for c in CASES if c.reference == "eager"], ids=lambda c: c.name)
def test_outside_cp_equals_eager(case):
    tc.check_outside_cp(case)
