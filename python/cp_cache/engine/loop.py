"""The ring's loop and the local checks every strategy makes. Step 0 runs before the agreement is waited for; step i on
rank r uses rank ``(r - i) % W``'s K/V rows: those needed (the direct exchange) or whole blocks (exchange="ring")."""

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

SMALL_EXCHANGE_BYTES = 1 << 20  # a direct exchange receiving at most this posts every stage at once: latency rules

__all__ = ["own_group", "group_info", "with_length", "planned_exchange", "RingStep", "ForwardResult",
           "BackwardResult", "Traffic", "forward_ring", "backward_ring", "placed_block", "check_steps", "check_step",
           "empty_outputs", "check_qkv", "check_keep_prob", "check_backward_operands"]


def own_group(groups):
    """The innermost of ``groups`` (outer first; empty: None): hybrid's ring gets the outer ones."""
    return groups[-1] if len(groups) else None


def group_info(world_size: int, rank: int, group) -> tuple[int, int, object]:
    """(W, rank, group) of a plan's ring, checked against ``group`` (None: the default group if W > 1)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if group is None and world_size > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"world_size={world_size} needs a process group, but group is None "
                             "and torch.distributed is not initialized")
        group = dist.group.WORLD
    if group is None:
        size, rank_in_group = 1, 0
    elif isinstance(group, dist.ProcessGroup):  # no lookup through the default group
        size, rank_in_group = group.size(), group.rank()
    else:
        size, rank_in_group = dist.get_world_size(group), dist.get_rank(group)
    if size != world_size:
        raise ValueError(f"plan.world_size={world_size} but the process group has {size} ranks")
    if rank_in_group != rank:
        raise ValueError(f"plan.rank={rank} but this process is rank {rank_in_group} of the group")
    return size, rank, group


def with_length(t: Tensor, seq_dim: int, length: int) -> torch.Size:
    shape = list(t.shape)
    shape[seq_dim] = length
    return torch.Size(shape)


def _timed(wait: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    result = wait()
    return result, time.perf_counter() - started


def _zeros(like, shapes=None, dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    shapes = [t.shape for t in like] if shapes is None else shapes
    return [torch.zeros(shape, dtype=dtype or t.dtype, device=t.device) for t, shape in zip(like, shapes)]


@dataclass
class RingStep:
    index: int  # 0..W-1
    part: str  # "causal", "full", "q_tail", "kv_head", "band", "masked" or "skip"
    rng: tuple = ()  # per kernel call of the step: (seed, offset) tensors, or () without
    kept: tuple = ()  # keep_kv: the (K rows, V rows) this step received, kept for the backward

    def source_rank(self, rank: int, size: int) -> int:
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


@dataclass(kw_only=True)
class Traffic:
    """What a run moved and spent on this rank; a backward's bounds count the K/V rows and the dK/dV rows back."""
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_lower_bound: Optional[int] = None  # the least this rank must send (None: not computed)
    bytes_received_lower_bound: Optional[int] = None  # the least it must receive
    compute_seconds: float = 0.0  # kernels, merges and accumulation
    wait_seconds: float = 0.0  # blocked on a receive: communication the compute did not hide
    lengths: Optional[list] = None  # every rank's (local query length, local K/V length), as the ranks agreed


@dataclass
class ForwardResult(Traffic):
    out: Tensor
    lse: Tensor
    steps: list[RingStep]


@dataclass
class BackwardResult(Traffic):
    dq: Tensor
    dk: Tensor
    dv: Tensor
    dsink: Optional[Tensor] = None  # the attention sink's gradient over this rank's rows (algorithms/sinks.py)


def _row_bytes(k: Tensor, v: Tensor, seq_dim: int, itemsize: Optional[int] = None) -> int:
    length = k.size(seq_dim)
    if length == 0:
        return 0
    return (k.numel() * (itemsize or k.element_size()) + v.numel() * (itemsize or v.element_size())) // length


def _bounds(traffic: Traffic, exchange: ExchangePlan, k: Tensor, v: Tensor, seq_dim: int, kv_kept: bool = False,
            partial_itemsize: Optional[int] = None) -> None:
    """The least bytes: the K/V rows (none if kept); with ``partial_itemsize`` (backward) their partials back."""
    kv = 0 if kv_kept else _row_bytes(k, v, seq_dim)
    traffic.bytes_lower_bound = exchange.rows_sent * kv
    traffic.bytes_received_lower_bound = exchange.rows_received * kv
    if partial_itemsize:
        grad = _row_bytes(k, v, seq_dim, partial_itemsize)
        traffic.bytes_lower_bound += exchange.rows_received * grad
        traffic.bytes_received_lower_bound += exchange.rows_sent * grad


class _Blocks:
    """``current`` K/V block; ``post_next`` before step i posts step i+1's, ``advance`` waits (seconds); dK/dV:
    ``for_block`` gives step i's accumulators, ``pass_on`` sends them (seconds blocked), ``home``: the own block's."""
    def __init__(self, k: Tensor, v: Tensor, lengths: list, seq_dim: int, *, group, rank: int, size: int):
        self._own = [k.contiguous(), v.contiguous()]
        self.lengths, self._dim, self._group, self._rank, self._size = lengths, seq_dim, group, rank, size
        self.sent = self.received = 0

    def block_shapes(self, source: int) -> list[torch.Size]:
        return [with_length(t, self._dim, self.lengths[source][1]) for t in self._own]


class _Ring(_Blocks):
    """Whole blocks relayed round the ring; a backward's float32 dK/dV travel with their block, at the end home."""
    def __init__(self, k: Tensor, v: Tensor, lengths: list, seq_dim: int, **where):
        super().__init__(k, v, lengths, seq_dim, **where)
        self._kv = Rotation(self._own, self._group, self._rank, self._size, TAG_KV)
        self._grads: Optional[Rotation] = None

    @property
    def current(self) -> list[Tensor]:
        return self._kv.current

    def _post(self, rotation: Rotation, i: int, shift: int) -> None:
        """Send ``shift`` ranks on; receive the block ``rotation`` holds after step ``i``."""
        shapes = self.block_shapes((self._rank - shift - i) % self._size)
        self.received += sum(shape.numel() * t.element_size() for shape, t in zip(shapes, rotation.current))
        self.sent += rotation.post(shift, recv_shapes=shapes)

    def post_next(self, i: int, last: int) -> None:
        if i < last:
            self._post(self._kv, i, 1)

    def advance(self) -> float:
        return _timed(self._kv.advance)[1] if self._kv.in_flight else 0.0

    def for_block(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._grads is None:
            self._grads = Rotation(_zeros((k, v), dtype=torch.float32), self._group, self._rank, self._size, TAG_DKV)
        return self.home()

    def pass_on(self, i: int, last: int, held: tuple[Tensor, Tensor]) -> float:
        """Send the held accumulators on (after ``last``: home), receive the next."""
        shift = 1 if i < last else self._size - last
        if shift % self._size:
            self._post(self._grads, i, shift)
        return 0.0

    def home(self) -> tuple[Tensor, Tensor]:
        if self._grads.in_flight:
            self._grads.advance()
        return tuple(self._grads.current)

    def drain(self) -> None:
        for rotation in (self._kv, self._grads):
            if rotation is not None:
                rotation.drain()


class _Direct(_Blocks):
    """Stage s brings the rows needed of rank r-s's block (into two buffers whose other rows are never read); ``keep``:
    keep them (``kept``); ``kept``: a ``keep_kv`` forward's rows. dK/dV partials go straight back to their owner."""
    def __init__(self, k: Tensor, v: Tensor, lengths: list, seq_dim: int, exchange: ExchangePlan, *,
                 keep: bool = False, kept: Optional[list] = None, partials: torch.dtype = torch.float32, **where):
        super().__init__(k, v, lengths, seq_dim, **where)
        self._plan, self._keep, self._forward_rows, self._partials_dtype = exchange, keep, kept, partials
        self.kept: dict[int, tuple] = {}
        self.current = self._own
        self._transfers: dict[int, object] = {}  # stage -> its transfer in flight (kept rows: a tuple)
        self._stage = 0
        self._spare: Optional[list[Tensor]] = None  # a block buffer not in use
        self._buffered = False  # whether ``current`` is one of the two block buffers
        most = max([kv for _, kv in lengths], default=k.size(seq_dim))  # alike on every rank
        self._all_at_once = kept is None and (self._size - 1) * most * _row_bytes(k, v, seq_dim) <= SMALL_EXCHANGE_BYTES
        self._acc: list[Tensor] = []  # the own block's float32 dK/dV (backward)
        self._partials: list[Optional[list[Tensor]]] = [None, None]
        self._returning: Optional[tuple[Transfer, int]] = None  # a step's dK/dV returns in flight

    def _buffers(self, shapes: list[torch.Size]) -> list[Tensor]:
        spare, self._spare = self._spare, None
        return spare if spare is not None and [t.shape for t in spare] == shapes else _zeros(self._own, shapes)

    def post_next(self, i: int, last: int) -> None:
        """Post stage i+1 (every stage, where all is small)."""
        if i + 1 <= last and i + 1 not in self._transfers:
            for stage in range(i + 1, last + 1 if self._all_at_once else i + 2):
                self._post(stage)

    def _post(self, stage: int) -> None:
        send, recv = self._plan.send[stage], self._plan.recv[stage]
        if self._forward_rows is not None:
            if recv.count and len(self._forward_rows[stage]) != 2:
                raise RuntimeError(f"keep_kv: the forward kept no K/V rows for ring step {stage}, whose block "
                                   f"needs {recv.count} rows: the step records are not this call's")
            self._transfers[stage] = tuple(self._forward_rows[stage]) if recv.count else ()
            return
        sending = [_taken(send, t, self._dim) for t in self._own] if send.count else []
        if not recv.count:
            receiving = []
        elif recv.index is None:  # the whole block: straight into a block buffer
            receiving = self._buffers(self.block_shapes((self._rank - stage) % self._size))
        else:
            receiving = [torch.empty(with_length(t, self._dim, recv.count), dtype=t.dtype, device=t.device)
                         for t in self._own]
        self._transfers[stage] = self._transfer(sending, receiving, stage, TAG_KV)

    def _transfer(self, sending: list[Tensor], receiving: list[Tensor], shift: int, tag: int) -> Transfer:
        transfer = Transfer.shifted(sending, receiving, shift, self._rank, self._size, self._group, tag)
        self.sent += transfer.nbytes
        self.received += transfer.received_bytes
        return transfer

    def advance(self) -> float:
        transfer = self._transfers.pop(self._stage + 1, None)
        if transfer is None:
            return 0.0
        self._stage += 1
        rows = self._plan.recv[self._stage]
        received, waited = (list(transfer), 0.0) if isinstance(transfer, tuple) else _timed(transfer.wait)
        shapes = self.block_shapes((self._rank - self._stage) % self._size)
        block, buffered = placed_block(self._own, received, rows, shapes, self._dim, self._buffers)
        if self._keep and received:
            self.kept[self._stage] = tuple(received)
        if self._buffered and not self._keep:  # kept rows may live in a block buffer: none is reused
            self._spare = self.current
        self.current = block  # the forward's rows are no block buffer, even where they are the whole block
        self._buffered = buffered and (self._forward_rows is None or rows.index is not None)
        return waited

    def for_block(self, i: int, k: Tensor, v: Tensor) -> list[Tensor]:
        """Step 0: the own accumulators; else zeroed in one of two buffers (the other may be in flight)."""
        if i == 0:
            self._acc = _zeros((k, v), dtype=torch.float32)
            return self._acc
        held = self._partials[i % 2]
        if held is None or [t.shape for t in held] != [k.shape, v.shape]:
            held = self._partials[i % 2] = _zeros((k, v), dtype=torch.float32)
        else:
            for t in held:
                t.zero_()
        return held

    def pass_on(self, i: int, last: int, held: list[Tensor]) -> float:
        """The previous step's returns added, this step's posted; seconds blocked."""
        waited = self._settle()
        if i == 0:
            return waited
        back, coming = self._plan.recv[i], self._plan.send[i]
        sending = [_taken(back, t, self._dim).to(self._partials_dtype) for t in held] if back.count else []
        receiving = [torch.empty(with_length(t, self._dim, coming.count), dtype=self._partials_dtype,
                                 device=t.device) for t in self._acc] if coming.count else []
        self._returning = (self._transfer(sending, receiving, -i, TAG_DKV), i)
        return waited

    def _settle(self) -> float:
        if self._returning is None:
            return 0.0
        (transfer, i), self._returning = self._returning, None
        partials, waited = _timed(transfer.wait)
        rows = self._plan.send[i]
        where = rows.index if rows.start is None else (rows.start, rows.count)
        for acc, got in zip(self._acc, partials):
            _add_at(acc, where, got, self._dim)
        return waited

    def home(self) -> list[Tensor]:
        self._settle()
        return self._acc

    def drain(self) -> None:
        transfers, self._transfers = list(self._transfers.values()), {}
        if self._returning is not None:
            transfers.append(self._returning[0])
            self._returning = None
        for transfer in transfers:
            if isinstance(transfer, Transfer):  # not the rows a forward kept
                transfer.drain()


def _add_at(acc: Tensor, where, grad: Tensor, dim: int) -> None:
    """Add ``grad`` into the rows ``where`` of ``acc``: all (None), (start, length), or an index."""
    if where is None:
        acc.add_(grad)
    elif isinstance(where, tuple):
        acc.narrow(dim, *where).add_(grad)
    else:
        acc.index_add_(dim, where, grad.to(acc.dtype))


def placed_block(own: list[Tensor], received: list[Tensor], rows: StageRows, shapes: list[torch.Size], seq_dim: int,
                 buffers: Optional[Callable[[list[torch.Size]], list[Tensor]]] = None) -> tuple[list[Tensor], bool]:
    """``received`` placed at ``rows`` of a block of ``shapes`` (in zeros from ``buffers``); whether it is a buffer."""
    if rows.count and rows.index is None:
        return received, True
    if not rows.count:  # no query of this rank reads that block: zeros without memory
        return [t.new_zeros(()).expand(shape) for t, shape in zip(own, shapes)], False
    zeros = _zeros(own, shapes) if buffers is None else buffers(shapes)
    for buffer, got in zip(zeros, received):
        if rows.start is None:
            buffer.index_copy_(seq_dim, rows.index, got)
        else:
            buffer.narrow(seq_dim, rows.start, rows.count).copy_(got)
    return zeros, True


def _taken(rows: StageRows, t: Tensor, dim: int) -> Tensor:
    if rows.index is None:
        return t
    if rows.start is not None:
        return t.narrow(dim, rows.start, rows.count)
    return t.index_select(dim, rows.index)


def planned_exchange(plan: CallPlan, lengths: list, device: torch.device, *, group=None,
                     mask_rows: Optional[Tensor] = None, state=None) -> ExchangePlan:
    """Per call for a given mask, else remembered on the CP group's ``state``."""
    if plan.mask.given or plan.world_size == 1:
        return exchange_plan(plan, lengths, group=group, mask_rows=mask_rows).on(device)
    state = group_state(group) if state is None else state
    key = ("exchange", plan.world_size, plan.rank, plan.layout, plan.mask, plan.load_balance, plan.documents,
           plan.placement, tuple(map(tuple, lengths)), device)
    found = state.memo.get(key)
    return state.keep(key, exchange_plan(plan, lengths).on(device)) if found is None else found


def _agreed_first(compute, agreement, k: Tensor, v: Tensor):
    """Step 0; if it fails the agreement is waited for first: ranks that disagree all raise its error."""
    try:
        return compute(0, k, v)
    except BaseException:
        agreement.lengths()
        raise


def _agreed(plan: CallPlan, agreement, lengths: Optional[list], k: Tensor, v: Tensor, seq_dim: int,
            mask_rows: Optional[Tensor], *, keep: bool = False, kept: Optional[list] = None,
            partials: torch.dtype = torch.float32, **where) -> tuple[_Blocks, ExchangePlan]:
    agreed = agreement.lengths()
    lengths = agreed if lengths is None else lengths
    group, state = where["group"], None
    if plan.world_size > 1:
        state = group_state(group)
        if not state.joined and plan.exchange == "direct":
            join_once(group, k.device)
    exchange = planned_exchange(plan, lengths, k.device, group=group, mask_rows=mask_rows, state=state)
    if plan.exchange == "direct":
        return _Direct(k, v, lengths, seq_dim, exchange, keep=keep, kept=kept, partials=partials, **where), exchange
    if keep or kept is not None:
        raise ValueError("keep_kv needs the direct exchange (exchange='direct')")
    return _Ring(k, v, lengths, seq_dim, **where), exchange


def _agree_first(k: Tensor, v: Tensor) -> bool:
    """Whether to wait for the agreement before step 0, so that stage 1 travels during it: where compute is
    synchronous (CPU) and the block is large enough that its transfer, not the agreement's latency, costs."""
    return k.device.type == "cpu" and k.nbytes + v.nbytes > SMALL_EXCHANGE_BYTES


def forward_ring(plan: CallPlan, groups, k: Tensor, v: Tensor, seq_dim: int, last: int, compute, agreement, *,
                 mask_rows: Optional[Tensor] = None, lengths: Optional[list] = None) -> tuple[list[RingStep], Traffic]:
    """Steps 0..``last``, ``compute(i, cur_k, cur_v) -> (part, rng)`` on the block held."""
    size, rank, group = group_info(plan.world_size, plan.rank, own_group(groups))
    steps: list[RingStep] = []
    traffic = Traffic()
    kv = exchange = None
    keep = plan.keep_kv
    agreed = functools.partial(_agreed, plan, agreement, lengths, k, v, seq_dim, mask_rows, keep=keep, group=group,
                               rank=rank, size=size)
    try:
        if _agree_first(k, v):
            kv, exchange = agreed()
        for i in range(last + 1):
            cur_k, cur_v = (k, v) if kv is None else kv.current
            if kv is not None:
                kv.post_next(i, last)
            started = time.perf_counter()
            part, rng = compute(i, cur_k, cur_v) if kv is not None else _agreed_first(compute, agreement, k, v)
            steps.append(RingStep(index=i, part=part, rng=tuple(rng), kept=kv.kept.get(i, ()) if keep and kv else ()))
            traffic.compute_seconds += time.perf_counter() - started
            del cur_k, cur_v
            if kv is None:
                kv, exchange = agreed()
                kv.post_next(0, last)
            traffic.wait_seconds += kv.advance()
    except BaseException:
        if kv is not None:
            kv.drain()
        raise
    traffic.bytes_sent, traffic.bytes_received, traffic.lengths = kv.sent, kv.received, kv.lengths
    _bounds(traffic, exchange, k, v, seq_dim)
    return steps, traffic


def backward_ring(plan: CallPlan, groups, k: Tensor, v: Tensor, seq_dim: int, last: int, compute, agreement,
                  steps: list[RingStep], *, mask_rows: Optional[Tensor] = None,
                  lengths: Optional[list] = None) -> tuple[Tensor, Tensor, Traffic]:
    """As ``forward_ring``, ``compute(...) -> [(rows, dk, dv)]``; returns the own block's float32 dK and dV."""
    size, rank, group = group_info(plan.world_size, plan.rank, own_group(groups))
    kept = [step.kept for step in steps] if plan.keep_kv else None
    partials = k.dtype if plan.grad_partials == "input" else torch.float32
    kv = exchange = None
    traffic = Traffic()
    agreed = functools.partial(_agreed, plan, agreement, lengths, k, v, seq_dim, mask_rows, kept=kept,
                               partials=partials, group=group, rank=rank, size=size)
    try:
        if _agree_first(k, v):
            kv, exchange = agreed()
        for i in range(last + 1):
            cur_k, cur_v = (k, v) if kv is None else kv.current
            if kv is not None:
                kv.post_next(i, last)
            started = time.perf_counter()
            kv_grads = compute(i, cur_k, cur_v) if kv is not None else _agreed_first(compute, agreement, k, v)
            computed = time.perf_counter()
            if kv is None:
                kv, exchange = agreed()
                kv.post_next(0, last)
            held = kv.for_block(i, cur_k, cur_v)
            received = time.perf_counter()
            for rows, dk_i, dv_i in kv_grads:
                _add_at(held[0], rows, dk_i, seq_dim)
                _add_at(held[1], rows, dv_i, seq_dim)
            del kv_grads
            blocked = kv.pass_on(i, last, held)
            traffic.compute_seconds += (computed - started) + (time.perf_counter() - received) - blocked
            traffic.wait_seconds += (received - computed) + blocked
            del cur_k, cur_v, held
            traffic.wait_seconds += kv.advance()
    except BaseException:
        if kv is not None:
            kv.drain()
        raise
    (dk, dv), waited = _timed(kv.home)
    traffic.wait_seconds += waited
    traffic.bytes_sent, traffic.bytes_received, traffic.lengths = kv.sent, kv.received, kv.lengths
    _bounds(traffic, exchange, k, v, seq_dim, kv_kept=kept is not None, partial_itemsize=partials.itemsize)
    return dk, dv, traffic


def check_steps(steps: list[RingStep], rank: int, size: int, expected: int) -> None:
    if len(steps) != expected:
        raise RuntimeError(f"backward got {len(steps)} ring steps where its forward makes {expected} "
                           f"(world size {size})")
    for i, st in enumerate(steps):
        if st.index != i:
            raise RuntimeError(f"ring step record {i} has index {st.index}: the records of rank {rank} of {size} "
                               "are out of order")


def check_step(step: RingStep, rank: int, part: str, calls: int) -> None:
    """That the backward's inputs are the forward's: a record against what its step plans now."""
    if step.part != part or (step.rng and len(step.rng) != calls):
        raise RuntimeError(
            f"ring step {step.index} on rank {rank} recorded part {step.part!r} with {len(step.rng)} kernel calls; "
            f"its plan now gives {part!r} with {calls}: the backward's inputs (mask, lengths, documents, "
            "configuration) differ from the forward's")


def empty_outputs(plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return (q.new_empty(L.output_shape(q, k, v, plan.layout, plan.head_num)),
            q.new_empty(L.lse_shape(q, plan.layout, plan.head_num), dtype=torch.float32))


@functools.lru_cache(maxsize=256)
def check_qkv(plan: CallPlan, q_shape: tuple, k_shape: tuple, v_shape: tuple) -> tuple[L.Dims, int]:
    q, k, v = (torch.empty(shape, device="meta") for shape in (q_shape, k_shape, v_shape))
    lay = L.check_layout(plan.layout)
    qd = L.dims(q, lay, plan.head_num)
    nkv = L.heads_of(k, lay, qd.head_dim)
    kd = L.dims(k, lay, nkv)
    L.check_value(k, v, lay, nkv)  # V's head size may differ (MLA), nothing else
    if kd.batch != qd.batch or kd.head_dim != qd.head_dim:
        raise ValueError(f"query {tuple(q.shape)} and key {tuple(k.shape)} disagree on batch or head size "
                         f"(input_layout={lay!r})")
    if plan.head_num % nkv:
        raise ValueError(f"head_num={plan.head_num} is not a multiple of the K/V head count {nkv}")
    if plan.mask.positional and kd.seq != qd.seq:
        raise ValueError(f"causal, band and masked ring attention need equal local query and key lengths, got "
                         f"{qd.seq} and {kd.seq}")
    if plan.mask.positional and plan.load_balance and qd.seq % 2:
        raise ValueError(f"load balancing needs an even local sequence length, got {qd.seq} "
                         f"(input_layout={lay!r}, world_size={plan.world_size})")
    check_keep_prob(plan)
    return qd, nkv


def check_keep_prob(plan: CallPlan) -> None:
    if not 0.0 < plan.keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {plan.keep_prob}")


def check_backward_operands(plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                            lse: Tensor) -> None:
    expected_out, expected = _expected_shapes(plan, tuple(q.shape), tuple(k.shape), tuple(v.shape))
    if tuple(dout.shape) != expected_out or tuple(out.shape) != expected_out:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have the output's shape "
                         f"{expected_out} (the query's {tuple(q.shape)} with the value's head size)")
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse has shape {tuple(lse.shape)}, expected {expected}")


@functools.lru_cache(maxsize=256)
def _expected_shapes(plan: CallPlan, q_shape: tuple, k_shape: tuple, v_shape: tuple) -> tuple[tuple, tuple]:
    q, k, v = (torch.empty(shape, device="meta") for shape in (q_shape, k_shape, v_shape))
    return tuple(L.output_shape(q, k, v, plan.layout, plan.head_num)), tuple(L.lse_shape(q, plan.layout, plan.head_num))
