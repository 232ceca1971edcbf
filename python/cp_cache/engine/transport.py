"""Payload moves between ranks, on their device (HCCL and NCCL refuse CPU tensors), and per CP group state."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Transfer", "join_once", "Rotation", "TAG_KV", "TAG_DKV", "GroupState", "group_state", "exchange_heads",
           "own_storage"]

TAG_KV = 0  # k: 0, v: 1 (message j of an exchange is tagged tag + j)
TAG_DKV = 2  # dk: 2, dv: 3; apart from TAG_KV: a backward's K/V and dK/dV exchanges may be in flight together


@dataclass
class GroupState:
    """Per CP group: whether its ranks joined one collective, and values computed from values (bounded)."""
    LIMIT = 256
    joined: bool = False
    memo: dict = field(default_factory=dict)  # read with .get(key); written by ``keep``

    def keep(self, key, value):
        if len(self.memo) >= self.LIMIT:
            self.memo.clear()
        self.memo[key] = value
        return value


_STATES: dict[str, GroupState] = {}
_STATES_LOCK = threading.Lock()


def group_state(group) -> GroupState:
    name = (dist.group.WORLD if group is None else group).group_name
    state = _STATES.get(name)
    if state is None:
        with _STATES_LOCK:
            state = _STATES.setdefault(name, GroupState())
    return state


def join_once(group, device: torch.device) -> None:
    """Before the direct exchange: NCCL wants every rank of a group in its first batched point-to-point call."""
    state = group_state(group)
    with _STATES_LOCK:
        if state.joined:
            return
        state.joined = True
    dist.all_reduce(torch.zeros(1, device=device), group=dist.group.WORLD if group is None else group)


class Transfer:
    """``send`` to group rank ``to``, ``recv`` from ``source``: one message of each dtype (each costs a round)."""
    def __init__(self, send: list[Tensor], to: int, recv: list[Tensor], source: int, group, tag: int):
        # kept until the sends complete: one flat message where they share a dtype and device
        self._sent = _sendable([torch.cat([t.reshape(-1) for t in send])] if _one_message(send) else send)
        self._unpack = _one_message(recv)  # one flat message: its pieces copied into ``recv``
        if self._unpack:
            self._landing = [recv[0].new_empty(sum([t.numel() for t in recv]))]
        else:  # the backends receive into contiguous memory only
            self._landing = _sendable(recv)
        self.nbytes = sum([t.nbytes for t in send])
        self.received_bytes = sum([t.nbytes for t in recv])
        self.recv = recv
        ops = [dist.P2POp(dist.irecv, r, dist.get_global_rank(group, source), group, tag + j)
               for j, r in enumerate(self._landing)]
        ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(group, to), group, tag + j)
                for j, t in enumerate(self._sent)]
        self._works = dist.batch_isend_irecv(ops) if ops else []  # NCCL, HCCL: a stage's ops in one batch

    @classmethod
    def shifted(cls, send: list[Tensor], recv: list[Tensor], shift: int, rank: int, size: int, group,
                tag: int) -> "Transfer":
        return cls(send, (rank + shift) % size, recv, (rank - shift) % size, group, tag)

    def wait(self) -> list[Tensor]:
        works, self._works = self._works, []  # waited once, even if the wait fails
        for w in works:
            w.wait()
        recv, landing = self.recv, self._landing
        if self._unpack:
            offset = 0
            for t in recv:
                t.copy_(landing[0].narrow(0, offset, t.numel()).view(t.shape))
                offset += t.numel()
        else:
            for target, landed in zip(recv, landing):
                if target is not landed:
                    target.copy_(landed)
        self.recv, self._sent, self._landing = None, None, None
        return recv

    def drain(self) -> None:
        """Wait, dropping errors (after one here): no buffer freed under the backend, no message left over."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the original error is the one raised
            pass


def _sendable(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` in contiguous memory (the list itself when they all are), which the backends take."""
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


class Rotation:
    """Tensors travelling round the ring; a block once sent receives the one after next (never the first)."""
    def __init__(self, tensors: list[Tensor], group, rank: int, size: int, tag: int):
        self.current = self._own = tensors
        self._spare: Optional[list[Tensor]] = None
        self._transfer: Optional[Transfer] = None
        self._group, self._rank, self._size, self._tag = group, rank, size, tag

    def post(self, shift: int, recv_shapes: list[torch.Size]) -> int:
        recv, self._spare = self._spare, None
        if recv is None or [t.shape for t in recv] != list(recv_shapes):
            recv = [torch.empty(shape, dtype=t.dtype, device=t.device) for t, shape in zip(self.current, recv_shapes)]
        self._transfer = Transfer.shifted(self.current, recv, shift, self._rank, self._size, self._group, self._tag)
        return self._transfer.nbytes

    def advance(self) -> None:
        """Wait for the hop; the received tensors become current, the sent ones the spare buffers."""
        transfer, self._transfer = self._transfer, None  # waited once, even if the wait fails
        received = transfer.wait()
        if self.current is not self._own:
            self._spare = self.current
        self.current = received

    @property
    def in_flight(self) -> bool:
        return self._transfer is not None

    def drain(self) -> None:
        if self._transfer is not None:
            self._transfer.drain()
            self._transfer = None


def exchange_heads(tensors: list[Tensor], group, world: int, to_heads: bool,
                   lengths: Optional[list[int]] = None) -> tuple[list[Tensor], int]:
    """``to_heads``: [B, N, s, D] -> [B, N/W, W*s, D], else back; ``lengths``: each rank's s (packed); bytes sent."""
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
        rows = torch.cat([pieces[i] for i in members], dim=1)  # row j goes to rank j
        received = torch.empty_like(rows)  # row i came from rank i
        dist.all_to_all_single(received, rows, group=group)
        sent += rows.nbytes * (world - 1) // world
        start = 0
        for i in members:
            b, n, s, d = tensors[i].shape
            width = pieces[i].shape[1]
            got = received[:, start:start + width]
            start += width
            if to_heads:  # row r: rank r's sequence shard of my heads
                results[i] = got.reshape(world, b, n // world, s, d).permute(1, 2, 0, 3, 4).reshape(
                    b, n // world, world * s, d)
            else:  # row r: head group r of my sequence shard
                results[i] = got.reshape(world, b, n, s // world, d).transpose(0, 1).reshape(
                    b, world * n, s // world, d)
    return results, sent


def _exchange_uneven(tensors: list[Tensor], group, world: int, to_heads: bool,
                     lengths: list[int]) -> tuple[list[Tensor], int]:
    me = dist.get_rank(group)
    starts = [sum(lengths[:r]) for r in range(world)]
    results: list[Optional[Tensor]] = [None] * len(tensors)
    sent = 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        slots = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        members, m = [tensors[i] for i in slots], len(slots)
        # at r * m + j: member j's piece for rank r (flat) and the shape of its piece from r
        pieces, shapes = [], []
        for r in range(world):
            for t in members:
                b, n, _, d = t.shape
                if to_heads:
                    pieces.append(t.narrow(1, r * (n // world), n // world).reshape(-1))
                    shapes.append((b, n // world, lengths[r], d))
                else:
                    pieces.append(t.narrow(2, starts[r], lengths[r]).reshape(-1))
                    shapes.append((b, n, lengths[me], d))
        send = torch.cat(pieces)
        sizes = [b * n * s * d for b, n, s, d in shapes]
        in_splits = [sum(p.numel() for p in pieces[r * m:(r + 1) * m]) for r in range(world)]
        out_splits = [sum(sizes[r * m:(r + 1) * m]) for r in range(world)]
        received = send.new_empty(sum(out_splits))
        dist.all_to_all_single(received, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        sent += (send.numel() - in_splits[me]) * send.element_size()
        arrived = received.split(sizes)
        for j, i in enumerate(slots):
            parts = [arrived[r * m + j].view(shapes[r * m + j]) for r in range(world)]
            results[i] = torch.cat(parts, dim=2 if to_heads else 1)
    return results, sent


def own_storage(x: Tensor) -> Tensor:
    """``x`` in storage of its own, not a view keeping a shared all-to-all buffer alive (autograd saves it)."""
    if x.untyped_storage().nbytes() == x.nbytes and x.is_contiguous():
        return x
    return x.clone(memory_format=torch.contiguous_format)
