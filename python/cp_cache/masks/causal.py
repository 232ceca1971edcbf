"""Causal attention: query i sees keys j <= i (sparse_mode 2 left-up; 3 right-down for packed documents).
torch's ring rules: contiguous shards: step 0 causal, a lower rank's block full, a higher rank's
skipped; head-tail shards (chunks r and 2W-1-r of 2W): step 0 causal over the local block, a lower
rank's block seen by every query through its first half ("kv_head"), a higher rank's by the second
half of the queries ("q_tail"). Packed documents follow the same rules per document."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..npu_ops import causal_arguments
from ..placement import CONTIGUOUS
from .base import NONE, BlockTask, MaskSpec, Segment, StepMask, VarlenCall, VarlenStep, block_positions, span

__all__ = ["step_part", "plan_step", "needed", "document_needed", "document_step", "pairs",
           "npu_arguments", "masked"]

_CAUSAL = StepMask("causal")


def step_part(rank: int, index: int, world_size: int, causal: bool, load_balance: bool) -> str:
    """Which part of the block pair step ``index`` on ``rank`` computes (full and causal)."""
    if not causal:
        return "full"
    if index == 0:
        return "causal"
    source = (rank - index) % world_size
    if source < rank:
        return "kv_head" if load_balance else "full"
    return "q_tail" if load_balance else "skip"


def plan_step(rank: int, index: int, world_size: int, load_balance: bool, spec: MaskSpec, q_len: int,
              kv_len: int, mask_rows=None) -> tuple[str, list[BlockTask]]:
    part = step_part(rank, index, world_size, True, load_balance)
    if part == "skip":
        return part, []
    if part == "q_tail":
        half = q_len // 2
        return part, [BlockTask((half, q_len - half), (0, kv_len), NONE)]
    if part == "kv_head":
        return part, [BlockTask((0, q_len), (0, kv_len // 2), NONE)]
    return part, [BlockTask((0, q_len), (0, kv_len), _CAUSAL if part == "causal" else NONE)]


def needed(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    return k_pos <= q_pos.max()


def document_needed(spec: MaskSpec, reach: Tensor, k_pos: Tensor, **_) -> Tensor:
    """Packed documents: the keys up to the rank's last query of their document (``reach``)."""
    return reach >= k_pos


def _earlier_keys(doc: int, mine: list, theirs: list) -> Optional[Segment]:
    """A block from another rank: my pieces that see some of theirs (a suffix of mine) against their
    pieces some of mine see (a prefix of theirs). Pieces of a document on two ranks are disjoint, and
    the placements make the chosen key pieces all come before the chosen query pieces."""
    queries = [p for p in mine if p[1] > theirs[0][1]]
    keys = [p for p in theirs if p[1] < mine[-1][1]]
    if not queries or not keys:
        return None
    if keys[-1][1] > queries[0][1]:
        raise RuntimeError(f"document {doc}: pieces {mine} and {theirs} do not meet in one rectangle; the "
                           "placement cannot run on the ring")
    return Segment(doc, *span(queries), *span(keys))


def document_step(mine: dict, theirs: dict, rank: int, source: int, index: int, placement: str,
                  causal: bool = True) -> VarlenStep:
    """Causal (or, ``causal`` False, full) attention in every document of ``mine``: one kernel call."""
    if not causal:
        part, mask = "full", NONE
    elif index == 0:
        part, mask = "causal", _CAUSAL
    elif placement != CONTIGUOUS:
        part, mask = ("kv_head" if source < rank else "q_tail"), NONE
    else:
        part, mask = ("full" if source < rank else "skip"), NONE
    segments = []
    for doc, pieces in mine.items():
        if doc not in theirs or part == "skip":
            continue
        if part in ("full", "causal"):
            segments.append(Segment(doc, *span(pieces), *span(theirs[doc])))
        else:
            segment = _earlier_keys(doc, pieces, theirs[doc])
            if segment is not None:
                segments.append(segment)
    if not segments:
        return VarlenStep("skip", ())
    return VarlenStep(part, (VarlenCall(mask, tuple(segments)),))


def pairs(step: StepMask, q_len: int, kv_len: int) -> int:
    return q_len * (q_len + 1) // 2  # the ring's causal blocks are square


def npu_arguments(step: StepMask, device, layout: str) -> dict:
    # packed documents: per segment; the ring's causal segments are square, where both modes
    # agree, and right-down is the mode varlen callers use
    return causal_arguments(device, right_down=layout == "TND")


def masked(step: StepMask, sq: int, sk: int, device):
    i, j = block_positions(sq, sk, device)
    return j > i
