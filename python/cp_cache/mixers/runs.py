"""Packed runs (documents) inside the fixed-size chunks of cp_cache's chunked mixer kernels (the delta rule, the
SSD scan, the selective scan): the masks that keep runs apart, the state carried from chunk to chunk, and the
float32 context they compute in."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["autocast_off", "run_masks", "first_run", "carry"]


def autocast_off(device_type: str):
    """The caller may run under bf16 autocast; a device without autocast (meta) needs nothing."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def run_masks(segments: Sequence[int], padded: int, chunk_size: int, device) -> tuple[Tensor, ...]:
    """Per chunk, from the runs: pairs (i, j <= i) in one run [N, C, C]; tokens that read the
    incoming state, tokens that write the outgoing one [N, C]; whether the incoming state carries
    through [N]. The padding belongs to the last run."""
    lengths = [int(n) for n in segments]
    lengths[-1] += padded - sum(lengths)
    run = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device),
                                  output_size=padded)
    run = run.view(-1, chunk_size)
    incoming_run = torch.cat([run[:1, :1], run[:-1, -1:]])
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    same_run = (run.unsqueeze(-1) == run.unsqueeze(-2)) & causal
    reads = (run == incoming_run).float()
    writes = (run == run[:, -1:]).float()
    carries = (run[:, -1] == incoming_run[:, 0]).float()
    return same_run, reads, writes, carries


def first_run(segments: Sequence[int] | None, length: int, device) -> Tensor:
    mask = torch.zeros(length, device=device)
    mask[:(segments or [length])[0]] = 1
    return mask


def carry(contributions: Tensor, through: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The state entering each chunk [chunks, ...] and the final one: S <- through S + contribution
    (``through`` broadcasts against the state)."""
    incoming = []
    # unbind, not indexing: each index's backward would write a zero tensor of the whole size
    for contribution, chunk_through in zip(contributions.unbind(0), through.unbind(0)):
        incoming.append(state)
        state = torch.addcmul(contribution, state, chunk_through)
    return torch.stack(incoming), state
