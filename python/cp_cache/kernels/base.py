"""The step-kernel protocol: one attention block of a ring step, forward and backward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

from torch import Tensor

from ..npu_ops import INT_MAX

__all__ = ["StepForward", "StepKernel", "StepMask"]


@dataclass(frozen=True)
class StepMask:
    """The mask of one kernel call, in the op's terms: "none", "causal" (sparse_mode 2),
    "band" (sparse_mode 4 with the op's pre/next_tockens) or "given" (sparse_mode 1 with
    ``block``, True = masked out)."""

    kind: str
    pre_tockens: int = INT_MAX
    next_tockens: int = INT_MAX
    block: Optional[Tensor] = field(default=None, compare=False)


@dataclass
class StepForward:
    """Result of one block's forward.

    out: in the input layout and the query dtype.
    lse: float32 [B, Nq, Sq]; -inf for rows that see no key.
    seed, offset: int64 [1] CPU tensors the kernel used for dropout (None, or
        tensor([0]), when there is no dropout).
    """

    out: Tensor
    lse: Tensor
    seed: Optional[Tensor]
    offset: Optional[Tensor]


@runtime_checkable
class StepKernel(Protocol):
    """Computes attention of a query block against one K/V block.

    ``mask`` (``StepMask``) in the op's terms: "none", "causal" (left-up,
    sparse_mode 2), "band" (sparse_mode 4 with its pre/next_tockens, anchored at the
    bottom-right corner) or "given" (its ``block``, True = masked out).
    K/V may have fewer heads than Q (GQA, Nq % Nkv == 0); kernels handle it.
    """

    name: str

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        layout: str,
        head_num: int,
        scale: float,
        keep_prob: float,
        mask: StepMask,
    ) -> StepForward: ...

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dout: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        layout: str,
        head_num: int,
        scale: float,
        keep_prob: float,
        mask: StepMask,
        seed: Optional[Tensor],
        offset: Optional[Tensor],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of this block given the FINAL merged ``out`` (query dtype) and
        float32 ``lse`` of these query rows; returns dq, dk, dv (float32 allowed)."""
        ...
