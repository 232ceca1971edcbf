"""torch_npu 2.14.0 / 2.13.0 / 2.12.0: their own CP handlers, loaded from the wheels' Python files over
the emulator (``cp_cache.testing.torch_npu_wheel``), called inside torch's CP dispatcher."""

from __future__ import annotations

import contextlib

from ..._measure import tensors_in
from ..catalogue import TORCH_NPU_RELEASES
from ..patches import lift_dropout_guard
from .base import DTensorSystem


class TorchNpuSystem(DTensorSystem):
    def __init__(self, mesh, name: str, lifted: bool = False):
        super().__init__(mesh)
        self.name, self.version, self.lifted = name, TORCH_NPU_RELEASES[name], lifted
        self.loaded = None

    @contextlib.contextmanager
    def session(self):
        import cp_cache
        from torch.distributed.tensor.experimental._context_parallel import _attention as att

        from ....testing.torch_npu_wheel import load_torch_npu_cp

        if cp_cache.enabled():
            cp_cache.disable()  # torch_npu's handlers must run, not cp_cache's
        with load_torch_npu_cp(self.version) as npu:
            self.loaded = npu
            lift = lift_dropout_guard(npu.cp_module) if self.lifted else contextlib.nullcontext()
            with lift:
                att._dispatch_mode = att._DispatchMode.MONKEY_PATCH
                att._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=self.mesh)
                try:
                    yield self
                finally:
                    att._disable_context_parallel_dispatcher_impl()
                    self.loaded = None

    def held_tensors(self) -> list:
        stack = self.loaded.step_cache_stack if self.loaded is not None else None
        return tensors_in(list(stack), []) if stack is not None else []

    def stack_entries(self) -> int | None:
        stack = self.loaded.step_cache_stack if self.loaded is not None else None
        return None if stack is None else len(stack)

    def clear_stack(self) -> None:
        if self.loaded is not None and self.loaded.step_cache_stack is not None:
            self.loaded.step_cache_stack.clear()
