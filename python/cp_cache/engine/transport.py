"""How strategies move tensors between ranks: the CP process groups, ring shifts (point to
point, two receive buffers reused from hop to hop), the all-to-all of Ulysses, and the CPU
side group of a CP group.

The CP group carries only the call's payload tensors, on their device: on a cluster it is
usually accelerator-only (HCCL, NCCL), which refuses CPU tensors, and reading a device
value back on the host would stall the device queue. The call's metadata (the ranks'
agreement: integer signatures, refusal messages) goes over a gloo group of its own over the
same ranks instead (``side_group``). Payload messages go through torch.distributed, as on any
backend.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Exchange", "Transfer", "join_once", "Rotation", "TAG_KV",
           "TAG_DKV", "GroupState", "group_state", "exchange_heads", "own_storage"]


class Exchange:
    """One ring shift of a list of tensors: send to the rank ``shift`` ahead, receive from the
    rank ``shift`` behind (``Transfer``: one message each way)."""

    def __init__(self, tensors: list[Tensor], group, rank: int, size: int, tag: int, shift: int = 1,
                 recv: Optional[list[Tensor]] = None, recv_shapes: Optional[list[torch.Size]] = None):
        if recv is None:
            shapes = recv_shapes or [t.shape for t in tensors]
            recv = [torch.empty(shape, dtype=t.dtype, device=t.device) for t, shape in zip(tensors, shapes)]
        self._transfer = Transfer.shifted(tensors, recv, shift, rank, size, group, tag)
        self.nbytes = self._transfer.nbytes

    def wait(self) -> list[Tensor]:
        return self._transfer.wait()


class GroupState:
    """What cp_cache keeps per CP process group: whether its ranks joined one collective, and what
    its calls compute that depends only on values (``remember``), bounded."""

    LIMIT = 256

    def __init__(self) -> None:
        self.joined = False
        self._memo: dict = {}

    def remember(self, key, make: Callable[[], object]):
        """``make()``, made once per ``key`` (a value) on this group."""
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) >= self.LIMIT:
                self._memo.clear()
            found = self._memo[key] = make()
        return found


_STATES: dict[str, GroupState] = {}
_STATES_LOCK = threading.Lock()


def group_state(group) -> GroupState:
    """The state of the CP group ``group`` (None: the default group), by its name."""
    name = (dist.group.WORLD if group is None else group).group_name
    state = _STATES.get(name)
    if state is None:
        with _STATES_LOCK:
            state = _STATES.setdefault(name, GroupState())
    return state


def join_once(group, device: torch.device) -> None:
    """Before the direct exchange's first stage on ``group``, once per process: one collective every
    rank of the group takes part in (a one-element all_reduce on the payload device; no host read).
    NCCL wants every rank of a group in its first batched point-to-point call; the direct exchange's
    stages post only the operations a rank has. Every rank runs the same plan, so every rank gets here."""
    state = group_state(group)
    with _STATES_LOCK:
        if state.joined:
            return
        state.joined = True
    dist.all_reduce(torch.zeros(1, device=device), group=dist.group.WORLD if group is None else group)


class Transfer:
    """One point-to-point stage: ``send`` to group rank ``to`` and receive into ``recv`` from group
    rank ``source`` (either list may be empty: no operation for it). Tensors of one dtype travel
    as one message each way (packed into one buffer, unpacked into ``recv`` on ``wait``): every
    message costs the backend a round of its own, whatever its size."""

    def __init__(self, send: list[Tensor], to: int, recv: list[Tensor], source: int, group, tag: int):
        packed_send = _sendable(_packed(send))
        self._packed_recv = _packed_buffer(recv)
        self._unpack = self._packed_recv is not recv
        # the backends receive into contiguous memory only: a strided target gets a landing buffer
        self._landing = _sendable(self._packed_recv)
        nbytes = received = 0
        for t in send:
            nbytes += t.nbytes
        for t in recv:
            received += t.nbytes
        self.nbytes, self.received_bytes = nbytes, received
        self.recv, self._sent = recv, packed_send  # kept until the sends complete
        self._works = _post(packed_send, to, self._landing, source, group, tag)

    @classmethod
    def shifted(cls, send: list[Tensor], recv: list[Tensor], shift: int, rank: int, size: int, group,
                tag: int) -> "Transfer":
        """A stage of a ring shift on ``rank`` of ``size``: ``send`` to the rank ``shift`` ahead,
        ``recv`` from the rank ``shift`` behind (a negative ``shift``: the other way round)."""
        return cls(send, (rank + shift) % size, recv, (rank - shift) % size, group, tag)

    def wait(self) -> list[Tensor]:
        works, self._works = self._works, []  # waited once, even if the wait fails
        for w in works:
            w.wait()
        recv, packed = self.recv, self._packed_recv
        if self._landing is not packed:
            for target, landed in zip(packed, self._landing):
                if target is not landed:
                    target.copy_(landed)
        if self._unpack:  # one message: its pieces into the receive tensors
            offset = 0
            message = packed[0]
            for t in recv:
                size = t.numel()
                t.copy_(message.narrow(0, offset, size).view(t.shape))
                offset += size
        self.recv, self._sent, self._packed_recv, self._landing = None, None, None, None
        return recv

    def drain(self) -> None:
        """Wait, dropping errors (after an error on this rank: see ``Rotation.drain``)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the original error is the one raised
            pass


def _post(send: list[Tensor], to: int, recv: list[Tensor], source: int, group, tag: int) -> list:
    """Post one stage's messages (message j tagged ``tag + j``) as one batch through
    torch.distributed (NCCL and HCCL want a stage's sends and receives together); the works."""
    if not send and not recv:
        return []
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, to), group, tag + j) for j, t in enumerate(send)]
    ops += [dist.P2POp(dist.irecv, r, dist.get_global_rank(group, source), group, tag + j)
            for j, r in enumerate(recv)]
    return dist.batch_isend_irecv(ops)


def _sendable(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` in contiguous memory, which gloo, NCCL and HCCL take (the list itself when
    they all are): a run of rows narrowed out of a block, or a strided view, is copied."""
    for t in tensors:
        if not t.is_contiguous():
            return [t if t.is_contiguous() else t.contiguous() for t in tensors]
    return tensors


def _one_message(tensors: list[Tensor]) -> bool:
    if len(tensors) < 2:
        return False
    dtype, device = tensors[0].dtype, tensors[0].device
    for t in tensors:  # a loop, not a set of pairs: this runs for every stage
        if t.dtype != dtype or t.device != device:
            return False
    return True


def _packed(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` as one flat message when they share a dtype and device (else as they are)."""
    if not _one_message(tensors):
        return tensors
    return [torch.cat([t.reshape(-1) for t in tensors])]


def _packed_buffer(tensors: list[Tensor]) -> list[Tensor]:
    """Where the message of ``tensors`` arrives: one flat buffer when they travel packed, else
    ``tensors`` themselves."""
    if not _one_message(tensors):
        return tensors
    first = tensors[0]
    return [torch.empty(sum([t.numel() for t in tensors]), dtype=first.dtype, device=first.device)]


class Rotation:
    """Tensors travelling around the ring (the K/V blocks, or the dK/dV accumulators), with
    two receive buffers reused from hop to hop: a block, once sent, receives the block after
    next. The first tensors (possibly the caller's) are never received into."""

    def __init__(self, tensors: list[Tensor], group, rank: int, size: int, tag: int):
        self.current = tensors
        self._own = tensors
        self._spare: Optional[list[Tensor]] = None
        self._exchange: Optional[Exchange] = None
        self._group, self._rank, self._size, self._tag = group, rank, size, tag

    def post(self, shift: int = 1, recv_shapes: Optional[list[torch.Size]] = None) -> int:
        """Send the current tensors ``shift`` ranks ahead, receive from ``shift`` behind (tensors
        of ``recv_shapes``, default the current ones' shapes: uneven shards); bytes sent."""
        spare = self._spare
        if spare is not None and recv_shapes is not None and [t.shape for t in spare] != list(recv_shapes):
            spare = None
        self._exchange = Exchange(self.current, self._group, self._rank, self._size, self._tag, shift,
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


# Each exchange uses tags tag, tag + 1 (one per message: K and V travel packed as one when
# they share a dtype). In backward a K/V shift and a dK/dV shift are in flight between the
# same two ranks at once: distinct tags keep a receive from matching the other exchange's send.
TAG_KV = 0  # k: 0, v: 1
TAG_DKV = 2  # dk: 2, dv: 3


# ---------------------------------------------------------------- Ulysses


def _all_to_all(rows: Tensor, group, world: int) -> tuple[Tensor, int]:
    """[W, n] -> [W, n]: row j goes to rank j, row i of the result came from rank i."""
    received = torch.empty_like(rows)
    dist.all_to_all_single(received, rows, group=group)
    return received, rows.nbytes * (world - 1) // world


def exchange_heads(tensors: list[Tensor], group, world: int, to_heads: bool,
                   lengths: Optional[list[int]] = None) -> tuple[list[Tensor], int]:
    """Sequence shards -> head shards (``to_heads``) or back, of [B, N, S, D] tensors.

    to_heads: [B, N, s, D] on each rank -> [B, N/W, W*s, D], the sequence in rank order.
    back: [B, N/W, W*s, D] -> [B, N, s, D], the heads in rank order.
    Each tensor keeps its own N and D (V, the output and their gradients at V's head size);
    tensors of one dtype travel in one all-to-all. ``lengths``: each rank's s where they differ
    (packed documents); the all-to-all then carries uneven splits, and W*s is their sum.
    """
    if world == 1:
        return [t.contiguous() for t in tensors], 0
    if lengths is not None and len(set(lengths)) > 1:
        return _exchange_uneven(tensors, group, world, to_heads, lengths)
    pieces = []
    for t in tensors:
        b, n, s, d = t.shape
        if to_heads:
            piece = t.reshape(b, world, n // world, s, d).transpose(0, 1)  # [W, B, N/W, s, D]
        else:
            piece = t.reshape(b, n, world, s // world, d).permute(2, 0, 1, 3, 4)  # [W, B, N/W, s/W, D]
        pieces.append(piece.reshape(world, -1))
    results: list[Optional[Tensor]] = [None] * len(tensors)
    sent = 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        received, nbytes = _all_to_all(torch.cat([pieces[i] for i in members], dim=1), group, world)
        sent += nbytes
        start = 0
        for i in members:
            b, n, s, d = tensors[i].shape
            width = pieces[i].shape[1]
            rows = received[:, start:start + width]
            start += width
            if to_heads:  # row r: rank r's sequence shard of my heads
                results[i] = rows.reshape(world, b, n // world, s, d).permute(1, 2, 0, 3, 4).reshape(
                    b, n // world, world * s, d)
            else:  # row r: head group r of my sequence shard
                results[i] = rows.reshape(world, b, n, s // world, d).transpose(0, 1).reshape(
                    b, world * n, s // world, d)
    return results, sent


def _exchange_uneven(tensors: list[Tensor], group, world: int, to_heads: bool,
                     lengths: list[int]) -> tuple[list[Tensor], int]:
    """``exchange_heads`` where rank r holds ``lengths[r]`` rows: one all-to-all per dtype with
    split sizes (rank r sends each rank its lengths[r] rows of that rank's heads; back, each rank
    its own rows of this rank's heads)."""
    me = dist.get_rank(group)
    starts = [sum(lengths[:r]) for r in range(world)]
    results: list[Optional[Tensor]] = [None] * len(tensors)
    sent = 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        # per destination rank: each member's piece for it, flattened, one after the other
        pieces: list[list[Tensor]] = [[] for _ in range(world)]
        for i in members:
            t = tensors[i]
            b, n, s, d = t.shape
            for r in range(world):
                if to_heads:
                    pieces[r].append(t[:, r * (n // world):(r + 1) * (n // world)].reshape(-1))
                else:
                    pieces[r].append(t.narrow(2, starts[r], lengths[r]).reshape(-1))
        send = torch.cat([p for per_rank in pieces for p in per_rank])
        in_splits = [sum(p.numel() for p in per_rank) for per_rank in pieces]
        # what each source sends me: its rows of my heads (to_heads), or my rows of its heads
        rows_from = lengths if to_heads else [lengths[me]] * world
        widths = [[_piece_numel(tensors[i], world, to_heads, rows) for i in members] for rows in rows_from]
        out_splits = [sum(w) for w in widths]
        received = send.new_empty(sum(out_splits))
        dist.all_to_all_single(received, send, output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=group)
        sent += (send.numel() - in_splits[me]) * send.element_size()
        chunks = received.split(out_splits)
        for slot, i in enumerate(members):
            b, n, s, d = tensors[i].shape
            parts = []
            for source, chunk in enumerate(chunks):
                offset = sum(widths[source][:slot])
                piece = chunk[offset:offset + widths[source][slot]]
                if to_heads:
                    parts.append(piece.view(b, n // world, lengths[source], d))
                else:
                    parts.append(piece.view(b, n, lengths[me], d))
            results[i] = torch.cat(parts, dim=2 if to_heads else 1)
    return results, sent


def _piece_numel(t: Tensor, world: int, to_heads: bool, rows: int) -> int:
    """Elements of one rank's piece of ``t`` ([B, N, s, D]) with ``rows`` sequence rows: a 1/W
    share of its heads (to_heads), or all of them (back)."""
    b, n, _, d = t.shape
    return b * (n // world if to_heads else n) * rows * d


def own_storage(x: Tensor) -> Tensor:
    """``x`` in storage of its own: a result of ``exchange_heads`` can be a view of a receive buffer
    shared with the other tensors of its all-to-all, which it would keep alive (autograd saves
    the output and the LSE until backward)."""
    if x.untyped_storage().nbytes() == x.nbytes and x.is_contiguous():
        return x
    return x.clone(memory_format=torch.contiguous_format)
