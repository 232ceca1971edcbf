"""Mask kinds, one module each: ``none`` (full attention), ``causal``, ``band`` and ``given``. A kind's
module owns its step tasks (dense and packed documents), the K/V rows each rank needs of another's
block, and its kernel arguments (the NPU op's, and a boolean block for the other kernels); the
functions here pick the kind's. A new kind is one module here plus its reading from the op's
arguments (``handlers/spec``); the agreement compares any ``MaskSpec`` by its fields."""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..documents import document_pieces
from . import band, causal, given, none
from .base import NONE, BlockTask, MaskSpec, Segment, StepMask, VarlenCall, VarlenStep

__all__ = ["MaskSpec", "StepMask", "BlockTask", "NONE", "Segment", "VarlenCall", "VarlenStep", "KINDS",
           "plan_step", "hops_needed", "document_step", "step_pairs", "needed_keys", "npu_arguments", "masked_positions"]

KINDS = {"none": none, "causal": causal, "band": band, "given": given}


def plan_step(rank: int, index: int, world_size: int, load_balance: bool, spec: MaskSpec, q_len: int, kv_len: int,
              mask_rows: Optional[Tensor] = None) -> tuple[str, Sequence[BlockTask]]:
    """(part, tasks) of ring step ``index`` on ``rank``; ``mask_rows``: a given mask's rows of this rank's
    queries (local order, every column). Positional masks are planned once per step and shapes."""
    if spec.given:
        return given.plan_step(rank, index, world_size, load_balance, spec, q_len, kv_len, mask_rows)
    return _positional_step(rank, index, world_size, load_balance, spec, q_len, kv_len)


@functools.lru_cache(maxsize=1024)
def _positional_step(rank, index, world_size, load_balance, spec, q_len, kv_len):
    part, tasks = KINDS[spec.kind].plan_step(rank, index, world_size, load_balance, spec, q_len, kv_len)
    return part, tuple(tasks)


def hops_needed(world_size: int, load_balance: bool, spec: MaskSpec, length: int) -> int:
    """The last ring step in which any rank computes something: a band on contiguous shards may end
    early; the other kinds need every hop."""
    if spec.kind != "band" or world_size == 1:
        return world_size - 1
    return band.hops_needed(world_size, load_balance, spec, length)


def _doc_pieces(cu: Sequence[int], rank: int, world_size: int, placement: str) -> dict[int, list]:
    """{document: [(local start, global start, length), ...]} of the pieces ``rank`` holds."""
    pieces: dict[int, list] = {}
    for doc, local, start, length in document_pieces(cu, rank, world_size, placement):
        pieces.setdefault(doc, []).append((local, start, length))
    return pieces


def document_step(cu: Sequence[int], rank: int, index: int, world_size: int, placement: str,
                  spec: MaskSpec) -> VarlenStep:
    """What step ``index`` on ``rank`` computes in each packed document (documents ``cu``, global
    cumulative ends, placed by ``placement``): its kernel calls, each one TND call of segments."""
    source = (rank - index) % world_size
    mine = _doc_pieces(cu, rank, world_size, placement)
    theirs = mine if source == rank else _doc_pieces(cu, source, world_size, placement)
    if spec.window:
        return band.document_step(mine, theirs, rank, source, index, placement, spec, len(cu))
    return causal.document_step(mine, theirs, rank, source, index, placement, causal=spec.causal)


def needed_keys(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor, documents: tuple = ()) -> Tensor:
    """bool over ``k_pos``: whether some query at the positions ``q_pos`` may see that key (positional
    kinds; packed documents given by their cumulative ends). A given mask's are ``given.columns``."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return torch.zeros(k_pos.numel(), dtype=torch.bool)
    kind = KINDS[spec.kind]
    if not documents:
        return kind.needed(spec, q_pos, k_pos)
    ends = torch.tensor(documents, dtype=torch.int64)
    k_doc = torch.searchsorted(ends, k_pos, right=True)
    q_doc = torch.searchsorted(ends, q_pos, right=True)
    # the last query position of each document on this rank (-1: none), seen from each key
    last = torch.full((len(documents),), -1, dtype=torch.int64).scatter_reduce(0, q_doc, q_pos, "amax")
    return kind.document_needed(spec, last[k_doc], k_pos, q_pos=q_pos, ends=ends, k_doc=k_doc)


def step_pairs(step: VarlenStep) -> int:
    """(query, key) pairs a packed step's kernel calls compute (forward FLOPs: 4 x pairs x N x D)."""
    return sum([KINDS[call.mask.kind].pairs(call.mask, s.q_len, s.kv_len) for call in step.calls
                for s in call.segments])


def _kind(name: str):
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown step mask kind {name!r}")
    return kind


def npu_arguments(step: StepMask, device, layout: str) -> dict:
    """The NPU op's mask arguments for one kernel call (``atten_mask``, ``sparse_mode``, pre/next)."""
    return _kind(step.kind).npu_arguments(step, torch.device(device), layout)


def masked_positions(step: StepMask, sq: int, sk: int, device) -> Optional[Tensor]:
    """The block's [sq, sk] bool mask, True = masked out (None: no mask)."""
    return _kind(step.kind).masked(step, sq, sk, device)
