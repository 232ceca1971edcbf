"""Binding a DTensor custom-op handler's ``(args, kwargs)`` to the op's argument names."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["bind_arguments", "describe"]


class _Parameter(NamedTuple):
    name: str
    positional: bool
    has_default: bool
    default: Any


# id(schema) -> (schema, its parameters): read once per schema object (an op overload keeps its
# own), the schema held so that its id stays its own
_PARAMETERS: dict[int, tuple[Any, tuple[_Parameter, ...]]] = {}


def _parameters(schema) -> tuple[_Parameter, ...]:
    found = _PARAMETERS.get(id(schema))
    if found is None or found[0] is not schema:
        params = tuple(_Parameter(a.name, not a.kwarg_only, a.has_default_value(),
                                  a.default_value if a.has_default_value() else None) for a in schema.arguments)
        found = _PARAMETERS[id(schema)] = (schema, params)
    return found[1]


def bind_arguments(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, positional or keyword, defaults filled in.

    Dispatch passes positional arguments in ``args`` (trailing defaults may be absent)
    and keyword-only ones in ``kwargs``; reading them by name needs no index table.
    ``schema``: ``op._schema`` of an op overload, or a parsed schema string.
    """
    params = _parameters(schema)
    if kwargs:
        unknown = sorted(set(kwargs) - {p.name for p in params})
        if unknown:
            raise TypeError(f"{schema.name}: unexpected keyword argument(s) {unknown}")
    positional = sum(p.positional for p in params)
    if len(args) > positional:
        raise TypeError(f"{schema.name}: takes {positional} positional arguments, got {len(args)}")
    bound: dict[str, Any] = {}
    for index, p in enumerate(params):
        if p.positional and index < len(args):
            if p.name in kwargs:
                raise TypeError(f"{schema.name}: argument {p.name!r} given twice")
            bound[p.name] = args[index]
        elif p.name in kwargs:
            bound[p.name] = kwargs[p.name]
        elif p.has_default:
            bound[p.name] = p.default
        else:
            raise TypeError(f"{schema.name}: missing required argument {p.name!r}")
    return bound


def describe(value: Any) -> str:
    """A short description of an argument for error messages (tensors by shape and dtype)."""
    if isinstance(value, Tensor):
        return f"<tensor of shape {tuple(value.shape)} and dtype {value.dtype}>"
    return repr(value)
