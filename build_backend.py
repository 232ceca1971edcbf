"""The PEP 517 build backend: setuptools', building against the torch installed where pip runs.

A C++ extension of torch must be compiled against the torch it will run with. pip's build
isolation hides the installed packages and would install the newest torch into a throw-away
environment instead (another version, gigabytes, and an extension that cannot load). This
backend finds the torch the installing interpreter has and builds against it; it installs no
torch of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

REBUILD_COMMAND = "pip install --no-build-isolation ."


def _installed_torch_site() -> str | None:
    """The site directory holding the torch that this interpreter imports outside pip's isolation."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    probe = "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return result.stdout.strip().splitlines()[-1] if result.returncode == 0 and result.stdout.strip() else None


def _make_torch_importable() -> None:
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    site_dir = _installed_torch_site()
    if site_dir is None:
        raise RuntimeError(
            f"cp_cache builds against the torch installed in the environment, and {sys.executable} has none: "
            "install torch first (torch 2.13 to 2.15, e.g. pip install torch==2.14.1), then pip install ."
        )
    sys.path.append(site_dir)
    try:
        import torch  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            f"cp_cache could not load the torch installed in {site_dir} from pip's build environment ({error}); "
            f"build without isolation instead: {REBUILD_COMMAND}"
        ) from error


_make_torch_importable()

from setuptools.build_meta import (  # noqa: E402
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]
