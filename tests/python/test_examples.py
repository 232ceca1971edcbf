"""Every file under examples/ runs as a user runs it: ``torchrun --nproc-per-node 2 examples/<name>.py`` on CPU
(gloo, torch's own kernels: no emulator), with no edits, and passes its own check against one process: exit status
0 and a line per rank naming the comparison. The docs point at the examples: every example is linked from a page
(or the README), and the README's quick start is examples/quickstart.py itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example is two fresh processes: left out of make matrix's fast subset

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _run(example: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("CP_CACHE_")}
    env["OMP_NUM_THREADS"] = "1"  # what torchrun sets anyway, without its banner
    # --standalone: a free port of its own, so runs beside other suites do not collide
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_examples_are_found():
    names = {p.stem for p in EXAMPLES}
    assert {"quickstart", "sdpa_full_gradients", "transformers_step", "trainer", "trl_sft",
            "torchtitan_style"} <= names, names


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_and_matches_one_process(example: Path):
    proc = _run(example)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{example.name} exited {proc.returncode}:\n{output[-6000:]}"
    # the ranks' lines may interleave on the shared stdout: each rank's header, and the comparisons
    ranks = re.findall(r"rank (\d) of 2 \(cpu\)", proc.stdout)
    assert sorted(set(ranks)) == ["0", "1"] and proc.stdout.count("one process") >= 2, (
        f"{example.name} printed no comparison per rank:\n{proc.stdout}")


def test_every_example_is_linked_from_the_docs():
    text = "".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    unlinked = [p.name for p in EXAMPLES if f"examples/{p.name})" not in text]
    assert not unlinked, f"no page links these examples: {unlinked}"


def _code_of(path: Path) -> str:
    """The example's code: the file less its docstring."""
    text = path.read_text(encoding="utf-8")
    return re.sub(r'^""".*?"""\n', "", text, count=1, flags=re.S).strip()


def test_readme_quick_start_is_the_example():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "README's quick start has no python block"
    assert block.group(1).strip() == _code_of(ROOT / "examples" / "quickstart.py"), (
        "README's quick start differs from examples/quickstart.py: copy the file's code (less its docstring)")


def _code_lines(text: str) -> list[str]:
    """Lines of code, stripped, without comments (a fragment's comments may be worded for the page)."""
    return [line.split("  #", 1)[0].strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_docs_fragments_come_from_the_examples():
    """A python block in a section of a docs page that links an example is taken from it: every line of code
    in the block is a line of one of the examples the section links (so a recipe on a page cannot rot)."""
    checked, stale = 0, []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for section in re.split(r"^## ", page.read_text(encoding="utf-8"), flags=re.M)[1:]:
            linked = set(re.findall(r"\(\.\./examples/([\w.]+\.py)\)", section))
            if not linked:
                continue
            lines = {line for name in linked for line in _code_lines((ROOT / "examples" / name).read_text())}
            for block in re.findall(r"```python\n(.*?)```", section, re.S):
                checked += 1
                stale += [(page.name, line) for line in _code_lines(block) if line not in lines]
    assert checked >= 3, f"only {checked} fragments found next to an example link"
    assert not stale, f"lines on a page that its examples do not have: {stale}"
