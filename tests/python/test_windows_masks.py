"""Band (sliding-window) attention and explicit masks: the ring's plan (the hops a window
needs, blocks outside the band skipped, a band over the whole sequence run as causal or full)
and the emulator's sparse_mode 4 pinned to the band rule.

Through the CP handlers against dense float64 (windows smaller than, equal to and larger than
the local length and the whole sequence, bands beside the diagonal, with and without load
balancing, GQA; random masks with and without fully masked rows, bool and uint8, [S, S] /
[B, 1, S, S] / [B, N, S, S], replicated or sharded on the query dimension; sparse_mode 0 with a
band; dropout under the masks the call drew; W = 1 to 8), with the bytes each rank sends and
receives against the rows other ranks need (the direct exchange), they are drawn by the random
net, test_random_configs.py, with fixed corners for a window inside a shard, a sharded mask with
a band and dropout, per-head masks and fully masked rows.
"""

from __future__ import annotations

import pytest
import torch

from cp_cache.npu_ops import causal_mask
from cp_cache.masks import hops_needed, plan_step
from cp_cache.plan import MaskSpec
from cp_cache.testing import install_npu_emulator

S_LOCAL = 8


def test_window_hops_closed_form():
    for world in (2, 4, 8):
        for w in range(1, 9 * S_LOCAL):
            spec = MaskSpec(window=True, pre_tockens=w - 1, next_tockens=0)
            assert hops_needed(world, False, spec, S_LOCAL) == min(world - 1, -(-(w - 1) // S_LOCAL)), (world, w)
            # head-tail: a rank's tail chunk needs the tail chunk of the next rank, which comes last
            assert hops_needed(world, True, spec, S_LOCAL) == (world - 1 if w > 1 else 0), (world, w)


def test_blocks_outside_the_band_are_skipped():
    spec = MaskSpec(window=True, pre_tockens=S_LOCAL - 1, next_tockens=0)
    # contiguous, W=4: rank 3 sees its own block (band) and rank 2's (band); nothing further
    parts = [plan_step(3, i, 4, False, spec, S_LOCAL, S_LOCAL)[0] for i in range(4)]
    assert parts == ["band", "band", "skip", "skip"]
    # a block wholly inside the band is computed without a mask
    wide = MaskSpec(window=True, pre_tockens=10 * S_LOCAL, next_tockens=0)
    _, tasks = plan_step(3, 1, 4, False, wide, S_LOCAL, S_LOCAL)
    assert [t.mask.kind for t in tasks] == ["none"]


# ---------------------------------------------------------------- the emulator's sparse_mode 4


@pytest.mark.parametrize("sq, skv", [(8, 8), (6, 10), (10, 6)])
@pytest.mark.parametrize("pre, nxt", [(2, 0), (0, 3), (4, 4), (-2, 5), (5, -1)])
def test_emulator_band_mode_is_pinned(sq, skv, pre, nxt):
    """sparse_mode 4: with d = Skv - Sq (0 for the square global call),
    query i sees key j iff i - pre + d <= j <= i + next + d."""
    install_npu_emulator(route_sdpa=False)
    g = torch.Generator().manual_seed(sq * 100 + skv)
    q = torch.randn(1, 2, sq, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, skv, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", atten_mask=causal_mask("cpu"), scale=0.5,
                                                sparse_mode=4, pre_tockens=pre, next_tockens=nxt)[0]
    d = skv - sq
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    masked = (j - i > nxt + d) | (i - j > pre - d)
    s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(masked, float("-inf"))
    dead = masked.all(-1, keepdim=True)
    want = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0) @ v
    # float64 both: a few roundings of eps 2.2e-16 at the largest value (a wrong band misses by O(1))
    assert torch.allclose(out, want, rtol=0, atol=256 * torch.finfo(torch.float64).eps * float(want.abs().max()))


def test_band_over_the_whole_sequence_runs_as_causal_or_full():
    seq = 32
    assert MaskSpec(window=True, pre_tockens=seq - 1, next_tockens=0).simplified(seq) == MaskSpec(causal=True)
    assert MaskSpec(window=True, pre_tockens=10**6, next_tockens=seq).simplified(seq) == MaskSpec()
    narrower = MaskSpec(window=True, pre_tockens=seq - 2, next_tockens=0)
    assert narrower.simplified(seq) == narrower
    given = MaskSpec(given=True, window=True, pre_tockens=seq, next_tockens=seq)
    assert given.simplified(seq) == given
