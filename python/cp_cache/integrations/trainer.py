"""cp_cache's context parallelism in Hugging Face's ``Trainer`` (docs/transformers.md): each step runs inside
``cp_cache.context_parallel(mesh, buffers=[...])``, per-token entries sharded, a packed batch laid out by its
documents. The mesh: accelerate's "cp" dimension (its torch-ring preparation replaced: it refuses sliding windows
and drops masks), or with ``cp_size=N`` a ``("dp_replicate", "cp")`` mesh given to accelerate (DDP, CPU)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from transformers import Trainer

from .. import context_parallel
from . import transformers as attention

__all__ = ["ContextParallelMixin", "ContextParallelTrainer"]

IGNORE_INDEX = -100
# a packed batch's entries about its documents: global, never sharded
DOCUMENT_ENTRIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_MESH_DIMS = ("dp_replicate", "cp")  # the mesh cp_size= builds: accelerate's names for its data-loader rule


class ContextParallelMixin:
    def __init__(self, *args: Any, cp_size: Optional[int] = None, **kwargs: Any) -> None:
        if cp_size is not None and (not isinstance(cp_size, int) or cp_size < 1):
            raise ValueError(f"cp_size={cp_size!r} must be a positive integer")
        attention.register()
        self.cp_size_requested = cp_size
        self.cp_mesh = None
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.cp_mesh = self._cp_mesh()

    def get_cp_size(self) -> int:
        return self.cp_mesh.size() if self.cp_mesh is not None else super().get_cp_size()

    def _cp_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh
        accelerator, cp_size = self.accelerator, self.cp_size_requested
        config = getattr(accelerator, "parallelism_config", None)
        if config is not None and config.cp_enabled:
            if cp_size not in (None, config.cp_size):
                raise ValueError(f"cp_size={cp_size} disagrees with the parallelism_config's "
                                 f"cp_size={config.cp_size}; give one of them")
            accelerator._prepare_cp = functools.partial(_prepare_cp, accelerator)
            return accelerator.torch_device_mesh["cp"]
        if cp_size is None:
            raise ValueError("ContextParallelTrainer needs the CP size: cp_size=N, or "
                             "TrainingArguments(parallelism_config=ParallelismConfig(cp_size=N))")
        world = accelerator.num_processes
        if world % cp_size:
            raise ValueError(f"cp_size={cp_size} must divide the number of processes ({world})")
        existing = accelerator.torch_device_mesh
        if existing is not None and existing.mesh_dim_names == _MESH_DIMS and existing["cp"].size() == cp_size:
            return existing["cp"]  # ours, from an earlier trainer on the same accelerator state
        if existing is not None:
            raise NotImplementedError(
                f"cp_size={cp_size} with accelerate's device mesh {existing} (FSDP2, TP): give the CP size to "
                "accelerate instead, TrainingArguments(parallelism_config=ParallelismConfig(cp_size=N))")
        mesh = init_device_mesh(accelerator.device.type, (world // cp_size, cp_size), mesh_dim_names=_MESH_DIMS)
        accelerator.state.device_mesh = mesh  # accelerate's data loaders: one batch stream per CP group
        return mesh["cp"]

    def _prepare_context_parallel_inputs(self, model: torch.nn.Module, inputs: dict) -> tuple[Callable, dict]:
        """(the step's CP context, the inputs it shards): Trainer enters it around the step."""
        if self.cp_mesh is None:
            return super()._prepare_context_parallel_inputs(model, inputs)
        config = getattr(getattr(model, "module", model), "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if config is not None and implementation != attention.NAME:
            raise ValueError(f"ContextParallelTrainer: the model's attention implementation is {implementation!r}; "
                             f"make it with attn_implementation={attention.NAME!r} (or call "
                             f"model.set_attn_implementation({attention.NAME!r})) so that its attention runs under CP")
        mask = inputs.get("attention_mask")
        if mask is not None:  # one that masks nothing is dropped (a host read per step); padding is refused
            if mask.dim() != 2 or not bool(mask.all()):
                raise NotImplementedError("ContextParallelTrainer: a batch with padding (attention_mask with zeros) "
                                          "is not supported under CP; pack the batch instead: "
                                          "DataCollatorWithFlattening(return_flash_attn_kwargs=True)")
            del inputs["attention_mask"]
        if "labels" in inputs and "shift_labels" not in inputs:  # shifted on the whole sequence
            labels = torch.nn.functional.pad(inputs["labels"], (0, 1), value=IGNORE_INDEX)
            inputs["shift_labels"] = labels[:, 1:].contiguous()
        ids = inputs["input_ids"]
        if inputs.get("position_ids") is None:
            inputs["position_ids"] = torch.arange(ids.size(1), device=ids.device).repeat(ids.size(0), 1)
        documents = _documents(inputs)
        buffers = [value for name, value in inputs.items() if _per_token(name, value, ids)]
        return functools.partial(context_parallel, self.cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                 no_restore_buffers=set(buffers), documents=documents, model=model), inputs


class ContextParallelTrainer(ContextParallelMixin, Trainer):
    """``transformers.Trainer`` whose steps run under cp_cache's context parallelism."""


def _prepare_cp(accelerator, *args):
    """In place of accelerate's ``Accelerator._prepare_cp`` (torch's ring): cp_cache's region, masks kept."""
    accelerator._cp_context = functools.partial(context_parallel, mesh=accelerator.torch_device_mesh["cp"])
    return args


def _per_token(name: str, value: Any, ids: torch.Tensor) -> bool:
    """Whether a batch entry is per token ([B, T, ...], like ``input_ids``): sharded with the tokens."""
    return (isinstance(value, torch.Tensor) and name not in DOCUMENT_ENTRIES and value.dim() >= 2
            and value.shape[:2] == ids.shape[:2])


def _documents(inputs: dict) -> Optional[torch.Tensor]:
    """A packed batch's ``cu_seq_lens_q`` (else made from restarting position ids, a host read); None: dense."""
    given = inputs.get("cu_seq_lens_q")
    if given is not None:
        return given
    positions = inputs["position_ids"]
    if positions.size(0) != 1:
        return None
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    if starts == [0]:
        return None  # one sequence
    if starts[:1] != [0]:
        raise ValueError(f"ContextParallelTrainer: position_ids {positions[0, :8].tolist()}... do not start at 0; "
                         "a packed batch's position ids restart at 0 with every document")
    documents = torch.tensor(starts + [positions.size(1)], dtype=torch.int32)
    inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = documents
    return documents
