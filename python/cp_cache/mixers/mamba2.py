"""Mamba-2 under CP (Bamba, Granite 4 hybrid, Nemotron-H, Zamba2, Falcon-H1, Mamba-2): the SSD scan's state carried
across ranks. The state update has a scalar decay per head, S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, so a
chunk's summary is its final state from zero and one number per head (its decay): "state" form (ring, hybrid)
gathers and chains them, each chunk adding its tokens' read of the state entering it (and ``auto``: measured 1.7x
faster than the other form); "heads" form (ulysses) shards the heads (and B/C's groups, or B/C repeated per head)
over the ranks for one scan of the whole sequence.
The model's fused path (mamba_ssm's split-conv-scan kernel) is turned off inside a region: its conv and scan run
as the two functions cp_cache serves."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import region, sequence
from .heads import by_heads, to_heads, to_sequence
from .kernels import kernel
from .kinds import SERVERS
from .sequence import ShardedSequence, by_state, document_ends, document_lengths, lengths_of
from .serving import FunctionServer
from .short_conv import served_conv
from .ssd import ssd_state_read, ssd_transition

__all__ = ["ssd_under_cp", "served_chunk_scan"]


def ssd_under_cp(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], seq: ShardedSequence,
                 algorithm: str = "ring") -> Tensor:
    """``ssd_scan``'s local shards (dt discretised) -> the local output, float32, exact."""
    if by_heads(algorithm, x.size(2), seq.world, "a Mamba-2 layer", auto=False):
        return _by_heads(x, dt, A, B, C, D, seq)

    def run(chunk, rows):
        out, final = kernel("ssd")(x[:, rows].float(), dt[:, rows], A, B[:, rows], C[:, rows], D=D,
                                   segments=chunk.pieces)
        return (out, ssd_transition(dt[:, rows], A, chunk.pieces), final,
                lambda state: ssd_state_read(dt[:, rows], A, C[:, rows], state, segments=chunk.pieces))

    return by_state(seq, run, lambda decay, state: decay[..., None, None] * state, dim=1)


def _by_heads(x, dt, A, B, C, D, seq: ShardedSequence) -> Tensor:
    heads, groups = x.size(2), B.size(2)
    if groups % seq.world or (heads // seq.world) % (heads // groups):  # groups that do not split with the heads
        B, C = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))
    x_h, dt_h, B_h, C_h = to_heads(seq, [x.float(), dt.unsqueeze(-1), B, C])
    mine = slice(seq.rank * (heads // seq.world), (seq.rank + 1) * (heads // seq.world))
    out, _ = kernel("ssd")(x_h, dt_h.squeeze(-1), A[mine], B_h, C_h, D=None if D is None else D[mine],
                      segments=document_lengths(seq))
    return to_sequence(seq, out)


def discretised(dt: Tensor, dt_bias: Optional[Tensor], softplus: bool, limit: tuple[float, float]) -> Tensor:
    """As the models' ``mamba2_chunk_scan`` does before its scan."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=limit[0], max=limit[1])


def served_chunk_scan(original):
    """cp_cache's ``mamba2_chunk_scan`` (transformers' signature; returns float32, as it does)."""

    @functools.wraps(original)
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        ends = document_ends(kwargs.get("cu_seq_lens_q"))
        seq = sequence.current(hidden_states.size(1), ends)
        if seq is None:
            region.refuse_without_region("a Mamba-2 layer")
            if ends is None or len(ends) == 1:
                return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                                initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                return_final_states=return_final_states, **kwargs)
            discrete = discretised(dt, dt_bias, dt_softplus, dt_limit)
            out, final = kernel("ssd")(hidden_states.float(), discrete, A, B, C, D=D, initial_state=initial_states,
                                       segments=lengths_of(ends))
            return (out, final) if return_final_states else out
        if initial_states is not None or return_final_states:
            raise NotImplementedError("cp_cache: a Mamba-2 layer with a cache (initial_states, return_final_states) "
                                      "under context parallelism is not supported; train with use_cache=False")
        return ssd_under_cp(hidden_states, discretised(dt, dt_bias, dt_softplus, dt_limit), A, B, C, D, seq,
                            region.active().algorithm)

    return mamba2_chunk_scan


def unfused_inside_regions(original):
    """A fused kernel that would scan the local shard alone: None inside a region (the model then runs its conv and
    scan, which cp_cache serves), the kernel elsewhere."""

    @functools.wraps(original)
    def fused(*args, **kwargs):
        return None if region.in_cp() else original(*args, **kwargs)

    return fused


SERVERS["mamba2"] = FunctionServer({"causal_conv1d_fn": served_conv, "mamba2_chunk_scan": served_chunk_scan},
                                   optional={"mamba2_split_conv1d_scan_combined": unfused_inside_regions})
