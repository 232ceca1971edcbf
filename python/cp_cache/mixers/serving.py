"""How a served mixer kind reaches a model: the functions the mixer's forward calls for its token mixing (globals of
its modeling module, e.g. ``causal_conv1d_fn``) replaced by cp_cache's, which run the CP form inside a cp_cache
region and the model's own function elsewhere (packed documents kept apart). The model's code runs as written."""

from __future__ import annotations

import inspect
from typing import Callable

import torch

__all__ = ["FunctionServer"]


class FunctionServer:
    """Serves a module whose forward calls every function named in ``replacements`` (name -> a maker taking the
    model's function and returning cp_cache's), and those of ``optional`` it calls; idempotent."""

    def __init__(self, replacements: dict[str, Callable[[Callable], Callable]],
                 optional: dict[str, Callable[[Callable], Callable]] | None = None):
        self.replacements, self.optional = replacements, optional or {}
        self._served: dict[type, bool] = {}  # by the module's class: its forward's globals are the class's

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.replacements)

    def __call__(self, module: torch.nn.Module) -> bool:
        """Called before each of the module's forwards inside a region: its class is readied once."""
        served = self._served.get(type(module))
        if served is None:
            served = self._served[type(module)] = self._serve(type(module))
        return served

    def _serve(self, cls: type) -> bool:
        namespace = inspect.unwrap(cls.forward).__globals__
        if any(name not in namespace for name in self.replacements):
            return False
        for name, make in {**self.replacements, **self.optional}.items():
            if name in namespace and not hasattr(namespace[name], "cp_cache_serves"):
                served = make(namespace[name])
                served.cp_cache_serves = namespace[name]
                namespace[name] = served
        return True
