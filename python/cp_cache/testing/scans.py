"""What the tests of the recurrent mixer kernels share (test_delta_rule, test_ssd, test_selective_scan): a kernel's
results (its output, its final state and every input's gradient against fixed weights), their errors against a
float64 truth, and the bounds: ``FACTOR`` times a reference kernel's float32 error measured in the same run, plus
``EPS_FLOOR`` eps (a reference that happens to round exactly cannot make a bound 0). Each test module says what it
measured against its factor."""

from __future__ import annotations

from typing import Callable

import torch

from .reference import error_bound, rel_err

__all__ = ["FACTOR", "EPS_FLOOR", "results", "errors", "Measured", "assert_within"]

FACTOR = 8.0
EPS_FLOOR = 4.0


def results(fn: Callable, inputs: dict, case, weights: tuple, dtype=torch.float32) -> dict:
    """fn's out, final state and gradients of sum(out * w_out) + sum(state * w_state)."""
    leaves = {name: x.detach().to(dtype, copy=True).requires_grad_() for name, x in inputs.items() if x is not None}
    out, state = fn({**inputs, **leaves}, case)
    ((out * weights[0]).sum() + (state * weights[1]).sum()).backward()
    return {"out": out.detach(), "state": state.detach(), **{name: x.grad for name, x in leaves.items()}}


def errors(result: dict, truth: dict) -> dict:
    return {name: rel_err(result[name].double(), truth[name]) for name in truth}


class Measured:
    """Per case name: (inputs, the float64 truth, the bound of each quantity), measured once (the truth is slow)."""

    def __init__(self, cases: dict, make_inputs: Callable, make_weights: Callable, truth: Callable,
                 reference: Callable):
        self.cases, self.make_inputs, self.make_weights = cases, make_inputs, make_weights
        self.truth, self.reference = truth, reference
        self._measured: dict = {}

    def __call__(self, case_name: str) -> tuple[dict, dict, dict]:
        if case_name not in self._measured:
            case = self.cases[case_name]
            inputs, weights = self.make_inputs(case), self.make_weights(case)
            truth = results(self.truth, inputs, case, weights, torch.float64)
            reference = errors(results(self.reference, inputs, case, weights), truth)
            bounds = {name: error_bound(err, factor=FACTOR, floor=EPS_FLOOR) for name, err in reference.items()}
            self._measured[case_name] = inputs, truth, bounds
        return self._measured[case_name]


def assert_within(errs: dict, bounds: dict, what: str) -> None:
    over = {name: (f"{errs[name]:.2e}", f"{bounds[name]:.2e}") for name in errs if errs[name] > bounds[name]}
    assert not over, f"{what}: error over its bound (error, bound): {over}"
