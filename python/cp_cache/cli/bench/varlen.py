"""The ``varlen`` section of ``python -m cp_cache bench``: packed documents (TND).

Work balance (computed from the ring's plans, no kernels run): for a mix of document
lengths drawn so that most tokens sit in long documents, the attention work each rank's
kernels compute -- (query, key) pairs counted from the per-step segments; FLOPs are
4 * pairs * N * D forward -- as max/mean over ranks, for three ways of sharding:

* ``per_document``: per-document head-tail (placement "head_tail"; every document padded up
  to a multiple of 2W with ``pad_documents``, the padding counted as work);
* ``balanced``: the balanced placement (cp_cache's default under load balancing; no padding);
* ``contiguous``: contiguous T/W slices (cp_cache without load balancing; no padding);
* ``whole_sequence``: head-tail over the whole sequence (chunks r and 2W-1-r of 2W, the
  documents ignored) with the block-diagonal mask given explicitly: a (query chunk, key
  chunk) block is computed in full unless the mask masks all of it, as the ring's
  given-mask tasks do; ``needed`` counts only the pairs the mask keeps.

Each is also given as a fraction of dense-causal attention over the whole sequence and
against the block-diagonal minimum (the causal pairs inside the original, unpadded
documents). Then time per call (forward and backward, medians) of the TND handlers on
CPU with the emulator kernel, per-document head-tail and contiguous, with the error
against a dense float64 block-diagonal reference.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from .._common import cp_session, table
from .shared import Section

__all__ = ["SECTION", "draw_documents", "balance_rows", "varlen_rank"]

_PAD_MULTIPLE = 16


def draw_documents(total: int, seed: int = 0, shortest: int = 32, alpha: float = 0.8) -> list[int]:
    """Document lengths summing to ``total``: Pareto-distributed (tail index ``alpha``) from
    ``shortest`` up, capped at total/2, so most tokens sit in the few long documents."""
    import random

    rng = random.Random(seed)
    lengths: list[int] = []
    left = total
    while left > 0:
        length = min(int(shortest / (1.0 - rng.random()) ** (1.0 / alpha)), total // 2, left)
        if left - length < shortest:
            length = left
        lengths.append(length)
        left -= length
    rng.shuffle(lengths)
    return lengths


def _cumulative(lengths: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


def _ring_pairs(cu: Sequence[int], world: int, placement: str) -> list[int]:
    from ...masks import MaskSpec, document_step, step_pairs

    return [sum(step_pairs(document_step(cu, rank, i, world, placement, MaskSpec(causal=True))) for i in range(world))
            for rank in range(world)]


def _whole_sequence_pairs(cu: Sequence[int], world: int) -> tuple[list[int], list[int]]:
    """(computed, needed) pairs per rank: whole-sequence head-tail with the block-diagonal
    causal mask given; computed at the granularity of (query chunk, key chunk) blocks."""
    total = cu[-1]
    chunk = total // (2 * world)
    starts = [0] + list(cu[:-1])

    def doc_spans(a: int, b: int):
        for start, end in zip(starts, cu):
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                yield start, lo, hi

    def needed_rows(a: int, b: int) -> int:  # causal pairs of rows [a, b) inside their documents
        return sum((lo - s + 1 + hi - s) * (hi - lo) // 2 for s, lo, hi in doc_spans(a, b))

    def block_live(qa: int, qb: int, ka: int, kb: int) -> bool:
        for start, end in zip(starts, cu):
            q_hi, k_lo = min(qb, end), max(ka, start)
            if max(qa, start) < q_hi and k_lo < min(kb, end) and k_lo <= q_hi - 1:
                return True
        return False

    held = [[r, 2 * world - 1 - r] for r in range(world)]
    computed, needed = [], []
    for rank in range(world):
        pairs = need = 0
        for qc in held[rank]:
            qa, qb = qc * chunk, (qc + 1) * chunk
            need += needed_rows(qa, qb)
            for kc in range(2 * world):
                if block_live(qa, qb, kc * chunk, (kc + 1) * chunk):
                    pairs += chunk * chunk
        computed.append(pairs)
        needed.append(need)
    return computed, needed


def _imbalance(per_rank: Sequence[int]) -> float:
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def balance_rows(total: int, worlds: Sequence[int], seed: int = 0) -> dict:
    """The work-balance table for one drawn mix of ``total`` tokens, at each W."""
    from ...packing import pad_documents

    import torch

    lengths = draw_documents(total, seed)
    minimum = sum(n * (n + 1) // 2 for n in lengths)
    dense_causal = total * (total + 1) // 2
    cu = _cumulative(lengths)
    long_tokens = sum(n for n in lengths if n >= total // 16)
    rows = []
    for world in worlds:
        _, cu_padded, _ = pad_documents(torch.zeros(total), cu, 2 * world)
        cu_padded = cu_padded.tolist()
        per_doc = _ring_pairs(cu_padded, world, "head_tail")
        contiguous = _ring_pairs(cu, world, "contiguous") if total % world == 0 else None
        whole, whole_needed = _whole_sequence_pairs(cu, world) if total % (2 * world) == 0 else (None, None)
        balanced = _ring_pairs(cu, world, "balanced")
        for scheme, pairs, padded in (("per_document", per_doc, cu_padded[-1] - total), ("balanced", balanced, 0),
                                      ("contiguous", contiguous, 0), ("whole_sequence", whole, 0)):
            if pairs is None:
                continue
            rows.append(dict(
                world_size=world, scheme=scheme, padding_tokens=padded,
                max_over_mean=_imbalance(pairs), pairs_per_rank=pairs, pairs_total=sum(pairs),
                over_block_diagonal_minimum=sum(pairs) / minimum - 1.0,
                fraction_of_dense_causal=sum(pairs) / dense_causal,
                needed_max_over_mean=_imbalance(whole_needed) if scheme == "whole_sequence" else None,
            ))
    return dict(tokens=total, documents=len(lengths), longest=max(lengths), shortest=min(lengths),
                tokens_in_documents_over_T_16=long_tokens / total, block_diagonal_minimum_pairs=minimum,
                dense_causal_pairs=dense_causal, lengths=lengths, rows=rows)


def varlen_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    """Time per TND call (forward, backward) through the handlers on this rank, and the
    error against a dense float64 block-diagonal reference, per placement."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    import cp_cache
    from ...npu_ops import causal_arguments
    from ...testing.varlen_reference import dense_tnd_attention

    shape, repeats, warmup = plan["varlen"], plan["repeats"], plan["warmup"]
    total, n, d = shape["tokens"], shape["heads"], shape["head_dim"]
    # the same documents at every W: padded to a multiple of 2 * 8 (load balancing up to W = 8)
    lengths = draw_documents(total, seed=1)
    _, cu_padded, _ = cp_cache.pad_documents(torch.zeros(total), _cumulative(lengths), _PAD_MULTIPLE)
    cu = cu_padded.tolist()
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(cu[-1], n, d, generator=g) for _ in range(4)]
    ref = dense_tnd_attention(*(t.double() for t in full), cu, cu, "left_up")
    kw = dict(scale=1.0 / math.sqrt(d), actual_seq_qlen=torch.tensor(cu), actual_seq_kvlen=torch.tensor(cu),
              **causal_arguments("cpu", right_down=True))
    rows = []
    for placement, load_balance in (("head_tail", True), ("balanced", True), ("contiguous", False)):
        with cp_session(mesh, policy="handle", documents="head_tail" if placement == "contiguous" else placement):
            _cp_options.enable_load_balance = load_balance
            times, got, dq = _timed_calls(full, cu, kw, n, repeats, warmup, mesh)
        rows.append(dict(
            world_size=world_size, rank=rank, placement=placement, load_balance=load_balance, tokens=cu[-1],
            documents=len(cu), heads=n, head_dim=d, local_tokens=int(got[1]),
            fwd_ms_median=statistics.median(times["forward"]) * 1e3,
            bwd_ms_median=statistics.median(times["backward"]) * 1e3,
            out_max_abs=float((got[0] - ref["out"]).abs().max()), dq_max_abs=float((dq - ref["dq"]).abs().max()),
        ))
    return rows


def _timed_calls(full: list, cu: list[int], kw: dict, heads: int, repeats: int, warmup: int, mesh):
    """Handler seconds per call (forward, backward) of the TND call on the placement in force;
    ((the output gathered, the local length), dq gathered)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    import cp_cache
    from ... import layout as L

    local = [cp_cache.shard_documents(t, cu, mesh) for t in full]

    def dtensor(t, whole):  # local lengths may differ between ranks
        return DTensor.from_local(t, mesh, [Shard(0)], shape=whole.shape, stride=whole.stride())

    times = {"forward": [], "backward": []}
    for i in range(warmup + repeats):
        q, k, v = (dtensor(t.clone(), w).requires_grad_() for t, w in zip(local[:3], full[:3]))
        out = torch.ops.npu.npu_fusion_attention_v3(q, k, v, heads, L.TND, **kw)[0]
        out.backward(dtensor(local[3], full[3]))
        calls = cp_cache.call_stats()
        if i >= warmup:
            for direction in times:
                times[direction].append(calls[direction]["handler_seconds"])
    got = cp_cache.unshard_documents(out.to_local().detach(), cu, mesh).double()
    dq = cp_cache.unshard_documents(q.grad.to_local(), cu, mesh).double()
    return times, (got, local[0].size(0)), dq


def _placement_of(row: dict) -> str:
    return row.get("placement") or ("head_tail" if row["load_balance"] else "contiguous")  # older reports


def print_varlen(report: dict) -> None:
    balance = report.get("varlen_balance")
    if balance:
        print(f"\npacked documents: work per rank for {balance['documents']} documents in {balance['tokens']} tokens "
              f"({balance['shortest']}..{balance['longest']}, {balance['tokens_in_documents_over_T_16']:.0%} of the "
              "tokens in documents longer than T/16), causal")
        rows = [[r["world_size"], r["scheme"], f"{r['max_over_mean']:.3f}",
                 "-" if r["needed_max_over_mean"] is None else f"{r['needed_max_over_mean']:.3f}",
                 f"{r['over_block_diagonal_minimum']:+.2%}", f"{r['fraction_of_dense_causal']:.3f}",
                 r["padding_tokens"]] for r in balance["rows"]]
        print(table(["W", "sharding", "work max/mean", "needed max/mean", "FLOPs vs block-diag min",
                     "of dense causal", "padding"], rows))
    all_timed = report.get("varlen") or []
    timed = [r for r in all_timed if r["rank"] == 0]
    if timed:
        print("\npacked documents: time per call (slowest rank's median; CPU: the emulator loops over a call's "
              "segments in Python, the ranks share the host's cores) and max error over ranks vs dense float64")

        def worst(r, key):
            return max(x[key] for x in all_timed
                       if (x["world_size"], _placement_of(x)) == (r["world_size"], _placement_of(r)))

        rows = [[r["world_size"], _placement_of(r), r["tokens"],
                 r["documents"], f"{worst(r, 'fwd_ms_median'):.1f}", f"{worst(r, 'bwd_ms_median'):.1f}",
                 f"{worst(r, 'out_max_abs'):.1e}", f"{worst(r, 'dq_max_abs'):.1e}"] for r in timed]
        print(table(["W", "placement", "T", "docs", "fwd ms", "bwd ms", "out err", "dq err"], rows))


SECTION = Section(
    name="varlen",
    about="packed documents (TND): work per rank (max/mean) and FLOPs against the block-diagonal minimum for "
          "per-document head-tail, contiguous and whole-sequence head-tail sharding, and time per call",
    quick=dict(varlen=dict(tokens=256, heads=2, head_dim=16), varlen_balance=dict(tokens=4096, worlds=[2, 4])),
    full=dict(varlen=dict(tokens=2048, heads=4, head_dim=32), varlen_balance=dict(tokens=65536, worlds=[2, 4, 8])),
    rank=varlen_rank,
    derived=lambda plan, rows: {"varlen_balance": balance_rows(plan["varlen_balance"]["tokens"],
                                                               plan["varlen_balance"]["worlds"])},
    summary=print_varlen,
)
