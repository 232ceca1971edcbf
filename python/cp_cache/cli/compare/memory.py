"""(b) Memory profiling on one rank, and (d) the traffic of the same forward and backward.

Bytes kept from forward to backward: the distinct storages autograd saves during the attention
forward (q, k, v and the mask excluded), union the tensors a system holds outside autograd
(torch_npu 2.12.0's stack), plus the growth of cp_cache's store. Peaks: the torch profiler's
allocation events during the forward and the backward, in one profile.
"""

from __future__ import annotations

import gc

from .._measure import SavedStorages, distinct_storage_bytes, peak_bytes, storage_key, trace_memory
from .inputs import mask_for, resource_inputs
from .patches import SentCounter, set_load_balance


class _MemoryPass:
    """One forward and backward of a system, as phases for ``trace_memory``: ``forward``,
    ``between`` (reads what is kept), ``backward``."""

    def __init__(self, system, q, k, v, dout, spec, mask, checkpointed: bool):
        self.system, self.q, self.k, self.v, self.dout = system, q, k, v, dout
        self.spec, self.mask, self.checkpointed = spec, mask, checkpointed
        self.exclude = {key[0] for key in map(storage_key, (q, k, v, mask)) if key}
        self.recorder = SavedStorages(exclude=(q, k, v, mask))
        self.sent = SentCounter()
        self.output = None
        self.store_before = 0
        self.kept: dict = {}

    def _call(self, a, b, c):
        return self.system.attention(a, b, c, self.spec, self.mask)

    def forward(self) -> None:
        from torch.utils.checkpoint import checkpoint

        self.store_before = self.system.store_bytes()
        self.sent.phase = "forward"
        with self.recorder:
            if self.checkpointed:
                self.output = checkpoint(self._call, self.q, self.k, self.v, use_reentrant=False)
            else:
                self.output = self._call(self.q, self.k, self.v)
        self.sent.phase = None

    def between(self) -> None:
        saved = self.recorder.storages
        held = {}
        for t in self.system.held_tensors():
            key = storage_key(t)
            if key and key[0] not in self.exclude:
                held[key[0]] = key[1]
        union = dict(saved)
        union.update(held)
        self.kept = dict(
            autograd_saved_bytes=sum(saved.values()),
            stack_bytes=sum(held.values()),
            store_bytes=self.system.store_bytes() - self.store_before,
            stack_entries=self.system.stack_entries(),
        )
        self.kept["total_bytes"] = sum(union.values()) + self.kept["store_bytes"]

    def backward(self) -> None:
        self.sent.phase = "backward"
        output, self.output = self.output, None
        output.backward(self.dout)
        self.sent.phase = None

    def traffic(self) -> dict:
        """The bytes and calls sent during the forward and the backward."""
        sent = self.sent
        return dict(forward_bytes=sent.by_phase.get("forward", 0), backward_bytes=sent.by_phase.get("backward", 0),
                    forward_calls=sent.calls_by_phase.get("forward", {}),
                    backward_calls=sent.calls_by_phase.get("backward", {}),
                    cp_cache_reported=self.system.reported_sent_bytes())


def memory_pass(system, q, k, v, dout, spec, mask, checkpointed: bool) -> dict:
    """Bytes kept from forward to backward, the peaks of each, what a gc after backward frees,
    and the bytes sent: one traced forward and backward (with or without checkpointing)."""
    for t in (q, k, v):
        t.grad = None
    run = _MemoryPass(system, q, k, v, dout, spec, mask, checkpointed)
    net: dict = {}
    gc.collect()  # start from a collected heap: garbage of earlier calls is not freed inside the windows
    with run.sent:
        peaks = trace_memory([("forward", run.forward), ("between", run.between), ("backward", run.backward),
                              ("gc", gc.collect)], net)
    result = dict(run.kept, traffic=run.traffic(), forward_peak_bytes=peaks["forward"],
                  backward_peak_bytes=peaks["backward"],
                  freed_by_gc_after_backward=-net["gc"],
                  stack_entries_after_backward=system.stack_entries(),
                  store_bytes_after_backward=system.store_bytes() - run.store_before)
    system.clear_stack()
    return result


def eval_pass(system, q, k, v, spec, mask, forwards: int = 3) -> dict:
    """What ``forwards`` forwards under ``torch.no_grad()`` leave behind (stack entries, bytes)."""
    import torch

    store_before = system.store_bytes()
    with torch.no_grad():
        for _ in range(forwards):
            system.attention(q, k, v, spec, mask)
    held = system.held_tensors()
    result = dict(forwards=forwards, stack_entries_left=system.stack_entries(),
                  stack_bytes_left=distinct_storage_bytes(held, exclude=(q, k, v, mask)),
                  store_bytes_left=system.store_bytes() - store_before)
    system.clear_stack()
    return result


def resources(system, plan: dict, rank: int, world: int) -> dict:
    """(b) memory with and without checkpointing, (d) traffic (in the first memory pass), eval entries."""
    q, k, v, dout, spec = resource_inputs(plan, rank, world)
    set_load_balance(True)
    mask = mask_for(spec, world)
    out = {}
    for _ in range(plan["warmup"]):  # extra warm-up calls (the cases have already run the system)
        system.attention(q, k, v, spec, mask).backward(dout)
        system.clear_stack()
    # (b) memory
    out["memory"] = memory_pass(system, q, k, v, dout, spec, mask, checkpointed=False)
    out["traffic"] = out["memory"].pop("traffic")  # (d): bytes sent during that forward and backward
    out["memory_checkpoint"] = memory_pass(system, q, k, v, dout, spec, mask, checkpointed=True)
    out["eval"] = eval_pass(system, q, k, v, spec, mask)
    return out


def validate_memory_helper(nbytes: int = 8 << 20) -> dict:
    """``peak_bytes`` of a known allocation."""
    import torch

    def alloc():
        x = torch.empty(nbytes, dtype=torch.uint8)
        x.fill_(1)
        del x

    measured = peak_bytes(alloc)
    return dict(allocated=nbytes, measured_peak=measured, ok=nbytes <= measured <= nbytes + (64 << 10))
