"""cp_cache's SSD scan (Mamba-2) against a float64 token-by-token recurrence (the truth): forward, final state
and the gradients of every input (initial state included), for groups (G < H), L off the chunk grid and
below it, with and without D and an initial state, packed runs (length-1 runs, runs across chunk
boundaries, runs starting on one, many short runs) and strong decay; bf16 autocast around the call;
transformers' mamba2_chunk_scan on one run; the state's affinity (two halves chained equal the whole) and
the helpers that give an initial state's effect (ssd_state_read, ssd_transition). Every bound is
error_bound of the error of transformers' float32 mamba2_chunk_scan (chained run by run) measured here on
the same inputs."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

from cp_cache.mixers.ssd import ssd_scan, ssd_state_read, ssd_transition
from cp_cache.testing import scans

NAMES = ("x", "dt", "A", "B", "C", "D", "initial_state")
# The bounds' factor (scans.FACTOR, 8): measured on these cases over 6 seeds: the function errs up to 3.3x as much as
# transformers' float32 chunked one, and 7.6x on A's gradient (H sums over every token, their rounding a draw): at
# most 0.6 of the bound with the floor. A wrong mask or a lost reset errs by 1e-2 or more.


@dataclass(frozen=True)
class Case:
    length: int
    heads: int = 4
    groups: int = 2
    head_dim: int = 8
    state_dim: int = 16
    batch: int = 2
    chunk_size: int = 32
    segments: tuple[int, ...] | None = None
    initial_state: bool = True
    skip: bool = True
    dt_shift: float = -1.0


def _short_runs(count: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(1, 7) for _ in range(count))


CASES = {
    "groups": Case(150),
    "shorter_than_chunk": Case(20, initial_state=False, skip=False, chunk_size=64),
    "one_group_no_skip": Case(70, groups=1, skip=False),
    "heads_own_groups": Case(45, groups=4, chunk_size=16),
    "runs": Case(150, segments=(1, 40, 3, 70, 1, 35)),
    "runs_on_chunk_edges": Case(90, segments=(32, 32, 1, 25)),
    "many_short_runs": Case(sum(_short_runs(60, 1)), segments=_short_runs(60, 1), chunk_size=64, batch=1),
    "strong_decay": Case(130, dt_shift=2.0, segments=(50, 80)),
}


def _inputs(case: Case, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b, n, h, g = case.batch, case.length, case.heads, case.groups
    return {
        "x": torch.randn(b, n, h, case.head_dim, generator=gen),
        "dt": F.softplus(torch.randn(b, n, h, generator=gen) + case.dt_shift),
        "A": -torch.empty(h).uniform_(0.5, 4.0, generator=gen),
        "B": torch.randn(b, n, g, case.state_dim, generator=gen),
        "C": torch.randn(b, n, g, case.state_dim, generator=gen),
        "D": torch.randn(h, generator=gen) if case.skip else None,
        "initial_state": (torch.randn(b, h, case.head_dim, case.state_dim, generator=gen)
                          if case.initial_state else None),
    }


def _truth(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token in float64, the state zeroed at every run after the first."""
    x, dt, A, B, C = (inputs[name].double() for name in NAMES[:5])
    B, C = (t.repeat_interleave(case.heads // case.groups, dim=2) for t in (B, C))
    zero = torch.zeros(case.batch, case.heads, case.head_dim, case.state_dim, dtype=torch.float64)
    state = zero if inputs["initial_state"] is None else inputs["initial_state"].double()
    starts = set(itertools.accumulate(case.segments or ()))
    outs = []
    for t in range(case.length):
        if t in starts:
            state = zero
        state = (dt[:, t] * A).exp()[..., None, None] * state
        state = state + (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * B[:, t].unsqueeze(-2)
        outs.append((state @ C[:, t].unsqueeze(-1)).squeeze(-1))
    y = torch.stack(outs, dim=1)
    if inputs["D"] is not None:
        y = y + inputs["D"].double()[:, None] * x
    return y, state


def _transformers(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float32 mamba2_chunk_scan, called run by run (the reference's error)."""
    outs, state, start = [], inputs["initial_state"], 0
    for run in case.segments or (case.length,):
        window = slice(start, start + run)
        out, state = mamba2_chunk_scan(
            inputs["x"][:, window], inputs["dt"][:, window], inputs["A"], inputs["B"][:, window],
            inputs["C"][:, window], chunk_size=case.chunk_size, D=inputs["D"],
            initial_states=state if start == 0 else None, return_final_states=True)
        outs.append(out)
        start += run
    return torch.cat(outs, dim=1), state


def _ours(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return ssd_scan(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], D=inputs["D"],
                    initial_state=inputs["initial_state"], segments=case.segments, chunk_size=case.chunk_size)




def _weights(case: Case) -> tuple:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(case.batch, case.length, case.heads, case.head_dim, generator=gen),
            torch.randn(case.batch, case.heads, case.head_dim, case.state_dim, generator=gen))











MEASURED = scans.Measured(CASES, _inputs, _weights, _truth, _transformers)

@pytest.mark.parametrize("case_name", list(CASES))
def test_against_float64_recurrence(case_name):
    case = CASES[case_name]
    inputs, truth, bounds = MEASURED(case_name)
    result = scans.results(_ours, inputs, case, _weights(case))
    assert result["out"].dtype == torch.float32 and result["state"].dtype == torch.float32
    scans.assert_within(scans.errors(result, truth), bounds, case_name)


def test_bf16_autocast_keeps_float32_accuracy():
    case = CASES["runs"]
    inputs, truth, bounds = MEASURED("runs")

    def under_autocast(x, c):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _ours(x, c)

    result = scans.results(under_autocast, inputs, case, _weights(case))
    assert result["out"].dtype == torch.float32
    scans.assert_within(scans.errors(result, truth), bounds, "bf16 autocast")


def test_bf16_inputs_give_bf16_output():
    case = CASES["groups"]
    inputs = {name: x if x is None or name in ("A", "initial_state") else x.bfloat16()
              for name, x in _inputs(case).items()}
    out, state = _ours(inputs, case)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


@pytest.mark.parametrize("case_name", ["groups", "shorter_than_chunk", "one_group_no_skip", "heads_own_groups"])
def test_equals_transformers_on_one_run(case_name):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    weights = _weights(case)
    ours = scans.results(_ours, inputs, case, weights)
    theirs = scans.results(_transformers, inputs, case, weights)
    scans.assert_within(scans.errors(ours, {k: v.double() for k, v in theirs.items()}), bounds, case_name)



def test_non_contiguous_inputs():
    """The models pass strided views (x, B, C as views of one projection split along its last dim)."""
    case = CASES["groups"]
    inputs, _, bounds = MEASURED("groups")
    strided = {name: x if x is None or x.dim() < 3 else x.transpose(1, -1).contiguous().transpose(1, -1)
               for name, x in inputs.items()}
    assert not strided["B"].is_contiguous()
    out, state = _ours(strided, case)
    expected_out, expected_state = _ours(inputs, case)
    expected = {"out": expected_out.double(), "state": expected_state.double()}
    scans.assert_within(scans.errors({"out": out, "state": state}, expected), bounds, "strided")

def _split_runs(case: Case, split: int) -> tuple:
    """The runs of tokens [0, split) and [split, L), and whether a run starts at split."""
    edges = set(itertools.accumulate(case.segments or (case.length,), initial=0))
    head = sorted(e for e in edges | {split} if e <= split)
    tail = sorted(e for e in edges | {split} if e >= split)
    return (tuple(b - a for a, b in itertools.pairwise(head)), tuple(b - a for a, b in itertools.pairwise(tail)),
            split in edges)


@pytest.mark.parametrize("case_name, split", [("groups", 64), ("groups", 75), ("runs", 60), ("runs", 41)])
def test_two_halves_chained_equal_the_whole(case_name, split):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    head, tail = ({name: x if name in ("A", "D", "initial_state") else x[:, part] for name, x in inputs.items()}
                  for part in (slice(0, split), slice(split, None)))
    head_runs, tail_runs, new_run = _split_runs(case, split)
    out_head, state = _ours(head, replace(case, length=split, segments=head_runs))
    out_tail, final = _ours({**tail, "initial_state": None if new_run else state},
                            replace(case, length=case.length - split, segments=tail_runs))
    whole, whole_final = _ours(inputs, case)
    chained = {"out": torch.cat([out_head, out_tail], 1).double(), "state": final.double()}
    scans.assert_within(scans.errors(chained, {"out": whole.double(), "state": whole_final.double()}), bounds, "halves")


def _with_helpers(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_scan from a zero state, the initial state's effect added by the helpers."""
    out, final = _ours({**inputs, "initial_state": None}, case)
    read = ssd_state_read(inputs["dt"], inputs["A"], inputs["C"], inputs["initial_state"], segments=case.segments)
    transition = ssd_transition(inputs["dt"], inputs["A"], case.segments)
    return out + read, final + transition[..., None, None] * inputs["initial_state"]


@pytest.mark.parametrize("case_name", ["groups", "runs", "runs_on_chunk_edges", "strong_decay"])
def test_state_read_and_transition_match_the_kernel(case_name):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    weights = _weights(case)
    helped = scans.results(_with_helpers, inputs, case, weights)
    kernel = scans.results(_ours, inputs, case, weights)
    scans.assert_within(scans.errors(helped, {k: v.double() for k, v in kernel.items()}), bounds, case_name)
    if case.segments:  # a run starting after the first token zeroes the state: S0 no longer reaches the end
        assert ssd_transition(inputs["dt"], inputs["A"], case.segments).abs().max() == 0


@pytest.mark.parametrize("bad, message", [
    ({"segments": (100, 49)}, "segments"),
    ({"segments": (150, 0)}, "segments"),
    ({"dt": torch.zeros(2, 150, 2)}, "dt "),
    ({"B": torch.zeros(2, 150, 3, 16), "C": torch.zeros(2, 150, 3, 16)}, "B "),
    ({"initial_state": torch.zeros(2, 4, 16, 8)}, "initial_state"),
])
def test_bad_inputs_are_refused(bad, message):
    case = CASES["groups"]
    inputs = {**_inputs(case), **{k: v for k, v in bad.items() if k != "segments"}}
    if "segments" in bad:
        case = replace(case, segments=bad["segments"])
    with pytest.raises(ValueError, match=message):
        _ours(inputs, case)
