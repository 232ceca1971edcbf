"""Which product modules one attention call walks through, traced at run time.

``trace_modules(fn)`` runs ``fn`` under ``sys.setprofile`` and records, in order, the module of
every Python function entered whose module is cp_cache's product (the emulator, the tools and
these helpers excluded; so is whatever the emulator calls while it stands in for the NPU op:
on Ascend that is the op's own work, not the product's path; and so is code generated at run
time, a dataclass's ``__init__``, ``__eq__`` or ``__hash__``, which no module's source holds). A call that reads top-down enters few modules and rarely comes back to
one it has left: ``CallPath.modules`` counts the distinct modules, ``CallPath.returns`` how many
times the path re-entered a module it had already left.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

__all__ = ["CallPath", "trace_modules"]

_EMULATOR = "cp_cache.emulator"
_HANDLERS = "cp_cache.handlers.attention"
_EXCLUDED = (_EMULATOR, "cp_cache.testing", "cp_cache.cli")


@dataclass(frozen=True)
class CallPath:
    order: tuple[str, ...]  # the modules entered, consecutive repeats collapsed

    @property
    def modules(self) -> int:
        return len(set(self.order))

    @property
    def returns(self) -> int:
        return len(self.order) - self.modules

    def names(self) -> list[str]:
        return sorted(set(self.order))


def trace_modules(fn: Callable[[], object]) -> CallPath:
    """The product modules ``fn()`` enters on this thread (run autograd's backward with
    ``torch.autograd.set_multithreading_enabled(False)`` to keep it on this thread)."""
    order: list[str] = []
    # (frame, emulating) where the tracing changed mode: inside an emulator frame nothing is
    # recorded, until the emulated op's dispatch enters the handlers again (its autograd glue
    # calls the grad op, which DTensor hands to cp_cache's backward handler)
    modes: list = []

    def profile(frame, event, arg):
        if event == "return":
            if modes and modes[-1][0] is frame:
                modes.pop()
            return
        if event != "call":
            return
        if frame.f_code.co_filename.startswith("<"):
            return  # code generated at run time (a dataclass's __init__, __eq__, __hash__): no module's own
        module = frame.f_globals.get("__name__", "")
        emulating = bool(modes) and modes[-1][1]
        if module.startswith(_EMULATOR):
            if not emulating:
                modes.append((frame, True))
            return
        if emulating and module == _HANDLERS:
            modes.append((frame, False))
            emulating = False
        if not emulating and module.startswith("cp_cache") and not module.startswith(_EXCLUDED) and (
                not order or order[-1] != module):
            order.append(module)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return CallPath(tuple(order))
