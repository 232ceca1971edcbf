"""The build on every supported torch: the extension records the torch it was built against and
refuses to load under another; pip's isolated build finds the installed torch instead of fetching one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import cp_cache
from cp_cache import native

ROOT = Path(__file__).resolve().parents[2]


def test_the_extension_was_built_against_the_running_torch():
    assert native.built_with_torch() == torch.__version__
    assert native.torch_supported()
    assert cp_cache._C.default_store() is cp_cache.store()


def test_another_torch_is_refused_naming_both_versions(tmp_path, monkeypatch):
    record = tmp_path / "native-build.txt"
    record.write_text("2.12.0+cpu\n")
    monkeypatch.setattr(native, "BUILD_RECORD", record)
    with pytest.raises(ImportError) as error:
        native.load()
    message = str(error.value)
    assert "2.12.0+cpu" in message and torch.__version__ in message and "make build" in message, message


def test_an_unrecorded_build_still_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "BUILD_RECORD", tmp_path / "absent.txt")
    assert native.built_with_torch() is None
    assert native.load() is cp_cache._C


@pytest.mark.parametrize("version, supported", [("2.12.1", False), ("2.13.0+cpu", True), ("2.14.1+cu130", True),
                                                ("2.15.0", True), ("2.16.0", False)])
def test_supported_versions(version, supported):
    assert native.torch_supported(version) == supported


def test_the_build_backend_finds_the_installed_torch(monkeypatch):
    """What pip's isolated build environment sees: the backend's probe runs this interpreter
    without PYTHONPATH/PYTHONNOUSERSITE and reports the site directory holding torch."""
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    monkeypatch.setenv("PYTHONPATH", os.devnull)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)  # setuptools reads setup.py from the working directory
    import build_backend

    assert build_backend._installed_torch_site() == str(Path(torch.__file__).parents[1])
    assert "torch" not in " ".join(build_backend.get_requires_for_build_wheel())
    sys.modules.pop("build_backend", None)
