"""Loading torch_npu's CP modules from the extracted files over the emulator, recording and undoing
every change their import makes to torch; what their CP does on the running torch."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.machinery
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .fetch import _REQUIRED_FILES, wheel_root

log = logging.getLogger("cp_cache")

# the four fused-attention ops the stub exposes as torch_npu.<name>
OP_NAMES = (
    "npu_fusion_attention",
    "npu_fusion_attention_v3",
    "npu_fusion_attention_grad",
    "npu_fusion_attention_grad_v3",
)

# stub packages (no __init__ code runs) and the modules imported, in import_torch_npu's order
_STUB_PACKAGES = (
    "torch_npu",
    "torch_npu.distributed",
    "torch_npu.distributed.tensor",
    "torch_npu.distributed.tensor.experimental",
)
_LAYER1_MODULE = "torch_npu.distributed.tensor._attention"
_CP_PACKAGE = "torch_npu.distributed.tensor.experimental._context_parallel"
_CP_PATCH_MODULE = _CP_PACKAGE + "._attention"
_CP_HANDLER_MODULE = _CP_PACKAGE + "._npu_attention"
_TORCH_CP_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"



# What torch_npu's CP does on torch 2.14+ (measured with the wheels' files over the emulator):
# torch-npu 2.13.0 and 2.14.0 register their CP sharding strategy through torch's
# `_single_dim_strategy_context` where torch has one (from 2.14), which calls a single-dim strategy
# as f(op, args_meta, kwargs_meta), while theirs takes one OpSchema: their first sequence-sharded
# call raises this TypeError. torch-npu 2.12.0 does not register one and runs.
CP_STRATEGY_TYPE_ERROR = "_npu_fa_v3_cp_strategy() takes 1 positional argument but 3 were given"


def cp_strategy_breaks_on_this_torch(version: str, cache_dir: Optional[os.PathLike] = None) -> bool:
    """Whether torch-npu ``version``'s CP handlers raise CP_STRATEGY_TYPE_ERROR under the running torch."""
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules

    source = (wheel_root(version, cache_dir) / _REQUIRED_FILES[-1]).read_text()
    return (hasattr(_sharding_rules, "_single_dim_strategy_context") and "_single_dim_strategy_context" in source
            and "def _npu_fa_v3_cp_strategy(op_schema)" in source)




@dataclasses.dataclass(frozen=True)
class TorchChange:
    """One change the import of torch_npu's modules made to torch's process state."""

    where: str  # "module attribute", "custom op handler", "sharding strategy", "implicit replication"
    target: str  # e.g. "torch.distributed...._attention._enable_cp_dtensor_dispatcher"
    old: Any
    new: Any


@dataclasses.dataclass
class LoadedTorchNpuCP:
    """What ``load_torch_npu_cp`` loaded (valid inside the ``with`` block)."""

    version: str
    root: Path
    modules: dict  # every torch_npu* module in sys.modules (stubs included), by name
    cp_module: types.ModuleType  # ..._context_parallel._npu_attention: the CP handlers
    patch_module: types.ModuleType  # ..._context_parallel._attention: patches torch on import
    layer1_module: Optional[types.ModuleType]  # torch_npu.distributed.tensor._attention
    forward_handler: Callable  # torch_npu's CP handler of npu_fusion_attention_v3.default
    backward_handler: Callable  # ... of npu_fusion_attention_grad_v3.default
    enable_dispatcher: Callable  # what replaced torch's _enable_cp_dtensor_dispatcher
    disable_dispatcher: Callable  # ... _disable_cp_dtensor_dispatcher
    custom_ops: dict  # torch_npu's {op: handler} written on CP entry
    layer1_handlers: dict  # torch_npu's non-CP DTensor handlers (layer-1 _attention.customized_ops)
    step_cache_stack: Optional[list]  # 2.12: the module-level _step_cache_stack; None when absent
    changes: list  # [TorchChange] made by the import
    new_torch_modules: list  # torch.* modules first imported by the load (left loaded)

    def handlers(self) -> dict:
        """torch_npu's CP handlers by op: {npu_fusion_attention_v3.default: fwd, ..._grad_v3.default: bwd}."""
        return dict(self.custom_ops)


def _ops_required() -> dict:
    import torch

    found, missing = {}, []
    for name in OP_NAMES:
        try:
            found[name] = getattr(torch.ops.npu, name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    if missing:
        raise RuntimeError(
            f"load_torch_npu_cp(): torch.ops.npu lacks {missing}; install the CPU emulator first "
            "(cp_cache.emulator.install_npu_emulator()) -- torch_npu's CP files call these ops"
        )
    return found


def _stub_package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name, f"cp_cache stub package for {name} (torch_npu Python files over the emulator)")
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    mod.__spec__ = spec
    mod.__path__ = [str(path)]
    mod.__package__ = name
    mod.__file__ = None
    return mod


def _torch_module_dicts() -> dict:
    return {
        name: dict(vars(mod))
        for name, mod in list(sys.modules.items())
        if mod is not None and (name == "torch" or name.startswith("torch.")) and hasattr(mod, "__dict__")
    }


class _TorchState:
    """A snapshot of the torch state torch_npu's import and CP entry/exit touch."""

    def __init__(self) -> None:
        from torch.distributed.tensor import DTensor

        disp = DTensor._op_dispatcher
        prop = disp.sharding_propagator
        self.dispatcher = disp
        self.propagator = prop
        self.modules = _torch_module_dicts()
        self.handlers_obj = disp._custom_op_handlers
        self.handlers = dict(disp._custom_op_handlers)
        self.implicit = disp._allow_implicit_replication
        self.registries = {name: dict(getattr(prop, name)) for name in self._registry_names(prop)}
        cp = importlib.import_module(_TORCH_CP_MODULE)
        self.existing_obj = cp.existing_custom_ops
        self.existing = dict(cp.existing_custom_ops)
        self.import_changes: list = []

    @staticmethod
    def _registry_names(prop) -> list:
        names = ("op_strategy_funcs", "op_to_schema_info", "op_single_dim_strategy_funcs",
                 "op_to_schema_info_for_single_dim_strategy", "op_to_rules")
        return [n for n in names if isinstance(getattr(prop, n, None), dict)]

    def diff(self) -> tuple[list, list]:
        """(changes since the snapshot, names of torch modules imported since)."""
        changes: list = []
        new_modules: list = []
        missing = object()
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "torch" or name.startswith("torch.")):
                continue
            before = self.modules.get(name)
            if before is None:
                new_modules.append(name)
                continue
            now = vars(mod)
            for attr in set(before) | set(now):
                old, new = before.get(attr, missing), now.get(attr, missing)
                if old is not new and not _is_submodule_binding(name, attr, old, new):
                    changes.append(TorchChange("module attribute", f"{name}.{attr}",
                                               None if old is missing else old, None if new is missing else new))
        disp = self.dispatcher
        if disp._custom_op_handlers is not self.handlers_obj:
            changes.append(TorchChange("custom op handler table", "DTensor._op_dispatcher._custom_op_handlers",
                                       self.handlers_obj, disp._custom_op_handlers))
        now_h = disp._custom_op_handlers
        for op in set(self.handlers) | set(now_h):
            if self.handlers.get(op) is not now_h.get(op):
                changes.append(TorchChange("custom op handler", str(op), self.handlers.get(op), now_h.get(op)))
        if disp._allow_implicit_replication != self.implicit:
            changes.append(TorchChange("implicit replication", "DTensor._op_dispatcher._allow_implicit_replication",
                                       self.implicit, disp._allow_implicit_replication))
        for reg, before in self.registries.items():
            now_r = getattr(self.propagator, reg)
            for op in set(before) | set(now_r):
                if before.get(op) is not now_r.get(op):
                    changes.append(TorchChange("sharding strategy", f"{reg}[{op}]", before.get(op), now_r.get(op)))
        return changes, new_modules

    def restore(self) -> list:
        """Put back everything torch_npu changed; returns what was restored (for the log)."""
        restored = []
        missing = object()
        # module attributes: those the import changed (whatever they hold now), and any other
        # attribute that now holds something of torch_npu's
        imported = {c.target for c in self.import_changes if c.where == "module attribute"}
        for name, before in self.modules.items():
            mod = sys.modules.get(name)
            if mod is None:
                continue
            now = vars(mod)
            for attr in set(before) | set(now):
                old, new = before.get(attr, missing), now.get(attr, missing)
                if old is new:
                    continue
                if f"{name}.{attr}" not in imported and not _from_torch_npu(new):
                    continue
                if old is missing:
                    delattr(mod, attr)
                else:
                    setattr(mod, attr, old)
                restored.append(f"{name}.{attr}")
        disp = self.dispatcher
        # handler tables: the live one (object and npu entries), the captured one in torch's CP module
        cp = sys.modules.get(_TORCH_CP_MODULE)
        if disp._custom_op_handlers is not self.handlers_obj:
            live = disp._custom_op_handlers
            if _table_has_torch_npu(live) or _only_npu_entries_differ(live, self.handlers_obj):
                disp._custom_op_handlers = self.handlers_obj
                restored.append("DTensor._op_dispatcher._custom_op_handlers (object)")
        tables = [(disp._custom_op_handlers, self.handlers), (self.existing_obj, self.existing)]
        if cp is not None and cp.existing_custom_ops is not self.existing_obj:
            cp.existing_custom_ops = self.existing_obj
            restored.append(f"{_TORCH_CP_MODULE}.existing_custom_ops")
        for table, before in tables:
            for op in list(table):
                if _from_torch_npu(table[op]):
                    if op in before and not _from_torch_npu(before[op]):
                        table[op] = before[op]
                    else:
                        del table[op]
                    restored.append(f"handler {op}")
            for op, handler in before.items():
                if op not in table and _is_npu_op(op):
                    table[op] = handler
                    restored.append(f"handler {op} (re-added)")
        if disp._allow_implicit_replication != self.implicit:
            disp._allow_implicit_replication = self.implicit
            restored.append("DTensor._op_dispatcher._allow_implicit_replication")
        # sharding registries: entries of npu ops, or entries whose value comes from torch_npu
        for reg, before in self.registries.items():
            now_r = getattr(self.propagator, reg)
            for op in set(before) | set(now_r):
                old, new = before.get(op, missing), now_r.get(op, missing)
                if old is new or not (_is_npu_op(op) or _from_torch_npu(new) or _from_torch_npu(old)):
                    continue
                if old is missing:
                    del now_r[op]
                else:
                    now_r[op] = old
                restored.append(f"{reg}[{op}]")
        _clear_sharding_caches()
        return restored


def _is_submodule_binding(parent: str, attr: str, old: Any, new: Any) -> bool:
    """A package gaining its newly imported submodule as an attribute (ordinary import side effect)."""
    return isinstance(new, types.ModuleType) and old is not new and new.__name__ == f"{parent}.{attr}"


def _from_torch_npu(value: Any) -> bool:
    """A function (or a partial over one) defined in a torch_npu module."""
    if isinstance(value, functools.partial):
        return _from_torch_npu(value.func) or any(_from_torch_npu(a) for a in value.args)
    mod = getattr(value, "__module__", None) if callable(value) else None
    return isinstance(mod, str) and (mod == "torch_npu" or mod.startswith("torch_npu."))


def _is_npu_op(op: Any) -> bool:
    return getattr(op, "namespace", None) == "npu"


def _table_has_torch_npu(table: dict) -> bool:
    return any(_from_torch_npu(h) for h in table.values())


def _only_npu_entries_differ(live: dict, before: dict) -> bool:
    keys = set(live) | set(before)
    return all(_is_npu_op(k) or live.get(k) is before.get(k) for k in keys)


def _clear_sharding_caches() -> None:
    try:
        from torch.distributed.tensor.debug import (
            _clear_fast_path_sharding_prop_cache,
            _clear_python_sharding_prop_cache,
        )
    except ImportError:  # pragma: no cover - older torch
        return
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()


_LOADED: list = []


@contextlib.contextmanager
def load_torch_npu_cp(version: str, *, cache_dir: Optional[os.PathLike] = None,
                      layer1: bool = True) -> Iterator[LoadedTorchNpuCP]:
    """Import torch_npu ``version``'s CP modules over the emulator; undo everything on exit.

    ``layer1``: also import ``torch_npu.distributed.tensor._attention`` first, as ``import
    torch_npu`` does (its DTensor handlers and sharding strategies for the four ops outside
    CP). torch_npu 2.13's CP module imports it anyway.

    Requires the emulator's ops (``install_npu_emulator()``) and no torch_npu in
    ``sys.modules``. Not re-entrant: one version at a time.
    """
    if _LOADED:
        raise RuntimeError(f"load_torch_npu_cp({version!r}): torch-npu {_LOADED[-1]} is loaded; exit it first")
    present = sorted(n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu."))
    if present:
        raise RuntimeError(
            f"load_torch_npu_cp({version!r}): torch_npu modules are already imported ({present[:3]}...); "
            "the loader is for machines without torch_npu"
        )
    root = wheel_root(version, cache_dir)
    ops = _ops_required()
    import torch  # noqa: F401  (ops above imported it)

    importlib.import_module(_TORCH_CP_MODULE)
    state = _TorchState()
    added: list = []
    _LOADED.append(version)
    try:
        for name in _STUB_PACKAGES:
            stub = _stub_package(name, root.joinpath(*name.split(".")))
            sys.modules[name] = stub
            added.append(name)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, stub)
        top = sys.modules["torch_npu"]
        top.__version__ = version
        for name, packet in ops.items():
            setattr(top, name, packet)
        if layer1:
            importlib.import_module(_LAYER1_MODULE)
        importlib.import_module(_CP_PACKAGE)
        added.extend(n for n in sys.modules if (n == "torch_npu" or n.startswith("torch_npu.")) and n not in added)
        changes, new_modules = state.diff()
        state.import_changes = changes
        cp_module = sys.modules[_CP_HANDLER_MODULE]
        custom_ops = dict(getattr(cp_module, "_npu_custom_ops"))
        fwd_op = torch.ops.npu.npu_fusion_attention_v3.default
        bwd_op = torch.ops.npu.npu_fusion_attention_grad_v3.default
        layer1_module = sys.modules.get(_LAYER1_MODULE)
        loaded = LoadedTorchNpuCP(
            version=version,
            root=root,
            modules={n: sys.modules[n] for n in added if n in sys.modules},
            cp_module=cp_module,
            patch_module=sys.modules[_CP_PATCH_MODULE],
            layer1_module=layer1_module,
            forward_handler=custom_ops[fwd_op],
            backward_handler=custom_ops[bwd_op],
            enable_dispatcher=cp_module.npu_enable_cp_dtensor_dispatcher,
            disable_dispatcher=cp_module.npu_disable_cp_dtensor_dispatcher,
            custom_ops=custom_ops,
            layer1_handlers=dict(getattr(layer1_module, "customized_ops", {}) or {}) if layer1_module else {},
            step_cache_stack=getattr(cp_module, "_step_cache_stack", None),
            changes=changes,
            new_torch_modules=new_modules,
        )
        log.info("torch-npu %s CP loaded from %s: %d changes to torch", version, root, len(changes))
        yield loaded
    finally:
        try:
            restored = state.restore()
            log.info("torch-npu %s CP unloaded: restored %s", version, restored)
        finally:
            for name in list(sys.modules):
                if name == "torch_npu" or name.startswith("torch_npu."):
                    del sys.modules[name]
            _LOADED.clear()
