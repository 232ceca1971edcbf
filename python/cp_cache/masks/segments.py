"""A packed-documents step's kernel calls: segments (one document's query rows x K/V rows) in
calls that share one mask (the op takes one sparse_mode and one pre/next_tockens per call)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import StepMask

__all__ = ["Segment", "VarlenCall", "VarlenStep", "span"]


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
