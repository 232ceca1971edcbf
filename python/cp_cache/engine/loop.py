"""The ring's loop, shared by the strategies that rotate K/V blocks (the ring, packed
documents, the ring inside hybrid): the step records, the results, the forward and backward
loops (K/V rotation posted before each step's compute, dK/dV accumulators travelling with
their block, per-call timing, drain on error).

Step i on rank r uses the block of group rank ``(r - i) % W``; at most two K/V blocks are
alive. A strategy gives the loop a ``compute`` callback for one step on the block it holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import layout as L
from .steps import PARTS
from .transport import TAG_DKV, TAG_KV, Rotation

__all__ = ["RingStep", "ForwardResult", "BackwardResult", "forward_ring", "backward_ring", "check_steps",
           "with_length", "empty_outputs"]


@dataclass
class RingStep:
    index: int  # 0..W-1
    source_rank: int  # group rank whose K/V block this step used: (rank - index) % W
    part: str  # one of engine.steps.PARTS
    rng: tuple = ()  # per kernel call of the step: (seed, offset) tensors, or () without

    @property
    def seed(self) -> Optional[Tensor]:
        return self._single()[0]

    @property
    def offset(self) -> Optional[Tensor]:
        return self._single()[1]

    def _single(self) -> tuple:
        if len(self.rng) > 1:
            raise ValueError(f"ring step {self.index} made {len(self.rng)} kernel calls; read .rng")
        return self.rng[0] if self.rng else (None, None)


@dataclass
class ForwardResult:
    out: Tensor
    lse: Tensor
    steps: list[RingStep]
    bytes_sent: int
    compute_seconds: float = 0.0  # kernels and merges
    wait_seconds: float = 0.0  # blocked on a K/V receive: communication the compute did not hide
    lengths: Optional[list] = None  # every rank's (local query length, local K/V length)


@dataclass
class BackwardResult:
    dq: Tensor
    dk: Tensor
    dv: Tensor
    bytes_sent: int
    compute_seconds: float = 0.0  # kernels and accumulation
    wait_seconds: float = 0.0  # blocked on a K/V or dK/dV receive
    lengths: Optional[list] = None  # every rank's (local query length, local K/V length)


def with_length(t: Tensor, layout: str, length: int) -> torch.Size:
    """``t``'s shape with sequence length ``length``."""
    shape = list(t.shape)
    shape[L.seq_dim(layout)] = length
    return torch.Size(shape)


class _KVTravel:
    """This rank's K/V block travelling round the ring (every rank's lengths in ``lengths``):
    at step i the current block is rank ``(rank - i) % W``'s; the next one is in flight while
    step i computes."""

    def __init__(self, k: Tensor, v: Tensor, lengths: list, layout: str, *, group, rank: int, size: int):
        self._kv = Rotation([k.contiguous(), v.contiguous()], group, rank, size, TAG_KV)
        self._like, self._lengths, self._layout = (k, v), lengths, layout
        self._rank, self._size = rank, size

    def block_shapes(self, source: int) -> list[torch.Size]:
        """The shapes of rank ``source``'s K/V block."""
        return [with_length(t, self._layout, self._lengths[source][1]) for t in self._like]

    @property
    def current(self) -> list[Tensor]:
        return self._kv.current

    def post_next(self, i: int, last: int) -> int:
        """Before step ``i``'s compute: send the held block on, receive step i+1's (none after
        the ``last`` step); bytes sent."""
        if i >= last:
            return 0
        return self._kv.post(recv_shapes=self.block_shapes((self._rank - i - 1) % self._size))

    def advance(self) -> float:
        """After step i's compute: wait for the hop in flight; seconds blocked."""
        if not self._kv.in_flight:
            return 0.0
        started = time.perf_counter()
        self._kv.advance()
        return time.perf_counter() - started

    def drain(self) -> None:
        self._kv.drain()


def forward_ring(k: Tensor, v: Tensor, lengths: list, layout: str, last: int, compute, *, group, rank: int,
                 size: int) -> tuple[list[RingStep], int, float, float]:
    """Steps 0..``last`` of a forward ring: this rank's K/V block (``k``, ``v``; every rank's
    lengths in ``lengths``) travels round while ``compute(i, cur_k, cur_v) -> (part, rng)``
    computes step i on the block it holds. Returns (the step records, bytes sent, compute
    seconds, seconds blocked on a receive)."""
    steps: list[RingStep] = []
    bytes_sent = 0
    compute_s = wait_s = 0.0
    kv = _KVTravel(k, v, lengths, layout, group=group, rank=rank, size=size)
    try:
        for i in range(last + 1):
            cur_k, cur_v = kv.current
            bytes_sent += kv.post_next(i, last)
            started = time.perf_counter()
            part, rng = compute(i, cur_k, cur_v)
            steps.append(RingStep(index=i, source_rank=(rank - i) % size, part=part, rng=tuple(rng)))
            compute_s += time.perf_counter() - started
            del cur_k, cur_v
            wait_s += kv.advance()
    except BaseException:
        kv.drain()
        raise
    return steps, bytes_sent, compute_s, wait_s


class _GradAccumulators:
    """The float32 dK/dV accumulators, travelling around the ring with their K/V block.

    At step i a rank holds block (rank - i) % W and that block's accumulators: fresh
    zeros for its own block at step 0, else the ones that arrived from the previous
    rank. After adding its step's gradients it passes them on to the next rank, and
    after the last step straight back to the block's owner (the next rank too when the
    ring went all the way round). Two pairs of buffers serve every hop.
    """

    def __init__(self, group, rank: int, size: int):
        self._group, self._rank, self._size = group, rank, size
        self._rotation: Optional[Rotation] = None
        self.bytes_sent = 0

    def for_block(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The accumulators of the block (``k``, ``v``) held at this step."""
        if self._rotation is None:
            zeros = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
            self._rotation = Rotation(zeros, self._group, self._rank, self._size, TAG_DKV)
        elif self._rotation.in_flight:
            self._rotation.advance()
        return tuple(self._rotation.current)

    def pass_on(self, shift: int = 1, recv_shapes: Optional[list[torch.Size]] = None) -> None:
        """Send the held accumulators ``shift`` ranks ahead (nothing to do when that is this rank),
        receiving those the rank ``shift`` behind holds (of ``recv_shapes``: uneven shards)."""
        if shift % self._size:
            self.bytes_sent += self._rotation.post(shift, recv_shapes=recv_shapes)

    def drain(self) -> None:
        if self._rotation is not None:
            self._rotation.drain()

    def home(self) -> tuple[Tensor, Tensor]:
        """This rank's own block's accumulators, after the last hop."""
        if self._rotation.in_flight:
            self._rotation.advance()
        return tuple(self._rotation.current)


def backward_ring(k: Tensor, v: Tensor, lengths: list, layout: str, last: int, compute, add_rows, *, group,
                  rank: int, size: int) -> tuple[Tensor, Tensor, int, float, float]:
    """Steps 0..``last`` of a backward ring: the K/V blocks travel round as in ``forward_ring``;
    ``compute(i, cur_k, cur_v) -> [(where, dk, dv)]`` computes step i, whose gradients
    ``add_rows(accumulator, where, grad)`` adds into the held block's float32 accumulators,
    which then move on with their block, and home after the last step. Returns (this rank's
    own block's dK and dV accumulators, bytes sent, compute seconds, seconds blocked on a
    receive)."""

    accumulators = _GradAccumulators(group, rank, size)
    bytes_sent = 0
    compute_s = wait_s = 0.0
    kv = _KVTravel(k, v, lengths, layout, group=group, rank=rank, size=size)
    try:
        for i in range(last + 1):
            cur_k, cur_v = kv.current
            bytes_sent += kv.post_next(i, last)
            started = time.perf_counter()
            kv_grads = compute(i, cur_k, cur_v)
            computed = time.perf_counter()
            dk_acc, dv_acc = accumulators.for_block(cur_k, cur_v)
            received = time.perf_counter()
            for where, dk_i, dv_i in kv_grads:
                add_rows(dk_acc, where, dk_i)
                add_rows(dv_acc, where, dv_i)
            del dk_acc, dv_acc, kv_grads
            shift = 1 if i < last else size - last
            accumulators.pass_on(shift, kv.block_shapes((rank - shift - i) % size))  # the block it holds
            passed = time.perf_counter()
            compute_s += (computed - started) + (passed - received)
            wait_s += received - computed
            del cur_k, cur_v
            wait_s += kv.advance()
    except BaseException:
        kv.drain()
        accumulators.drain()
        raise
    homed = time.perf_counter()
    dk, dv = accumulators.home()
    wait_s += time.perf_counter() - homed
    return dk, dv, bytes_sent + accumulators.bytes_sent, compute_s, wait_s


def check_steps(steps: list[RingStep], rank: int, size: int, expected: int) -> None:
    if len(steps) != expected:
        raise RuntimeError(
            f"backward got {len(steps)} ring steps where its forward makes {expected} (world size {size})"
        )
    for i, st in enumerate(steps):
        if st.index != i or st.source_rank != (rank - i) % size or st.part not in PARTS:
            raise RuntimeError(
                f"ring step record {i} (index={st.index}, source_rank={st.source_rank}, part={st.part!r}) "
                f"does not belong to rank {rank} of {size}"
            )


def empty_outputs(plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Empty (out, float32 LSE) of the shapes a strategy's forward returns for ``q``, ``k``, ``v``
    (``plan``: its CallPlan; out: the query's shape with V's head size): what the strategies'
    ``fake`` give while tracing."""
    return (q.new_empty(L.output_shape(q, k, v, plan.layout, plan.head_num)),
            q.new_empty(L.lse_shape(q, plan.layout, plan.head_num), dtype=torch.float32))
