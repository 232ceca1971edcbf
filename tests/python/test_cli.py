"""python -m cp_cache demo | bench | doctor, run as a user would (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cp_cache.testing.reference import dense_attention, error_bound
from demo_reference import demo_rounding

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=240):
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CP_CACHE_POLICY"):
        env.pop(name, None)  # a spawned run, whatever launched pytest
    proc = subprocess.run([sys.executable, "-m", "cp_cache", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc


def test_demo_short_run_parity_and_no_live_caches(tmp_path):
    out = tmp_path / "demo.json"
    proc = _run("demo", "--steps", "2", "--ranks", "2", "--seq-len", "32", "--layers", "2", "--dim", "32",
                "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
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


def test_bench_quick_writes_json_and_png(tmp_path):
    proc = _run("bench", "--quick", "--worlds", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert f"written: {tmp_path / 'bench.json'}" in proc.stdout
    for key in ("memory", "overhead", "calls", "accuracy", "traffic", "traffic_summary", "store", "torch_npu_formula"):
        assert key in report, key
    for png in ("bench_traffic.png", "bench_overhead.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
    # the overhead section reports (no timing is asserted): one row per W > 1 and direction, three systems
    assert {(r["world_size"], r["direction"]) for r in report["overhead"]} == {(2, "forward"), (2, "backward")}
    for r in report["overhead"]:
        for key in ("cp_cache_us", "torch_ring_us", "kernels_us", "cp_cache_overhead_us", "torch_ring_overhead_us"):
            assert isinstance(r[key], float), (key, r)
        assert "ratio" in r, r
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


def test_doctor_reports_versions_extension_and_ops():
    proc = _run("doctor", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for expected in ("python", "torch", "torch_npu", "native extension", "policy", "attention ops"):
        assert expected in text, text
    assert f"built against torch {torch.__version__}" in text, text
    assert "all good" in text


def test_doctor_flags_a_bad_policy():
    env_policy = dict(os.environ, CP_CACHE_POLICY="lifo")
    proc = subprocess.run([sys.executable, "-m", "cp_cache", "doctor"], cwd=REPO, env=env_policy,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "CP_CACHE_POLICY=handle" in proc.stdout


def test_no_command_prints_help():
    proc = _run(timeout=60)
    assert proc.returncode == 2
    assert "demo" in proc.stdout and "bench" in proc.stdout and "doctor" in proc.stdout


def test_console_script_runs_the_same_commands():
    """``cp-cache`` (the package's console script) is ``python -m cp_cache``."""
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("cp-cache") == "cp_cache.cli:main", scripts.get("cp-cache")
    script = os.path.join(os.path.dirname(sys.executable), "cp-cache")
    assert os.path.exists(script), f"{script}: reinstall the package (make test does) to create it"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    helps = [subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
             for cmd in ([script, "--help"], [sys.executable, "-m", "cp_cache", "--help"])]
    assert [h.returncode for h in helps] == [0, 0], [h.stderr for h in helps]
    for command in ("demo", "bench", "compare", "doctor"):
        assert command in helps[0].stdout
    assert helps[0].stdout.startswith("usage: cp-cache ")
    assert helps[0].stdout.replace("usage: cp-cache", "usage: python -m cp_cache") == helps[1].stdout
