"""MLA: V's head dim differing from Q/K's (DeepSeek-V3: 192 / 128), on one process: K and V
that disagree on anything but the head size are refused, naming both shapes; the ring runs MLA
in every layout; the strategies' fakes give the output at V's head size.

The CP numerics of MLA (the ring with every mask, the fused and the float32 merge, both step
kernels, Ulysses, hybrid, packed documents, every layout, W = 1 to 8, dropout under the masks
the call drew) and its bytes against ``plan.bytes_per_rank`` with V at its own head size are
drawn by the random net, test_random_configs.py (MLA in a quarter of its draws, V's head size
smaller and larger than Q/K's, and fixed corners for hybrid at W = 8, Ulysses and the ring with
full attention).
"""

from __future__ import annotations

import pytest
import torch

from cp_cache import layout as L


# ---------------------------------------------------------------- inconsistent K and V, one process


def _ring_call(layout: str, k_shape: tuple, v_shape: tuple, q_shape: tuple):
    from cp_cache.algorithms import PACKED, RING, run_forward
    from cp_cache.kernels import get_kernel
    from cp_cache.testing import install_npu_emulator
    from cp_cache.testing.reference import ring_plan

    install_npu_emulator(route_sdpa=False)
    q, k, v = (torch.randn(s) for s in (q_shape, k_shape, v_shape))
    packed = layout == L.TND
    plan = ring_plan(world_size=1, rank=0, layout=layout, head_num=4, scale=1.0, keep_prob=1.0,
                     documents=(q_shape[0],) if packed else ())
    return run_forward(PACKED if packed else RING, plan, q, k, v, kernel=get_kernel("npu"))


REFUSED = [  # layout, q, k, v: V disagrees with K on batch, heads or sequence length
    ("BNSD", (2, 4, 6, 12), (2, 2, 6, 12), (1, 2, 6, 8)),
    ("BSND", (2, 6, 4, 12), (2, 6, 2, 12), (2, 6, 4, 8)),
    ("BSH", (2, 6, 48), (2, 6, 24), (2, 5, 16)),
    ("SBH", (6, 2, 48), (6, 2, 24), (6, 2, 15)),  # hidden 15: not a whole number of heads of 2
    ("TND", (6, 4, 12), (6, 2, 12), (6, 4, 8)),
]


@pytest.mark.parametrize("layout, q, k, v", REFUSED, ids=[r[0] for r in REFUSED])
def test_key_and_value_that_disagree_beyond_the_head_dim_are_refused(layout, q, k, v):
    with pytest.raises(ValueError, match=r"(key .* and value .* disagree|value's hidden size)") as info:
        _ring_call(layout, k, v, q)
    assert str(tuple(v)) in str(info.value)


@pytest.mark.parametrize("layout", L.ALL_LAYOUTS)
def test_one_process_mla_runs_in_every_layout(layout):
    dims = {"BNSD": ((2, 4, 6, 12), (2, 2, 6, 12), (2, 2, 6, 8)), "BSND": ((2, 6, 4, 12), (2, 6, 2, 12), (2, 6, 2, 8)),
            "BSH": ((2, 6, 48), (2, 6, 24), (2, 6, 16)), "SBH": ((6, 2, 48), (6, 2, 24), (6, 2, 16)),
            "TND": ((6, 4, 12), (6, 2, 12), (6, 2, 8))}[layout]
    res = _ring_call(layout, dims[1], dims[2], dims[0])
    expected = list(dims[0])
    expected[-1] = 4 * 8 if layout in ("BSH", "SBH") else 8
    assert tuple(res.out.shape) == tuple(expected)


@pytest.mark.parametrize("layout", L.ALL_LAYOUTS)
def test_strategy_fakes_give_the_output_at_v_head_dim(layout):
    """What a traced graph records (``cp_cache::ring_forward``'s fake asks the strategy): from
    shapes alone, under FakeTensorMode, the output at V's head size and the LSE."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cp_cache.algorithms import HYBRID, PACKED, RING, ULYSSES
    from cp_cache.testing.reference import ring_plan

    dims = {"BNSD": ((2, 4, 6, 12), (2, 2, 6, 12), (2, 2, 6, 8), (2, 4, 6, 8)),
            "BSND": ((2, 6, 4, 12), (2, 6, 2, 12), (2, 6, 2, 8), (2, 6, 4, 8)),
            "BSH": ((2, 6, 48), (2, 6, 24), (2, 6, 16), (2, 6, 32)),
            "SBH": ((6, 2, 48), (6, 2, 24), (6, 2, 16), (6, 2, 32)),
            "TND": ((6, 4, 12), (6, 2, 12), (6, 2, 8), (6, 4, 8))}[layout]
    plan = ring_plan(world_size=2, rank=0, layout=layout, head_num=4, scale=1.0, keep_prob=1.0)
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(torch.empty(s)) for s in dims[:3])
        for strategy in ((PACKED,) if layout == L.TND else (RING, ULYSSES, HYBRID)):
            out, lse = strategy.fake(plan, q, k, v)
            assert tuple(out.shape) == dims[3], (strategy, tuple(out.shape))
            assert tuple(lse.shape) == L.lse_shape(q, layout, 4) and lse.dtype == torch.float32
