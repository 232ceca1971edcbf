"""Mamba (Mamba-1) under CP (Jamba, Zamba, Mamba, Falcon-Mamba): the selective scan's state carried across ranks.
The decay is diagonal, one per channel and state entry, so a chunk's summary is its final state from zero and its
decay [Dch, N]: "state" form (ring, hybrid; auto: within 10% of the other's time and 0.6x its memory) gathers and
chains them, each chunk adding its tokens' read of the state entering it (before the gate); "channels" form
(ulysses) shards the channels over the ranks (B and C, shared by every channel, go to every rank whole). The
models hand the scan no packed documents: it takes those the model was called with. mamba_ssm's fused path is
turned off inside a region."""

from __future__ import annotations

import functools
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from . import region, sequence
from .heads import by_heads, to_heads, to_sequence
from .kernels import kernel
from .kinds import SERVERS
from .mamba2 import unfused_inside_regions
from .selective_scan import selective_state_read, selective_transition
from .sequence import ShardedSequence, by_state, document_lengths
from .serving import FunctionServer
from .short_conv import served_conv

__all__ = ["selective_scan_under_cp", "served_selective_scan"]


def selective_scan_under_cp(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, seq: ShardedSequence, *,
                            D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                            delta_bias: Optional[Tensor] = None, delta_softplus: bool = False,
                            algorithm: str = "ring") -> Tensor:
    """``selective_scan``'s local shards ([batch, Dch, L] and [batch, N, L]) -> the local output, exact."""
    options = dict(D=D, delta_bias=delta_bias, delta_softplus=delta_softplus)
    if by_heads(algorithm, u.size(1), seq.world, "a Mamba layer's channels", auto=False):
        return _by_channels(u, delta, A, B, C, z, seq, options)
    discrete = delta if delta_bias is None else delta + delta_bias.to(delta.dtype)[..., None]
    discrete = F.softplus(discrete) if delta_softplus else discrete

    def run(chunk, rows):
        gate = None if z is None else z[..., rows]
        out, final = kernel("selective")(u[..., rows].float(), delta[..., rows], A, B[..., rows], C[..., rows],
                                         z=gate, segments=chunk.pieces, **options)

        def read(state):  # before the gate, as the scan's own sum
            summed = selective_state_read(discrete[..., rows], A, C[..., rows], state, segments=chunk.pieces)
            return summed if gate is None else summed * F.silu(gate.float())

        return out, selective_transition(discrete[..., rows], A, chunk.pieces), final, read

    return by_state(seq, run, lambda decay, state: decay * state, dim=-1).to(u.dtype)


def _by_channels(u, delta, A, B, C, z, seq: ShardedSequence, options: dict) -> Tensor:
    """Channels as heads: [batch, Dch, L] -> [batch, L, Dch, 1]; B and C repeated once per rank."""
    world, channels = seq.world, u.size(1)
    per_rank = [t.transpose(1, 2).unsqueeze(-1) for t in ([u, delta] if z is None else [u, delta, z])]
    shared = [t.transpose(1, 2).unsqueeze(2).expand(-1, -1, world, -1).contiguous() for t in (B, C)]
    moved = to_heads(seq, per_rank + shared)
    u_h, delta_h = (t.squeeze(-1).transpose(1, 2) for t in moved[:2])
    z_h = None if z is None else moved[2].squeeze(-1).transpose(1, 2)
    B_h, C_h = (t.squeeze(2).transpose(1, 2) for t in moved[-2:])
    mine = slice(seq.rank * (channels // world), (seq.rank + 1) * (channels // world))
    D, bias = (None if t is None else t[mine] for t in (options["D"], options["delta_bias"]))
    out, _ = kernel("selective")(u_h.float(), delta_h, A[mine], B_h, C_h, D=D, z=z_h, delta_bias=bias,
                            delta_softplus=options["delta_softplus"], segments=document_lengths(seq))
    return to_sequence(seq, out.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2).to(u.dtype)


def served_selective_scan(original):
    """cp_cache's ``mamba_selective_scan`` (transformers' signature)."""

    @functools.wraps(original)
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        seq = sequence.current(hidden_states.size(-1))
        options = dict(D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
        if seq is None:
            region.refuse_without_region("a Mamba layer")
            return original(hidden_states, dt, A, B, C, return_last_state=return_last_state, use_mambapy=use_mambapy,
                            use_associative_scan=use_associative_scan, **options, **kwargs)
        if return_last_state:
            raise NotImplementedError("cp_cache: a Mamba layer with a cache (return_last_state) under context "
                                      "parallelism is not supported; train with use_cache=False")
        return selective_scan_under_cp(hidden_states, dt, A, B, C, seq, algorithm=region.active().algorithm, **options)

    return mamba_selective_scan


SERVERS["mamba1"] = FunctionServer({"causal_conv1d_fn": served_conv, "mamba_selective_scan": served_selective_scan},
                                   optional={"mamba_inner_fn": unfused_inside_regions})
