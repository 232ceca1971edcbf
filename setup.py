from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))

setup(
    ext_modules=[
        CppExtension(
            name="cp_cache._C",
            sources=SOURCES,
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
