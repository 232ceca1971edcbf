"""cp-cache selftest as a user runs it (2 spawned CPU ranks), its failing verdict, and the pieces
it reports with (the K/V lower bound, the hybrid mesh). The command goes through the CLI's
``main`` in this process: its ranks are separate processes either way (forked from the suite's
forkserver); python -m cp_cache itself runs in test_cli.py."""

import os
import re

import pytest
import torch

from cp_cache.cli import selftest


@pytest.fixture
def run_selftest(capsys, monkeypatch):
    """``selftest ARGS`` through ``cp_cache.cli.main``: (exit code, stdout)."""
    from cp_cache.cli import main

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CP_CACHE_POLICY",
                 "CP_CACHE_ALGORITHM"):
        monkeypatch.delenv(name, raising=False)  # spawned ranks, whatever launched pytest
    # the command sets it (setdefault) for the ranks it spawns: do the same through monkeypatch,
    # which puts this process's value back afterwards
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "0"))

    def run(*args) -> tuple[int, str]:
        code = main(["selftest", *args])
        return code, capsys.readouterr().out

    return run


def _rows(text: str) -> dict:
    """{case: result} from a printed table."""
    rows = {}
    for case in selftest.cases(2):
        line = next((ln for ln in text.splitlines() if ln.startswith(case.name + "  ")), None)
        assert line is not None, f"no row for {case.name!r}:\n{text}"
        rows[case.name] = re.split(r"\s{2,}", line.strip())[-1]
    return rows


def test_selftest_passes_on_two_spawned_cpu_ranks(run_selftest):
    """Not launched: the path a user of this machine gets (cp_cache's op on torch's kernels; dropout refused on
    CPU, so not run), then the NPU path over the emulator; both pass."""
    code, text = run_selftest("--repeats", "1")
    assert code == 0, text
    assert "cp_cache selftest: 2 ranks on cpu" in text and "spawned, gloo on loopback; 2 paths" in text, text
    header = next(ln for ln in text.splitlines() if ln.startswith("case "))
    for column in ("check", "error", "bound", "ms/call", "sent", "K/V lower bound", "sent/bound", "result"):
        assert column in header, header
    torch_path, npu_path = text.split("\npath 2: ", 1)
    assert "path 1: torch's fused kernels through cp_cache's op" in torch_path, torch_path
    assert "(cp_cache attention ops, torch step kernel)" in torch_path, torch_path
    assert "the NPU path, its ops emulated on CPU (emulator attention ops, npu step kernel)" in npu_path, npu_path
    for name, result in _rows(torch_path).items():
        assert result.startswith("n/a [") if "dropout" in name else result == "ok", (name, result)
    rows = _rows(npu_path)
    for name, result in rows.items():
        assert result == "ok", (name, result)
    dropout = sum("dropout" in name for name in rows)
    assert re.search(rf"^verdict: PASS: {len(rows) - dropout} of {len(rows)} cases passed on 2 ranks on cpu "
                     r"\(cp_cache ops, torch step kernel\); not run: .*dropout", text, re.M), text
    assert re.search(rf"^verdict: PASS: {len(rows)} of {len(rows)} cases passed on 2 ranks on cpu \(emulator ops",
                     text, re.M), text
    assert "hybrid" not in text  # W = 2 does not factor into two CP sizes >= 2


def test_injected_error_fails_the_verdict(run_selftest):
    code, text = run_selftest("--inject-error", "--cases", "ring full", "--repeats", "0", "--ranks", "1")
    assert code == 1, text
    assert re.search(r"^ring full, GQA .* FAIL$", text, re.M), text
    assert "verdict: FAIL: 1 failed (ring full, GQA)" in text, text


def test_no_matching_case_fails():
    rows = []
    ok, text = selftest.verdict(rows, 2, dict(device="cpu", ops="emulator", kernel="npu"))
    assert not ok and "no case" in text


def test_hybrid_only_when_the_world_size_factors():
    assert [selftest.hybrid_sizes(w) for w in (1, 2, 3, 4, 6, 7, 8)] == [None, None, None, (2, 2), (3, 2), None, (4, 2)]
    assert not any(c.algorithm == "hybrid" for c in selftest.cases(2))
    assert sum(c.algorithm == "hybrid" for c in selftest.cases(4)) == 5
    assert len({c.name for c in selftest.cases(4)}) == len(selftest.cases(4))


def _blocks(case: selftest.Case, world: int) -> float:
    """The lower bound in local K/V blocks (K and V of one rank's shard)."""
    prob = selftest.make_problem(case, world)
    block = prob.k.size(0) * prob.nkv * (prob.seq // world) * (prob.k.size(-1) + prob.v.size(-1)) * 4
    return selftest.kv_lower_bound(prob) / block


@pytest.mark.parametrize("world", (1, 2, 4))
def test_kv_lower_bound_of_the_plain_layouts(world):
    # full: every rank needs every other block; causal, contiguous: rank r needs the r blocks before
    # it; causal, head-tail: rank r needs all but its chunks except the 2W-1-r..W chunks after r's head
    assert _blocks(selftest.Case("full", mask="full", lb=False), world) == world * (world - 1)
    assert _blocks(selftest.Case("causal", mask="causal", lb=False), world) == world * (world - 1) / 2
    chunks = sum(2 * world - 1 - r - 1 for r in range(world))  # chunks below rank r's tail, less its head
    assert _blocks(selftest.Case("lb", mask="causal", lb=True), world) == chunks / 2


def test_kv_lower_bound_of_a_window():
    # contiguous, a window of S_LOCAL/2 keys before each query: each rank but the first needs the
    # last S_LOCAL/2 rows of the rank before
    case = selftest.Case("w", mask="band", lb=False)
    assert _blocks(case, 4) == 3 * 0.5
    prob = selftest.make_problem(case, 4)
    assert torch.equal(prob.masked[5, :], ~((torch.arange(prob.seq) <= 5) & (torch.arange(prob.seq) >= 5 - 8)))
