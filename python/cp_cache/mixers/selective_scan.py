"""Mamba-1's selective scan in plain torch (CPU, CUDA, Ascend NPU), packed documents kept apart.

Semantics of transformers' ``mamba_selective_scan`` (Mamba, Falcon-Mamba, Jamba, Zamba): per channel d a
diagonal state h [N], h_t = exp(delta_t A_d) h_{t-1} + delta_t u_t B_t, y_t = (h_t . C_t + D_d u_t) silu(z_t).
The decay differs per state entry, so there is no matrix form short of a [C, C] matrix per entry, and the
cumulative form overflows float32 once |A| x (delta summed over a chunk) passes ~88. So a two-level scan in
float32, every exponent <= 0: the recurrence token by token inside chunks, all chunks at once from a zero state;
the states between chunks carried in a loop; then each chunk's tokens read the state entering it, batched.

Packed runs (``segments``): a run starting inside a chunk zeroes the state there, only the tokens of the run the
incoming state belongs to read it, and it carries through a chunk only when no run starts inside.
``selective_state_read`` and ``selective_transition`` give the effect of an initial state, for a caller under CP:
y(S0) = y(0) + read silu(z), final(S0) = final(0) + transition S0.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .runs import autocast_off, carry, first_run, run_masks

__all__ = ["selective_scan", "selective_state_read", "selective_transition"]


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
                   z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
                   initial_state: Tensor | None = None, segments: Sequence[int] | None = None,
                   chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The selective scan over ``[batch, Dch, L]`` inputs; returns ``(y [batch, Dch, L], final_state)``.

    u, delta ``[batch, Dch, L]``; delta + delta_bias (if given), then softplus (if ``delta_softplus``), in
    float32, as transformers does; A ``[Dch, N]`` (< 0); B, C ``[batch, N, L]``, or ``[batch, G, N, L]``
    with each group serving Dch/G consecutive channels (mamba_ssm's grouped form); D ``[Dch]`` or None; z
    ``[batch, Dch, L]`` or None: y = (h . C + D u) silu(z). ``initial_state`` ``[batch, Dch, N]`` (None:
    zeros) enters the first token; ``segments`` (host ints summing to L) are consecutive runs, the state
    zeroed at the start of every run after the first. ``final_state`` ``[batch, Dch, N]`` float32 is the
    state after the last token; y has u's dtype. The loops run chunk_size + L / chunk_size steps.
    Differentiable in every tensor.
    """
    batch, channels, length = u.shape
    state_dim = A.shape[-1]
    _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, segments, chunk_size)
    groups = 1 if B.dim() == 3 else B.shape[1]
    with autocast_off(u.device.type):
        u32, delta = u.float(), delta.float()
        if delta_bias is not None:
            delta = delta + delta_bias.float()[:, None]
        if delta_softplus:
            delta = F.softplus(delta)
        padded = -(-length // chunk_size) * chunk_size
        u_c, delta_c = (_to_chunks(t.unflatten(1, (groups, -1)), chunk_size, padded) for t in (u32, delta))
        B_c, C_c = (_to_chunks(t.float().reshape(batch, groups, state_dim, length), chunk_size, padded)
                    for t in (B, C))
        if initial_state is None:
            state = u32.new_zeros(batch, groups, channels // groups, state_dim)
        else:
            state = initial_state.float().reshape(batch, groups, channels // groups, state_dim)
        y, final_state = _two_level_scan(u_c, delta_c, A.float().reshape(groups, -1, state_dim), B_c, C_c, state,
                                         _masks(segments or [length], padded, chunk_size, u.device))
        y = y.permute(2, 3, 4, 1, 0).reshape(batch, channels, padded)[..., :length]
        if D is not None:
            y = y + D.float()[:, None] * u32
        if z is not None:
            y = y * F.silu(z.float())
    return y.to(u.dtype), final_state.reshape(batch, channels, state_dim)


def selective_state_read(delta: Tensor, A: Tensor, C: Tensor, state: Tensor, *,
                         segments: Sequence[int] | None = None) -> Tensor:
    """The read of ``state`` (entering the first token) by the tokens of the first run, 0 after it:
    ``[batch, Dch, L]`` float32, read_t = sum_N exp(A sum_{s<=t} delta_s) state C_t, before the D term and
    the gate. delta is the discretised step (bias and softplus applied). With the gate z, y(state) =
    y(0) + read * silu(z) (y(0) from ``selective_scan(..., initial_state=None)``, same D and z)."""
    batch, channels, length = delta.shape
    groups = 1 if C.dim() == 3 else C.shape[1]
    with autocast_off(delta.device.type):
        decay = (delta.float().cumsum(-1)[..., None] * A.float()[:, None, :]).exp()
        weighted = (decay * state.float()[:, :, None, :]).unflatten(1, (groups, -1))
        C = C.float().reshape(batch, groups, -1, length).transpose(-1, -2)
        read = (weighted * C[:, :, None]).sum(-1).flatten(1, 2)
    return read * first_run(segments, length, delta.device)


def selective_transition(delta: Tensor, A: Tensor, segments: Sequence[int] | None = None) -> Tensor:
    """The final state's dependence on the initial one, final(S0) = transition * S0 + final(0): ``[batch,
    Dch, N]`` float32, exp(A sum of delta) (delta discretised), 0 when a run starts after the first token."""
    with autocast_off(delta.device.type):
        transition = (delta.float().sum(-1)[..., None] * A.float()).exp()
    return transition * float(segments is None or len(segments) <= 1)


def _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, segments, chunk_size) -> None:
    batch, channels, length = u.shape
    state_dim = A.shape[-1]
    problems = []
    for name, t in (("delta", delta), ("z", z)):
        if t is not None and t.shape != u.shape:
            problems.append(f"{name} {tuple(t.shape)} != u {tuple(u.shape)}")
    if A.shape != (channels, state_dim):
        problems.append(f"A {tuple(A.shape)} is not [Dch, N] with Dch = {channels}")
    grouped = B.dim() == 4 and B.shape[0] == batch and channels % B.shape[1] == 0
    if B.shape[-2:] != (state_dim, length) or not (B.dim() == 3 and B.shape[0] == batch or grouped):
        problems.append(f"B {tuple(B.shape)} is not [batch, N, L] or [batch, G, N, L] (G dividing Dch)")
    if C.shape != B.shape:
        problems.append(f"C {tuple(C.shape)} != B {tuple(B.shape)}")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and t.shape != (channels,):
            problems.append(f"{name} {tuple(t.shape)} != [Dch] = {(channels,)}")
    if initial_state is not None and initial_state.shape != (batch, channels, state_dim):
        problems.append(f"initial_state {tuple(initial_state.shape)} != {(batch, channels, state_dim)}")
    if segments is not None and (sum(segments) != length or min(segments, default=0) < 1):
        problems.append(f"segments {list(segments)} are not positive ints summing to L = {length}")
    if length < 1 or chunk_size < 1:
        problems.append(f"L = {length} and chunk_size = {chunk_size} must be positive")
    if problems:
        raise ValueError("selective_scan: " + "; ".join(problems))


def _to_chunks(x: Tensor, chunk_size: int, padded: int) -> Tensor:
    """[batch, G, K, L] -> [chunk_size, chunks, batch, G, K] contiguous (time-major: a step's slice is one
    block); the padding zeros (delta 0: an identity token)."""
    x = F.pad(x, [0, padded - x.shape[-1]]).unflatten(-1, (-1, chunk_size))
    return x.permute(4, 3, 0, 1, 2).contiguous()


def _masks(segments: Sequence[int], padded: int, chunk_size: int, device) -> tuple[dict, Tensor, Tensor]:
    """Per step t > 0 inside a chunk where some run starts: the chunks whose state it zeroes (a
    [chunks, 1, 1, 1, 1] keep mask); the tokens that read the incoming state [C, chunks, 1, 1, 1, 1]; whether
    the incoming state carries through each chunk [chunks, 1, 1, 1, 1]."""
    _, reads, _, carries = run_masks(segments, padded, chunk_size, device)
    starts: dict = {}
    for start in itertools.accumulate(segments[:-1]):
        if start % chunk_size:
            starts.setdefault(start % chunk_size, []).append(start // chunk_size)
    keep = {}
    for step, chunks in starts.items():
        keep[step] = torch.ones(padded // chunk_size, 1, 1, 1, 1, device=device)
        keep[step][chunks] = 0
    return keep, reads.T[..., None, None, None, None], carries[:, None, None, None, None]


def _two_level_scan(u, delta, A, B, C, state, masks):
    """On [C, chunks, batch, G, *] chunks: the recurrence inside every chunk from a zero state, the
    carry between chunks, each chunk's read of its incoming state; returns (y [C, chunks, batch, G, Dg],
    final state [batch, G, Dg, N])."""
    keep, reads, carries = masks
    h = u.new_zeros(*u.shape[1:], A.shape[-1])
    y = []
    # unbind, not indexing: each index's backward would write a zero tensor of the whole size
    for step, (u_t, delta_t, B_t, C_t) in enumerate(zip(u.unbind(0), delta.unbind(0), B.unbind(0), C.unbind(0))):
        if step in keep:
            h = h * keep[step]
        h = torch.addcmul((delta_t[..., None] * A).exp() * h, (delta_t * u_t)[..., None], B_t[..., None, :])
        y.append(h @ C_t[..., None])
    cum = delta.cumsum(0)[..., None]
    incoming, final_state = carry(h, (cum[-1] * A).exp() * carries, state)
    read = (((cum * A).exp() * incoming) @ C[..., None]) * reads
    return (torch.stack(y) + read).squeeze(-1), final_state
