"""Gated DeltaNet under CP (Qwen3.5, Qwen3-Next, OLMo-hybrid and their kin): the delta rule's state carried
across ranks in one of two forms.

- "state" (``algorithm`` ring or hybrid): each rank runs its chunks from a zero state and, in the same pass, the
  identity carried as extra value columns, which gives each chunk's transition M [Dk, Dk] and every token's read
  of the incoming state; the summaries (M, final state) are gathered and chained in sequence order, and each
  chunk adds its tokens' read of the state that enters it. O(heads Dk (Dk + Dv)) per chunk crosses ranks.
- "heads" (``ulysses``): an all-to-all from sequence shards to head shards, one kernel call on the whole
  sequence for H/W value heads, and back (H divisible by W).
``auto`` takes "heads" where W divides the value heads (measured a little faster: docs/hybrid.md), else "state"."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import region, sequence
from .heads import by_heads, to_heads, to_sequence
from .kernels import kernel
from .kinds import SERVERS
from .sequence import ShardedSequence, by_state, document_ends, document_lengths, lengths_of
from .serving import FunctionServer
from .short_conv import served_conv

__all__ = ["delta_rule_under_cp", "served_rule"]


def delta_rule_under_cp(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, seq: ShardedSequence,
                        *, algorithm: str = "ring", scale: Optional[float] = None,
                        use_qk_l2norm: bool = False) -> Tensor:
    """The local ``[B, L, ...]`` shards of ``chunk_gated_delta_rule``'s inputs -> the local output, exact."""
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)
    if by_heads(algorithm, value.size(2), seq.world, "a Gated DeltaNet", auto=True):
        return _by_heads(query, key, value, g, beta, seq, options)
    return _by_state(query, key, value, g, beta, seq, options)


def _by_state(query, key, value, g, beta, seq: ShardedSequence, options: dict) -> Tensor:
    batch, _, v_heads, v_dim = value.shape
    k_dim = key.size(-1)

    def run(chunk, rows):
        q, k, v, g_c, b_c = (t[:, rows] for t in (query.float(), key, value, g, beta))  # float32 out
        if not chunk.continues:  # starts a document: nothing to read
            out, final = kernel("gated_delta")(q, k, v, g_c, b_c, segments=chunk.pieces, **options)
            return out, final.new_zeros(batch, v_heads, k_dim, k_dim), final, None
        # the identity as extra value columns: the chunk's transition and its tokens' read of the state entering it
        v = torch.cat([v.float(), v.new_zeros(*v.shape[:-1], k_dim, dtype=torch.float32)], dim=-1)
        eye = torch.eye(k_dim, device=v.device).expand(batch, v_heads, k_dim, k_dim)
        initial = torch.cat([eye.new_zeros(batch, v_heads, k_dim, v_dim), eye], dim=-1)
        out, final = kernel("gated_delta")(q, k, v, g_c, b_c, initial_state=initial, segments=chunk.pieces,
                                            **options)
        operator = out[..., v_dim:]
        return (out[..., :v_dim], final[..., v_dim:], final[..., :v_dim],
                lambda state: torch.einsum("blhk,bhkv->blhv", operator, state))

    return by_state(seq, run, lambda transition, state: transition @ state, dim=1).to(query.dtype)


def _by_heads(query, key, value, g, beta, seq: ShardedSequence, options: dict) -> Tensor:
    v_heads, k_heads = value.size(2), key.size(2)
    if k_heads % seq.world or (v_heads // seq.world) % (v_heads // k_heads):  # q/k heads do not split with v's
        query, key = (t.repeat_interleave(v_heads // k_heads, dim=2) for t in (query, key))
    q, k, v, g_h, b_h = to_heads(seq, [query, key, value, g.unsqueeze(-1), beta.unsqueeze(-1)])
    out, _ = kernel("gated_delta")(q, k, v, g_h.squeeze(-1), b_h.squeeze(-1), segments=document_lengths(seq),
                                    **options)
    return to_sequence(seq, out)


def served_rule(original):
    """cp_cache's ``torch_chunk_gated_delta_rule`` (transformers' signature)."""

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     **kwargs):
        ends = document_ends(cu_seqlens)
        seq = sequence.current(query.size(1), ends)
        if seq is not None:
            if initial_state is not None or output_final_state:
                raise NotImplementedError("cp_cache: Gated DeltaNet with a cache (initial_state, output_final_state) "
                                          "under context parallelism is not supported; train with use_cache=False")
            return delta_rule_under_cp(query, key, value, g, beta, seq, algorithm=region.active().algorithm,
                                       use_qk_l2norm=use_qk_l2norm_in_kernel), None
        region.refuse_without_region("a Gated DeltaNet")
        if ends is None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        out, final = kernel("gated_delta")(query, key, value, g, beta, initial_state=initial_state,
                                            segments=lengths_of(ends), use_qk_l2norm=use_qk_l2norm_in_kernel)
        return out, final if output_final_state else None

    return torch_chunk_gated_delta_rule


SERVERS["gated_delta"] = FunctionServer({"causal_conv1d_fn": served_conv, "torch_chunk_gated_delta_rule": served_rule})
