"""Report what cp_cache finds on this machine and what to do about anything missing."""

from __future__ import annotations

import argparse
import os
import platform
import sys

NAME = "doctor"
HELP = "versions, native extension, the step kernel that will serve here and why, and what to do about what is missing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def _check(label: str, ok: bool | None, detail: str, todo: list[str], fix: str | None = None) -> None:
    mark = {True: "ok  ", False: "FAIL", None: "info"}[ok]
    print(f"[{mark}] {label:<22} {detail}")
    if ok is False and fix:
        todo.append(fix)


def run(args: argparse.Namespace) -> int:
    todo: list[str] = []
    print("cp_cache doctor")
    _check("python", sys.version_info >= (3, 10), f"{platform.python_version()} ({sys.executable})", todo,
           "use Python 3.10 or newer")
    torch = _torch_check(todo)
    if torch is None:
        return _finish(todo)
    _torch_npu_check(torch, todo)
    if not _extension_check(todo):
        return _finish(todo)

    import cp_cache

    _policy_check(todo)
    _kernel_check(todo)
    _attention_ops_check(todo)
    _optional_packages_check(todo)
    _merge_check(todo)
    s = cp_cache.stats()
    _check("store", True, f"live_entries={s['live_entries']}, stack_depth={s['stack_depth']}", todo)
    return _finish(todo)


def _torch_check(todo: list[str]):
    """torch, or None when it does not import."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        _check("torch", False, f"not importable: {e}", todo, "run make build (it installs torch in .venv)")
        return None
    from cp_cache.native import SUPPORTED_TORCH, torch_supported

    supported = f"supported: {', '.join(SUPPORTED_TORCH)}"
    _check("torch", torch_supported(), f"{torch.__version__} ({supported})", todo,
           f"install a supported torch ({supported}), then rebuild cp_cache against it")
    return torch


def _torch_npu_check(torch, todo: list[str]) -> None:
    """torch_npu's version and the NPUs it sees; a broken torch_npu is reported, not raised."""
    npu_version, npu_error = None, None
    try:
        import torch_npu  # noqa: F401

        npu_version = getattr(torch_npu, "__version__", "unknown version")
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - a broken torch_npu must not crash the doctor
        npu_error = f"{type(e).__name__}: {e}"
    if npu_version:
        try:
            count = torch.npu.device_count() if torch.npu.is_available() else 0
        except Exception:  # noqa: BLE001
            count = 0
        _check("torch_npu", True, f"{npu_version}, {count} NPU(s) visible", todo)
    elif npu_error:
        _check("torch_npu", False, f"import failed: {npu_error}", todo,
               "fix the torch_npu install (CANN environment: source set_env.sh) or uninstall it to use the emulator")
    else:
        _check("torch_npu", None, "not installed (no NPU ops: torch's kernels serve, below)", todo)


def _extension_check(todo: list[str]) -> bool:
    """Whether the native extension cp_cache._C loads, and the torch it was built against."""
    try:
        from cp_cache import _C
        from cp_cache.native import built_with_torch

        built = built_with_torch() or "an unrecorded torch"
        _check("native extension", True, f"built against torch {built}, loaded from {_C.__file__}", todo)
        return True
    except Exception as e:  # noqa: BLE001
        _check("native extension", False, f"cp_cache._C does not load: {type(e).__name__}: {e}", todo,
               "run make build in a checkout, or pip install --no-build-isolation --force-reinstall --no-deps . "
               "in cp_cache's source")
        return False


def _policy_check(todo: list[str]) -> None:
    """The step-cache policy in use and where it comes from."""
    from cp_cache.config import POLICY_ENV, resolve_config

    try:
        policy = resolve_config().policy
        source = f"from {POLICY_ENV}" if os.environ.get(POLICY_ENV) else f"default; set {POLICY_ENV} to change"
        _check("policy", True, f"{policy} ({source})", todo)
    except ValueError as e:
        _check("policy", False, str(e), todo, f"set {POLICY_ENV}=handle or {POLICY_ENV}=stack")


def _kernel_check(todo: list[str]) -> None:
    """The step kernel ``cp_cache.enable()`` picks on this machine, and why."""
    import torch

    from cp_cache.kernels.npu import available

    if available():
        _check("step kernel", True, '"npu": torch.ops.npu.npu_fusion_attention_v3 exists (torch_npu); '
               "F.scaled_dot_product_attention reaches it through torch_npu's route", todo)
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = (f"{gpus} CUDA GPU(s) visible: flash / memory-efficient attention, dropout included; on CPU"
             if gpus else "no CUDA GPU visible; on CPU")
    _check("step kernel", True, '"torch": no NPU op here (torch.ops.npu.npu_fusion_attention_v3 does not exist), '
           f"so torch's own fused kernels serve ({where} aten._scaled_dot_product_flash_attention_for_cpu, no "
           "dropout); F.scaled_dot_product_attention and the transformers integration run cp_cache's own op", todo)


def _attention_ops_check(todo: list[str]) -> None:
    """The real NPU attention ops, or the emulator that can stand in for them (the NPU path on CPU)."""
    from cp_cache.emulator import emulator_installed, install_npu_emulator, uninstall_npu_emulator
    from cp_cache.kernels.npu import available

    if available() and not emulator_installed():
        _check("attention ops", True, "real torch.ops.npu.npu_fusion_attention_v3 (torch_npu)", todo)
    else:
        try:
            installed = install_npu_emulator(route_sdpa=False)
            if installed:
                uninstall_npu_emulator()
            _check("attention ops", None, "no NPU ops; the NPU path on CPU is available: "
                   'cp_cache.emulator.install_npu_emulator() before the CP region makes "npu" serve (dropout on CPU '
                   "included, slower)", todo)
        except Exception as e:  # noqa: BLE001
            _check("attention ops", False, f"no NPU ops, and the emulator does not install: {e}", todo,
                   "check the torch version (2.13 to 2.15 supported); import torch_npu on Ascend")


def _optional_packages_check(todo: list[str]) -> None:
    """numpy (torch's CP sharding rules) and matplotlib (the plots)."""
    try:
        import numpy

        _check("numpy", True, f"{numpy.__version__} (needed by torch's CP sharding rules)", todo)
    except ImportError:
        _check("numpy", False, "missing (torch's context_parallel imports it)", todo, "run make build")
    try:
        import matplotlib

        _check("matplotlib", True, f"{matplotlib.__version__} (bench plots)", todo)
    except ImportError:
        _check("matplotlib", None, "not installed (optional: bench writes JSON only, no plots)", todo)


def _merge_check(todo: list[str]) -> None:
    """Which merge the ring uses for its steps: the fused op or the float32 merge."""
    from cp_cache.config import FUSED_MERGE_ENV, resolve_config
    from cp_cache.emulator import emulator_installed
    from cp_cache.engine.merge import OP_NAME, fused_merge_available

    try:
        wanted = resolve_config().fused_merge
    except ValueError as e:
        _check("ring merge", False, str(e), todo, f"set {FUSED_MERGE_ENV}=0 or {FUSED_MERGE_ENV}=1")
        return
    if not fused_merge_available():  # the merge the default path uses here: no NPU op, no fused merge
        detail = (f"float32 merge in plain torch (torch.ops.npu.{OP_NAME} exists with torch_npu or the emulator)"
                  if wanted else f"float32 merge in plain torch ({FUSED_MERGE_ENV}=0)")
    elif wanted:
        detail = f"fused: torch.ops.npu.{OP_NAME} ({'emulated' if emulator_installed() else 'torch_npu'})"
    else:
        detail = f"float32 merge in plain torch ({FUSED_MERGE_ENV}=0)"
    _check("ring merge", None, detail, todo)


def _finish(todo: list[str]) -> int:
    if todo:
        print("\nto do:")
        for item in dict.fromkeys(todo):
            print(f"  - {item}")
        return 1
    print("\nall good: try `make demo` or `python -m cp_cache demo`")
    return 0
