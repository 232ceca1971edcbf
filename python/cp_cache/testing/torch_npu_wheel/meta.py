"""The wheel's fake (meta) functions of the fused-attention ops, as plain callables."""

from __future__ import annotations

import ast
import os
from typing import Optional, Sequence

from .fetch import wheel_root
from .loader import OP_NAMES


_META_FILES = ("torch_npu/op_plugin/meta/_fake_registrations.py", "torch_npu/op_plugin/meta/_meta_registrations.py")


def _registered_op(deco: ast.expr) -> Optional[str]:
    """The op name a registration decorator names: register_fake("npu::X") or impl(m, "X")."""
    if not isinstance(deco, ast.Call):
        return None
    for arg in deco.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.split("::", 1)[-1]
    return None


class _ErrCodes:
    """Stand-in for torch_npu's ``ErrCode`` enum in the meta functions' messages: any member is ''."""

    def __getattr__(self, name: str) -> str:
        return ""


_ERR_CODES = _ErrCodes()


def wheel_meta_functions(version: str, ops: Sequence[str] = OP_NAMES,
                         cache_dir: Optional[os.PathLike] = None) -> dict:
    """The wheel's fake (meta) functions of ``ops`` as plain callables: {op: (function, "file:line")}.

    Each function is compiled alone from the wheel's source, without its registration
    decorator (importing those files would register them with torch.library, which clashes
    with the emulator's own fake kernels, and needs the native part). Their globals are
    ``torch``, ``math`` and no-op stand-ins for the warning and error-code helpers they call
    (``_warn*``, ``ops_error``, ``ErrCode``), so a failed check raises torch's RuntimeError.
    """
    import math

    import torch

    root = wheel_root(version, cache_dir)
    found: dict = {}
    for rel in _META_FILES:
        path = root / rel
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            names = {_registered_op(d) for d in node.decorator_list} - {None}
            for op in names & set(ops):
                if op in found:
                    continue
                fn_node = ast.FunctionDef(**{f: getattr(node, f) for f in node._fields})
                fn_node.decorator_list = []
                module = ast.Module(body=[fn_node], type_ignores=[])
                ast.copy_location(fn_node, node)
                ast.fix_missing_locations(module)
                namespace: dict = {"torch": torch, "math": math, "__name__": f"torch_npu_wheel_meta_{version}"}
                for ref in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
                    if ref.startswith("_warn"):
                        namespace[ref] = lambda *a, **k: None
                    elif ref == "ops_error":  # error-code suffix of a failed torch._check's message
                        namespace[ref] = lambda *a, **k: ""
                    elif ref == "ErrCode":
                        namespace[ref] = _ERR_CODES
                exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - the wheel's own function
                found[op] = (namespace[node.name], f"{rel}:{node.lineno}")
    return found
