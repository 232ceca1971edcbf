"""The ring's loop, shared by the strategies that rotate K/V blocks (the ring, packed documents, the
ring inside hybrid): the step records and results, the forward and backward loops (step 0 on the
rank's own block, then the ranks' agreement, then the other steps as their K/V rows arrive), timing,
drain on error; and the checks every strategy makes of its local inputs.

Step i on rank r uses the block of group rank ``(r - i) % W``. The rows get there by the direct
exchange (``engine/exchange.py``: rank r sends rank r+i only the rows of its block that rank needs,
posted before the previous step's compute, every stage at once where the whole exchange is small;
in backward the dK/dV partials go straight back to their owner), or with ``exchange="ring"`` as
whole blocks relayed round the ring, the dK/dV accumulators travelling with their block.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import layout as L
from ..plan import CallPlan
from .exchange import ExchangePlan, StageRows, exchange_plan
from .transport import TAG_DKV, TAG_KV, Rotation, Transfer, group_state, join_once

# A rank whose whole direct exchange receives at most this many bytes posts every stage before
# step 0 instead of one stage ahead: below it a stage's latency, not its bytes, sets its time, so
# W-1 rounds become one; the extra memory is at most this.
SMALL_EXCHANGE_BYTES = 1 << 20

__all__ = ["own_group", "group_info", "with_length", "planned_exchange", "RingStep", "ForwardResult", "BackwardResult", "Traffic", "forward_ring", "backward_ring", "placed_block",
           "check_steps", "check_step", "empty_outputs", "check_qkv",
           "check_keep_prob", "check_backward_operands"]


def own_group(groups):
    """A strategy's own process group: the innermost of ``groups`` (outer first; empty: none).
    Hybrid's Ulysses takes the inner CP dimension and gives its ring the rest."""
    return groups[-1] if len(groups) else None


def group_info(world_size: int, rank: int, group) -> tuple[int, int, object]:
    """(world size, rank, group) of a plan's ring after checking them against ``group`` (None:
    the default group when W > 1, none when W == 1)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if group is None and world_size > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"world_size={world_size} needs a process group, but group is None "
                "and torch.distributed is not initialized"
            )
        group = dist.group.WORLD
    if group is None:
        size, rank_in_group = 1, 0
    elif isinstance(group, dist.ProcessGroup):  # its own size and rank: no lookup through the default group
        size, rank_in_group = group.size(), group.rank()
    else:
        size, rank_in_group = dist.get_world_size(group), dist.get_rank(group)
    if size != world_size:
        raise ValueError(f"plan.world_size={world_size} but the process group has {size} ranks")
    if rank_in_group != rank:
        raise ValueError(f"plan.rank={rank} but this process is rank {rank_in_group} of the group")
    return size, rank, group


def with_length(t: Tensor, seq_dim: int, length: int) -> torch.Size:
    """``t``'s shape with ``length`` on its sequence dim ``seq_dim``."""
    shape = list(t.shape)
    shape[seq_dim] = length
    return torch.Size(shape)


@dataclass
class RingStep:
    index: int  # 0..W-1
    part: str  # "causal", "full", "q_tail", "kv_head", "band", "masked" or "skip"
    rng: tuple = ()  # per kernel call of the step: (seed, offset) tensors, or () without
    kept: tuple = ()  # keep_kv: the (K rows, V rows) this step received, kept for the backward

    def source_rank(self, rank: int, size: int) -> int:
        """The group rank whose K/V block this step used on ``rank`` of ``size``."""
        return (rank - self.index) % size

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
    bytes_received: int = 0
    bytes_lower_bound: Optional[int] = None  # the least this rank must send (None: not computed)
    bytes_received_lower_bound: Optional[int] = None  # the least it must receive


@dataclass
class BackwardResult:
    dq: Tensor
    dk: Tensor
    dv: Tensor
    bytes_sent: int
    compute_seconds: float = 0.0  # kernels and accumulation
    wait_seconds: float = 0.0  # blocked on a K/V or dK/dV receive
    lengths: Optional[list] = None  # every rank's (local query length, local K/V length)
    bytes_received: int = 0
    bytes_lower_bound: Optional[int] = None  # as in ForwardResult: K/V rows again and dK/dV rows back
    bytes_received_lower_bound: Optional[int] = None
    dsink: Optional[Tensor] = None  # the attention sink's gradient over this rank's rows (algorithms/sinks.py)


@dataclass
class Traffic:
    """The bytes a ring loop moved for this rank, and the least it had to (the K/V rows the
    mask needs; backward: those again and their float32 dK/dV partials back to the owner)."""

    sent: int = 0
    received: int = 0
    sent_bound: Optional[int] = None
    received_bound: Optional[int] = None

    def fields(self) -> dict:
        """As the keyword arguments of a ForwardResult / BackwardResult."""
        return dict(bytes_sent=self.sent, bytes_received=self.received, bytes_lower_bound=self.sent_bound,
                    bytes_received_lower_bound=self.received_bound)


def _row_bytes(k: Tensor, v: Tensor, seq_dim: int, itemsize: Optional[int] = None) -> int:
    """Bytes of one sequence row of K plus one of V (at ``itemsize``: their own by default)."""
    length = k.size(seq_dim)
    if length == 0:
        return 0
    return (k.numel() * (itemsize or k.element_size()) + v.numel() * (itemsize or v.element_size())) // length


def _bounds(traffic: Traffic, exchange: ExchangePlan, k: Tensor, v: Tensor, seq_dim: int, backward: bool,
            kv_kept: bool = False, partial_itemsize: int = 4) -> Traffic:
    kv = 0 if kv_kept else _row_bytes(k, v, seq_dim)  # a backward on kept rows moves no K/V
    traffic.sent_bound = exchange.rows_sent * kv
    traffic.received_bound = exchange.rows_received * kv
    if backward:  # the partials of the rows received go back (float32, or K/V's dtype)
        grad = _row_bytes(k, v, seq_dim, partial_itemsize)
        traffic.sent_bound += exchange.rows_received * grad
        traffic.received_bound += exchange.rows_sent * grad
    return traffic


class _KVTravel:
    """This rank's K/V block travelling round the ring (every rank's lengths in ``lengths``):
    at step i the current block is rank ``(rank - i) % W``'s; the next one is in flight while
    step i computes."""

    def __init__(self, k: Tensor, v: Tensor, lengths: list, seq_dim: int, *, group, rank: int, size: int):
        self._kv = Rotation([k.contiguous(), v.contiguous()], group, rank, size, TAG_KV)
        self._like, self._lengths, self._dim = (k, v), lengths, seq_dim
        self._rank, self._size = rank, size
        self.received = 0

    def block_shapes(self, source: int) -> list[torch.Size]:
        """The shapes of rank ``source``'s K/V block."""
        return [with_length(t, self._dim, self._lengths[source][1]) for t in self._like]

    @property
    def current(self) -> list[Tensor]:
        return self._kv.current

    def post_next(self, i: int, last: int) -> int:
        """Before step ``i``'s compute: send the held block on, receive step i+1's (none after
        the ``last`` step); bytes sent."""
        if i >= last:
            return 0
        shapes = self.block_shapes((self._rank - i - 1) % self._size)
        self.received += sum(shape.numel() * t.element_size() for shape, t in zip(shapes, self._like))
        return self._kv.post(recv_shapes=shapes)

    def advance(self) -> float:
        """After step i's compute: wait for the hop in flight; seconds blocked."""
        if not self._kv.in_flight:
            return 0.0
        started = time.perf_counter()
        self._kv.advance()
        return time.perf_counter() - started

    def drain(self) -> None:
        self._kv.drain()


class _KVDirect:
    """The direct exchange of K/V rows (``ExchangePlan``): before step i's compute, stage i+1
    sends rank r+i+1 the rows of this rank's block it needs and receives from rank r-i-1 the
    rows this rank needs of that block. At step i the current block is rank (r - i) % W's, of
    its shape, with the rows received in place; its other rows are never read (every query of
    this rank is masked there): zeros, or what the buffer held before. Two block buffers
    serve every stage, as in the ring."""

    def __init__(self, k: Tensor, v: Tensor, lengths: list, seq_dim: int, exchange: ExchangePlan, *, group,
                 rank: int, size: int, keep: bool = False):
        if size > 1:
            join_once(group, k.device)
        self._keep = keep  # keep each stage's received rows (``kept``): no buffer is reused
        self.kept: dict[int, tuple] = {}
        self._own = [k.contiguous(), v.contiguous()]
        self.current = self._own
        self._plan = exchange
        self._lengths, self._dim = lengths, seq_dim
        self._group, self._rank, self._size = group, rank, size
        self._transfers: dict[int, Transfer] = {}  # stage -> its transfer in flight
        self._stage = 0
        self._spare: Optional[list[Tensor]] = None  # a block buffer not in use
        self._buffered = False  # whether ``current`` is one of the two block buffers
        # alike on every rank (the ranks agreed on the row sizes and share the lengths)
        most = max([kv for _, kv in lengths], default=k.size(seq_dim))
        self._all_at_once = (size - 1) * most * _row_bytes(k, v, seq_dim) <= SMALL_EXCHANGE_BYTES
        self.received = 0

    def block_shapes(self, source: int) -> list[torch.Size]:
        return [with_length(t, self._dim, self._lengths[source][1]) for t in self._own]

    def _buffers(self, shapes: list[torch.Size]) -> list[Tensor]:
        spare, self._spare = self._spare, None
        if spare is not None and [t.shape for t in spare] == shapes:
            return spare
        return [torch.zeros(shape, dtype=t.dtype, device=t.device) for t, shape in zip(self._own, shapes)]

    def post_next(self, i: int, last: int) -> int:
        """Before step ``i``'s compute: post stage i+1 (none after the ``last`` step), or before
        step 0 every stage where the whole exchange is small; bytes sent."""
        if i + 1 > last or i + 1 in self._transfers:
            return 0
        sent = 0
        for stage in range(i + 1, last + 1 if self._all_at_once else i + 2):
            sent += self._post(stage)
        return sent

    def _post(self, stage: int) -> int:
        transfer = self._transfers[stage] = self._transfer(stage)
        self.received += transfer.received_bytes
        return transfer.nbytes

    def _transfer(self, stage: int) -> Transfer:
        send, recv = self._plan.send[stage], self._plan.recv[stage]
        sending = [_taken(send, t, self._dim) for t in self._own] if send.count else []
        if not recv.count:
            receiving = []
        elif recv.index is None:  # the whole block: straight into a block buffer
            receiving = self._buffers(self.block_shapes((self._rank - stage) % self._size))
        else:
            receiving = [torch.empty(with_length(t, self._dim, recv.count), dtype=t.dtype, device=t.device)
                         for t in self._own]
        return Transfer.shifted(sending, receiving, stage, self._rank, self._size, self._group, TAG_KV)

    def advance(self) -> float:
        """After step i's compute: wait for stage i+1; seconds blocked."""
        transfer = self._transfers.pop(self._stage + 1, None)
        if transfer is None:
            return 0.0
        self._stage += 1
        started = time.perf_counter()
        received = transfer.wait()
        waited = time.perf_counter() - started
        block, buffered = self._block(received)
        if self._keep and received:
            self.kept[self._stage] = tuple(received)
        if self._buffered and not self._keep:  # kept rows may live in a block buffer: none is reused
            self._spare = self.current
        self.current, self._buffered = block, buffered
        return waited

    def _block(self, received: list[Tensor]) -> tuple[list[Tensor], bool]:
        """The block of the stage's source with the ``received`` rows in place; whether it is a
        block buffer."""
        shapes = self.block_shapes((self._rank - self._stage) % self._size)
        return placed_block(self._own, received, self._plan.recv[self._stage], shapes, self._dim, self._buffers)

    def drain(self) -> None:
        transfers, self._transfers = self._transfers, {}
        for transfer in transfers.values():
            transfer.drain()


class _KVKept(_KVDirect):
    """The K/V blocks of a backward whose forward kept the rows it received (``keep_kv``): each
    stage's block is rebuilt from those rows, nothing is sent or received."""

    def __init__(self, k: Tensor, v: Tensor, lengths: list, seq_dim: int, exchange: ExchangePlan, kept: list,
                 *, group, rank: int, size: int):
        super().__init__(k, v, lengths, seq_dim, exchange, group=group, rank=rank, size=size)
        self._kept = kept

    def post_next(self, i: int, last: int) -> int:
        stage = i + 1
        if stage <= last:
            self._stage = stage
            rows = self._plan.recv[stage]
            if rows.count and len(self._kept[stage]) != 2:
                raise RuntimeError(f"keep_kv: the forward kept no K/V rows for ring step {stage}, whose block "
                                   f"needs {rows.count} rows: the step records are not this call's")
        return 0

    def advance(self) -> float:
        if self._stage == 0:
            return 0.0
        block, buffered = self._block(list(self._kept[self._stage]) if self._plan.recv[self._stage].count else [])
        if self._buffered:
            self._spare = self.current
        self.current, self._buffered = block, buffered and self._plan.recv[self._stage].index is not None
        self._stage = 0
        return 0.0


def placed_block(own: list[Tensor], received: list[Tensor], rows: StageRows, shapes: list[torch.Size], seq_dim: int,
                 buffers: Optional[Callable[[list[torch.Size]], list[Tensor]]] = None) -> tuple[list[Tensor], bool]:
    """The K/V block of ``shapes`` whose ``rows`` arrived as ``received`` (like ``own``: dtypes,
    device), the rows in place: the received tensors where they are the whole block, else zeros
    (``buffers(shapes)``; None: new ones) with the rows copied in; whether it is such a buffer."""
    if rows.count and rows.index is None:
        return received, True
    if not rows.count:  # no query of this rank reads that block: zeros without memory
        return [t.new_zeros(()).expand(shape) for t, shape in zip(own, shapes)], False
    if buffers is None:
        zeros = [torch.zeros(shape, dtype=t.dtype, device=t.device) for t, shape in zip(own, shapes)]
    else:
        zeros = buffers(shapes)
    return [_placed(rows, buf, seq_dim, got) for buf, got in zip(zeros, received)], True


def _taken(rows: StageRows, t: Tensor, dim: int) -> Tensor:
    """These rows of ``t`` (a block) on ``dim``: ``t`` itself (all), a view (consecutive) or a copy."""
    if rows.index is None:
        return t
    if rows.start is not None:
        return t.narrow(dim, rows.start, rows.count)
    return t.index_select(dim, rows.index)


def _placed(rows: StageRows, buffer: Tensor, dim: int, got: Tensor) -> Tensor:
    """``buffer`` (a block) with ``got`` (these rows of it) copied in place."""
    if rows.start is not None:
        buffer.narrow(dim, rows.start, rows.count).copy_(got)
        return buffer
    return buffer.index_copy_(dim, rows.index, got)


def planned_exchange(plan: CallPlan, lengths: list, device: torch.device, *, group=None,
                     mask_rows: Optional[Tensor] = None) -> ExchangePlan:
    """This rank's direct exchange for ``plan`` with its indices on ``device``: made per call for a given
    mask (its values decide), else remembered by value on the CP group (a layer's calls repeat it)."""
    if plan.mask.given or plan.world_size == 1:
        return exchange_plan(plan, lengths, group=group, mask_rows=mask_rows).on(device)
    key = ("exchange", plan.world_size, plan.rank, plan.layout, plan.mask, plan.load_balance, plan.documents,
           plan.placement, tuple(map(tuple, lengths)), device)
    return group_state(group).remember(key, lambda: exchange_plan(plan, lengths).on(device))


def _kv_blocks(k: Tensor, v: Tensor, lengths: list, seq_dim: int, exchange: Optional[ExchangePlan], *,
               keep: bool = False, kept: Optional[list] = None, **where):
    """Where each step's K/V block comes from: the ring (no exchange plan), the direct exchange
    (keeping what it receives with ``keep``), or the rows a forward kept (``kept``, per step)."""
    if exchange is None:
        if keep or kept is not None:
            raise ValueError("keep_kv needs the direct exchange (exchange='direct')")
        return _KVTravel(k, v, lengths, seq_dim, **where)
    if kept is not None:
        return _KVKept(k, v, lengths, seq_dim, exchange, kept, **where)
    return _KVDirect(k, v, lengths, seq_dim, exchange, keep=keep, **where)


def _agreed_first(compute, agreement, k: Tensor, v: Tensor):
    """Step 0 on this rank's own block, before the agreement is waited for. A step 0 that fails waits
    for it first: ranks whose calls disagree then raise the agreement's error, the same on every rank."""
    try:
        return compute(0, k, v)
    except BaseException:
        agreement.lengths()
        raise


def _agreed(plan: CallPlan, agreement, lengths: Optional[list], group, device, mask_rows) -> tuple:
    """Once the ranks agree: every rank's (query, K/V) lengths (the agreement's, or ``lengths`` where
    the placement gives them) and the direct exchange's plan (also the bound of the ring's)."""
    agreed = agreement.lengths()
    lengths = agreed if lengths is None else lengths
    return lengths, planned_exchange(plan, lengths, device, group=group, mask_rows=mask_rows)


def forward_ring(plan: CallPlan, groups, k: Tensor, v: Tensor, seq_dim: int, last: int, compute, agreement, *,
                 mask_rows: Optional[Tensor] = None,
                 lengths: Optional[list] = None) -> tuple[list[RingStep], Traffic, float, float, list]:
    """Steps 0..``last`` of a forward ring on the innermost of ``groups``: ``compute(i, cur_k, cur_v) ->
    (part, rng)`` computes step i on the block held. Step 0 runs on this rank's own block while the
    ``agreement`` settles; then the K/V rows each step needs arrive, each stage posted before the
    previous step's compute. With ``plan.keep_kv`` each record keeps the rows its step received.
    Returns (the step records, the traffic, compute seconds, seconds blocked, the lengths)."""
    size, rank, group = group_info(plan.world_size, plan.rank, own_group(groups))
    steps: list[RingStep] = []
    traffic = Traffic()
    compute_s = wait_s = 0.0
    kv = exchange = None
    keep = plan.keep_kv
    try:
        for i in range(last + 1):
            cur_k, cur_v = (k, v) if kv is None else kv.current
            if kv is not None:
                traffic.sent += kv.post_next(i, last)
            started = time.perf_counter()
            part, rng = compute(i, cur_k, cur_v) if kv is not None else _agreed_first(compute, agreement, k, v)
            steps.append(RingStep(index=i, part=part, rng=tuple(rng), kept=kv.kept.get(i, ()) if keep and kv else ()))
            compute_s += time.perf_counter() - started
            del cur_k, cur_v
            if kv is None:
                lengths, exchange = _agreed(plan, agreement, lengths, group, k.device, mask_rows)
                kv = _kv_blocks(k, v, lengths, seq_dim, exchange if plan.exchange == "direct" else None, keep=keep,
                                group=group, rank=rank, size=size)
                traffic.sent += kv.post_next(0, last)
            wait_s += kv.advance()
    except BaseException:
        if kv is not None:
            kv.drain()
        raise
    traffic.received = kv.received
    _bounds(traffic, exchange, k, v, seq_dim, backward=False)
    return steps, traffic, compute_s, wait_s, lengths


class _GradAccumulators:
    """The float32 dK/dV accumulators, travelling around the ring with their K/V block.

    At step i a rank holds block (rank - i) % W and that block's accumulators: fresh
    zeros for its own block at step 0, else the ones that arrived from the previous
    rank. After adding its step's gradients it passes them on to the next rank, and
    after the last step straight back to the block's owner (the next rank too when the
    ring went all the way round). Two pairs of buffers serve every hop.
    """

    def __init__(self, kv: _KVTravel, group, rank: int, size: int):
        self._kv, self._group, self._rank, self._size = kv, group, rank, size
        self._rotation: Optional[Rotation] = None
        self.bytes_sent = self.received = 0

    def for_block(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The accumulators of the block (``k``, ``v``) held at step ``i``."""
        if self._rotation is None:
            zeros = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
            self._rotation = Rotation(zeros, self._group, self._rank, self._size, TAG_DKV)
        elif self._rotation.in_flight:
            self._rotation.advance()
        return tuple(self._rotation.current)

    def pass_on(self, i: int, last: int, held: tuple[Tensor, Tensor]) -> float:
        """After step ``i``: send the held accumulators on (after the ``last`` step: home),
        receiving those of the block the rank behind holds."""
        shift = 1 if i < last else self._size - last
        if shift % self._size:
            shapes = self._kv.block_shapes((self._rank - shift - i) % self._size)  # the block it holds
            self.received += sum(shape.numel() * 4 for shape in shapes)
            self.bytes_sent += self._rotation.post(shift, recv_shapes=shapes)
        return 0.0

    def drain(self) -> None:
        if self._rotation is not None:
            self._rotation.drain()

    def home(self) -> tuple[Tensor, Tensor]:
        """This rank's own block's accumulators, after the last hop."""
        if self._rotation.in_flight:
            self._rotation.advance()
        return tuple(self._rotation.current)


class _GradReturns:
    """The float32 dK/dV of the direct exchange. This rank's own block has its accumulators;
    at step i > 0 the partials of the block held (rank r-i's) go into fresh zeros, and after
    the step the rows this rank received of it go straight back to rank r-i, while the
    partials rank r+i computed for the rows it received of this rank's block come in and are
    added (waited for after the next step)."""

    def __init__(self, k: Tensor, v: Tensor, seq_dim: int, exchange: ExchangePlan, group, rank: int, size: int,
                 partials: torch.dtype = torch.float32):
        self._own = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                     torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        self._partials_dtype = partials  # what the partials travel in (added in float32 at home)
        self._plan, self._dim = exchange, seq_dim
        self._group, self._rank, self._size = group, rank, size
        self._pending: Optional[tuple[Transfer, int]] = None
        self._partials: list[Optional[tuple[Tensor, Tensor]]] = [None, None]
        self.bytes_sent = self.received = 0

    def for_block(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Step 0: this rank's own accumulators; step i > 0: zeros of the held block's shape, in
        one of two buffers (the other may still be on its way back)."""
        if i == 0:
            return self._own
        held = self._partials[i % 2]
        if held is None or [t.shape for t in held] != [k.shape, v.shape]:
            held = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                    torch.zeros(v.shape, dtype=torch.float32, device=v.device))
            self._partials[i % 2] = held
        else:
            for t in held:
                t.zero_()
        return held

    def pass_on(self, i: int, last: int, held: tuple[Tensor, Tensor]) -> float:
        """After step ``i``: the previous step's returns added, this step's posted; seconds blocked."""
        waited = self._settle()
        if i == 0:
            return waited
        back, coming = self._plan.recv[i], self._plan.send[i]
        sending = [_taken(back, t, self._dim).to(self._partials_dtype) for t in held] if back.count else []
        receiving = [torch.empty(with_length(t, self._dim, coming.count), dtype=self._partials_dtype,
                                 device=t.device) for t in self._own] if coming.count else []
        # the partials go back to the block's owner, rank r-i; rank r+i's come in
        transfer = Transfer.shifted(sending, receiving, -i, self._rank, self._size, self._group, TAG_DKV)
        self.bytes_sent += transfer.nbytes
        self.received += transfer.received_bytes
        self._pending = (transfer, i)
        return waited

    def _settle(self) -> float:
        if self._pending is None:
            return 0.0
        (transfer, i), self._pending = self._pending, None
        started = time.perf_counter()
        partials = transfer.wait()
        waited = time.perf_counter() - started
        rows = self._plan.send[i]
        for acc, got in zip(self._own, partials):
            if rows.index is None:
                acc.add_(got)
            elif rows.start is not None:
                acc.narrow(self._dim, rows.start, rows.count).add_(got)
            else:
                acc.index_add_(self._dim, rows.index, got.float())
        return waited

    def drain(self) -> None:
        if self._pending is not None:
            (transfer, _), self._pending = self._pending, None
            transfer.drain()

    def home(self) -> tuple[Tensor, Tensor]:
        self._settle()
        return self._own


def _add_at(acc: Tensor, where, grad: Tensor, dim: int) -> None:
    """Add ``grad`` into the rows ``where`` of ``acc``: all (None), (start, length), or an index."""
    if where is None:
        acc.add_(grad)
    elif isinstance(where, tuple):
        acc.narrow(dim, *where).add_(grad)
    else:
        acc.index_add_(dim, where, grad.to(acc.dtype))


def backward_ring(plan: CallPlan, groups, k: Tensor, v: Tensor, seq_dim: int, last: int, compute, agreement,
                  steps: list[RingStep], *, mask_rows: Optional[Tensor] = None,
                  lengths: Optional[list] = None) -> tuple[Tensor, Tensor, Traffic, float, float, list]:
    """Steps 0..``last`` of a backward ring, as ``forward_ring``: ``compute(i, cur_k, cur_v) -> [(rows,
    dk, dv)]`` gives step i's gradients of the held block's ``rows`` (``_add_at``), added into its
    float32 accumulators, which then go back to the block's owner. A ``plan.keep_kv`` forward's
    records (``steps``) rebuild the blocks: no K/V moves. Returns (this rank's own block's dK and dV
    accumulators, the traffic, compute seconds, seconds blocked, the lengths)."""
    size, rank, group = group_info(plan.world_size, plan.rank, own_group(groups))
    where = dict(group=group, rank=rank, size=size)
    kept = [step.kept for step in steps] if plan.keep_kv else None
    partials = k.dtype if plan.grad_partials == "input" else torch.float32
    direct = plan.exchange == "direct"
    kv = accumulators = exchange = None
    traffic = Traffic()
    compute_s = wait_s = 0.0
    try:
        for i in range(last + 1):
            cur_k, cur_v = (k, v) if kv is None else kv.current
            if kv is not None:
                traffic.sent += kv.post_next(i, last)
            started = time.perf_counter()
            kv_grads = compute(i, cur_k, cur_v) if kv is not None else _agreed_first(compute, agreement, k, v)
            computed = time.perf_counter()
            if kv is None:
                lengths, exchange = _agreed(plan, agreement, lengths, group, k.device, mask_rows)
                kv = _kv_blocks(k, v, lengths, seq_dim, exchange if direct else None, kept=kept, **where)
                accumulators = (_GradReturns(k, v, seq_dim, exchange, partials=partials, **where) if direct
                                else _GradAccumulators(kv, **where))
                traffic.sent += kv.post_next(0, last)
            ready_at = time.perf_counter()
            held = accumulators.for_block(i, cur_k, cur_v)
            received = time.perf_counter()
            for rows, dk_i, dv_i in kv_grads:
                _add_at(held[0], rows, dk_i, seq_dim)
                _add_at(held[1], rows, dv_i, seq_dim)
            del kv_grads
            blocked = accumulators.pass_on(i, last, held)
            passed = time.perf_counter()
            compute_s += (computed - started) + (passed - received) - blocked
            wait_s += (ready_at - computed) + (received - ready_at) + blocked
            del cur_k, cur_v, held
            wait_s += kv.advance()
    except BaseException:
        for mover in (kv, accumulators):
            if mover is not None:
                mover.drain()
        raise
    homed = time.perf_counter()
    dk, dv = accumulators.home()
    wait_s += time.perf_counter() - homed
    traffic.sent += accumulators.bytes_sent
    traffic.received = kv.received + accumulators.received
    _bounds(traffic, exchange, k, v, seq_dim, backward=True, kv_kept=kept is not None,
            partial_itemsize=partials.itemsize)
    return dk, dv, traffic, compute_s, wait_s, lengths


def check_steps(steps: list[RingStep], rank: int, size: int, expected: int) -> None:
    """The forward's step records fit this backward: ``expected`` of them, in order."""
    if len(steps) != expected:
        raise RuntimeError(
            f"backward got {len(steps)} ring steps where its forward makes {expected} (world size {size})"
        )
    for i, st in enumerate(steps):
        if st.index != i:
            raise RuntimeError(f"ring step record {i} has index {st.index}: the records of rank {rank} of {size} "
                               "are out of order")


def check_step(step: RingStep, rank: int, part: str, calls: int) -> None:
    """One record against what its step plans now (``part``, ``calls`` kernel calls): the one check
    of the ring's and the packed ring's backward that their inputs are the forward's."""
    if step.part != part or (step.rng and len(step.rng) != calls):
        raise RuntimeError(
            f"ring step {step.index} on rank {rank} recorded part {step.part!r} with {len(step.rng)} kernel calls; "
            f"its plan now gives {part!r} with {calls}: the backward's inputs (mask, lengths, documents, "
            "configuration) differ from the forward's")


def empty_outputs(plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Empty (out, float32 LSE) of the shapes a strategy's forward returns for ``q``, ``k``, ``v``
    (``plan``: its CallPlan; out: the query's shape with V's head size): what the strategies'
    ``fake`` give while tracing."""
    return (q.new_empty(L.output_shape(q, k, v, plan.layout, plan.head_num)),
            q.new_empty(L.lse_shape(q, plan.layout, plan.head_num), dtype=torch.float32))


# ---------------------------------------------------------------- the local checks every strategy makes


def check_qkv(plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[L.Dims, int]:
    """(the query's dims, the K/V head count) of dense-layout q/k/v, after checking them
    against the plan; ValueError (NotImplementedError for TND) naming what is wrong. Checked
    once per (plan, shapes): a layer's calls repeat theirs."""
    return _checked_shapes(plan, tuple(q.shape), tuple(k.shape), tuple(v.shape))


@functools.lru_cache(maxsize=256)
def _checked_shapes(plan: CallPlan, q_shape: tuple, k_shape: tuple, v_shape: tuple) -> tuple[L.Dims, int]:
    q, k, v = (torch.empty(shape, device="meta") for shape in (q_shape, k_shape, v_shape))
    lay = L.check_layout(plan.layout)
    qd = L.dims(q, lay, plan.head_num)
    nkv = L.heads_of(k, lay, qd.head_dim)
    kd = L.dims(k, lay, nkv)
    L.check_value(k, v, lay, nkv)  # V's head size may differ (MLA), nothing else
    if kd.batch != qd.batch or kd.head_dim != qd.head_dim:
        raise ValueError(
            f"query {tuple(q.shape)} and key {tuple(k.shape)} disagree on batch or head size "
            f"(input_layout={lay!r})"
        )
    if plan.head_num % nkv:
        raise ValueError(f"head_num={plan.head_num} is not a multiple of the K/V head count {nkv}")
    if plan.mask.positional and kd.seq != qd.seq:
        raise ValueError(
            f"causal, band and masked ring attention need equal local query and key lengths, got "
            f"{qd.seq} and {kd.seq}"
        )
    if plan.mask.positional and plan.load_balance and qd.seq % 2:
        raise ValueError(
            f"load balancing needs an even local sequence length, got {qd.seq} "
            f"(input_layout={lay!r}, world_size={plan.world_size})"
        )
    check_keep_prob(plan)
    return qd, nkv


def check_keep_prob(plan: CallPlan) -> None:
    if not 0.0 < plan.keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {plan.keep_prob}")


def check_backward_operands(plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                            lse: Tensor) -> None:
    """The backward's incoming gradient, forward output and LSE against q/k/v: dout and out have the
    output's shape (the query's with V's head size)."""
    expected_out, expected = _expected_shapes(plan, tuple(q.shape), tuple(k.shape), tuple(v.shape))
    if tuple(dout.shape) != expected_out or tuple(out.shape) != expected_out:
        raise ValueError(
            f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have the output's shape {expected_out} "
            f"(the query's {tuple(q.shape)} with the value's head size)"
        )
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse has shape {tuple(lse.shape)}, expected {expected}")


@functools.lru_cache(maxsize=256)
def _expected_shapes(plan: CallPlan, q_shape: tuple, k_shape: tuple, v_shape: tuple) -> tuple[tuple, tuple]:
    """(the output's shape, the LSE's) of a call of ``plan`` on q/k/v of these shapes."""
    q, k, v = (torch.empty(shape, device="meta") for shape in (q_shape, k_shape, v_shape))
    return tuple(L.output_shape(q, k, v, plan.layout, plan.head_num)), tuple(L.lse_shape(q, plan.layout, plan.head_num))
