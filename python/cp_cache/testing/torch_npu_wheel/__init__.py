"""torch_npu's own context-parallel (CP) Python code, run on CPU over the NPU emulator.

Why: users on Ascend run torch_npu's CP handlers today, so cp_cache is measured
against them and must coexist with them. The torch-npu wheels on PyPI cannot be
imported here: ``import torch_npu`` loads a native library that needs Ascend
CANN. Their CP files are plain Python, though, and only need
``torch.ops.npu.npu_fusion_attention*`` -- which the emulator
(``cp_cache.emulator.install_npu_emulator``) provides on CPU.

This package, one module per concern:

* ``fetch``: fetches a wheel with pip (``fetch``), keeps only the few Python/YAML files the
  CP path and the reports need, under ``CACHE_DIR/<version>/`` (the wheel itself
  is deleted);
* ``loader``: ``load_torch_npu_cp(version)``, a context manager that puts stub package
  modules (``torch_npu``, ``torch_npu.distributed``, ...) into ``sys.modules``
  with ``__path__`` pointing into the extracted files, gives the ``torch_npu``
  stub the emulator's ops, and imports the CP modules the way ``import torch_npu``
  does (``torch_npu.distributed.tensor`` imports its ``_attention`` module, then
  ``experimental._context_parallel``, whose ``_attention`` module patches torch's
  CP dispatcher functions). It records every change the import makes to torch
  and undoes all of them on exit, so 2.14.0, 2.13.0 and 2.12.0 can be loaded one after
  the other in one process; and what their CP does on the running torch
  (``cp_strategy_breaks_on_this_torch``);
* ``meta``: ``wheel_meta_functions(version)``, the wheel's fake/meta functions of the four
  fused-attention ops as plain callables (without registering them anywhere).

Command line (``__main__``): ``python -m cp_cache.testing.torch_npu_wheel fetch [--version V ...]``.
"""

from __future__ import annotations

from .fetch import CACHE_DIR, CACHE_ENV, FETCH_COMMAND, NEWEST, VERSIONS, fetch, wheel_root
from .loader import (
    CP_STRATEGY_TYPE_ERROR,
    OP_NAMES,
    LoadedTorchNpuCP,
    TorchChange,
    cp_strategy_breaks_on_this_torch,
    load_torch_npu_cp,
)
from .meta import wheel_meta_functions

__all__ = [
    "CACHE_DIR",
    "CACHE_ENV",
    "VERSIONS",
    "NEWEST",
    "CP_STRATEGY_TYPE_ERROR",
    "cp_strategy_breaks_on_this_torch",
    "FETCH_COMMAND",
    "OP_NAMES",
    "LoadedTorchNpuCP",
    "TorchChange",
    "fetch",
    "wheel_root",
    "load_torch_npu_cp",
    "wheel_meta_functions",
]
