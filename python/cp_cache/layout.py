"""Tensor layout facts for the attention layouts the NPU ops accept.

Layouts (``input_layout`` of ``npu_fusion_attention_v3``):

========  ==================  ========  ====================
layout    shape               seq dim   4-D view
========  ==================  ========  ====================
BNSD      [B, N, S, D]        2         [B, N, S, D]
BSND      [B, S, N, D]        1         [B, S, N, D]
BSH       [B, S, N*D]         1         [B, S, N, D]
SBH       [S, B, N*D]         0         [S, B, N, D]
========  ==================  ========  ====================

The 4-D view keeps the sequence dimension where the layout has it, so a
sequence range can be narrowed on either form. TND (varlen) is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = [
    "LAYOUTS",
    "Dims",
    "check_layout",
    "seq_dim",
    "dims",
    "as_4d",
    "lse_view",
    "to_bnsd",
    "from_bnsd",
    "narrow_seq",
]

LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")

_SEQ_DIM = {"BNSD": 2, "BSND": 1, "BSH": 1, "SBH": 0}
_NDIM = {"BNSD": 4, "BSND": 4, "BSH": 3, "SBH": 3}
# permutation taking the layout's 4-D view to [B, N, S, D]
_TO_BNSD = {"BNSD": (0, 1, 2, 3), "BSND": (0, 2, 1, 3), "BSH": (0, 2, 1, 3), "SBH": (1, 2, 0, 3)}
# permutation taking [B, N, S] (the LSE) to the order of the 4-D view's first three dims
_LSE_PERM = {"BNSD": (0, 1, 2), "BSND": (0, 2, 1), "BSH": (0, 2, 1), "SBH": (2, 0, 1)}


def check_layout(layout: str) -> str:
    """Return ``layout`` if supported; NotImplementedError for TND, ValueError otherwise."""
    if layout in _SEQ_DIM:
        return layout
    if layout == "TND":
        raise NotImplementedError(
            "input_layout='TND' (varlen) is not supported by cp_cache ring attention; "
            f"supported layouts: {', '.join(LAYOUTS)}"
        )
    raise ValueError(f"unknown input_layout={layout!r}; supported layouts: {', '.join(LAYOUTS)}")


def seq_dim(layout: str) -> int:
    """The sequence dimension of a tensor in ``layout`` (same in its 4-D view)."""
    return _SEQ_DIM[check_layout(layout)]


@dataclass(frozen=True)
class Dims:
    batch: int
    heads: int
    seq: int
    head_dim: int


def dims(x: Tensor, layout: str, head_num: int) -> Dims:
    """Batch, head count, sequence length and head size of ``x`` in ``layout``.

    ``head_num`` is the head count of ``x`` (for K/V under GQA, their own count).
    """
    check_layout(layout)
    if x.dim() != _NDIM[layout]:
        raise ValueError(
            f"input_layout={layout!r} expects a {_NDIM[layout]}-D tensor, got shape {tuple(x.shape)}"
        )
    if head_num <= 0:
        raise ValueError(f"head_num must be positive, got {head_num}")
    if layout == "BNSD":
        b, n, s, d = x.shape
    elif layout == "BSND":
        b, s, n, d = x.shape
    else:
        if layout == "BSH":
            b, s, h = x.shape
        else:
            s, b, h = x.shape
        if h % head_num:
            raise ValueError(
                f"input_layout={layout!r}: hidden size {h} is not divisible by head_num={head_num}"
            )
        n, d = head_num, h // head_num
    if n != head_num:
        raise ValueError(
            f"input_layout={layout!r}: tensor of shape {tuple(x.shape)} has {n} heads, head_num={head_num}"
        )
    return Dims(int(b), int(n), int(s), int(d))


def heads_of(x: Tensor, layout: str, head_dim: int) -> int:
    """Head count of ``x`` given its head size (used for K/V, whose count may differ from Q's)."""
    check_layout(layout)
    if x.dim() != _NDIM[layout]:
        raise ValueError(
            f"input_layout={layout!r} expects a {_NDIM[layout]}-D tensor, got shape {tuple(x.shape)}"
        )
    if layout == "BNSD":
        return int(x.shape[1])
    if layout == "BSND":
        return int(x.shape[2])
    h = int(x.shape[2])
    if h % head_dim:
        raise ValueError(
            f"input_layout={layout!r}: hidden size {h} is not a multiple of the head size {head_dim}"
        )
    return h // head_dim


def as_4d(x: Tensor, layout: str, head_num: int) -> Tensor:
    """A 4-D view of ``x`` (BSH -> [B, S, N, D], SBH -> [S, B, N, D]; 4-D layouts and
    tensors that already are the 4-D view are returned unchanged)."""
    check_layout(layout)
    if layout in ("BNSD", "BSND") or x.dim() == 4:
        return x
    a, b, h = x.shape
    return x.view(a, b, head_num, h // head_num)


def lse_view(lse: Tensor, layout: str) -> Tensor:
    """View an LSE of shape [B, N, S] so it broadcasts against ``as_4d`` of an output in ``layout``."""
    return lse.permute(_LSE_PERM[check_layout(layout)]).unsqueeze(-1)


def to_bnsd(x: Tensor, layout: str, head_num: int) -> Tensor:
    """A [B, N, S, D] view (permuted, not copied) of ``x`` in ``layout``."""
    return as_4d(x, layout, head_num).permute(_TO_BNSD[check_layout(layout)])


def from_bnsd(x: Tensor, layout: str) -> Tensor:
    """Turn a [B, N, S, D] tensor into a contiguous tensor in ``layout``."""
    check_layout(layout)
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)


def narrow_seq(x: Tensor, layout: str, start: int, length: int) -> Tensor:
    """The sequence range [start, start + length) of ``x`` (layout form or its 4-D view): a view."""
    return x.narrow(seq_dim(layout), start, length)
