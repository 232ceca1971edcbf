"""Binding a DTensor custom-op handler's ``(args, kwargs)`` to the op's argument names."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["bind_arguments", "describe"]


def bind_arguments(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, positional or keyword, defaults filled in.

    Dispatch passes positional arguments in ``args`` (trailing defaults may be absent)
    and keyword-only ones in ``kwargs``; reading them by name needs no index table.
    ``schema``: ``op._schema`` of an op overload, or a parsed schema string.
    """
    names = {a.name for a in schema.arguments}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"{schema.name}: unexpected keyword argument(s) {unknown}")
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{schema.name}: takes {len(positional)} positional arguments, got {len(args)}")
    bound: dict[str, Any] = {}
    for index, argument in enumerate(schema.arguments):
        if not argument.kwarg_only and index < len(args):
            if argument.name in kwargs:
                raise TypeError(f"{schema.name}: argument {argument.name!r} given twice")
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            raise TypeError(f"{schema.name}: missing required argument {argument.name!r}")
    return bound


def describe(value: Any) -> str:
    """A short description of an argument for error messages (tensors by shape and dtype)."""
    if isinstance(value, Tensor):
        return f"<tensor of shape {tuple(value.shape)} and dtype {value.dtype}>"
    return repr(value)
