"""cp_cache's selective scan (Mamba-1) against a float64 token-by-token recurrence (the truth): forward, final
state and the gradients of every input (initial state, delta_bias and the gate included), for B, C shared or
grouped, L off the chunk grid and below it, with and without D, z, softplus and an initial state, packed runs
(length-1 runs, runs across chunk boundaries, runs starting on one, many short runs) and strong decay (A
sum(delta) over a chunk far past float32's exp range); bf16 autocast around the call; transformers'
mamba_selective_scan on one run; the state's affinity (two halves chained equal the whole) and the helpers
that give an initial state's effect (selective_state_read, selective_transition). Every bound is error_bound
of the error of transformers' float32 torch path measured here on the same inputs: its decoding step
mamba_selective_state_update chained token by token (the one that takes a state; it is mamba_selective_scan's
recurrence), the state zeroed at every run after the first."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba.modeling_mamba import mamba_selective_scan, mamba_selective_state_update

from cp_cache.mixers.selective_scan import selective_scan, selective_state_read, selective_transition
from cp_cache.testing import scans

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
# The bounds' factor (scans.FACTOR, 8): measured on these cases over 6 seeds: the function errs up to 3.8x as much as
# transformers' float32 recurrence, 4.7x on A's gradient (sums over every token, their rounding a draw): at most 0.3
# of the bound with the floor. A wrong mask or a lost reset errs by 1e-2 or more.


@dataclass(frozen=True)
class Case:
    length: int
    channels: int = 12
    state_dim: int = 6
    groups: int | None = None  # None: B, C [batch, N, L]; else [batch, G, N, L]
    batch: int = 2
    chunk_size: int = 32
    segments: tuple[int, ...] | None = None
    initial_state: bool = True
    skip: bool = True
    gate: bool = True
    softplus: bool = True
    delta_shift: float = -1.0
    decay_scale: float = 1.0


def _short_runs(count: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(1, 7) for _ in range(count))


CASES = {
    "gated": Case(150),
    "groups": Case(150, groups=3),
    "shorter_than_chunk": Case(20, initial_state=False, skip=False, gate=False, chunk_size=64),
    "no_state_no_softplus": Case(70, initial_state=False, softplus=False),
    "runs": Case(150, segments=(1, 40, 3, 70, 1, 35)),
    "runs_on_chunk_edges": Case(90, segments=(32, 32, 1, 25), groups=2),
    "many_short_runs": Case(sum(_short_runs(60, 1)), segments=_short_runs(60, 1), chunk_size=64, batch=1),
    "strong_decay": Case(130, delta_shift=2.0, decay_scale=8.0, segments=(50, 80)),
}


def _inputs(case: Case, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b, d, n, length = case.batch, case.channels, case.state_dim, case.length
    bc_shape = (b, n, length) if case.groups is None else (b, case.groups, n, length)
    delta = torch.randn(b, d, length, generator=gen) + case.delta_shift
    return {
        "u": torch.randn(b, d, length, generator=gen),
        "delta": delta if case.softplus else F.softplus(delta),
        "A": -torch.empty(d, n).uniform_(0.2, 3.0, generator=gen) * case.decay_scale,
        "B": torch.randn(*bc_shape, generator=gen),
        "C": torch.randn(*bc_shape, generator=gen),
        "D": torch.randn(d, generator=gen) if case.skip else None,
        "z": torch.randn(b, d, length, generator=gen) if case.gate else None,
        "delta_bias": 0.5 * torch.randn(d, generator=gen) if case.softplus else None,
        "initial_state": torch.randn(b, d, n, generator=gen) if case.initial_state else None,
    }


def _per_channel(t: torch.Tensor, case: Case) -> torch.Tensor:
    """B or C as [batch, Dch or 1, N, L]."""
    return t.unsqueeze(1) if case.groups is None else t.repeat_interleave(case.channels // case.groups, dim=1)


def _discretised(inputs: dict, case: Case) -> torch.Tensor:
    """What the caller gives the helpers: softplus(delta + delta_bias) when the kernel is asked for it."""
    if not case.softplus:
        return inputs["delta"]
    return F.softplus(inputs["delta"] + inputs["delta_bias"][:, None])


def _truth(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token in float64, the state zeroed at every run after the first."""
    u, A = inputs["u"].double(), inputs["A"].double()
    delta = _discretised({k: v.double() if v is not None else None for k, v in inputs.items()}, case)
    B, C = (_per_channel(inputs[name].double(), case) for name in ("B", "C"))
    zero = torch.zeros(case.batch, case.channels, case.state_dim, dtype=torch.float64)
    state = zero if inputs["initial_state"] is None else inputs["initial_state"].double()
    starts = set(itertools.accumulate(case.segments or ()))
    outs = []
    for t in range(case.length):
        if t in starts:
            state = zero
        state = (delta[..., t, None] * A).exp() * state + (delta[..., t] * u[..., t]).unsqueeze(-1) * B[..., t]
        outs.append((state * C[..., t]).sum(-1))
    y = torch.stack(outs, dim=-1)
    if inputs["D"] is not None:
        y = y + inputs["D"].double()[:, None] * u
    return (y if inputs["z"] is None else y * F.silu(inputs["z"].double())), state


def _transformers(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float32 step, token by token and group by group (the reference's error). Each group's
    state lives in its own float64 tensor holding float32 values: the step updates it in place, and its
    .float() copies it exactly, so autograd keeps its own copy and the arithmetic stays float32."""
    groups = case.groups or 1
    width = case.channels // groups
    starts = set(itertools.accumulate(case.segments or ()))
    zero = torch.zeros(case.batch, case.channels, case.state_dim, dtype=torch.float64)
    initial = zero if inputs["initial_state"] is None else inputs["initial_state"].double()
    states = [part.clone() for part in initial.split(width, dim=1)]
    outs = []
    for t in range(case.length):
        if t in starts:
            states = [part.clone() for part in zero.split(width, dim=1)]
        outs.append(torch.cat([_step(inputs, case, states[g], slice(g * width, (g + 1) * width), g, t)
                               for g in range(groups)], dim=1))
    return torch.stack(outs, dim=-1), torch.cat(states, dim=1).float()


def _step(inputs: dict, case: Case, state: torch.Tensor, channels: slice, group: int, t: int) -> torch.Tensor:
    B, C = (inputs[name][..., t] if case.groups is None else inputs[name][:, group, :, t] for name in ("B", "C"))
    optional = {name: inputs[name][channels] if inputs[name] is not None else None for name in ("D", "delta_bias")}
    return mamba_selective_state_update(
        state, inputs["u"][:, channels, t], inputs["delta"][:, channels, t], inputs["A"][channels], B, C,
        optional["D"], dt_bias=optional["delta_bias"], dt_softplus=case.softplus,
        z=None if inputs["z"] is None else inputs["z"][:, channels, t])


def _ours(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], D=inputs["D"],
                          z=inputs["z"], delta_bias=inputs["delta_bias"], delta_softplus=case.softplus,
                          initial_state=inputs["initial_state"], segments=case.segments,
                          chunk_size=case.chunk_size)


def _transformers_scan(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' mamba_selective_scan itself (one run, no initial state, B and C shared)."""
    return mamba_selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], D=inputs["D"],
                                z=inputs["z"], delta_bias=inputs["delta_bias"], delta_softplus=case.softplus,
                                return_last_state=True)




def _weights(case: Case) -> tuple:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(case.batch, case.channels, case.length, generator=gen),
            torch.randn(case.batch, case.channels, case.state_dim, generator=gen))











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
    case = CASES["gated"]
    inputs = {name: x if x is None or name in ("A", "initial_state") else x.bfloat16()
              for name, x in _inputs(case).items()}
    out, state = _ours(inputs, case)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


@pytest.mark.parametrize("case_name", ["shorter_than_chunk", "no_state_no_softplus"])
def test_equals_transformers_on_one_run(case_name):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    weights = _weights(case)
    ours = scans.results(_ours, inputs, case, weights)
    theirs = scans.results(_transformers_scan, inputs, case, weights)
    scans.assert_within(scans.errors(ours, {k: v.double() for k, v in theirs.items()}), bounds, case_name)



def test_non_contiguous_inputs():
    """The models pass strided views (B and C transposed from [batch, L, N])."""
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


@pytest.mark.parametrize("case_name, split", [("gated", 64), ("groups", 75), ("runs", 60), ("runs", 41)])
def test_two_halves_chained_equal_the_whole(case_name, split):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    head, tail = ({name: x if x is None or x.dim() < 3 or name == "initial_state" else x[..., part]
                   for name, x in inputs.items()} for part in (slice(0, split), slice(split, None)))
    head_runs, tail_runs, new_run = _split_runs(case, split)
    out_head, state = _ours(head, replace(case, length=split, segments=head_runs))
    out_tail, final = _ours({**tail, "initial_state": None if new_run else state},
                            replace(case, length=case.length - split, segments=tail_runs))
    whole, whole_final = _ours(inputs, case)
    chained = {"out": torch.cat([out_head, out_tail], -1).double(), "state": final.double()}
    scans.assert_within(scans.errors(chained, {"out": whole.double(), "state": whole_final.double()}), bounds, "halves")


def _with_helpers(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """selective_scan from a zero state, the initial state's effect added by the helpers as a caller
    would: the read (before D and the gate) times silu(z), the transition times the state."""
    out, final = _ours({**inputs, "initial_state": None}, case)
    delta, state = _discretised(inputs, case), inputs["initial_state"]
    read = selective_state_read(delta, inputs["A"], inputs["C"], state, segments=case.segments)
    if inputs["z"] is not None:
        read = read * F.silu(inputs["z"])
    return out + read, final + selective_transition(delta, inputs["A"], case.segments) * state


@pytest.mark.parametrize("case_name", ["gated", "groups", "runs", "strong_decay"])
def test_state_read_and_transition_match_the_kernel(case_name):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    weights = _weights(case)
    helped = scans.results(_with_helpers, inputs, case, weights)
    kernel = scans.results(_ours, inputs, case, weights)
    scans.assert_within(scans.errors(helped, {k: v.double() for k, v in kernel.items()}), bounds, case_name)
    if case.segments:  # a run starting after the first token zeroes the state: S0 no longer reaches the end
        assert selective_transition(_discretised(inputs, case), inputs["A"], case.segments).abs().max() == 0


@pytest.mark.parametrize("bad, message", [
    ({"segments": (100, 49)}, "segments"),
    ({"segments": (150, 0)}, "segments"),
    ({"delta": torch.zeros(2, 12, 149)}, "delta "),
    ({"B": torch.zeros(2, 5, 6, 150), "C": torch.zeros(2, 5, 6, 150)}, "B "),
    ({"A": torch.zeros(12, 6, 1)}, "A "),
    ({"initial_state": torch.zeros(2, 12, 5)}, "initial_state"),
])
def test_bad_inputs_are_refused(bad, message):
    case = CASES["gated"]
    inputs = {**_inputs(case), **{k: v for k, v in bad.items() if k != "segments"}}
    if "segments" in bad:
        case = replace(case, segments=bad["segments"])
    with pytest.raises(ValueError, match=message):
        _ours(inputs, case)
