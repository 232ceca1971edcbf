"""Loads ``cp_cache._C`` only if built against the running torch (else it fails with an undefined symbol, or
misbehaves): ``setup.py`` records the build's torch in ``native-build.txt``. Also the supported versions."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import torch

SUPPORTED_TORCH = ("2.13", "2.14", "2.15")
SUPPORTED_TORCH_NPU = ("2.12", "2.13", "2.14")
BUILD_RECORD = Path(__file__).with_name("native-build.txt")
REBUILD = ("rebuild it against the running torch: `make build` in a checkout, or "
           "`pip install --no-build-isolation --no-deps --force-reinstall .` in cp_cache's source")


def built_with_torch() -> str | None:
    """None: no record."""
    try:
        return BUILD_RECORD.read_text().strip() or None
    except FileNotFoundError:
        return None


def torch_supported(version: str = torch.__version__) -> bool:
    return ".".join(version.split(".")[:2]) in SUPPORTED_TORCH


def load() -> ModuleType:
    """ImportError naming both versions when it was built against another torch."""
    built, running = built_with_torch(), torch.__version__
    if built is not None and built != running:
        raise ImportError(f"cp_cache's native extension was built against torch {built}, "
                          f"but torch {running} is running: {REBUILD}")
    try:
        return importlib.import_module("cp_cache._C")
    except ImportError as error:
        raise ImportError(f"cp_cache's native extension cp_cache._C does not load under torch {running} "
                          f"(built against {built or 'an unrecorded torch'}): {error}; {REBUILD}") from error
