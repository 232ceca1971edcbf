"""Testing helpers for cp_cache: a CPU emulation of torch_npu's fused attention ops."""

from .npu_emulator import (
    dropout_keep_mask,
    emulator_installed,
    install_npu_emulator,
    uninstall_npu_emulator,
)

__all__ = [
    "install_npu_emulator",
    "uninstall_npu_emulator",
    "dropout_keep_mask",
    "emulator_installed",
]
