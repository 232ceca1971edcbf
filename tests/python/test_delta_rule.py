"""cp_cache's chunked gated delta rule against a float64 token-by-token recurrence (the truth): forward,
final state and the gradients of every input (initial state included), for GQA, Dk != Dv, L off the
chunk grid and below it, packed runs (length-1 runs, runs across chunk boundaries, runs starting on
one, many short runs), strong decay (exp of the in-chunk decay underflows) and a chunk size that is not
a power of 2, with both triangular solvers; bf16 autocast around the call;
transformers' torch_chunk_gated_delta_rule on one run; the state's affinity (two halves chained equal
the whole, and a transition matrix carried in extra value columns). Every bound is error_bound of the
error of transformers' float32 chunked function (chained run by run) measured here on the same inputs."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from cp_cache.mixers.delta_rule import chunk_gated_delta_rule
from cp_cache.testing import scans

NAMES = ("query", "key", "value", "g", "beta", "initial_state")
# The bounds' factor (scans.FACTOR, 8): measured on these cases: the function errs up to 2.7x as much as transformers'
# float32 chunked one (a state and a key gradient without the l2 norm); a wrong mask or a lost reset errs by 1e-2 or
# more.


@dataclass(frozen=True)
class Case:
    length: int
    k_heads: int = 2
    v_heads: int = 4
    k_dim: int = 16
    v_dim: int = 24
    batch: int = 2
    chunk_size: int = 32
    segments: tuple[int, ...] | None = None
    initial_state: bool = True
    l2norm: bool = True
    scale: float | None = None
    decay_shift: float = 3.0


def _short_runs(count: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(1, 7) for _ in range(count))


CASES = {
    "gqa_dk_ne_dv": Case(150),
    "shorter_than_chunk": Case(20, initial_state=False, chunk_size=64),
    "mha_square": Case(70, k_heads=4, k_dim=16, v_dim=16),
    "runs": Case(150, segments=(1, 40, 3, 70, 1, 35)),
    "runs_on_chunk_edges": Case(90, segments=(32, 32, 1, 25)),
    "many_short_runs": Case(sum(_short_runs(100, 1)), segments=_short_runs(100, 1), chunk_size=64, batch=1),
    "scale_no_l2norm": Case(100, l2norm=False, scale=0.1, segments=(60, 40)),
    "strong_decay": Case(130, decay_shift=-4.0, segments=(50, 80)),
    "chunk_size_not_a_power_of_2": Case(100, chunk_size=24, segments=(30, 70)),
}


def _inputs(case: Case, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b, n = case.batch, case.length
    key = torch.randn(b, n, case.k_heads, case.k_dim, generator=gen)
    if not case.l2norm:  # keep the recurrence contractive without the in-kernel norm
        key = F.normalize(key, dim=-1)
    return {
        "query": torch.randn(b, n, case.k_heads, case.k_dim, generator=gen),
        "key": key,
        "value": torch.randn(b, n, case.v_heads, case.v_dim, generator=gen),
        "g": F.logsigmoid(torch.randn(b, n, case.v_heads, generator=gen) + case.decay_shift),
        "beta": torch.rand(b, n, case.v_heads, generator=gen),
        "initial_state": (torch.randn(b, case.v_heads, case.k_dim, case.v_dim, generator=gen)
                          if case.initial_state else None),
    }


def _truth(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token in float64, the state zeroed at every run after the first."""
    q, k, v, g, beta = (inputs[name].double() for name in NAMES[:5])
    groups = case.v_heads // case.k_heads
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    if case.l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (case.k_dim**-0.5 if case.scale is None else case.scale)
    zero = torch.zeros(case.batch, case.v_heads, case.k_dim, case.v_dim, dtype=torch.float64)
    state = zero if inputs["initial_state"] is None else inputs["initial_state"].double()
    starts = set(itertools.accumulate(case.segments or ()))
    outs = []
    for t in range(case.length):
        if t in starts:
            state = zero
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - (k[:, t].unsqueeze(-1) * state).sum(-2))
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-1) * state).sum(-2))
    return torch.stack(outs, dim=1), state


def _transformers(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float32 chunked function, called run by run (the reference's error)."""
    query = inputs["query"]
    if case.scale is not None:  # transformers always scales by Dk**-0.5 (l2norm is off in that case)
        query = query * (case.scale * case.k_dim**0.5)
    outs, state, start = [], inputs["initial_state"], 0
    for run in case.segments or (case.length,):
        window = slice(start, start + run)
        out, state = torch_chunk_gated_delta_rule(
            query[:, window], inputs["key"][:, window], inputs["value"][:, window], inputs["g"][:, window],
            inputs["beta"][:, window], chunk_size=case.chunk_size, initial_state=state if start == 0 else None,
            output_final_state=True, use_qk_l2norm_in_kernel=case.l2norm)
        outs.append(out)
        start += run
    return torch.cat(outs, dim=1), state


def _ours(inputs: dict, case: Case, solver: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return chunk_gated_delta_rule(
        inputs["query"], inputs["key"], inputs["value"], inputs["g"], inputs["beta"], scale=case.scale,
        initial_state=inputs["initial_state"], segments=case.segments, use_qk_l2norm=case.l2norm,
        chunk_size=case.chunk_size, solver=solver)




def _weights(case: Case) -> tuple:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(case.batch, case.length, case.v_heads, case.v_dim, generator=gen),
            torch.randn(case.batch, case.v_heads, case.k_dim, case.v_dim, generator=gen))











MEASURED = scans.Measured(CASES, _inputs, _weights, _truth, _transformers)

@pytest.mark.parametrize("solver", ["solve_triangular", "substitution"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_against_float64_recurrence(case_name, solver):
    case = CASES[case_name]
    inputs, truth, bounds = MEASURED(case_name)
    result = scans.results(lambda x, c: _ours(x, c, solver), inputs, case, _weights(case))
    assert result["out"].dtype == torch.float32 and result["state"].dtype == torch.float32
    scans.assert_within(scans.errors(result, truth), bounds, f"{case_name}/{solver}")


@pytest.mark.parametrize("case_name", ["gqa_dk_ne_dv", "runs", "many_short_runs"])
def test_substitution_equals_solve_triangular(case_name):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    weights = _weights(case)
    solved = scans.results(lambda x, c: _ours(x, c, "solve_triangular"), inputs, case, weights)
    substituted = scans.results(lambda x, c: _ours(x, c, "substitution"), inputs, case, weights)
    scans.assert_within(scans.errors(substituted, {k: v.double() for k, v in solved.items()}), bounds, case_name)


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
    case = CASES["gqa_dk_ne_dv"]
    inputs = {name: x if x is None or name == "initial_state" else x.bfloat16()
              for name, x in _inputs(case).items()}
    out, state = _ours(inputs, case)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


@pytest.mark.parametrize("case_name", ["gqa_dk_ne_dv", "shorter_than_chunk", "mha_square"])
def test_equals_transformers_on_one_run(case_name):
    case = CASES[case_name]
    inputs, _, bounds = MEASURED(case_name)
    weights = _weights(case)
    ours = scans.results(_ours, inputs, case, weights)
    theirs = scans.results(_transformers, inputs, case, weights)
    scans.assert_within(scans.errors(ours, {k: v.double() for k, v in theirs.items()}), bounds, case_name)


@pytest.mark.parametrize("split", [64, 75])
def test_two_halves_chained_equal_the_whole(split):
    case = CASES["gqa_dk_ne_dv"]
    inputs, _, bounds = MEASURED("gqa_dk_ne_dv")
    head, tail = ({name: x if name == "initial_state" else x[:, part] for name, x in inputs.items()}
                  for part in (slice(0, split), slice(split, None)))
    out_head, state = _ours(head, replace(case, length=split))
    out_tail, final = _ours({**tail, "initial_state": state}, replace(case, length=case.length - split))
    whole, whole_final = _ours(inputs, case)
    chained = {"out": torch.cat([out_head, out_tail], 1).double(), "state": final.double()}
    scans.assert_within(scans.errors(chained, {"out": whole.double(), "state": whole_final.double()}), bounds, "halves")


def _summary(inputs: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(contribution C, transition A) of the whole sequence in one pass: value' = [v | 0] from the
    state [0 | I], so that the final state from any S0 is A S0 + C."""
    eye = torch.eye(case.k_dim).expand(case.batch, case.v_heads, -1, -1)
    value = inputs["value"]
    extended = {**inputs, "value": torch.cat([value, value.new_zeros(*value.shape[:3], case.k_dim)], -1),
                "initial_state": torch.cat([torch.zeros(*eye.shape[:3], case.v_dim), eye], -1)}
    _, summary = _ours(extended, replace(case, v_dim=case.v_dim + case.k_dim))
    return summary.split([case.v_dim, case.k_dim], -1)


def test_transition_matrix_in_extra_value_columns():
    case = replace(CASES["runs"], segments=None)
    inputs, _, bounds = MEASURED("runs")
    contribution, transition = _summary(inputs, case)
    _, final = _ours(inputs, case)
    scans.assert_within(scans.errors({"state": (transition @ inputs["initial_state"] + contribution).double()},
                           {"state": final.double()}), bounds, "transition")
    # a run starting after the first token zeroes the state, so S0 no longer matters
    _, transition = _summary(inputs, CASES["runs"])
    assert transition.abs().max() == 0


@pytest.mark.parametrize("bad, message", [
    ({"segments": (100, 49)}, "segments"),
    ({"segments": (150, 0)}, "segments"),
    ({"g": torch.zeros(2, 150, 2)}, "g "),
    ({"initial_state": torch.zeros(2, 4, 16, 16)}, "initial_state"),
])
def test_bad_inputs_are_refused(bad, message):
    case = CASES["gqa_dk_ne_dv"]
    inputs = {**_inputs(case), **{k: v for k, v in bad.items() if k != "segments"}}
    if "segments" in bad:
        case = replace(case, segments=bad["segments"])
    with pytest.raises(ValueError, match=message):
        _ours(inputs, case)
