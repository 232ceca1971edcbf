"""The selftest's cases: what each checks, by world size; the shapes every case shares."""

from __future__ import annotations

from dataclasses import dataclass



B, D, S_LOCAL = 2, 8, 16  # batch, head size, tokens per rank
KEEP_PROB = 0.8


@dataclass(frozen=True)
class Case:
    """One CP attention call: algorithm, layout, mask, load balancing, heads, dropout, V's head size."""

    name: str
    algorithm: str = "ring"  # ring | ulysses | hybrid
    layout: str = "BNSD"  # BNSD | BSND | BSH | SBH | TND (packed documents)
    mask: str = "causal"  # causal | full | band | given | given_band
    lb: bool = True  # head-tail load balancing (torch's _cp_options.enable_load_balance)
    gqa: bool = False
    keep_prob: float = 1.0  # < 1: dropout, checked by directional derivatives
    mla: bool = False  # V's head size differs from Q/K's (MLA): D / 2
    sink: bool = False  # attention sinks (gpt-oss): the op's sink=, one logit per query head

    @property
    def dropout(self) -> bool:
        return self.keep_prob < 1.0


def hybrid_sizes(world: int) -> tuple[int, int] | None:
    """(ring, Ulysses) sizes of a 2-D CP mesh for hybrid, or None when ``world`` is prime or < 4."""
    for inner in range(2, world):
        if world % inner == 0 and world // inner >= 2:
            return world // inner, inner
    return None


def cases(world: int) -> list[Case]:
    """Every case the selftest runs at ``world`` ranks (hybrid only when the world size factors)."""
    out = [
        Case("ring causal, load balanced", "ring", "BNSD", "causal", True),
        Case("ring causal, contiguous, GQA", "ring", "BSND", "causal", False, gqa=True),
        Case("ring full, GQA", "ring", "BSH", "full", False, gqa=True),
        Case("ring window, contiguous", "ring", "SBH", "band", False),
        Case("ring window, load balanced, GQA", "ring", "BNSD", "band", True, gqa=True),
        Case("ring mask, load balanced", "ring", "BSND", "given", True),
        Case("ring mask + window, contiguous", "ring", "BNSD", "given_band", False, gqa=True),
        Case("ring causal, dropout", "ring", "BSND", "causal", True, keep_prob=KEEP_PROB),
        Case("ulysses causal, load balanced, GQA", "ulysses", "BSND", "causal", True, gqa=True),
        Case("ulysses full", "ulysses", "SBH", "full", False),
        Case("ulysses window, load balanced", "ulysses", "BSH", "band", True, gqa=True),
        Case("ulysses mask, contiguous", "ulysses", "BNSD", "given", False),
        Case("ulysses causal, dropout", "ulysses", "BNSD", "causal", True, keep_prob=KEEP_PROB),
    ]
    if hybrid_sizes(world):
        out += [
            Case("hybrid causal", "hybrid", "BNSD", "causal", False),
            Case("hybrid full, GQA", "hybrid", "BSND", "full", False, gqa=True),
            Case("hybrid window", "hybrid", "SBH", "band", False, gqa=True),
            Case("hybrid causal, dropout", "hybrid", "BSH", "causal", False, keep_prob=KEEP_PROB),
            Case("TND hybrid causal, load balanced, GQA", "hybrid", "TND", "causal", True, gqa=True),
        ]
    out += [
        Case("TND causal, load balanced", "ring", "TND", "causal", True),
        Case("TND full, contiguous, GQA", "ring", "TND", "full", False, gqa=True),
        Case("TND causal, dropout", "ring", "TND", "causal", True, keep_prob=KEEP_PROB),
        Case("TND ulysses causal, load balanced, GQA", "ulysses", "TND", "causal", True, gqa=True),
        Case("sinks", "ring", "BNSD", "causal", True, sink=True),
        Case("MLA (value head size != query's)", "ring", "BSND", "causal", True, mla=True),
    ]
    return out
