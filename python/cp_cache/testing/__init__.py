"""Testing helpers for cp_cache (loaded only when imported, never by ``import cp_cache``):

* ``install_npu_emulator`` and friends: re-exported from ``cp_cache.emulator`` (the CPU
  emulation of torch_npu's fused attention ops, a product module since it moved there);
* ``reference``: dense float64 attention and the head-tail sharding of the sequence;
* ``models``: a tiny decoder calling SDPA, with checkpointing modes;
* ``multiprocess``: ``run_ranks``, several gloo ranks over loopback.
"""

from ..emulator import (
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
