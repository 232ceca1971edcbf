"""The layouts the NPU ops accept (``input_layout``), the one place their names are written (dims: ``_TABLE``):
BNSD [B, N, S, D], BSND [B, S, N, D], BSH [B, S, N*D] and SBH [S, B, N*D] (4-D views [B, S, N, D], [S, B, N, D]),
softmax stats [B, N, S, 8]; TND [T, N, D] (packed documents), stats [T, N, 8], no 4-D view (``to_bnsd``: a batch
of one). V's head size may differ from Q/K's (MLA): V and the output end in ``D_v`` (BSH/SBH: ``N * D_v``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["LAYOUTS", "ALL_LAYOUTS", "TND", "head_dim_index", "stats_dims", "Dims", "check_layout",
           "seq_dim", "dims", "as_4d", "lse_view", "to_bnsd", "from_bnsd", "narrow_seq",
           "load_balance_enabled", "lse_shape", "check_value", "value_head_dim", "output_shape"]

LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")  # the dense layouts (a 4-D view each)
TND = "TND"  # packed documents
ALL_LAYOUTS = LAYOUTS + (TND,)

# layout: (sequence dim, the dim holding the heads (BSH/SBH: the hidden dim N*D, split by whole heads), ndim,
# the permutation taking its 4-D view to [B, N, S, D], the one taking [B, N, S, D] back to the 4-D view)
_TABLE = {"BNSD": (2, 1, 4, (0, 1, 2, 3), (0, 1, 2, 3)), "BSND": (1, 2, 4, (0, 2, 1, 3), (0, 2, 1, 3)),
          "BSH": (1, 2, 3, (0, 2, 1, 3), (0, 2, 1, 3)), "SBH": (0, 2, 3, (1, 2, 0, 3), (2, 0, 1, 3)),
          TND: (0, 1, 3, None, None)}


def check_layout(layout: str) -> str:
    """Return ``layout`` if it is a dense layout; NotImplementedError for TND, ValueError otherwise."""
    if layout in LAYOUTS:
        return layout
    if layout == TND:
        raise NotImplementedError("input_layout='TND' (varlen) is not supported by cp_cache ring attention; "
                                  f"supported layouts: {', '.join(LAYOUTS)}")
    raise ValueError(f"unknown input_layout={layout!r}; supported layouts: {', '.join(LAYOUTS)}")


def _known(layout: str) -> str:
    if layout not in _TABLE:
        raise ValueError(f"unknown input_layout={layout!r}; supported layouts: {', '.join(ALL_LAYOUTS)}")
    return layout


def seq_dim(layout: str) -> int:
    """The sequence dimension of a tensor in ``layout`` (same in its 4-D view); TND: 0."""
    return _TABLE[_known(layout)][0]


def head_dim_index(layout: str) -> int:
    return _TABLE[_known(layout)][1]


def stats_dims(layout: str) -> tuple[int, int]:
    """(sequence dim, head dim) of the op's softmax statistics for ``layout``: [B, N, S, 8], TND [T, N, 8]."""
    return (0, 1) if _known(layout) == TND else (2, 1)


def lse_shape(x: Tensor, layout: str, head_num: int) -> tuple[int, ...]:
    """The float32 LSE shape of a query ``x``: [B, N, S], or [T, N] for TND."""
    if layout == TND:
        return (x.size(0), head_num)
    d = dims(x, layout, head_num)
    return (d.batch, d.heads, d.seq)


@dataclass(frozen=True)
class Dims:
    batch: int
    heads: int
    seq: int
    head_dim: int


def _check_ndim(x: Tensor, layout: str) -> None:
    ndim = _TABLE[check_layout(layout)][2]
    if x.dim() != ndim:
        raise ValueError(f"input_layout={layout!r} expects a {ndim}-D tensor, got shape {tuple(x.shape)}")


def dims(x: Tensor, layout: str, head_num: int) -> Dims:
    """``head_num``: the head count of ``x`` (K/V's own under GQA)."""
    _check_ndim(x, layout)
    if head_num <= 0:
        raise ValueError(f"head_num must be positive, got {head_num}")
    shape = tuple(x.shape)
    if len(shape) == 3:  # BSH / SBH: the hidden size split into heads
        if shape[2] % head_num:
            raise ValueError(f"input_layout={layout!r}: hidden size {shape[2]} is not divisible by head_num={head_num}")
        shape = (shape[0], shape[1], head_num, shape[2] // head_num)
    b, n, s, d = (shape[i] for i in _TABLE[layout][3])
    if n != head_num:
        raise ValueError(f"input_layout={layout!r}: tensor of shape {tuple(x.shape)} has {n} heads, "
                         f"head_num={head_num}")
    return Dims(b, n, s, d)  # sizes as they are: symbolic while tracing with dynamic shapes


def heads_of(x: Tensor, layout: str, head_dim: int) -> int:
    _check_ndim(x, layout)
    if layout in ("BNSD", "BSND"):
        return int(x.shape[_TABLE[layout][1]])
    h = int(x.shape[2])
    if h % head_dim:
        raise ValueError(f"input_layout={layout!r}: hidden size {h} is not a multiple of the head size {head_dim}")
    return h // head_dim


def as_4d(x: Tensor, layout: str, head_num: int) -> Tensor:
    """The 4-D view of ``x`` (BSH -> [B, S, N, D], SBH -> [S, B, N, D]); 4-D and TND tensors as they are."""
    if layout == TND:
        return x
    check_layout(layout)
    if layout in ("BNSD", "BSND") or x.dim() == 4:
        return x
    a, b, h = x.shape
    return x.view(a, b, head_num, h // head_num)


def lse_view(lse: Tensor, layout: str) -> Tensor:
    """An LSE [B, N, S] ([T, N] for TND) viewed to broadcast against ``as_4d`` of an output in ``layout``."""
    if layout == TND:
        return lse.unsqueeze(-1)
    return lse.permute(_TABLE[check_layout(layout)][4][:3]).unsqueeze(-1)


def to_bnsd(x: Tensor, layout: str, head_num: int) -> Tensor:
    """A [B, N, S, D] view (permuted, not copied) of ``x`` in ``layout`` (TND: [1, N, T, D])."""
    if layout == TND:
        return x.permute(1, 0, 2).unsqueeze(0)
    return as_4d(x, layout, head_num).permute(_TABLE[check_layout(layout)][3])


def from_bnsd(x: Tensor, layout: str) -> Tensor:
    """A [B, N, S, D] tensor as a contiguous tensor in ``layout`` (TND: from a batch of one)."""
    if layout == TND:
        if x.size(0) != 1:
            raise ValueError(f"input_layout='TND' is a batch of one; got a [B, N, S, D] tensor of shape "
                             f"{tuple(x.shape)}")
        return x[0].permute(1, 0, 2).contiguous()
    check_layout(layout)
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    x = x.permute(_TABLE[layout][4])
    return x.contiguous() if layout == "BSND" else x.reshape(x.size(0), x.size(1), n * d)


def narrow_seq(x: Tensor, layout: str, start: int, length: int) -> Tensor:
    return x.narrow(seq_dim(layout), start, length)


def check_value(k: Tensor, v: Tensor, layout: str, kv_heads: int) -> int:
    """V's head size, after checking ``v`` agrees with ``k`` on every dim but the last (MLA)."""
    _known(layout)
    if not (v.dim() == k.dim() and all(v.size(i) == k.size(i) for i in range(k.dim() - 1))):
        raise ValueError(f"key {tuple(k.shape)} and value {tuple(v.shape)} disagree (input_layout={layout!r}): they "
                         "must agree on batch, heads and sequence length; only the head size may differ (MLA)")
    if layout in ("BSH", "SBH") and (kv_heads <= 0 or v.size(2) % kv_heads):
        raise ValueError(f"input_layout={layout!r}: the value's hidden size {v.size(2)} (shape {tuple(v.shape)}) "
                         f"is not a multiple of the K/V head count {kv_heads}")
    return value_head_dim(v, layout, kv_heads)


def value_head_dim(v: Tensor, layout: str, kv_heads: int) -> int:
    if layout in ("BSH", "SBH"):
        return v.size(2) // kv_heads if kv_heads > 0 else 0
    return v.size(-1)


def output_shape(q: Tensor, k: Tensor, v: Tensor, layout: str, head_num: int) -> tuple[int, ...]:
    """From shapes alone, as torch_npu's meta function (BSH/SBH: K/V heads = K's hidden size / Q's head size)."""
    shape = list(q.shape)
    if layout in ("BSH", "SBH"):
        q_head = q.size(2) // head_num if head_num > 0 else 0
        kv_heads = k.size(2) // q_head if q_head > 0 else 0
        shape[-1] = head_num * value_head_dim(v, layout, kv_heads)
    else:
        shape[-1] = v.size(-1)
    return tuple(shape)


def load_balance_enabled() -> bool:
    """torch's ``_cp_options.enable_load_balance`` (the one read of it): sequences lie head-tail, else contiguous."""
    global _CP_OPTIONS
    if _CP_OPTIONS is None:  # imported at the first read (torch.distributed may be absent until then)
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
        _CP_OPTIONS = _cp_options
    return bool(_CP_OPTIONS.enable_load_balance)


_CP_OPTIONS = None
