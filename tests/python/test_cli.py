"""python -m cp_cache demo | bench | doctor, and the ``cp-cache`` console script, run as a user would.

The commands that train or measure (demo, bench) go through the CLI's ``main`` in this process:
their ranks are separate processes either way (forked from the suite's forkserver instead of
spawned afresh), and the parent's part is argument parsing, printing and the JSON. The
commands whose point is the interpreter they start in (doctor reports what a fresh process
finds; the exit codes of ``python -m cp_cache`` and of ``cp-cache``) run as subprocesses: one
fresh ``python -m cp_cache``-as-``runpy`` interpreter for all the light ones, and ``cp-cache``.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from cp_cache.testing.reference import dense_attention, error_bound
from demo_reference import demo_rounding

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARS, "CP_CACHE_POLICY")}
    return {**env, **extra}  # a spawned run, whatever launched pytest


@pytest.fixture
def cli(capsys, monkeypatch):
    """``main(argv)`` in this process: (exit code, stdout)."""
    from cp_cache.cli import main

    for name in (*LAUNCHER_VARS, "CP_CACHE_POLICY"):
        monkeypatch.delenv(name, raising=False)

    def run(*argv) -> tuple[int, str]:
        code = main(list(argv))
        return code, capsys.readouterr().out

    return run


# Several ``python -m cp_cache ARGS`` in one fresh interpreter: each is runpy's run of cp_cache's
# __main__ (what -m does: sys.argv[0] is __main__.py, SystemExit carries the exit code), its
# stdout captured. argv[1]: JSON [[args, env to set (null: unset)], ...]; prints JSON
# [[exit code, stdout], ...].
_MANY_RUNS = """
import contextlib, io, json, os, runpy, sys
out = []
for args, env in json.loads(sys.argv[1]):
    for name, value in env.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    sys.argv = ["cp_cache", *args]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            runpy.run_module("cp_cache", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out.append([code, text.getvalue()])
print(json.dumps(out))
"""


def _python_m_runs(runs: list, env: dict) -> list:
    """[(exit code, stdout)] of each ``python -m cp_cache`` of ``runs`` ([(args, env changes)]),
    one after the other in one fresh interpreter started with ``env``."""
    proc = subprocess.run([sys.executable, "-c", _MANY_RUNS, json.dumps(runs)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


@pytest.fixture(scope="module")
def light_commands() -> dict:
    """doctor with a bad policy in the environment from the interpreter's start, doctor without it,
    no command, --help: {name: (exit code, stdout)}."""
    names = ("doctor_bad_policy", "doctor", "no_command", "help")
    runs = [(["doctor"], {}), (["doctor"], {"CP_CACHE_POLICY": None}), ([], {}), (["--help"], {})]
    return dict(zip(names, _python_m_runs(runs, _env(CP_CACHE_POLICY="lifo"))))


def test_demo_short_run_parity_and_no_live_caches(tmp_path, cli):
    out = tmp_path / "demo.json"
    code, text = cli("demo", "--steps", "2", "--ranks", "2", "--seq-len", "32", "--layers", "2", "--dim", "32",
                     "--json", str(out))
    assert code == 0, text
    for expected in ("policy = handle", "policy = stack", "eval 1-proc", "|diff|", "held fwd->bwd",
                     "side by side", "verdict:"):
        assert expected in text, text
    report = json.loads(out.read_text())
    runs = {r["policy"]: r for r in report["runs"]}
    assert set(runs) == {"handle", "stack"}
    # 20x the float32 rounding of the same model on one process (against float64) + 32 eps
    rounding = demo_rounding(seq_len=32, layers=2, dim=32)
    for run in runs.values():
        assert len(run["rows"]) == 2
        for row in run["rows"]:
            assert row["parity"] <= error_bound(rounding["loss"], scale=abs(row["eval_one"])), (row, rounding)
        assert run["grad_diff"] <= error_bound(rounding["grad"], scale=rounding["grad_scale"]), (run, rounding)
    for row in runs["handle"]["rows"]:
        # full checkpointing: nothing held between forward and backward, nothing left after the step
        assert (row["live_fwd"], row["live_bwd"], row["live_eval"]) == (0, 0, 0), row
        assert (row["bytes_fwd"], row["bytes_bwd"], row["bytes_eval"]) == (0, 0, 0), row
    for row in runs["stack"]["rows"]:
        assert row["new_fwd"] == 2, row  # one entry per layer from forward to backward
    # the same seed trains to the same losses under both policies
    assert [r["train_loss"] for r in runs["handle"]["rows"]] == [r["train_loss"] for r in runs["stack"]["rows"]]


def test_bench_quick_writes_json_and_png(tmp_path, cli):
    from cp_cache.cli.bench.overhead import torch_npu_release

    code, text = cli("bench", "--quick", "--worlds", "2", "--out", str(tmp_path))
    assert code == 0, text
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert f"written: {tmp_path / 'bench.json'}" in text
    for key in ("memory", "overhead", "calls", "accuracy", "traffic", "traffic_summary", "store", "torch_npu_formula"):
        assert key in report, key
    for png in ("bench_traffic.png", "bench_overhead.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
    # the overhead section reports (no timing is asserted): one row per W > 1 and direction, four systems
    assert {(r["world_size"], r["direction"]) for r in report["overhead"]} == {(2, "forward"), (2, "backward")}
    for r in report["overhead"]:
        for clock in ("", "_cpu"):
            keys = [f"{name}{clock}_us" for name in ("cp_cache", "torch_ring", "kernels", "dtensor_floor")]
            keys += [f"{name}{clock}_overhead_us" for name in ("cp_cache", "torch_ring")]
            for key in keys:
                assert isinstance(r[key], float), (key, r)
        for ratio in ("ratio", "cpu_ratio", "ratio_beyond_floor", "cpu_ratio_beyond_floor"):
            assert ratio in r, (ratio, r)
        # torch_npu's own handlers, where a release that runs on this torch is fetched (make test fetches them)
        assert r["torch_npu_version"] == torch_npu_release(), r
        if r["torch_npu_version"] is not None:
            for key in ("torch_npu_us", "torch_npu_cpu_us", "torch_npu_overhead_us", "torch_npu_cpu_overhead_us"):
                assert isinstance(r[key], float), (key, r)
            assert "ratio_vs_torch_npu" in r and "cpu_ratio_vs_torch_npu" in r, r
    handle_ckpt = [r for r in report["memory"] if r["policy"] == "handle" and r["checkpoint"] == "non_reentrant"]
    assert handle_ckpt and all(r["held_entries"] == 0 for r in handle_ckpt)
    for r in report["calls"]:
        # forward sends each other rank the K/V rows its queries may attend to, once
        assert r["fwd_bytes_sent"] == r["fwd_bytes_lower_bound"] <= r["ring_minimum_bytes"], r
    for c in report["traffic_summary"]:  # bytes received at the mask's lower bound (none when it is 0)
        if c["exchange"] == "direct" and c["bound_total"]:
            assert c["fwd_total_ratio"] == c["fwd_busiest_ratio"] == 1.0, c
        elif c["exchange"] == "direct":
            assert c["fwd_received_total"] == 0, c
    for r in report["traffic"]:  # the bound cp_cache reports is the one computed from the mask
        if r["exchange"] == "direct":
            assert r["fwd_reported_received_bound"] == r["bound_received"] == r["fwd_received"], r
    bound = _accuracy_bound(report["meta"]["plan"]["attn"])
    assert all(r["out_max_abs"] <= bound for r in report["accuracy"] if r["dtype"] == "float32"), bound
    # the gpt-oss-shaped row: both layer kinds on every rank, sinks included in the error
    assert {(r["layer"], r["rank"]) for r in report["models"]} == {(kind, rank) for rank in (0, 1)
                                                                   for kind in ("full causal", "window 8")}
    for r in report["models"]:
        assert r["fp32_rel_error"] <= error_bound(r["dense_fp32_rel_error"]), r
        assert r["fwd"]["bytes_sent"] > 0 and r["bwd"]["bytes_sent"] > 0, r
        assert r["fwd"]["bytes_received"] == r["fwd"]["bytes_received_lower_bound"], r  # the direct exchange


def _accuracy_bound(a: dict) -> float:
    """20x dense torch's float32 error of the output (max abs) on the inputs bench's accuracy
    section draws (seed 123, causal), + 32 eps of the output's largest value."""
    g = torch.Generator().manual_seed(123)
    q, k, v, dy = (torch.randn(a["batch"], a["heads"], a["seq"], a["head_dim"], generator=g, dtype=torch.float64)
                   for _ in range(4))
    ref, low = (dense_attention(q, k, v, dy, causal=True, dtype=dt)["out"] for dt in (torch.float64, torch.float32))
    return error_bound(float((low.double() - ref).abs().max()), scale=float(ref.abs().max()))


def test_doctor_reports_versions_extension_and_ops(light_commands):
    code, text = light_commands["doctor"]
    assert code == 0, text
    for expected in ("python", "torch", "torch_npu", "native extension", "policy", "step kernel", "attention ops"):
        assert expected in text, text
    # no NPU op in the suite's processes: the kernel that will serve is torch's, and the line says why
    assert re.search(r'step kernel +"torch": no NPU op here', text) and "install_npu_emulator()" in text, text
    assert f"built against torch {torch.__version__}" in text, text
    assert "all good" in text


def test_doctor_flags_a_bad_policy(light_commands):
    code, text = light_commands["doctor_bad_policy"]  # CP_CACHE_POLICY=lifo since the interpreter started
    assert code == 1, text
    assert "CP_CACHE_POLICY=handle" in text


def test_no_command_prints_help(light_commands):
    code, text = light_commands["no_command"]
    assert code == 2
    assert "demo" in text and "bench" in text and "doctor" in text
    assert text.startswith("usage: python -m cp_cache "), text
    help_code, help_text = light_commands["help"]
    assert help_code == 0 and help_text == text, (help_code, help_text)  # --help prints the same


def test_console_script_runs_the_same_commands(light_commands):
    """``cp-cache`` (the package's console script) is ``python -m cp_cache``: the same help and
    exit code with no command."""
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("cp-cache") == "cp_cache.cli:main", scripts.get("cp-cache")
    script = os.path.join(os.path.dirname(sys.executable), "cp-cache")
    assert os.path.exists(script), f"{script}: reinstall the package (make test does) to create it"
    proc = subprocess.run([script], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    for command in ("demo", "bench", "compare", "doctor"):
        assert command in proc.stdout
    assert proc.stdout.startswith("usage: cp-cache "), proc.stdout
    assert proc.stdout.replace("usage: cp-cache", "usage: python -m cp_cache") == light_commands["no_command"][1]
