"""Gated DeltaNet's chunked gated delta rule in plain torch (CPU, CUDA, Ascend NPU), packed documents kept apart.

Semantics of transformers' ``torch_chunk_gated_delta_rule``: per value head a state S [Dk, Dv],
S <- exp(g_t) S, S <- S + k_t beta_t (v_t - k_t^T S), o_t = q_t^T S. Computed in float32 in the
chunked WY/UT form: everything inside a chunk is batched over all chunks, and only the carry of the
state from chunk to chunk is a loop.

Packed runs (``segments``) need no padding per run: a chunk's tokens interact only within one run
(the pairwise decay is masked across runs), only the tokens of the run the incoming state belongs
to read it, only the tokens of the chunk's last run write the outgoing state, and the incoming state
carries through a chunk only when no run starts inside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .runs import autocast_off, run_masks

__all__ = ["chunk_gated_delta_rule"]

SOLVERS = ("solve_triangular", "substitution")


def chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, *,
                           scale: float | None = None, initial_state: Tensor | None = None,
                           segments: Sequence[int] | None = None, use_qk_l2norm: bool = False,
                           chunk_size: int = 64, solver: str | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule over ``[B, L, ...]`` inputs; returns ``(out [B, L, H, Dv], final_state)``.

    query, key ``[B, L, Hk, Dk]``; value ``[B, L, H, Dv]`` (each q/k head serves H/Hk consecutive value
    heads; Dv is free, e.g. extra columns to carry a transition matrix); g (log decay, <= 0) and beta
    ``[B, L, H]``. ``scale`` multiplies the query (default Dk**-0.5), after the l2 norm if
    ``use_qk_l2norm``. ``initial_state`` ``[B, H, Dk, Dv]`` (None: zeros) enters the first token;
    ``segments`` (host ints summing to L) are consecutive runs, the state zeroed at the start of every
    run after the first. ``final_state`` ``[B, H, Dk, Dv]`` float32 is the state after the last token.
    ``out`` has query's dtype. ``solver``: "solve_triangular" or "substitution" (standard ops only);
    None picks solve_triangular on CPU and CUDA, substitution elsewhere. Differentiable in every tensor.
    """
    batch, length, k_heads, k_dim = query.shape
    v_heads, v_dim = value.shape[-2:]
    out_dtype = query.dtype
    _check_inputs(query, key, value, g, beta, initial_state, segments, chunk_size)
    solver = solver or ("solve_triangular" if query.device.type in ("cpu", "cuda") else "substitution")
    if solver not in SOLVERS:
        raise ValueError(f"chunk_gated_delta_rule: solver {solver!r} is not one of {SOLVERS}")
    with autocast_off(query.device.type):
        query, key = (x.float().repeat_interleave(v_heads // k_heads, dim=2) for x in (query, key))
        if use_qk_l2norm:
            query, key = _l2norm(query), _l2norm(key)
        query = query * (k_dim**-0.5 if scale is None else scale)
        padded = -(-length // chunk_size) * chunk_size
        q, k, v, g_c, beta_c = (_to_chunks(x.float(), chunk_size, padded) for x in (query, key, value, g, beta))
        masks = run_masks(segments or [length], padded, chunk_size, q.device)
        if initial_state is None:
            state = q.new_zeros(batch * v_heads, k_dim, v_dim)
        else:
            state = initial_state.float().reshape(batch * v_heads, k_dim, v_dim)
        out, final_state = _chunked_delta_rule(q, k, v, g_c, beta_c, state, masks, solver)
    out = out.view(-1, batch, v_heads, chunk_size, v_dim).permute(1, 0, 3, 2, 4)
    out = out.reshape(batch, padded, v_heads, v_dim)[:, :length]
    return out.to(out_dtype), final_state.view(batch, v_heads, k_dim, v_dim)


def _check_inputs(query, key, value, g, beta, initial_state, segments, chunk_size) -> None:
    batch, length, k_heads, k_dim = query.shape
    v_heads, v_dim = value.shape[-2:]
    problems = []
    if key.shape != query.shape:
        problems.append(f"key {tuple(key.shape)} != query {tuple(query.shape)}")
    if value.shape[:2] != (batch, length) or v_heads % k_heads:
        problems.append(f"value {tuple(value.shape)} is not [B, L, H, Dv] with H a multiple of Hk = {k_heads}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, length, v_heads):
            problems.append(f"{name} {tuple(x.shape)} != [B, L, H] = {(batch, length, v_heads)}")
    if initial_state is not None and initial_state.shape != (batch, v_heads, k_dim, v_dim):
        problems.append(f"initial_state {tuple(initial_state.shape)} != {(batch, v_heads, k_dim, v_dim)}")
    if segments is not None and (sum(segments) != length or min(segments, default=0) < 1):
        problems.append(f"segments {list(segments)} are not positive ints summing to L = {length}")
    if length < 1 or chunk_size < 1:
        problems.append(f"L = {length} and chunk_size = {chunk_size} must be positive")
    if problems:
        raise ValueError("chunk_gated_delta_rule: " + "; ".join(problems))


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _to_chunks(x: Tensor, chunk_size: int, padded: int) -> Tensor:
    """[B, L, H, *rest] -> [chunks, B*H, chunk_size, *rest], the padding zeros (an identity token)."""
    batch, length, heads = x.shape[:3]
    rest = x.shape[3:]
    x = F.pad(x, [0, 0] * len(rest) + [0, 0, 0, padded - length]).view(batch, -1, chunk_size, heads, *rest)
    x = x.permute(1, 0, 3, 2, *range(4, x.dim()))
    return x.reshape(-1, batch * heads, chunk_size, *rest)


def _chunked_delta_rule(q, k, v, g, beta, state, masks, solver):
    """The WY/UT form on [N, B*H, C, *] chunks; returns (out [N, B*H, C, Dv], final state)."""
    same_run, reads, writes, carries = masks
    cum = g.cumsum(-1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~same_run.unsqueeze(1), float("-inf")).exp()
    from_start = cum.exp() * reads.unsqueeze(1)
    to_end = (cum[..., -1:] - cum).exp() * writes.unsqueeze(1)
    through = cum[..., -1].exp() * carries.unsqueeze(1)
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    if solver == "solve_triangular":
        identity = torch.eye(system.shape[-1], dtype=system.dtype, device=system.device).expand_as(system)
        inverse = torch.linalg.solve_triangular(system, identity, upper=False, unitriangular=True)
    else:
        inverse = _unit_lower_inverse(system)
    new_values = inverse @ (v * beta.unsqueeze(-1))
    state_weights = inverse @ (k_beta * from_start.unsqueeze(-1))
    read, corrected, final_state = _scan(q * from_start.unsqueeze(-1), new_values, state_weights,
                                         k * to_end.unsqueeze(-1), through, state)
    attn = (q @ k.transpose(-1, -2)) * pair_decay
    out = torch.baddbmm(read.flatten(0, 1), attn.flatten(0, 1), corrected.flatten(0, 1))
    return out.view_as(read), final_state


def _scan(queries, new_values, state_weights, keys_to_end, through, state):
    """The state carried from chunk to chunk: per chunk what its queries read from the state that
    enters it, its tokens' values corrected by that state (v_new = u - w S); the final state."""
    # unbind, not indexing: each index's backward would write a zero tensor of the whole size
    per_chunk = zip(queries.unbind(0), new_values.unbind(0), state_weights.unbind(0),
                    keys_to_end.transpose(-1, -2).contiguous().unbind(0), through[..., None, None].unbind(0))
    read, corrected = [], []
    for chunk_queries, chunk_values, chunk_weights, chunk_keys, chunk_through in per_chunk:
        read.append(chunk_queries @ state)
        corrected.append(torch.baddbmm(chunk_values, chunk_weights, state, alpha=-1))
        state = torch.baddbmm(state * chunk_through, chunk_keys, corrected[-1])
    return torch.stack(read), torch.stack(corrected), state


def _unit_lower_inverse(system: Tensor) -> Tensor:
    """(I + strictly-lower part of ``system``)^-1 by block forward substitution: the inverse
    diagonal blocks of size 1, 2, 4, ... merged pairwise (only matmuls, for devices without a
    triangular solver)."""
    size = system.shape[-1]
    padded = 1 << (size - 1).bit_length()
    strict = F.pad(system.tril(-1), (0, padded - size, 0, padded - size))
    batch = strict.shape[:-2]
    blocks = strict.new_ones(*batch, padded, 1, 1)
    width = 1
    while width < padded:
        pairs = padded // (2 * width)
        diagonal_blocks = strict.reshape(*batch, pairs, 2 * width, pairs, 2 * width).diagonal(dim1=-4, dim2=-2)
        coupling = diagonal_blocks.movedim(-1, -3)[..., width:, :width]
        first, second = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        below = -(second @ coupling @ first)
        blocks = torch.cat([torch.cat([first, torch.zeros_like(first)], -1), torch.cat([below, second], -1)], -2)
        width *= 2
    return blocks[..., 0, :size, :size]
