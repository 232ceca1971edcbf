from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent


def core_sources() -> list[str]:
    """csrc/sources.txt: the native core, shared with CMakeLists.txt."""
    lines = (ROOT / "csrc" / "sources.txt").read_text().splitlines()
    return [f"csrc/{line.strip()}" for line in lines if line.strip() and not line.startswith("#")]


setup(
    ext_modules=[
        CppExtension(
            name="cp_cache._C",
            sources=core_sources() + ["csrc/bindings.cpp"],
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
