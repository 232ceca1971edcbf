"""Dense float64 references for packed documents (TND): the block-diagonal mask and
attention on the whole packed sequence, in ``[T, N, D]``."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..npu_ops import INT_MAX
from .reference import dense_attention

__all__ = ["document_masked", "dense_tnd_attention", "band_modes"]


def band_modes(documents: int, sparse_mode: int) -> list[str]:
    """``document_masked``'s mode of each of ``documents`` non-empty square documents under a band
    spelling: 4 the band in every one, 7 / 8 in the last / first, the others causal."""
    causal = ["left_up"] * documents
    if sparse_mode == 4:
        return ["band"] * documents
    if sparse_mode == 7:
        return causal[:-1] + ["band"]
    if sparse_mode == 8:
        return ["band"] + causal[1:]
    raise ValueError(f"sparse_mode={sparse_mode} is no band spelling (4, 7 or 8)")


def document_masked(cu_q: Sequence[int], cu_kv: Sequence[int], mode: Union[str, Sequence[str]] = "full",
                    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX) -> torch.Tensor:
    """[T, Tkv] bool, True = masked out: query segment i sees only key segment i; inside it
    ``mode`` "full", "left_up" (j <= i), "right_down" (j <= i + skv - sq) or "band" (the band of
    ``pre_tockens`` / ``next_tockens`` anchored at the segment's bottom-right corner:
    i - pre <= j - (skv - sq) <= i + next), for every segment or one mode per segment."""
    modes = [mode] * len(cu_q) if isinstance(mode, str) else list(mode)
    if len(modes) != len(cu_q):
        raise ValueError(f"{len(modes)} modes for {len(cu_q)} segments")
    masked = torch.ones(cu_q[-1], cu_kv[-1], dtype=torch.bool)
    q0 = k0 = 0
    for q1, k1, mode in zip(cu_q, cu_kv, modes):
        i = torch.arange(q1 - q0).view(-1, 1)
        j = torch.arange(k1 - k0).view(1, -1)
        shift = (k1 - k0) - (q1 - q0)
        if mode == "full":
            allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        elif mode == "left_up":
            allowed = j <= i
        elif mode == "right_down":
            allowed = j <= i + shift
        elif mode == "band":
            allowed = (j - shift - i <= next_tockens) & (i - (j - shift) <= pre_tockens)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        masked[q0:q1, k0:k1] = ~allowed
        q0, k0 = q1, k1
    return masked


def dense_tnd_attention(q, k, v, dout, cu_q: Sequence[int], cu_kv: Optional[Sequence[int]] = None,
                        mode: Union[str, Sequence[str]] = "full", keep=None, keep_prob: float = 1.0,
                        dtype=torch.float64, sink=None, pre_tockens: int = INT_MAX,
                        next_tockens: int = INT_MAX) -> dict:
    """``dense_attention`` (in ``dtype``, float64 by default; scale 1/sqrt(D)) of TND tensors
    q/dout [T, Nq, D], k/v [Tkv, Nkv, D] under the documents' block-diagonal mask (``mode`` and
    ``pre/next_tockens`` as ``document_masked``); ``keep``: [1, Nq, T, Tkv]; ``sink``: [Nq] attention sinks. Returns out/dq/dk/dv in [T, N, D], lse [T, Nq]
    (-inf for rows that see no key and no sink) and, with a sink, dsink [Nq]."""
    cu_kv = cu_q if cu_kv is None else cu_kv
    dense = [t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v, dout)]
    res = dense_attention(*dense, causal=False, keep=keep, keep_prob=keep_prob, dtype=dtype,
                          masked=document_masked(cu_q, cu_kv, mode, pre_tockens, next_tockens), sink=sink)
    out = {name: res[name].squeeze(0).permute(1, 0, 2) for name in ("out", "dq", "dk", "dv")}
    out["lse"] = res["lse"].squeeze(0).permute(1, 0)
    if sink is not None:
        out["dsink"] = res["dsink"]
    return out
