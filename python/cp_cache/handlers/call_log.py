"""Per-call measurements of the CP handlers (bytes sent and received, their lower bounds, time), read by
``cp_cache.call_stats()``."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

__all__ = ["CallRecord", "CallLog", "CALL_LOG"]


@dataclass
class CallRecord:
    """What the last call of one direction cost on this process."""

    bytes_sent: int = 0
    bytes_received: int = 0
    # the least this rank must send / receive for the call's mask (the K/V rows other ranks'
    # queries may attend to; backward: those again and their float32 dK/dV partials back);
    # None where no ring ran alone (Ulysses, hybrid: their all-to-alls have no such bound)
    bytes_lower_bound: Optional[int] = None
    bytes_received_lower_bound: Optional[int] = None
    handler_seconds: float = 0.0  # whole handler, ring included
    ring_seconds: float = 0.0  # kernels and communication
    compute_seconds: float = 0.0  # inside the ring: kernels, merges, accumulation
    wait_seconds: float = 0.0  # inside the ring: blocked on receives (communication not hidden)
    fused_merge: bool = False  # forward: steps merged by npu_ring_attention_update
    calls: int = 0

    @property
    def overhead_seconds(self) -> float:
        return self.handler_seconds - self.ring_seconds

    @property
    def exposed_fraction(self) -> float:
        """The share of the ring's time spent waiting for communication."""
        busy = self.compute_seconds + self.wait_seconds
        return self.wait_seconds / busy if busy > 0 else 0.0


class CallLog:
    """The last forward and backward call's record, and how many calls each direction had."""

    DIRECTIONS = ("forward", "backward")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records = {d: CallRecord() for d in self.DIRECTIONS}

    def record(self, direction: str, result, started: float, ring_seconds: float, *, fused_merge: bool = False) -> None:
        """Record a call of ``direction`` that began at ``started`` (time.perf_counter());
        ``result``: the strategy's ForwardResult / BackwardResult."""
        handler_seconds = time.perf_counter() - started
        with self._lock:
            record = self._records[direction]
            record.bytes_sent = result.bytes_sent
            record.bytes_received = result.bytes_received
            record.bytes_lower_bound = result.bytes_lower_bound
            record.bytes_received_lower_bound = result.bytes_received_lower_bound
            record.handler_seconds = handler_seconds
            record.ring_seconds = ring_seconds
            record.compute_seconds = result.compute_seconds
            record.wait_seconds = result.wait_seconds
            record.fused_merge = fused_merge
            record.calls += 1

    def set_handler_seconds(self, direction: str, started: float) -> None:
        """The whole handler's time of the last ``direction`` call, recorded by the ring op
        inside it (a compiled graph runs the op without the handler: its own time stays)."""
        with self._lock:
            self._records[direction].handler_seconds = time.perf_counter() - started

    def snapshot(self) -> dict[str, dict]:
        """{"forward": {...}, "backward": {...}} with bytes_sent, bytes_received, their lower bounds
        (bytes_lower_bound, bytes_received_lower_bound), handler_seconds, ring_seconds,
        overhead_seconds, compute_seconds, wait_seconds, exposed_fraction, fused_merge and
        calls of each direction."""
        with self._lock:
            return {
                d: dict(asdict(r), overhead_seconds=r.overhead_seconds, exposed_fraction=r.exposed_fraction)
                for d, r in self._records.items()
            }


# The process's call log: the ring ops record into it (a compiled graph runs them with no
# handler around), the handlers and ``cp_cache.call_stats()`` read the same one.
CALL_LOG = CallLog()
