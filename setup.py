from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent


def core_sources() -> list[str]:
    """csrc/sources.txt: the native core, shared with CMakeLists.txt."""
    lines = (ROOT / "csrc" / "sources.txt").read_text().splitlines()
    return [f"csrc/{line.strip()}" for line in lines if line.strip() and not line.startswith("#")]


class BuildWithTorchRecord(BuildExtension):
    """Builds with the C++ standard the installed torch requires (torch's own default flag: C++17
    up to torch 2.13, C++20 from 2.14) and writes the torch version it was built against beside the
    extension (``cp_cache/native-build.txt``), so that ``import cp_cache`` refuses an extension
    built against another torch."""

    def run(self) -> None:
        super().run()  # with --inplace (editable installs) the extension is copied into python/ after
        package_dir = Path(self.get_ext_fullpath("cp_cache._C")).parent
        package_dir.mkdir(parents=True, exist_ok=True)
        (package_dir / "native-build.txt").write_text(f"{torch.__version__}\n")


setup(
    ext_modules=[
        CppExtension(
            name="cp_cache._C",
            sources=core_sources() + ["csrc/bindings.cpp"],
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args=["-O2"],
        )
    ],
    cmdclass={"build_ext": BuildWithTorchRecord.with_options(use_ninja=True)},
)
