"""Ulysses (all-to-all) and hybrid (Ulysses x ring) context-parallel attention, forward and backward.

Ulysses over a group of U ranks, each holding a sequence shard of every head:

1. one all-to-all turns the sequence shards of q, k, v into head shards: rank u gets
   query heads [u*Nq/U, (u+1)*Nq/U) over the whole sequence (K/V: their own head
   count; with GQA and Nkv < U dividing U, each K/V head is first repeated U/Nkv times,
   so rank u gets the one K/V head its query heads use);
2. the sequence arrives in the order the ranks hold it; head-tail load balancing is
   undone (global order) before the local call and redone after it;
3. one full-sequence attention call of the step kernel (causal, band, full, or a given mask
   shared by the heads), with its own dropout seed/offset, recorded like a ring step;
4. one all-to-all brings the output and the LSE back to sequence shards.

Backward exchanges q, k, v, the output, its gradient and the LSE again (nothing but
the op's outputs is kept from forward), replays the recorded seed/offset, and an
all-to-all brings dq, dk, dv home (repeated K/V heads summed).

Hybrid (USP): the CP ranks form a W0 x W1 grid; rank (i, j) holds sequence chunk
i*W1 + j of W0*W1. Ulysses runs over j (the inner group): rank (i, j) then holds head
group j of the contiguous block i of W0. The ring runs over i (the outer group) on
those blocks (``ring.py``, contiguous layout), then Ulysses brings the output back.

Dropout: every rank of a Ulysses group computes different heads, so no two may share
a mask. Rank u advances the random generator of the query's device by u draws before
its attention call(s) and by U-1-u after them: each rank draws its own seed/offset,
and every rank leaves the generator in the same state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import layout as L
from .kernels.base import StepKernel, StepMask
from .ring import (
    RingBackward,
    RingConfig,
    RingForward,
    RingStep,
    _agreed_checks,
    _check_inputs,
    ring_attention_backward,
    ring_attention_forward,
)
from .ring_plan import positions

__all__ = [
    "HeadPlan",
    "head_plan",
    "ulysses_attention_forward",
    "ulysses_attention_backward",
    "bytes_per_rank",
    "choose_algorithm",
    "ulysses_degree",
]

log = logging.getLogger("cp_cache")

_BNSD = "BNSD"


# ---------------------------------------------------------------- heads


@dataclass(frozen=True)
class HeadPlan:
    """How the heads split over a Ulysses group of ``world`` ranks."""

    nq: int
    nkv: int
    world: int
    kv_repeats: int  # each K/V head is repeated this many times before the exchange

    @property
    def local_nq(self) -> int:
        return self.nq // self.world

    @property
    def local_nkv(self) -> int:
        return self.nkv * self.kv_repeats // self.world


def ulysses_degree(algorithm: str, cp_sizes: list[int]) -> int:
    """The Ulysses degree (``RingConfig.ulysses_size``) of ``algorithm`` on a mesh whose CP
    dimensions have these sizes, outer first: all of one dimension for Ulysses, the inner
    one for hybrid, 1 for the ring; 0 where the algorithm cannot run on such a mesh."""
    if algorithm == "ulysses":
        return cp_sizes[0] if len(cp_sizes) == 1 else 0
    if algorithm == "hybrid":
        return cp_sizes[1] if len(cp_sizes) == 2 else 0
    return 1


def head_plan(nq: int, nkv: int, world: int) -> HeadPlan:
    """The head split of Ulysses; ValueError naming N, Nkv and W when it cannot be done."""
    if nq % nkv:
        raise ValueError(f"the query head count N={nq} is not a multiple of the K/V head count Nkv={nkv}")
    if nq % world == 0 and nkv % world == 0:
        return HeadPlan(nq, nkv, world, 1)
    if nq % world == 0 and world % nkv == 0:
        return HeadPlan(nq, nkv, world, world // nkv)
    raise ValueError(
        f"Ulysses context parallelism splits the heads over W={world} ranks: it needs the query head "
        f"count N divisible by W and the K/V head count Nkv divisible by W or dividing W; got N={nq}, "
        f"Nkv={nkv}, W={world} (heads per rank, after any tensor-parallel split)"
    )


def bytes_per_rank(algorithm: str, *, nq: int, nkv: int, world: int, batch: int, local_seq: int,
                   head_dim: int, itemsize: int) -> int:
    """Bytes one rank sends for one attention call, forward plus backward, with full attention
    (what ``call_stats()`` reports; a causal ring skips no transfer either).

    ring: forward W-1 K/V blocks; backward W-1 K/V blocks and W float32 dK/dV blocks.
    ulysses: the (W-1)/W share not kept of q, k, v (K/V repeated when Nkv < W) and of the
    output and LSE (forward); of q, k, v, output, output gradient, LSE, and dq, dk, dv
    (backward).
    """
    if world == 1:
        return 0
    token = batch * local_seq * head_dim
    kv = 2 * nkv * token
    if algorithm == "ring":
        return (world - 1) * kv * itemsize + (world - 1) * kv * itemsize + world * kv * 4
    if algorithm == "ulysses":
        plan = head_plan(nq, nkv, world)
        kv_sent = 2 * nkv * plan.kv_repeats * token
        lse = batch * nq * local_seq * 4
        forward = (nq * token + kv_sent + nq * token) * itemsize + lse
        backward = (3 * nq * token + kv_sent) * itemsize + lse + (nq * token + kv_sent) * itemsize
        return (forward + backward) * (world - 1) // world
    raise ValueError(f"bytes_per_rank: algorithm={algorithm!r} is not 'ring' or 'ulysses'")


def choose_algorithm(*, nq: int, nkv: int, world: int, given_mask: bool, batch: int = 1, local_seq: int = 1,
                     head_dim: int = 128, itemsize: int = 2) -> str:
    """What ``algorithm="auto"`` runs on one CP mesh dimension of ``world`` ranks.

    Ulysses when its head split exists (N and Nkv as ``head_plan`` needs), the mask is not a
    given one (the ring skips wholly masked blocks and takes every mask shape), and it sends
    fewer bytes per rank than the ring for this call's shapes (``bytes_per_rank``: apart from
    the small LSE, only the head counts and W matter); the ring otherwise, ties included (the
    ring hides its transfers behind the step kernels, Ulysses' all-to-alls are not hidden).
    For MHA that is Ulysses from W = 2 up (the ring's backward sends W float32 dK/dV blocks);
    for GQA with few K/V heads, the ring.
    """
    if world == 1 or given_mask:
        return "ring"
    try:
        head_plan(nq, nkv, world)
    except ValueError:
        return "ring"
    shape = dict(nq=nq, nkv=nkv, world=world, batch=batch, local_seq=local_seq, head_dim=head_dim,
                 itemsize=itemsize)
    return "ulysses" if bytes_per_rank("ulysses", **shape) < bytes_per_rank("ring", **shape) else "ring"


# ---------------------------------------------------------------- exchanges


def _all_to_all(rows: Tensor, group, world: int) -> tuple[Tensor, int]:
    """[W, n] -> [W, n]: row j goes to rank j, row i of the result came from rank i."""
    received = torch.empty_like(rows)
    dist.all_to_all_single(received, rows, group=group)
    return received, rows.nbytes * (world - 1) // world


def _exchange(tensors: list[Tensor], group, world: int, to_heads: bool) -> tuple[list[Tensor], int]:
    """Sequence shards -> head shards (``to_heads``) or back, of [B, N, S, D] tensors.

    to_heads: [B, N, s, D] on each rank -> [B, N/W, W*s, D], the sequence in rank order.
    back: [B, N/W, W*s, D] -> [B, N, s, D], the heads in rank order.
    Tensors of one dtype travel in one all-to-all.
    """
    if world == 1:
        return [t.contiguous() for t in tensors], 0
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
        received, nbytes = _all_to_all(torch.cat([pieces[i] for i in members], dim=1), group, world)
        sent += nbytes
        start = 0
        for i in members:
            b, n, s, d = tensors[i].shape
            width = pieces[i].shape[1]
            rows = received[:, start:start + width]
            start += width
            if to_heads:  # row r: rank r's sequence shard of my heads
                results[i] = rows.reshape(world, b, n // world, s, d).permute(1, 2, 0, 3, 4).reshape(
                    b, n // world, world * s, d)
            else:  # row r: head group r of my sequence shard
                results[i] = rows.reshape(world, b, n, s // world, d).transpose(0, 1).reshape(
                    b, world * n, s // world, d)
    return results, sent


def _own(x: Tensor) -> Tensor:
    """``x`` in storage of its own: a result of ``_exchange`` can be a view of a receive buffer
    shared with the other tensors of its all-to-all, which it would keep alive (autograd saves
    the output and the LSE until backward)."""
    if x.untyped_storage().nbytes() == x.nbytes and x.is_contiguous():
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _sequence_order(config: RingConfig, local_seq: int) -> Optional[Tensor]:
    """Global position of each row of the gathered sequence (rank order), or None when that
    is already the global order (contiguous shards)."""
    if not config.load_balance:
        return None
    world = config.ulysses_size
    return torch.cat([positions(r, world, local_seq, True) for r in range(world)])


def _to_global(x: Tensor, order: Optional[Tensor]) -> Tensor:
    if order is None:
        return x
    return x.index_select(2, torch.argsort(order).to(x.device))


def _to_rank_order(x: Tensor, order: Optional[Tensor]) -> Tensor:
    if order is None:
        return x
    return x.index_select(2, order.to(x.device))


# ---------------------------------------------------------------- the local part


def _check_mask(config: RingConfig, mask: Optional[Tensor], seq: int) -> None:
    """A given mask must cover the whole sequence (``seq``: the global length) and be shared by
    the heads (each rank computes other heads)."""
    if not config.given_mask:
        return
    if mask is not None and mask.dim() == 4 and mask.size(1) != 1:
        raise NotImplementedError(
            f"cp_cache Ulysses attention takes a mask shared by the heads ([S, S], [1, 1, S, S] or "
            f"[B, 1, S, S]), not a per-head mask of shape {tuple(mask.shape)} yet; use algorithm='ring'"
        )
    if mask is None or mask.dim() not in (2, 4) or tuple(mask.shape[-2:]) != (seq, seq):
        got = None if mask is None else tuple(mask.shape)
        raise ValueError(f"a Ulysses call with a given mask needs it over the whole sequence "
                         f"[..., {seq}, {seq}]; got {got}")


def _ring_mask_rows(config: RingConfig, groups: "_Groups", mask: Optional[Tensor], seq: int) -> Optional[Tensor]:
    """Hybrid: the given mask's rows of this rank's contiguous block (the ring plans the rest)."""
    if not config.given_mask:
        return None
    rows = seq // groups.ring_size
    return mask.narrow(mask.dim() - 2, groups.ring_rank * rows, rows)


def _local_mask(config: RingConfig, mask: Optional[Tensor], seq: int) -> tuple[str, StepMask]:
    """The mask of the local full-sequence call (``seq``: the global length)."""
    if config.given_mask:
        _check_mask(config, mask, seq)
        block = mask.bool()
        if config.window:  # sparse_mode 0: the band applies on top of the mask
            i = torch.arange(seq, device=mask.device).view(-1, 1)
            j = torch.arange(seq, device=mask.device).view(1, -1)
            block = block | (j - i > config.next_tockens) | (i - j > config.pre_tockens)
        return "masked", StepMask("given", block=block)
    if config.causal:
        return "causal", StepMask("causal")
    if config.window:
        return "band", StepMask("band", pre_tockens=config.pre_tockens, next_tockens=config.next_tockens)
    return "full", StepMask("none")


def _advance_rng(device: torch.device, draws: int) -> None:
    for _ in range(draws):
        torch.rand(1, device=device)


@dataclass(frozen=True)
class _Groups:
    ulysses_rank: int
    ring_size: int
    ring_rank: int


def _groups(config: RingConfig, group, ring_group) -> _Groups:
    u = config.ulysses_size
    if u < 1 or config.world_size % u:
        raise ValueError(f"ulysses_size={u} does not divide world_size={config.world_size}")
    ulysses_rank, ring_size, ring_rank = config.rank % u, config.world_size // u, config.rank // u
    for name, g, size, rank in (("group", group, u, ulysses_rank), ("ring_group", ring_group, ring_size, ring_rank)):
        if size == 1:
            continue
        if g is None:
            raise ValueError(f"{name} is None but that dimension has {size} ranks")
        if (dist.get_world_size(g), dist.get_rank(g)) != (size, rank):
            raise ValueError(
                f"{name} has rank {dist.get_rank(g)} of {dist.get_world_size(g)}; the config "
                f"(world_size={config.world_size}, rank={config.rank}, ulysses_size={u}) gives {rank} of {size}"
            )
    return _Groups(ulysses_rank, ring_size, ring_rank)


def _ring_config(config: RingConfig, groups: _Groups, local_heads: int) -> RingConfig:
    """The ring over the outer dimension of a hybrid run, on the gathered head shards."""
    return replace(config, world_size=groups.ring_size, rank=groups.ring_rank, head_num=local_heads,
                   layout=_BNSD, load_balance=False, ulysses_size=1)


def _check(q: Tensor, k: Tensor, v: Tensor, config: RingConfig, mask: Optional[Tensor]) -> HeadPlan:
    local_seq = q.size(L.seq_dim(config.layout))
    _check_mask(config, mask, local_seq * config.world_size)
    # the ring's checks but for its mask rows (here: the whole mask, checked above)
    qd, nkv = _check_inputs(q, k, v, replace(config, given_mask=False))
    if config.given_mask and k.size(L.seq_dim(config.layout)) != local_seq:
        raise ValueError(f"masked Ulysses attention needs equal local query and key lengths, got "
                         f"{local_seq} and {k.size(L.seq_dim(config.layout))}")
    if config.ulysses_size > 1 and config.world_size > config.ulysses_size and config.load_balance:
        raise NotImplementedError(
            "cp_cache hybrid (Ulysses x ring) attention lays the sequence out contiguously; load "
            "balancing (torch's _cp_options.enable_load_balance) with causal, band or masked attention "
            "is not supported with it yet: turn load balancing off"
        )
    return head_plan(qd.heads, nkv, config.ulysses_size)


def _bnsd(x: Tensor, layout: str, heads: int) -> Tensor:
    return L.to_bnsd(x, layout, heads)


def _kv_bnsd(x: Tensor, config: RingConfig, plan: HeadPlan) -> Tensor:
    x = _bnsd(x, config.layout, plan.nkv)
    return x.repeat_interleave(plan.kv_repeats, dim=1) if plan.kv_repeats > 1 else x


# ---------------------------------------------------------------- forward


def ulysses_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, config: RingConfig, *, group, kernel: StepKernel,
    ring_group=None, fused_merge: bool = False, mask: Optional[Tensor] = None,
) -> RingForward:
    """Ulysses (``config.ulysses_size == config.world_size``) or hybrid attention of the local
    sequence shards; returns, like the ring, the output (input layout and dtype), the float32
    LSE [B, Nq, s], the records of the attention calls (one step for Ulysses, the ring's
    steps for hybrid) and the bytes sent. ``mask``: with ``config.given_mask``, the mask over
    the whole sequence in global order, [S, S], [1, 1, S, S] or [B, 1, S, S] (True = masked
    out; Ulysses only)."""
    groups = _groups(config, group, ring_group)
    u = config.ulysses_size
    plan, _ = _agreed_checks("forward", lambda: _check(q, k, v, config, mask), config, q, k, v, size=u, group=group,
                             kernel=kernel, mask_rows=mask)
    if plan.kv_repeats > 1:
        log.info("cp_cache Ulysses: %d K/V heads over %d ranks: each K/V head repeated %d times",
                 plan.nkv, u, plan.kv_repeats)
    started = time.perf_counter()
    local_seq = q.size(L.seq_dim(config.layout))
    (qh, kh, vh), sent = _exchange([_bnsd(q, config.layout, plan.nq), _kv_bnsd(k, config, plan),
                                    _kv_bnsd(v, config, plan)], group, u, to_heads=True)
    exchanged = time.perf_counter()
    order = _sequence_order(config, local_seq)
    qh, kh, vh = (_to_global(t, order) for t in (qh, kh, vh))
    dropout = config.keep_prob < 1.0
    if dropout:
        _advance_rng(q.device, groups.ulysses_rank)
    if groups.ring_size == 1:
        part, step_mask = _local_mask(config, mask, qh.size(2))
        res = kernel.forward(qh, kh, vh, layout=_BNSD, head_num=plan.local_nq, scale=config.scale,
                             keep_prob=config.keep_prob, mask=step_mask)
        rng = ((res.seed, res.offset),) if res.seed is not None else ()
        steps = [RingStep(index=0, source_rank=config.rank, part=part, rng=rng)]
        out_h, lse_h, ring_bytes, ring_wait = res.out, res.lse, 0, 0.0
    else:
        ring = ring_attention_forward(qh, kh, vh, _ring_config(config, groups, plan.local_nq), group=ring_group,
                                      kernel=kernel, fused_merge=fused_merge,
                                      mask_rows=_ring_mask_rows(config, groups, mask,
                                                                local_seq * config.world_size))
        steps, out_h, lse_h, ring_bytes, ring_wait = ring.steps, ring.out, ring.lse, ring.bytes_sent, ring.wait_seconds
    if dropout:
        _advance_rng(q.device, u - 1 - groups.ulysses_rank)
    computed = time.perf_counter()
    out_h = _to_rank_order(out_h, order)
    lse_h = _to_rank_order(lse_h.float().unsqueeze(-1), order)
    (out_b, lse), back = _exchange([out_h, lse_h], group, u, to_heads=False)
    finished = time.perf_counter()
    log.debug("ulysses forward rank %d/%d (ring %d): %d bytes sent", groups.ulysses_rank, u, groups.ring_size,
              sent + back + ring_bytes)
    return RingForward(out=_own(L.from_bnsd(out_b.to(q.dtype), config.layout)), lse=_own(lse.squeeze(-1)),
                       steps=steps,
                       bytes_sent=sent + back + ring_bytes,
                       compute_seconds=(computed - exchanged) - ring_wait,
                       wait_seconds=(exchanged - started) + (finished - computed) + ring_wait)


# ---------------------------------------------------------------- backward


def ulysses_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, steps: list[RingStep],
    config: RingConfig, *, group, kernel: StepKernel, ring_group=None, mask: Optional[Tensor] = None,
) -> RingBackward:
    """Gradients of the local q, k, v shards; ``steps`` and ``mask`` as in the forward."""
    groups = _groups(config, group, ring_group)
    u = config.ulysses_size

    def check() -> HeadPlan:
        plan = _check(q, k, v, config, mask)
        if dout.shape != q.shape or out.shape != q.shape:
            raise ValueError(
                f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have the query's shape {tuple(q.shape)}"
            )
        qd = L.dims(q, config.layout, config.head_num)
        if tuple(lse.shape) != (qd.batch, qd.heads, qd.seq):
            raise ValueError(f"lse has shape {tuple(lse.shape)}, expected {(qd.batch, qd.heads, qd.seq)}")
        if groups.ring_size == 1 and len(steps) != 1:
            raise RuntimeError(f"a Ulysses backward needs the forward's 1 attention record, got {len(steps)}")
        return plan

    plan, _ = _agreed_checks("backward", check, config, q, k, v, size=u, group=group, kernel=kernel,
                             mask_rows=mask, steps=len(steps))
    started = time.perf_counter()
    lay, local_seq = config.layout, q.size(L.seq_dim(config.layout))
    tensors = [_bnsd(q, lay, plan.nq), _kv_bnsd(k, config, plan), _kv_bnsd(v, config, plan),
               _bnsd(out, lay, plan.nq), _bnsd(dout, lay, plan.nq), lse.float().unsqueeze(-1)]
    exchanged_in, sent = _exchange(tensors, group, u, to_heads=True)
    exchanged = time.perf_counter()
    order = _sequence_order(config, local_seq)
    qh, kh, vh, outh, douth, lseh = (_to_global(t, order) for t in exchanged_in)
    lseh = lseh.squeeze(-1)
    if groups.ring_size == 1:
        _, step_mask = _local_mask(config, mask, qh.size(2))
        (seed, offset), = steps[0].rng or ((None, None),)
        dq, dk, dv = kernel.backward(qh, kh, vh, douth, outh, lseh, layout=_BNSD, head_num=plan.local_nq,
                                     scale=config.scale, keep_prob=config.keep_prob, mask=step_mask,
                                     seed=seed, offset=offset)
        ring_bytes, ring_wait = 0, 0.0
    else:
        ring_cfg = _ring_config(config, groups, plan.local_nq)
        ring_steps = [replace(st, source_rank=(ring_cfg.rank - st.index) % ring_cfg.world_size) for st in steps]
        ring = ring_attention_backward(douth, qh, kh, vh, outh, lseh, ring_steps, ring_cfg, group=ring_group,
                                       kernel=kernel,
                                       mask_rows=_ring_mask_rows(config, groups, mask, local_seq * config.world_size))
        dq, dk, dv, ring_bytes, ring_wait = ring.dq, ring.dk, ring.dv, ring.bytes_sent, ring.wait_seconds
    computed = time.perf_counter()
    grads = [_to_rank_order(t, order) for t in (dq, dk, dv)]
    if plan.kv_repeats > 1:  # the repeated heads' gradients are summed: send them in float32
        grads[1], grads[2] = grads[1].float(), grads[2].float()
    (dq_b, dk_b, dv_b), back = _exchange(grads, group, u, to_heads=False)
    if plan.kv_repeats > 1:
        b, _, s, d = dk_b.shape
        dk_b, dv_b = (t.view(b, plan.nkv, plan.kv_repeats, s, d).sum(2) for t in (dk_b, dv_b))
    finished = time.perf_counter()
    return RingBackward(
        dq=_own(L.from_bnsd(dq_b.to(q.dtype), lay)), dk=_own(L.from_bnsd(dk_b.to(k.dtype), lay)),
        dv=_own(L.from_bnsd(dv_b.to(v.dtype), lay)), bytes_sent=sent + back + ring_bytes,
        compute_seconds=(computed - exchanged) - ring_wait,
        wait_seconds=(exchanged - started) + (finished - computed) + ring_wait,
    )
