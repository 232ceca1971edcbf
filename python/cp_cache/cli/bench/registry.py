"""The bench sections, in the order they run and print: the one list of them (each module
declares its own ``SECTION``)."""

from __future__ import annotations

from . import accuracy, agreement, algorithms, calls, floor, memory, models, overhead, overlap, packed_models
from . import mixers, placement, sequences, store, torch_kernel, traffic, varlen, windows
from .shared import Section

__all__ = ["SECTIONS", "NAMES", "by_name"]

SECTIONS: tuple[Section, ...] = tuple(module.SECTION for module in (
    memory, overhead, calls, traffic, sequences, accuracy, windows, floor, overlap, agreement, varlen, placement, algorithms,
    models, packed_models, torch_kernel, mixers, store,
))
NAMES = tuple(section.name for section in SECTIONS)
assert len(set(NAMES)) == len(NAMES) and len({s.report_key for s in SECTIONS}) == len(SECTIONS)


def by_name(names) -> list[Section]:
    """The sections named, in the registry's order."""
    wanted = set(names)
    return [section for section in SECTIONS if section.name in wanted]
