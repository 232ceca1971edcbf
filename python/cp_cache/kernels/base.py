"""The step-kernel protocol: one attention block of a ring step, forward and backward."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..masks import StepMask, masked_positions

__all__ = ["StepForward", "StepKernel", "StepMask", "masked_positions", "repeat_kv_heads", "sum_kv_heads",
           "segments_forward", "segments_backward"]


def repeat_kv_heads(x: Tensor, groups: int) -> Tensor:
    """[B, Nkv, S, D] -> [B, Nkv*groups, S, D]: query head h uses K/V head h // groups (GQA)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sum_kv_heads(x: Tensor, groups: int) -> Tensor:
    """[B, Nkv*groups, S, D] -> [B, Nkv, S, D], each group summed: the gradient of ``repeat_kv_heads``."""
    if groups == 1:
        return x
    b, n, s, d = x.shape
    return x.view(b, n // groups, groups, s, d).sum(dim=2)


def _segment_lengths(actual_seq_lens) -> tuple[list[int], list[int]]:
    return tuple(torch.diff(t, prepend=t.new_zeros(1)).tolist() for t in actual_seq_lens)


def segments_forward(kernel, q, k, v, *, actual_seq_lens, mask: StepMask, layout=None, **kw) -> StepForward:
    """A step's packed segments ([T, N, D], cumulative ends ``actual_seq_lens``) for a kernel without
    them: one call each, a batch of one in BSND; out [T, N, Dv], LSE [T, N]; each call's dropout seed and
    offset stacked, one row per segment."""
    q_lens, kv_lens = _segment_lengths(actual_seq_lens)
    outs, lses, rngs = [], [], []
    for qs, ks, vs in zip(q.split(q_lens), k.split(kv_lens), v.split(kv_lens)):
        res = kernel.forward(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), mask=mask, layout="BSND", **kw)
        outs.append(res.out.squeeze(0))
        lses.append(res.lse.squeeze(0).transpose(0, 1))
        if res.seed is not None:
            rngs.append((res.seed, res.offset))
    seed, offset = (torch.stack(t) for t in zip(*rngs)) if rngs else (None, None)
    return StepForward(out=torch.cat(outs), lse=torch.cat(lses), seed=seed, offset=offset)


def segments_backward(kernel, q, k, v, dout, out, lse, *, actual_seq_lens, mask: StepMask, layout=None, seed=None,
                      offset=None, **kw):
    """``segments_forward``'s gradients, segment by segment, each replaying its own dropout."""
    q_lens, kv_lens = _segment_lengths(actual_seq_lens)
    grads = ([], [], [])
    rngs = zip(seed, offset) if seed is not None else itertools.repeat((None, None))
    for qs, ks, vs, ds, os_, ls, (s, o) in zip(q.split(q_lens), k.split(kv_lens), v.split(kv_lens),
                                               dout.split(q_lens), out.split(q_lens), lse.split(q_lens), rngs):
        res = kernel.backward(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), ds.unsqueeze(0), os_.unsqueeze(0),
                              ls.transpose(0, 1).unsqueeze(0), mask=mask, layout="BSND", seed=s, offset=o, **kw)
        for acc, g in zip(grads, res):
            acc.append(g.squeeze(0))
    return tuple(torch.cat(g) for g in grads)


@dataclass
class StepForward:
    """One block's forward: ``out`` in the input layout and the query dtype; ``lse`` float32 [B, Nq, Sq],
    -inf for rows that see no key; ``seed``, ``offset``: the int64 [1] CPU tensors of its dropout
    (None, or tensor([0]), without dropout)."""

    out: Tensor
    lse: Tensor
    seed: Optional[Tensor]
    offset: Optional[Tensor]


@runtime_checkable
class StepKernel(Protocol):
    """Attention of a query block against one K/V block.

    ``mask`` (``StepMask``) in the op's terms: "none", "causal" (left-up, sparse_mode 2), "band"
    (sparse_mode 4 with its pre/next_tockens, anchored at the bottom-right corner) or "given" (its
    ``block``, True = masked out). K/V may have fewer heads than Q (GQA, Nq % Nkv == 0). ``takes_tnd``:
    whether one call takes a step's packed segments (``layout="TND"``, ``actual_seq_lens``: their
    cumulative query and K/V ends, CPU int64; the LSE then ``[T, N]``); else one call per segment.
    """

    name: str
    takes_tnd: bool

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, layout: str, head_num: int, scale: float,
                keep_prob: float, mask: StepMask,
                actual_seq_lens: Optional[tuple[Tensor, Tensor]] = None) -> StepForward: ...

    def backward(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor, *, layout: str,
                 head_num: int, scale: float, keep_prob: float, mask: StepMask, seed: Optional[Tensor],
                 offset: Optional[Tensor],
                 actual_seq_lens: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv (float32 allowed) of this block given the FINAL merged ``out`` (query dtype) and
        float32 ``lse`` of these query rows."""
        ...
