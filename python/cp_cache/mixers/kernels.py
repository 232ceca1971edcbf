"""The recurrent mixers' kernels by kind, registered as the attention step kernels are: cp_cache's own, in plain torch
("torch": every device), and whatever ``register`` adds behind the same contract (a GPU library's kernel, say):

- "gated_delta": ``delta_rule.chunk_gated_delta_rule(query, key, value, g, beta, *, scale, initial_state, segments,
  use_qk_l2norm) -> (out, final_state)``;
- "ssd": ``ssd.ssd_scan(x, dt, A, B, C, *, D, initial_state, segments) -> (y, final_state)``;
- "selective": ``selective_scan.selective_scan(u, delta, A, B, C, *, D, z, delta_bias, delta_softplus,
  initial_state, segments) -> (y, final_state)``.

A kind's kernel is the one ``CP_CACHE_MIXER_KERNELS`` names for it ("gated_delta=fla,ssd=torch"), else "torch";
every rank of a CP group must use the same."""

from __future__ import annotations

import os
import threading
from typing import Callable

from .delta_rule import chunk_gated_delta_rule
from .selective_scan import selective_scan
from .ssd import ssd_scan

__all__ = ["register", "kernel", "names"]

_lock = threading.Lock()
_KERNELS: dict[str, dict[str, Callable]] = {"gated_delta": {"torch": chunk_gated_delta_rule},
                                            "ssd": {"torch": ssd_scan}, "selective": {"torch": selective_scan}}


def register(kind: str, name: str, function: Callable, *, replace: bool = False) -> Callable:
    """Make ``function`` the ``kind`` kernel called ``name``; ValueError for an unknown kind, or a name taken
    (unless ``replace``)."""
    if kind not in _KERNELS:
        raise ValueError(f"register: kind={kind!r} is not one of {sorted(_KERNELS)}")
    if not callable(function) or not isinstance(name, str) or not name:
        raise TypeError(f"register: a {kind} kernel needs a non-empty name and a callable, got {name!r}, {function!r}")
    with _lock:
        if name in _KERNELS[kind] and _KERNELS[kind][name] is not function and not replace:
            raise ValueError(f"register: a {kind} kernel named {name!r} exists; pass replace=True to replace it")
        _KERNELS[kind][name] = function
    return function


def names(kind: str) -> tuple[str, ...]:
    return tuple(_KERNELS[kind])


def kernel(kind: str) -> Callable:
    """The kernel ``CP_CACHE_MIXER_KERNELS`` names for ``kind``, else "torch"."""
    chosen = dict(part.split("=", 1) for part in os.environ.get("CP_CACHE_MIXER_KERNELS", "").split(",") if "=" in part)
    name = chosen.get(kind, "torch")
    found = _KERNELS[kind].get(name)
    if found is None:
        raise ValueError(f"CP_CACHE_MIXER_KERNELS names the {kind} kernel {name!r}; registered: "
                         f"{', '.join(sorted(_KERNELS[kind]))}")
    return found
