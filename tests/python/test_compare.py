"""python -m cp_cache compare: the side-by-side run (quick, as a user runs it) and its memory helper."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cp_cache.cli import _measure, compare
from cp_cache.cli.compare.inputs import case_spec, full_inputs
from cp_cache.testing.reference import dense_attention, dense_errors, error_bound

pytestmark = pytest.mark.slow  # exhaustive sweeps: left out of make matrix's fast subset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHEELS = os.path.join(REPO, ".cache", "torch_npu")


def _wheels_present() -> bool:
    from cp_cache.testing.torch_npu_wheel import VERSIONS, wheel_root

    try:
        for version in VERSIONS:
            wheel_root(version)
    except FileNotFoundError:
        return False
    return True


def _breaks_here(name: str) -> bool:
    """torch_npu systems whose own CP sharding strategy fails on this torch (torch-npu 2.13/2.14 on torch
    2.14+, torch_npu_wheel.CP_STRATEGY_TYPE_ERROR): compare reports them refused, and what they would
    measure is checked on the torch that runs them (make test TORCH_VERSION=2.13.0)."""
    from cp_cache.cli.compare.catalogue import TORCH_NPU_RELEASES
    from cp_cache.testing.torch_npu_wheel import cp_strategy_breaks_on_this_torch

    return name in TORCH_NPU_RELEASES and cp_strategy_breaks_on_this_torch(TORCH_NPU_RELEASES[name])


# ---------------------------------------------------------------- in process, fast


@pytest.mark.parametrize("nbytes", [1 << 20, 8 << 20])
def test_peak_bytes_of_a_known_allocation(nbytes):
    def alloc():
        x = torch.empty(nbytes, dtype=torch.uint8)
        x.fill_(1)
        y = torch.empty(1024, dtype=torch.uint8)  # small, after x is allocated
        del x, y

    measured = _measure.peak_bytes(alloc)
    assert nbytes <= measured <= nbytes + (64 << 10), measured


def test_trace_memory_accounts_frees_across_phases():
    keep = {}

    def first():
        keep["x"] = torch.empty(4 << 20, dtype=torch.uint8)

    def second():
        del keep["x"]  # freed here: the level drops, then a smaller allocation
        z = torch.empty(1 << 20, dtype=torch.uint8)
        del z

    peaks = _measure.trace_memory([("first", first), ("second", second)])
    assert (4 << 20) <= peaks["first"] <= (4 << 20) + (64 << 10)
    assert peaks["second"] <= (64 << 10), peaks  # never above the level at its start


def test_distinct_storage_bytes_counts_views_once_and_excludes():
    a = torch.zeros(1000)  # 4000 B
    b = torch.zeros(10)  # 40 B
    assert _measure.distinct_storage_bytes([a, a[:10], a.view(10, 100), b]) == 4040
    assert _measure.distinct_storage_bytes([a, b], exclude=[a[5:]]) == 40


def test_bad_cli_input_names_the_argument(capsys):
    """Refused while parsing the arguments (argparse's exit code 2, the argument named on stderr),
    before anything runs: through the CLI's main in this process (python -m cp_cache runs in
    test_cli.py)."""
    from cp_cache.cli import main

    for args, name in ((["--worlds", "1"], "--worlds"), (["--repeats", "zero"], "--repeats")):
        with pytest.raises(SystemExit) as exit_:
            main(["compare", *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and name in err, (args, err)


# ---------------------------------------------------------------- the quick run (subprocess)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    if not _wheels_present():
        pytest.skip(f"torch-npu wheels not fetched into {WHEELS} (python -m cp_cache.testing.torch_npu_wheel fetch)")
    out = tmp_path_factory.mktemp("compare")
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CP_CACHE_POLICY"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "cp_cache", "compare", "--quick", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "compare.json").read_text()), out, proc.stdout


def test_quick_run_covers_every_system_and_world(quick_report):
    report, out, stdout = quick_report
    assert report["systems"] == list(compare.SYSTEMS)
    assert list(report["results"]) == ["2"]
    for name in compare.SYSTEMS:
        row = report["results"]["2"][name]
        if _breaks_here(name):
            from cp_cache.testing.torch_npu_wheel import CP_STRATEGY_TYPE_ERROR

            error = row.get("session_error") or row["dropout"]  # the dropout-only variant runs that case alone
            assert (error["error_type"], error["message"]) == ("TypeError", CP_STRATEGY_TYPE_ERROR), (name, error)
            continue
        assert "session_error" not in row, (name, row.get("session_error"))
        assert "dropout" in row
        if name not in compare.DROPOUT_ONLY:
            assert set(row["cases"]) == {c["name"] for c in compare.CASES}
            for key in ("memory", "time", "traffic", "eval_no_grad"):
                assert key in row, (name, key)
    assert (out / "compare.png").stat().st_size > 10_000
    assert "acceptance and max relative error" in stdout and "resources" in stdout


def test_the_checks_themselves_are_validated(quick_report):
    report, _, _ = quick_report
    v = report["validation"]
    assert v["directional_check"]["passes"], v["directional_check"]
    assert v["memory_helper"]["ok"], v["memory_helper"]


def _case_bounds(report) -> dict:
    """Per case: 20x dense torch's float32 error (the worst of out, dq, dk, dv) on the case's own
    inputs at W = 2 (+ 32 eps), against the same float64 reference compare measures with."""
    bounds = {}
    for case in compare.CASES:
        spec = case_spec(case, report["meta"]["plan"]["cases"])
        q, k, v, dout = full_inputs(spec, 2)
        causal = spec["mask"] == "causal"
        ref = dense_attention(q, k, v, dout, causal=causal)
        errors = dense_errors(q, k, v, dout, ref, causal, keys=("out", "dq", "dk", "dv"))
        bounds[case["name"]] = error_bound(max(errors.values()))
    return bounds


def _dropout_threshold(report) -> float:
    """Halfway (geometric mean) between the directional-derivative errors this run measured for a
    right gradient and for a deliberately wrong one (another dropout mask), on one process."""
    check = report["validation"]["directional_check"]
    return (check["dense_op_max"] * check["wrong_backward_max"]) ** 0.5


def test_cp_cache_is_right_and_its_dropout_gradients_pass(quick_report):
    report, _, _ = quick_report
    res = report["results"]["2"]
    bounds, threshold = _case_bounds(report), _dropout_threshold(report)
    for name in (compare.CP_CACHE, compare.CP_CACHE_STACK):
        for case, c in res[name]["cases"].items():  # the all-False sparse_mode 1 mask too: full attention
            assert c["status"] == "accepted", (name, case, c)
            assert c["max_error"] <= bounds[case], (name, case, c, bounds[case])
        drop = res[name]["dropout"]
        assert drop["status"] == "accepted" and drop["ok"] and drop["max_error"] < threshold, (drop, threshold)


def test_torch_npu_dropout_refused_or_wrong(quick_report):
    report, _, _ = quick_report
    res = report["results"]["2"]
    running = [name for name in (compare.NPU_214, compare.NPU_213, compare.NPU_213_LIFTED, compare.NPU_212)
               if not _breaks_here(name)]
    assert compare.NPU_212 in running
    for name in {compare.NPU_214, compare.NPU_213} & set(running):
        refused = res[name]["dropout"]
        assert refused["status"] == "refused" and "redistributed" in refused["message"], (name, refused)
    threshold = _dropout_threshold(report)
    for name in {compare.NPU_213_LIFTED, compare.NPU_212} & set(running):  # negative controls of the check
        drop = res[name]["dropout"]
        assert drop["status"] == "accepted" and not drop["ok"] and drop["max_error"] > threshold, (name, drop)
    # sparse_mode 1 with an all-False mask is full attention; torch_npu computes causal
    bound = _case_bounds(report)["sparse1_all_false_mask"]
    for name in {compare.NPU_214, compare.NPU_213, compare.NPU_212} & set(running):
        c = res[name]["cases"]["sparse1_all_false_mask"]
        assert c["status"] == "accepted" and c["silently_wrong"] and c["max_error"] > bound, (c, bound)


def test_memory_kept_between_forward_and_backward(quick_report):
    report, _, _ = quick_report
    res = report["results"]["2"]
    r = report["meta"]["plan"]["resources"]
    s_local = r["seq"] // 2
    out = r["batch"] * r["heads"] * s_local * r["head_dim"] * 4
    stats = 2 * r["batch"] * r["heads"] * s_local * 8 * 4
    mem = {name: res[name]["memory"] for name in res if "memory" in res[name]}
    # torch_npu 2.13.0: output + softmax_max/sum saved by autograd; cp_cache: the floor,
    # output + LSE (its statistics are stride-0 views of the LSE) + the handle's cache
    lse = r["batch"] * r["heads"] * s_local * 4
    for name in (compare.NPU_214, compare.NPU_213):
        if not _breaks_here(name):
            assert out + stats <= mem[name]["no_checkpoint"]["total_bytes"] <= out + stats + 1024, mem[name]
    kept = mem[compare.CP_CACHE]["no_checkpoint"]["total_bytes"]
    assert out + lse <= kept <= out + lse + 1024, mem[compare.CP_CACHE]
    # 2.12.0 additionally keeps the merged LSE and a clone of max/sum per ring step
    assert mem[compare.NPU_212]["no_checkpoint"]["total_bytes"] > mem[compare.CP_CACHE]["no_checkpoint"]["total_bytes"]
    # under checkpointing nothing is kept, except 2.12.0's stack entry
    assert mem[compare.CP_CACHE]["checkpoint"]["total_bytes"] == 0
    assert mem[compare.NPU_212]["checkpoint"]["stack_entries"] == 1
    assert mem[compare.NPU_212]["checkpoint"]["total_bytes"] >= out
    assert res[compare.NPU_212]["eval_no_grad"]["stack_entries_left"] == 3
    for name, m in mem.items():
        assert m["no_checkpoint"]["forward_peak_bytes"] > 0 and m["no_checkpoint"]["backward_peak_bytes"] > 0, name
        assert m["no_checkpoint"]["store_bytes_after_backward"] == 0, name


def test_traffic_counts_agree_with_cp_cache_and_the_ring(quick_report):
    report, _, _ = quick_report
    res = report["results"]["2"]
    r = report["meta"]["plan"]["resources"]
    kv = 2 * r["batch"] * r["heads"] * (r["seq"] // 2) * r["head_dim"] * 4  # K + V block, fp32
    traffic = res[compare.CP_CACHE]["traffic"]
    # cp_cache's own count is the K/V and dK/dV bytes, all that the counter sees on the CP group:
    # the ranks' agreement goes over the group's host backend directly (or cp_cache's CPU side group)
    assert traffic["cp_cache_reported"] == {"forward": traffic["forward_bytes"],
                                            "backward": traffic["backward_bytes"]}
    # causal head-tail at W=2: rank 1's queries end in chunk 2, so of rank 0's block (chunks 0 and
    # 3) cp_cache sends it chunk 0 alone; the other systems relay the whole block
    assert traffic["forward_bytes"] == kv // 2, traffic
    for name in (compare.NPU_214, compare.NPU_213, compare.NPU_212, compare.TORCH_AG, compare.TORCH_A2A):
        if not _breaks_here(name):
            assert res[name]["traffic"]["forward_bytes"] == kv, (name, res[name]["traffic"])
