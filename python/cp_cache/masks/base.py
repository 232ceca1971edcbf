"""What every mask kind shares: the call's mask on global positions (``MaskSpec``), one kernel
call's mask (``StepMask``), one kernel call of a step (``BlockTask``), and a packed-documents step's
kernel calls: segments (one document's query rows x K/V rows) in calls that share one mask."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..npu_ops import INT_MAX
from ..placement import sequence_pieces

__all__ = ["MaskSpec", "StepMask", "BlockTask", "NONE", "Segment", "VarlenCall", "VarlenStep", "chunk_tasks",
           "block_positions", "span"]


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask of a CP call, on global positions: ``causal``; ``window``: the band
    pre_tockens / next_tockens; ``given``: an explicit mask passed with the call (its band folded
    in where ``window``). ``band_document`` (packed documents, sparse_mode 7 / 8): "" the band in
    every document, "last" / "first" only there, the others causal."""

    causal: bool = False
    window: bool = False
    pre_tockens: int = INT_MAX
    next_tockens: int = INT_MAX
    given: bool = False
    band_document: str = ""

    def __post_init__(self):
        if self.causal and (self.window or self.given):
            raise ValueError(f"a causal MaskSpec takes no window and no given mask: {self}")
        if self.band_document not in ("", "first", "last") or (self.band_document and not self.window):
            raise ValueError(f"band_document must be '', 'first' or 'last', and set only with a window: {self}")

    @property
    def kind(self) -> str:
        """The module that owns this mask: "given", "causal", "band" or "none" (full attention)."""
        return "given" if self.given else "causal" if self.causal else "band" if self.window else "none"

    @property
    def positional(self) -> bool:
        """Whether the mask depends on global positions (anything but full attention)."""
        return self.causal or self.window or self.given

    def band_document_index(self, documents: int) -> Optional[int]:
        """The one document of ``documents`` that takes the band while the others are causal, or
        None when the band applies in every document."""
        return {"": None, "first": 0, "last": documents - 1}[self.band_document]

    def simplified(self, seq: int) -> "MaskSpec":
        """The same mask over ``seq`` tokens as the cheapest kind: a band that covers every earlier key
        and no later one is causal, one that covers all is full."""
        if not self.window or self.given:
            return self
        sees_all_past = self.pre_tockens >= seq - 1
        if sees_all_past and self.next_tockens >= seq - 1:
            return MaskSpec()
        if sees_all_past and self.next_tockens == 0:
            return MaskSpec(causal=True)
        return self


@dataclass(frozen=True)
class StepMask:
    """The mask of one kernel call, in the op's terms: "none", "causal" (left-up, sparse_mode 2),
    "band" (sparse_mode 4: pre/next_tockens anchored at the bottom-right corner) or "given"
    (``block``, True = masked out)."""

    kind: str
    pre_tockens: int = INT_MAX
    next_tockens: int = INT_MAX
    block: Optional[Tensor] = field(default=None, compare=False)


NONE = StepMask("none")


@dataclass(frozen=True)
class BlockTask:
    """One kernel call of a step: local query rows x rows of the K/V block, (start, length)."""

    q_rows: tuple[int, int]
    kv_rows: tuple[int, int]
    mask: StepMask


def chunk_tasks(task, rank: int, index: int, world_size: int, q_len: int, kv_len: int,
                load_balance: bool) -> list[BlockTask]:
    """``task(q_chunk, kv_chunk)`` for each pair of this rank's query chunks and step ``index``'s key chunks,
    each (local start, global start, length) (``placement.sequence_pieces``); the pairs it misses (None) left out."""
    def held(r: int, length: int) -> list[tuple[int, int, int]]:
        return [(p.local, p.start, p.length) for p in sequence_pieces(r, world_size, length, load_balance)]
    pairs = itertools.product(held(rank, q_len), held((rank - index) % world_size, kv_len))
    return [t for t in itertools.starmap(task, pairs) if t is not None]


def block_positions(sq: int, sk: int, device) -> tuple[Tensor, Tensor]:
    """Query and key indices of an [sq, sk] block, shaped to broadcast: ([sq, 1], [1, sk])."""
    return torch.arange(sq, device=device).view(-1, 1), torch.arange(sk, device=device).view(1, -1)


@dataclass(frozen=True)
class Segment:
    """One document's part of a step: local query rows x rows of the K/V block."""

    document: int
    q_start: int
    q_len: int
    kv_start: int
    kv_len: int


@dataclass(frozen=True)
class VarlenCall:
    """One TND kernel call: its mask and its segments, whose query rows never overlap."""

    mask: StepMask
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class VarlenStep:
    part: str
    calls: tuple[VarlenCall, ...]  # none when the step has no work

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(s for call in self.calls for s in call.segments)


def span(pieces: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(local start, length) of adjacent pieces, each (local start, global start, length)."""
    return pieces[0][0], sum(n for _, _, n in pieces)
