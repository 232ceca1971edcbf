"""Mamba-2's state space duality (SSD) scan in plain torch (CPU, CUDA, Ascend NPU), packed documents kept apart.

Semantics of transformers' ``mamba2_chunk_scan`` (Mamba-2, Bamba, ...) given the discretised step dt: per
head a state S [P, N], S_t = exp(dt_t A) S_{t-1} + (dt_t x_t) B_t^T, y_t = S_t C_t + D x_t. Computed in
float32 in the chunked SSD form: inside a chunk a causal "attention" C B^T weighted by the pairwise decay,
batched over all chunks; between chunks only the state is carried, in a loop; then every chunk's tokens
read the state that enters it, batched again.

Packed runs (``segments``) need no padding per run: the pairwise decay is masked across runs, only the
tokens of the run the incoming state belongs to read it, only the tokens of the chunk's last run write the
outgoing state, and the incoming state carries through a chunk only when no run starts inside it.
``ssd_state_read`` and ``ssd_transition`` give the effect of an initial state, for a caller under CP that
adds it afterwards: y(S0) = y(0) + read, final(S0) = final(0) + transition S0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .runs import autocast_off, carry, first_run, run_masks

__all__ = ["ssd_scan", "ssd_state_read", "ssd_transition"]


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
             initial_state: Tensor | None = None, segments: Sequence[int] | None = None,
             chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The SSD scan over ``[batch, L, ...]`` inputs; returns ``(y [batch, L, H, P], final_state)``.

    x ``[batch, L, H, P]``; dt ``[batch, L, H]``, already discretised (dt_bias, softplus and dt_limit
    applied by the caller, as transformers does before its scan), > 0; A ``[H]`` (< 0); B, C
    ``[batch, L, G, N]``, each group serving H/G consecutive heads; D ``[H]`` or None: y += D x. dt scales
    x (transformers' choice; dt B is the same product). ``initial_state`` ``[batch, H, P, N]`` (None:
    zeros) enters the first token; ``segments`` (host ints summing to L) are consecutive runs, the state
    zeroed at the start of every run after the first. ``final_state`` ``[batch, H, P, N]`` float32 is the
    state after the last token; y has x's dtype. Differentiable in every tensor.
    """
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[-2:]
    out_dtype = x.dtype
    _check_inputs(x, dt, A, B, C, D, initial_state, segments, chunk_size)
    with autocast_off(x.device.type):
        x, dt, A = x.float(), dt.float(), A.float()
        padded = -(-length // chunk_size) * chunk_size
        x_dt, log_decay = (_to_chunks(t, chunk_size, padded, groups) for t in (x * dt[..., None], dt * A))
        B_c, C_c = (_to_chunks(t.float(), chunk_size, padded, groups) for t in (B, C))
        masks = run_masks(segments or [length], padded, chunk_size, x.device)
        if initial_state is None:
            state = x.new_zeros(batch, groups, heads // groups, head_dim, state_dim)
        else:
            state = initial_state.float().reshape(batch, groups, heads // groups, head_dim, state_dim)
        y, final_state = _chunked_ssd(x_dt, log_decay, B_c, C_c, state, masks)
    y = y.permute(1, 0, 4, 2, 3, 5).reshape(batch, padded, heads, head_dim)[:, :length]
    if D is not None:
        y = y + D.float()[:, None] * x
    return y.to(out_dtype), final_state.reshape(batch, heads, head_dim, state_dim)


def ssd_state_read(dt: Tensor, A: Tensor, C: Tensor, state: Tensor, *,
                   segments: Sequence[int] | None = None) -> Tensor:
    """What ``ssd_scan(..., initial_state=state)`` adds to y over ``initial_state=None``: ``[batch, L, H,
    P]`` float32, y_t = exp(sum_{s<=t} dt_s A) state C_t for the tokens of the first run, 0 after it."""
    batch, length, heads = dt.shape
    groups = C.shape[-2]
    with autocast_off(dt.device.type):
        decay = (dt.float() * A.float()).cumsum(1).exp() * first_run(segments, length, dt.device)[:, None]
        state = state.float().unflatten(1, (groups, heads // groups))
        read = torch.einsum("blgn,bghpn->blghp", C.float(), state).flatten(2, 3)
    return read * decay[..., None]


def ssd_transition(dt: Tensor, A: Tensor, segments: Sequence[int] | None = None) -> Tensor:
    """The final state's dependence on the initial one, final(S0) = transition S0 + final(0): ``[batch, H]``
    float32, exp(sum of dt A) over the sequence, 0 when a run starts after the first token."""
    with autocast_off(dt.device.type):
        transition = (dt.float() * A.float()).sum(1).exp()
    return transition * float(segments is None or len(segments) <= 1)


def _check_inputs(x, dt, A, B, C, D, initial_state, segments, chunk_size) -> None:
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[-2:]
    problems = []
    if dt.shape != (batch, length, heads):
        problems.append(f"dt {tuple(dt.shape)} != [batch, L, H] = {(batch, length, heads)}")
    for name, t in (("A", A), ("D", D)):
        if t is not None and t.shape != (heads,):
            problems.append(f"{name} {tuple(t.shape)} != [H] = {(heads,)}")
    if B.shape[:2] != (batch, length) or B.dim() != 4 or heads % groups:
        problems.append(f"B {tuple(B.shape)} is not [batch, L, G, N] with G dividing H = {heads}")
    if C.shape != B.shape:
        problems.append(f"C {tuple(C.shape)} != B {tuple(B.shape)}")
    if initial_state is not None and initial_state.shape != (batch, heads, head_dim, state_dim):
        problems.append(f"initial_state {tuple(initial_state.shape)} != {(batch, heads, head_dim, state_dim)}")
    if segments is not None and (sum(segments) != length or min(segments, default=0) < 1):
        problems.append(f"segments {list(segments)} are not positive ints summing to L = {length}")
    if length < 1 or chunk_size < 1:
        problems.append(f"L = {length} and chunk_size = {chunk_size} must be positive")
    if problems:
        raise ValueError("ssd_scan: " + "; ".join(problems))


def _to_chunks(x: Tensor, chunk_size: int, padded: int, groups: int) -> Tensor:
    """[batch, L, K, *rest] -> [chunks, batch, G, K/G, chunk_size, *rest]; the padding zeros (dt 0: an
    identity token)."""
    batch, length, k = x.shape[:3]
    rest = x.shape[3:]
    x = F.pad(x, [0, 0] * len(rest) + [0, 0, 0, padded - length]).view(batch, -1, chunk_size, k, *rest)
    x = x.permute(1, 0, 3, 2, *range(4, x.dim()))
    return x.unflatten(2, (groups, k // groups))


def _segment_sums(log_decay: Tensor, same_run: Tensor) -> Tensor:
    """sum_{j<k<=i} log_decay_k for the pairs (i, j <= i) of one run, -inf elsewhere: [..., C, C]. Summed
    directly, as transformers' segment_sum, not as a difference of two cumulative sums (which loses
    digits once the decay over the chunk is large)."""
    size = log_decay.shape[-1]
    strict = torch.ones(size, size, dtype=torch.bool, device=log_decay.device).tril(-1)
    sums = log_decay.unsqueeze(-1).expand(*log_decay.shape, size).masked_fill(~strict, 0).cumsum(-2)
    return sums.masked_fill(~same_run[:, None, None, None], float("-inf"))


def _chunked_ssd(x_dt, log_decay, B, C, state, masks):
    """The SSD form on [chunks, batch, G, H/G, C, *] chunks (B, C with one head per group); returns
    (y [chunks, batch, G, H/G, C, P], final state [batch, G, H/G, P, N])."""
    same_run, reads, _, carries = masks
    cum = log_decay.cumsum(-1)
    from_start = cum.exp() * reads[:, None, None, None]
    through = cum[..., -1].exp() * carries[:, None, None, None]
    pair_decay = _segment_sums(log_decay, same_run).exp()
    to_end = pair_decay[..., -1, :]  # 0 off the chunk's last run: only it writes the outgoing state
    scores = (C @ B.transpose(-1, -2)) * pair_decay
    contributions = (x_dt * to_end[..., None]).transpose(-1, -2) @ B
    incoming, final_state = carry(contributions, through[..., None, None], state)
    read = (C @ incoming.transpose(-1, -2)) * from_start[..., None]
    return torch.baddbmm(read.flatten(0, -3), scores.flatten(0, -3), x_dt.flatten(0, -3)).view_as(read), final_state
