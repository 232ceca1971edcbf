"""The CP region's guard (DESIGN §20): every module that mixes tokens along the sequence is served or refused,
on every rank alike, before it computes.

While cp_cache is enabled, a forward pre-hook on every module (inactive outside CP regions and while compiling)
scans a model the first time it starts inside a region and refuses any mixer no kind serves; later calls read the
module's verdict. An attention module is checked for its ``attn_implementation`` before it runs and, when it
returns, for having reached cp_cache's attention at all. ``flex_attention`` on the region's shards is refused."""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import region
from .sequence import document_ends
from .kinds import ATTENTION, SERVED_ATTENTION, SERVERS, Kind, kind_of, served_summary

__all__ = ["Found", "scan", "check_model", "install", "uninstall", "set_active", "refusal"]

# module -> its Found, or _NEUTRAL (mixes no tokens, or is part of a mixer found above it)
_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
_NEUTRAL = object()
_LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")
# upfront checks skip these towers: their layers see image or audio features, not the sharded sequence
_TOWERS = re.compile(r"(^|\.)\w*(vision|visual|audio|speech|image)\w*(\.|$)")


@dataclass(frozen=True)
class Found:
    kind: Kind
    model: str  # the model's class
    cls: str  # the module's class
    path: str  # its name in the model
    layer: Optional[int]
    layer_kind: Optional[str]  # what the model's config calls that layer

    def where(self) -> str:
        layer = "" if self.layer is None else f" layer {self.layer}"
        said = "" if self.layer_kind is None else f" ({self.layer_kind})"
        return f"{self.model}{layer}{said}: {self.cls} at {self.path or 'the model itself'}"


def refusal(found: Found, implementation: Optional[str] = None, reached: bool = True) -> NotImplementedError:
    """The error for a mixer no kind serves, or an attention module that does not reach cp_cache."""
    if found.kind.name in SERVERS:
        return NotImplementedError(
            f"cp_cache: {found.where()} is {found.kind.what}, which cp_cache serves under context parallelism where "
            f"the layer's forward calls {', '.join(SERVERS[found.kind.name].names)} for its token mixing; this "
            "one's does not, so it is refused (it would compute on this rank's shard alone).")
    if found.kind is not ATTENTION:
        return NotImplementedError(
            f"cp_cache: {found.where()} is {found.kind.what}, which mixes tokens along the sequence; inside a CP "
            "region it would compute on this rank's shard alone (a silently wrong model), so it is refused. Served "
            f"under context parallelism: {served_summary()}. Train this model without a CP region.")
    if reached:
        return NotImplementedError(
            f"cp_cache: {found.where()} runs attn_implementation={implementation!r}, which cp_cache does not serve: "
            "inside a CP region it would attend within this rank's shard alone. Make the model with "
            "attn_implementation='cp_cache' (or 'sdpa'), or call model.set_attn_implementation('cp_cache').")
    return NotImplementedError(
        f"cp_cache: {found.where()} (attn_implementation={implementation!r}) returned without reaching cp_cache's "
        "attention: it computes attention of its own, within this rank's shard alone inside a CP region, which "
        "cp_cache cannot serve. Train this model without a CP region.")


def scan(root: torch.nn.Module) -> list[Found]:
    """Every mixer in ``root`` (a mixer's own submodules are its business), each module's verdict recorded."""
    owner = next((m for m in root.modules() if hasattr(m, "config")), root)
    config = getattr(owner, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found, inside = [], None
    for path, module in root.named_modules():
        kind = None if inside is not None and path.startswith(inside) else kind_of(module)
        if kind is None:
            _VERDICTS[module] = _NEUTRAL
            continue
        layer = _layer_index(module, path)
        found.append(Found(kind, type(owner).__name__, type(module).__name__, path, layer,
                           _layer_kind(config, layer)))
        _VERDICTS[module] = found[-1]
        if kind is not ATTENTION:
            inside = f"{path}."
    return found


def check_model(model: torch.nn.Module) -> None:
    """Serves every mixer a kind serves; refuses a mixer no kind serves, or attention cp_cache does not serve
    (towers aside)."""
    _note_documents_of(model)
    for found in scan(model):
        if _TOWERS.search(found.path):
            continue
        module = _module_at(model, found.path)
        if found.kind is ATTENTION:
            _check_attention(module, found)
        elif not _served(module, found):
            raise refusal(found)


_NOTING: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _note_documents_of(model: torch.nn.Module) -> None:
    """Each transformers model in ``model`` notes the packed documents it is called with (``cu_seq_lens_q``)."""
    for module in model.modules():
        if hasattr(module, "base_model_prefix") and module not in _NOTING:
            module.register_forward_pre_hook(_note_documents, with_kwargs=True)
            _NOTING.add(module)


def _note_documents(module: torch.nn.Module, args: Any, kwargs: dict) -> None:
    if region.in_cp() and not torch.compiler.is_compiling() and kwargs.get("cu_seq_lens_q") is not None:
        region.note_call_documents(document_ends(kwargs["cu_seq_lens_q"]))


def _served(module: torch.nn.Module, found: Found) -> bool:
    """The kind's server readies the module (it returns False where the module's forward is not one it knows)."""
    server = SERVERS.get(found.kind.name)
    return server is not None and server(module)


def _module_at(model: torch.nn.Module, path: str) -> torch.nn.Module:
    return model.get_submodule(path) if path else model


def _layer_index(module: torch.nn.Module, path: str) -> Optional[int]:
    index = getattr(module, "layer_idx", None)
    if isinstance(index, int):
        return index
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else None


def _layer_kind(config: Any, layer: Optional[int]) -> Optional[str]:
    if layer is None or config is None:
        return None
    for field in _LAYER_KIND_FIELDS:
        kinds = getattr(config, field, None)
        if isinstance(kinds, (list, tuple, str)) and layer < len(kinds):
            return f"{field}[{layer}] = {kinds[layer]!r}"
    return None


def _check_attention(module: torch.nn.Module, found: Found) -> None:
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation not in SERVED_ATTENTION:
        raise refusal(found, implementation)


class _Calls(threading.local):
    def __init__(self):
        self.open: list[tuple[torch.nn.Module, int]] = []  # attention modules started: (module, CP calls then)


_calls = _Calls()


# the mixers and attention modules that last ran inside a CP region (a checkpoint may recompute them)
_RAN_IN_REGION: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _before(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    if not region.in_cp():
        if _RAN_IN_REGION and module in _RAN_IN_REGION:
            _outside_region(module)
        return
    verdict = _VERDICTS.get(module)
    if verdict is None:  # a model starting: every mixer in it is checked now
        check_model(module)
        verdict = _VERDICTS[module]
    if verdict is _NEUTRAL:
        return
    _RAN_IN_REGION.add(module)
    if verdict.kind is ATTENTION:
        _check_attention(module, verdict)
        _calls.open.append((module, region.attention_calls()))
    elif not _served(module, verdict):
        raise refusal(verdict)


def _outside_region(module: torch.nn.Module) -> None:
    """A module that ran inside a CP region runs again outside: fine as a new forward, but a backward's recompute
    (activation checkpointing) would redo a sharded layer as if it held the whole sequence."""
    if torch._C._current_graph_task_id() >= 0:
        raise RuntimeError(f"cp_cache: {_VERDICTS[module].where()} is recomputed by a backward outside the CP region "
                           "it ran in (activation checkpointing): it would compute on this rank's shard as if it held "
                           "the whole sequence. Run the backward inside the region (cp_cache.context_parallel).")
    _RAN_IN_REGION.discard(module)


def _after(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling() or not _calls.open or _calls.open[-1][0] is not module:
        return
    _, before = _calls.open.pop()
    if region.attention_calls() == before:
        raise refusal(_VERDICTS[module], getattr(module.config, "_attn_implementation", None), reached=False)


_hooks: list = []


def install(active: bool) -> None:
    """Idempotent; ``active``: inside a CP region now. The hooks stay for the process's life and act only inside
    CP regions: removed and added again at every region (cp_cache enabled for one region), their new keys would
    make Dynamo recompile each step."""
    if not _hooks:
        _hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(_before))
        _hooks.append(torch.nn.modules.module.register_module_forward_hook(_after))
    set_active(active)


def uninstall() -> None:
    """The hooks go idle (see ``install``)."""
    set_active(False)


def set_active(active: bool) -> None:
    """On at a CP region's entry, off at its exit."""
    if active == region.in_cp():
        return
    region.set_in_cp(active)
    _calls.open.clear()
    _patch_flex(active)


_FLEX = {}  # the flex_attention module's input check while a region patches it


def _patch_flex(active: bool) -> None:
    """``flex_attention`` checks its inputs with ``_validate_device(query, key, value)``: the region's check goes
    there, so that every caller is seen, however it imported flex_attention."""
    from torch.nn.attention import flex_attention as flex
    if active and not _FLEX:
        _FLEX["original"] = original = flex._validate_device

        def _validate_device(query, key, value, *args, **kwargs):
            _check_flex(query, key)
            return original(query, key, value, *args, **kwargs)

        flex._validate_device = _validate_device
    elif not active and _FLEX:
        flex._validate_device = _FLEX.pop("original")


def _check_flex(query: torch.Tensor, key: torch.Tensor) -> None:
    here = region.active()
    if here is None or torch.compiler.is_compiling():
        return
    length = key.size(-2)
    sharded = [b for b in here.buffers if b.local == length and b.local != b.total]
    if sharded:
        raise NotImplementedError(
            f"cp_cache: flex_attention on the CP region's sequence shards (key {tuple(key.shape)}: {length} tokens, "
            f"this rank's share of buffers[{sharded[0].index}]'s {sharded[0].total}) attends within this rank's "
            "shard alone. Call F.scaled_dot_product_attention instead (cp_cache serves it under CP), or wrap the "
            "module that calls flex_attention in torch's _ContextParallel(seq_dim=2, attention_type=FLEX) style "
            "(parallelize_module), which all-gathers K/V, with a block mask for the local queries and all keys.")
