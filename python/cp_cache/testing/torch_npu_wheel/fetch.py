"""Fetching a torch-npu wheel's CP Python files into the cache (pip download, extract, keep the few
files the loader and the reports need)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("cp_cache")

CACHE_ENV = "CP_CACHE_TORCH_NPU_CACHE"
_REPO = Path(__file__).resolve().parents[4]
CACHE_DIR = Path(os.environ.get(CACHE_ENV) or (_REPO / ".cache" / "torch_npu"))
VERSIONS = ("2.14.0", "2.13.0", "2.12.0")  # newest first
NEWEST = VERSIONS[0]
FETCH_COMMAND = "make torch-npu-wheels  (or: python -m cp_cache.testing.torch_npu_wheel fetch --version {version})"

# pip: seconds per network operation, retries, and a bound on the whole download
PIP_SOCKET_TIMEOUT_S = 60
PIP_RETRIES = 2
PIP_TOTAL_TIMEOUT_S = 900

# what is kept from a wheel (paths inside it; a trailing "/" keeps a folder's .py files recursively)
_KEEP_TREES = ("torch_npu/distributed/tensor/",)
_KEEP_FILES = (
    "torch_npu/__init__.py",
    "torch_npu/version.py",
    "torch_npu/distributed/__init__.py",
    "torch_npu/_init/core/module_loader.py",
    "torch_npu/op_plugin/meta/__init__.py",
    "torch_npu/op_plugin/meta/_meta_registrations.py",
    "torch_npu/op_plugin/meta/_fake_registrations.py",
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
)
# without these the CP path cannot be loaded
_REQUIRED_FILES = (
    "torch_npu/distributed/tensor/_attention.py",
    "torch_npu/distributed/tensor/_common.py",
    "torch_npu/distributed/tensor/experimental/_context_parallel/__init__.py",
    "torch_npu/distributed/tensor/experimental/_context_parallel/_attention.py",
    "torch_npu/distributed/tensor/experimental/_context_parallel/_npu_attention.py",
)
_COMPLETE_MARKER = ".cp_cache-extracted"


def _cache_dir(cache_dir: Optional[os.PathLike]) -> Path:
    return Path(cache_dir) if cache_dir is not None else CACHE_DIR


def _is_extracted(root: Path) -> bool:
    return (root / _COMPLETE_MARKER).is_file() and all((root / f).is_file() for f in _REQUIRED_FILES)


def wheel_root(version: str, cache_dir: Optional[os.PathLike] = None) -> Path:
    """The folder holding the extracted ``torch_npu/`` of ``version``; FileNotFoundError if not fetched."""
    root = _cache_dir(cache_dir) / version
    if not _is_extracted(root):
        raise FileNotFoundError(
            f"torch-npu {version}: its Python files are not in {root} (not fetched yet). "
            f"Fetch them with: {FETCH_COMMAND.format(version=version)}"
            + (f"; the cache folder is set by {CACHE_ENV}" if cache_dir is None else "")
        )
    return root


def _keep(name: str) -> bool:
    if name in _KEEP_FILES:
        return True
    return name.endswith(".py") and any(name.startswith(t) for t in _KEEP_TREES)


def _pip_download(version: str, dest: Path, extra: Sequence[str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
        "--disable-pip-version-check", "--timeout", str(PIP_SOCKET_TIMEOUT_S),
        "--retries", str(PIP_RETRIES), "-d", str(dest), f"torch-npu=={version}", *extra,
    ]
    log.info("fetching torch-npu %s: %s", version, " ".join(cmd))
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TOTAL_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, e.stdout or "", f"pip timed out after {PIP_TOTAL_TIMEOUT_S} s")


def fetch(version: str, cache_dir: Optional[os.PathLike] = None) -> Path:
    """Download torch-npu ``version`` with pip, keep its CP-related Python/YAML files; the extracted root.

    Does nothing when they are already there. Any wheel of that version will do (only
    Python and YAML files are kept): first the one for this interpreter and platform, then
    the CPython 3.11 manylinux x86_64 / aarch64 builds. Raises RuntimeError with pip's
    output when no wheel could be downloaded.
    """
    base = _cache_dir(cache_dir)
    root = base / version
    if _is_extracted(root):
        return root
    base.mkdir(parents=True, exist_ok=True)
    attempts: list[list[str]] = [["--only-binary=:all:"]]
    for plat in ("manylinux_2_28_x86_64", "manylinux_2_28_aarch64"):
        attempts.append(["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                         "--abi", "cp311", "--platform", plat])
    failures = []
    with tempfile.TemporaryDirectory(prefix=f"torch_npu-{version}-", dir=base) as tmp:
        tmp_path = Path(tmp)
        wheels: list[Path] = []
        for extra in attempts:
            proc = _pip_download(version, tmp_path / "dl", extra)
            wheels = sorted((tmp_path / "dl").glob("torch_npu-*.whl"))
            if proc.returncode == 0 and wheels:
                break
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
            failures.append(f"pip download {' '.join(extra)}: exit {proc.returncode}: " + " | ".join(tail))
        if not wheels:
            raise RuntimeError(
                f"torch-npu {version}: no wheel could be downloaded from the package index "
                f"(network or index unavailable, or no such version):\n  " + "\n  ".join(failures)
            )
        staging = tmp_path / "extract"
        kept = 0
        with zipfile.ZipFile(wheels[0]) as zf:
            for info in zf.infolist():
                if not info.is_dir() and _keep(info.filename):
                    zf.extract(info, staging)
                    kept += 1
        for w in wheels:
            w.unlink()
        missing = [f for f in _REQUIRED_FILES if not (staging / f).is_file()]
        if missing:
            raise RuntimeError(
                f"torch-npu {version}: the wheel {wheels[0].name} lacks the CP files {missing}; "
                "this loader knows the layout of torch-npu 2.12 to 2.14"
            )
        (staging / _COMPLETE_MARKER).write_text(f"{wheels[0].name}\n{kept} files\n")
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    log.info("torch-npu %s: %d files kept in %s", version, kept, root)
    return root
