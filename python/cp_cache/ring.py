"""Ring attention over a 1-D process group, forward and backward, on any step kernel.

Each rank keeps its query block; the K/V blocks travel around the ring (rank r
sends to r+1 and receives from r-1). Step i on rank r uses the block of group
rank ``(r - i) % W``. The next block's transfer is posted before the current
block is computed and waited after, so at most two K/V blocks are alive.
Step results are merged in float32 with the log-sum-exp rule.

Causal rules (torch's ``_templated_ring_attention``):

* without load balancing rank r holds contiguous chunk r: step 0 is the causal
  diagonal block, blocks from lower ranks are full, from higher ranks skipped;
* with head-tail load balancing rank r holds chunks r and 2W-1-r of 2W: step 0
  is causal over the whole local block, a block from a lower rank is seen by
  all local queries through its first half ("kv_head"), a block from a higher
  rank is seen fully by the second half of the local queries ("q_tail").

Band (sliding window) and explicit masks are planned per block in ``ring_plan``;
with a band and contiguous sharding the rotation stops after the last hop any rank
needs.

Backward sends the K/V around again; the float32 dK/dV accumulators travel
with their block and go back to its owner after the last step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import agreement
from . import layout as L
from .kernels.base import StepKernel
from .merge import merge_into
from .npu_ops import INT_MAX
from .ring_plan import PARTS, BlockTask, MaskSpec, hops_needed, plan_step, step_part

__all__ = [
    "RingStep",
    "RingConfig",
    "RingForward",
    "RingBackward",
    "ring_attention_forward",
    "ring_attention_backward",
    "step_part",
    "MaskSpec",
]

log = logging.getLogger("cp_cache")

_TND = "TND"  # packed documents: run by varlen.py on this module's checks and ring loops

@dataclass
class RingStep:
    index: int  # 0..W-1
    source_rank: int  # group rank whose K/V block this step used: (rank - index) % W
    part: str  # one of ring_plan.PARTS
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
class RingConfig:
    world_size: int
    rank: int
    causal: bool
    load_balance: bool
    layout: str
    head_num: int
    scale: float
    keep_prob: float
    window: bool = False  # band attention: query i sees key j iff i - pre <= j <= i + next
    pre_tockens: int = INT_MAX
    next_tockens: int = INT_MAX
    given_mask: bool = False  # an explicit mask comes with the call
    policy: str = ""  # the step-cache policy of the handlers ("handle", "stack"), "" when driven directly
    algorithm: str = ""  # the handlers' CP algorithm ("ring", "ulysses", "hybrid"), "" when driven directly
    documents: str = ""  # layout TND: the packed documents' global cumulative ends, "5,12,20" (varlen.py)
    # Ulysses degree: world_size / ulysses_size ranks form the ring (ulysses.py); 1 for the ring alone
    ulysses_size: int = 1

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(causal=self.causal, window=self.window, pre_tockens=self.pre_tockens,
                        next_tockens=self.next_tockens, given=self.given_mask)


@dataclass
class RingForward:
    out: Tensor
    lse: Tensor
    steps: list[RingStep]
    bytes_sent: int
    compute_seconds: float = 0.0  # kernels and merges
    wait_seconds: float = 0.0  # blocked on a K/V receive: communication the compute did not hide
    lengths: Optional[list] = None  # every rank's (local query length, local K/V length)


@dataclass
class RingBackward:
    dq: Tensor
    dk: Tensor
    dv: Tensor
    bytes_sent: int
    compute_seconds: float = 0.0  # kernels and accumulation
    wait_seconds: float = 0.0  # blocked on a K/V or dK/dV receive
    lengths: Optional[list] = None  # every rank's (local query length, local K/V length)


# ---------------------------------------------------------------- checks


def _group_info(config: RingConfig, group) -> tuple[int, int, object]:
    """(world size, rank, group) after checking the config against the group."""
    if config.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {config.world_size}")
    if group is None and config.world_size > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"world_size={config.world_size} needs a process group, but group is None "
                "and torch.distributed is not initialized"
            )
        group = dist.group.WORLD
    if group is None:
        size, rank = 1, 0
    else:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != config.world_size:
        raise ValueError(f"config.world_size={config.world_size} but the process group has {size} ranks")
    if rank != config.rank:
        raise ValueError(f"config.rank={config.rank} but this process is rank {rank} of the group")
    return size, rank, group


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, config: RingConfig,
                  mask_rows: Optional[Tensor] = None) -> tuple[L.Dims, int]:
    lay = L.check_layout(config.layout)
    qd = L.dims(q, lay, config.head_num)
    if k.shape != v.shape:
        raise ValueError(
            f"key and value shapes differ: key {tuple(k.shape)}, value {tuple(v.shape)} "
            f"(input_layout={lay!r}, sequence dim {L.seq_dim(lay)})"
        )
    nkv = L.heads_of(k, lay, qd.head_dim)
    kd = L.dims(k, lay, nkv)
    if kd.batch != qd.batch or kd.head_dim != qd.head_dim:
        raise ValueError(
            f"query {tuple(q.shape)} and key {tuple(k.shape)} disagree on batch or head size "
            f"(input_layout={lay!r})"
        )
    if config.head_num % nkv:
        raise ValueError(f"head_num={config.head_num} is not a multiple of the K/V head count {nkv}")
    positional = config.causal or config.window or config.given_mask
    if positional and kd.seq != qd.seq:
        raise ValueError(
            f"causal, band and masked ring attention need equal local query and key lengths, got "
            f"{qd.seq} and {kd.seq}"
        )
    if positional and config.load_balance and qd.seq % 2:
        raise ValueError(
            f"load balancing needs an even local sequence length, got {qd.seq} "
            f"(input_layout={lay!r}, world_size={config.world_size})"
        )
    if config.given_mask:
        expected = (qd.seq, kd.seq * config.world_size)
        if mask_rows is None or tuple(mask_rows.shape[-2:]) != expected:
            got = None if mask_rows is None else tuple(mask_rows.shape)
            raise ValueError(
                f"a masked ring call needs the mask rows of the local queries over the whole "
                f"sequence, [..., {expected[0]}, {expected[1]}]; got {got}"
            )
    if not 0.0 < config.keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {config.keep_prob}")
    return qd, nkv


def _kv_heads(q: Tensor, k: Tensor, config: RingConfig) -> int:
    """The K/V head count, or -1 when the shapes do not say (the checks will tell why)."""
    if config.layout == _TND:
        return k.size(1) if k.dim() == 3 else -1
    try:
        return L.heads_of(k, config.layout, L.dims(q, config.layout, config.head_num).head_dim)
    except Exception:  # noqa: BLE001 - reported by the checks
        return -1


_CHECK_ERRORS = (ValueError, NotImplementedError, TypeError, RuntimeError)


def uneven_allowed(config: RingConfig) -> bool:
    """Whether the ranks may hold local sequences of different lengths: the ring alone (not
    Ulysses' all-to-alls, nor a hybrid's ring on their results), for full attention or causal
    attention on contiguous shards (each block is then wholly before, on, or after the
    diagonal whatever the lengths); windows, masks and head-tail shards are positional.
    Packed documents (TND, varlen.py) are cut into equal slices."""
    if config.algorithm not in ("", "ring") or config.layout == _TND:
        return False
    return not (config.window or config.given_mask or (config.causal and config.load_balance))


def _agreed_checks(direction: str, check, config: RingConfig, q: Tensor, k: Tensor, v: Tensor, *,
                   size: int, group, kernel: StepKernel, mask_rows: Optional[Tensor] = None, steps: int = -1):
    """Run this rank's argument checks, then (W > 1) agree with the other ranks on the call's
    signature before anything is exchanged: the ranks disagree -> the same RuntimeError on
    every rank; they agree -> a check that failed failed on every rank, and raises there.
    Returns (the check's result, every rank's (query length, K/V length))."""
    if size == 1:
        result = check()
        seq_dim = _seq_dim(config.layout)
        return result, [(q.size(seq_dim), k.size(seq_dim))]
    error = result = None
    try:
        result = check()
    except _CHECK_ERRORS as exc:
        error = exc
    sig = agreement.signature(direction=direction, config=config, q=q, k=k, v=v,
                              kv_heads=_kv_heads(q, k, config), kernel=getattr(kernel, "name", ""),
                              mask_rows=mask_rows, steps=steps, error=error, uneven=uneven_allowed(config))
    lengths = agreement.lengths(agreement.agree(sig, group, size, error))
    if error is not None:
        raise error
    if any(length < 1 for pair in lengths for length in pair):
        raise ValueError(f"every rank needs at least one query and one key; local (query, K/V) lengths "
                         f"by rank: {lengths}")  # the same on every rank: they all see the lengths
    return result, lengths


def _seq_dim(layout: str) -> int:
    return 0 if layout == _TND else L.seq_dim(layout)


def _with_length(t: Tensor, layout: str, length: int) -> torch.Size:
    shape = list(t.shape)
    shape[_seq_dim(layout)] = length
    return torch.Size(shape)


# ---------------------------------------------------------------- communication


class _Exchange:
    """One ring shift of a list of tensors: send to the rank ``shift`` ahead, receive from the
    rank ``shift`` behind."""

    def __init__(self, tensors: list[Tensor], group, rank: int, size: int, tag: int, shift: int = 1,
                 recv: Optional[list[Tensor]] = None, recv_shapes: Optional[list[torch.Size]] = None):
        nxt = dist.get_global_rank(group, (rank + shift) % size)
        prv = dist.get_global_rank(group, (rank - shift) % size)
        if recv is None:
            shapes = recv_shapes or [t.shape for t in tensors]
            recv = [torch.empty(shape, dtype=t.dtype, device=t.device) for t, shape in zip(tensors, shapes)]
        self.recv = recv
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag + j) for j, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, r, prv, group, tag + j) for j, r in enumerate(self.recv)]
        self.nbytes = sum(t.nbytes for t in tensors)
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for w in self._works:
            w.wait()
        self._works = None  # drop every reference to the sent and received buffers
        recv, self.recv = self.recv, None
        return recv


class _Rotation:
    """Tensors travelling around the ring (the K/V blocks, or the dK/dV accumulators), with
    two receive buffers reused from hop to hop: a block, once sent, receives the block after
    next. The first tensors (possibly the caller's) are never received into."""

    def __init__(self, tensors: list[Tensor], group, rank: int, size: int, tag: int):
        self.current = tensors
        self._own = tensors
        self._spare: Optional[list[Tensor]] = None
        self._exchange: Optional[_Exchange] = None
        self._group, self._rank, self._size, self._tag = group, rank, size, tag

    def post(self, shift: int = 1, recv_shapes: Optional[list[torch.Size]] = None) -> int:
        """Send the current tensors ``shift`` ranks ahead, receive from ``shift`` behind (tensors
        of ``recv_shapes``, default the current ones' shapes: uneven shards); bytes sent."""
        spare = self._spare
        if spare is not None and recv_shapes is not None and [t.shape for t in spare] != list(recv_shapes):
            spare = None
        self._exchange = _Exchange(self.current, self._group, self._rank, self._size, self._tag, shift,
                                   recv=spare, recv_shapes=recv_shapes)
        self._spare = None
        return self._exchange.nbytes

    def advance(self) -> None:
        """Wait for the hop; the received tensors become current, the sent ones the spare buffers."""
        exchange, self._exchange = self._exchange, None  # waited once, even if the wait fails
        received = exchange.wait()
        if self.current is not self._own:
            self._spare = self.current
        self.current = received

    @property
    def in_flight(self) -> bool:
        return self._exchange is not None

    def drain(self) -> None:
        """After an error on this rank: wait for the hop in flight (its peers posted the matching
        operations; bounded by the process group's timeout) so no buffer is freed under the
        backend and no message is left to match a later call's; errors are dropped."""
        if self._exchange is not None:
            try:
                self._exchange.wait()
            except Exception:  # noqa: BLE001 - the original error is the one raised
                pass
            self._exchange = None


# Each exchange uses tags tag, tag + 1 (one per tensor). In backward a K/V shift and
# a dK/dV shift are in flight between the same two ranks at once, with tensors of the
# same shapes: distinct tags keep a receive from matching the other exchange's send.
_TAG_KV = 0  # k: 0, v: 1
_TAG_DKV = 2  # dk: 2, dv: 3


# ---------------------------------------------------------------- step operands


def _rows(x: Tensor, layout: str, rows: tuple[int, int]) -> Tensor:
    """The sequence rows ``rows`` of ``x`` in ``layout`` (or its 4-D view): a view."""
    return L.narrow_seq(x, layout, *rows)


def _lse_rows(lse: Tensor, rows: tuple[int, int]) -> Tensor:
    return lse.narrow(2, *rows)  # lse is [B, N, S]


# ---------------------------------------------------------------- forward


def _plan(rank: int, index: int, config: RingConfig, q_len: int, kv_len: int, mask_rows: Optional[Tensor]):
    return plan_step(rank, index, config.world_size, config.load_balance, config.mask, q_len, kv_len, mask_rows)


def _last_step(config: RingConfig, kv_len: int) -> int:
    return hops_needed(config.world_size, config.load_balance, config.mask, kv_len)


def _task_operands(task: BlockTask, layout: str, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _rows(q, layout, task.q_rows), _rows(k, layout, task.kv_rows), _rows(v, layout, task.kv_rows)


def _forward_ring(k: Tensor, v: Tensor, lengths: list, layout: str, last: int, compute, *, group, rank: int,
                 size: int) -> tuple[list[RingStep], int, float, float]:
    """Steps 0..``last`` of a forward ring: this rank's K/V block (``k``, ``v``; every rank's
    lengths in ``lengths``) travels round while ``compute(i, cur_k, cur_v) -> (part, rng)``
    computes step i on the block it holds. Returns (the step records, bytes sent, compute
    seconds, seconds blocked on a receive)."""
    steps: list[RingStep] = []
    bytes_sent = 0
    compute_s = wait_s = 0.0
    kv = _Rotation([k.contiguous(), v.contiguous()], group, rank, size, _TAG_KV)
    try:
        for i in range(last + 1):
            cur_k, cur_v = kv.current
            if i < last:
                incoming = lengths[(rank - i - 1) % size][1]
                bytes_sent += kv.post(recv_shapes=[_with_length(t, layout, incoming) for t in (k, v)])
            started = time.perf_counter()
            part, rng = compute(i, cur_k, cur_v)
            steps.append(RingStep(index=i, source_rank=(rank - i) % size, part=part, rng=tuple(rng)))
            computed = time.perf_counter()
            compute_s += computed - started
            del cur_k, cur_v
            if kv.in_flight:
                kv.advance()
                wait_s += time.perf_counter() - computed
    except BaseException:
        kv.drain()
        raise
    return steps, bytes_sent, compute_s, wait_s


def ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, config: RingConfig, *, group, kernel: StepKernel,
    mask_rows: Optional[Tensor] = None, fused_merge: bool = False,
) -> RingForward:
    """Ring attention of the local queries against every rank's K/V block.

    ``mask_rows``: with ``config.given_mask``, the mask's rows of the local queries over the
    whole sequence (True = masked out). ``fused_merge``: merge step results with
    ``npu_ring_attention_update`` (it must exist) instead of plain torch. Returns the merged
    output (query dtype, input layout), the float32 LSE [B, Nq, Sq], the per-step records
    (for backward) and the bytes sent.
    """
    size, rank, group = _group_info(config, group)
    (qd, _), lengths = _agreed_checks("forward", lambda: _check_inputs(q, k, v, config, mask_rows), config,
                                      q, k, v, size=size, group=group, kernel=kernel, mask_rows=mask_rows)
    lay, hn = config.layout, config.head_num
    seq_dim = L.seq_dim(lay)

    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((qd.batch, hn, qd.seq), float("-inf"), dtype=torch.float32, device=q.device)
    kw = dict(layout=lay, head_num=hn, scale=config.scale, keep_prob=config.keep_prob)

    def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> tuple[str, list]:
        part, tasks = _plan(rank, i, config, qd.seq, cur_k.size(seq_dim), mask_rows)
        rng = []
        for task in tasks:
            res = kernel.forward(*_task_operands(task, lay, q, cur_k, cur_v), mask=task.mask, **kw)
            if res.seed is not None:
                rng.append((res.seed, res.offset))
            merge_into(_rows(acc_out, lay, task.q_rows), _lse_rows(acc_lse, task.q_rows), res.out, res.lse,
                       lay, hn, fused=fused_merge)
            del res
        return part, rng

    steps, bytes_sent, compute_s, wait_s = _forward_ring(k, v, lengths, lay, _last_step(config, k.size(seq_dim)),
                                                         compute, group=group, rank=rank, size=size)
    log.debug("ring forward rank %d/%d: parts %s, %d bytes sent", rank, size, [s.part for s in steps], bytes_sent)
    return RingForward(out=acc_out.to(q.dtype), lse=acc_lse, steps=steps, bytes_sent=bytes_sent,
                       compute_seconds=compute_s, wait_seconds=wait_s, lengths=lengths)


# ---------------------------------------------------------------- backward


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
        self._rotation: Optional[_Rotation] = None
        self.bytes_sent = 0

    def for_block(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The accumulators of the block (``k``, ``v``) held at this step."""
        if self._rotation is None:
            zeros = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
            self._rotation = _Rotation(zeros, self._group, self._rank, self._size, _TAG_DKV)
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


def _backward_ring(k: Tensor, v: Tensor, lengths: list, layout: str, last: int, compute, add_rows, *, group,
                  rank: int, size: int) -> tuple[Tensor, Tensor, int, float, float]:
    """Steps 0..``last`` of a backward ring: the K/V blocks travel round as in ``_forward_ring``;
    ``compute(i, cur_k, cur_v) -> [(where, dk, dv)]`` computes step i, whose gradients
    ``add_rows(accumulator, where, grad)`` adds into the held block's float32 accumulators,
    which then move on with their block, and home after the last step. Returns (this rank's
    own block's dK and dV accumulators, bytes sent, compute seconds, seconds blocked on a
    receive)."""

    def block_shapes(source: int) -> list[torch.Size]:
        return [_with_length(t, layout, lengths[source][1]) for t in (k, v)]

    accumulators = _GradAccumulators(group, rank, size)
    bytes_sent = 0
    compute_s = wait_s = 0.0
    kv = _Rotation([k.contiguous(), v.contiguous()], group, rank, size, _TAG_KV)
    try:
        for i in range(last + 1):
            cur_k, cur_v = kv.current
            if i < last:
                bytes_sent += kv.post(recv_shapes=block_shapes((rank - i - 1) % size))
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
            accumulators.pass_on(shift, block_shapes((rank - shift - i) % size))  # the block it holds
            passed = time.perf_counter()
            compute_s += (computed - started) + (passed - received)
            wait_s += received - computed
            del cur_k, cur_v
            if kv.in_flight:
                kv.advance()
                wait_s += time.perf_counter() - passed
    except BaseException:
        kv.drain()
        accumulators.drain()
        raise
    homed = time.perf_counter()
    dk, dv = accumulators.home()
    wait_s += time.perf_counter() - homed
    return dk, dv, bytes_sent + accumulators.bytes_sent, compute_s, wait_s


def _check_steps(steps: list[RingStep], rank: int, size: int, expected: int) -> None:
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


def ring_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    steps: list[RingStep],
    config: RingConfig,
    *,
    group,
    kernel: StepKernel,
    mask_rows: Optional[Tensor] = None,
) -> RingBackward:
    """Gradients of the local q and of this rank's own K/V block.

    ``out``/``lse`` are the forward's merged results, ``steps`` its records
    (parts and seeds are reused as recorded), ``mask_rows`` as in the forward.
    """
    size, rank, group = _group_info(config, group)

    def check():
        qd, _ = _check_inputs(q, k, v, config, mask_rows)
        _check_steps(steps, rank, size, _last_step(config, k.size(L.seq_dim(config.layout))) + 1)
        if dout.shape != q.shape or out.shape != q.shape:
            raise ValueError(
                f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have the query's shape {tuple(q.shape)}"
            )
        if tuple(lse.shape) != (qd.batch, config.head_num, qd.seq):
            raise ValueError(f"lse has shape {tuple(lse.shape)}, expected {(qd.batch, config.head_num, qd.seq)}")
        return qd

    qd, lengths = _agreed_checks("backward", check, config, q, k, v, size=size, group=group, kernel=kernel,
                                 mask_rows=mask_rows, steps=len(steps))
    lay = config.layout
    seq_dim = L.seq_dim(lay)
    last = _last_step(config, k.size(seq_dim))

    lse = lse.float()
    kw = dict(layout=lay, head_num=config.head_num, scale=config.scale, keep_prob=config.keep_prob)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def compute(i: int, cur_k: Tensor, cur_v: Tensor) -> list:
        kv_grads = []
        for task, (seed, offset) in _recorded_tasks(steps[i], rank, config, qd.seq, cur_k.size(seq_dim), mask_rows):
            grads = kernel.backward(
                *_task_operands(task, lay, q, cur_k, cur_v),
                _rows(dout, lay, task.q_rows), _rows(out, lay, task.q_rows), _lse_rows(lse, task.q_rows),
                mask=task.mask, seed=seed, offset=offset, **kw,
            )
            _rows(dq, lay, task.q_rows).add_(grads[0])
            kv_grads.append((task.kv_rows, grads[1], grads[2]))
            del grads
        return kv_grads

    def add_rows(acc: Tensor, kv_rows: tuple[int, int], grad: Tensor) -> None:
        _rows(acc, lay, kv_rows).add_(grad)

    dk, dv, bytes_sent, compute_s, wait_s = _backward_ring(k, v, lengths, lay, last, compute, add_rows,
                                                           group=group, rank=rank, size=size)
    log.debug("ring backward rank %d/%d: %d bytes sent", rank, size, bytes_sent)
    return RingBackward(dq=dq.to(q.dtype), dk=dk.to(k.dtype), dv=dv.to(v.dtype), bytes_sent=bytes_sent,
                        compute_seconds=compute_s, wait_seconds=wait_s, lengths=lengths)


def _recorded_tasks(step: RingStep, rank: int, config: RingConfig, q_len: int, kv_len: int, mask_rows):
    """The step's kernel calls, planned again, each with the (seed, offset) its forward drew."""
    part, tasks = _plan(rank, step.index, config, q_len, kv_len, mask_rows)
    if part != step.part or (step.rng and len(step.rng) != len(tasks)):
        raise RuntimeError(
            f"ring step {step.index} on rank {rank} recorded part {step.part!r} with {len(step.rng)} "
            f"kernel calls; its plan now gives {part!r} with {len(tasks)}: the backward's inputs "
            "(mask, lengths, configuration) differ from the forward's"
        )
    return zip(tasks, step.rng or [(None, None)] * len(tasks))
