"""Ulysses (all-to-all) and hybrid (Ulysses x ring) context-parallel attention.

Over a group of U ranks: one all-to-all turns the sequence shards of q, k, v into head shards (rank
u gets query heads [u*Nq/U, (u+1)*Nq/U) over the whole sequence; with Nkv < U dividing U each K/V
head is first repeated U/Nkv times), head-tail load balancing is undone before one full-sequence
call of the step kernel and redone after, and one all-to-all brings the output and LSE back. V and
its gradient travel at V's head size (MLA). The backward exchanges again and replays the recorded
seeds; repeated K/V heads' gradients are summed. Hybrid: on a W0 x W1 grid Ulysses runs over the
inner dimension and the ring it is given over the outer one, on contiguous blocks. Packed documents:
Ulysses around the packed ring, the all-to-alls carrying the placement's uneven splits (on one CP
dimension the inner ring is of one rank: one TND call over whole documents). Dropout: rank u
advances the device's generator by u draws before its call and U-1-u after, so no two ranks share
a mask and every rank leaves the generator in the same state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import layout as L
from ..documents import local_lengths, placement_order, sequence_order
from ..engine.agreement import Agreement
from ..engine.loop import (BackwardResult, ForwardResult, RingStep, check_backward_operands, check_qkv, empty_outputs,
                           own_group)
from ..engine.transport import exchange_heads, own_storage
from ..kernels import StepKernel, StepMask
from ..placement import CONTIGUOUS
from ..plan import CallPlan, HeadPlan, head_plan

__all__ = ["Ulysses", "ULYSSES"]

log = logging.getLogger("cp_cache")

_BNSD = "BNSD"  # the head shards' layout


# ---------------------------------------------------------------- the gathered sequence


class _Gathered:
    """The sequence a Ulysses group gathers, its members' shards in rank order: each member's
    length where they may differ (packed documents; None: all equal), and the global position
    of each gathered row where the local attention needs them in another order (None: the
    rows are already in it)."""

    def __init__(self, lengths: Optional[list[int]], order: Optional[Tensor]):
        self.lengths = lengths
        self._order = order
        self._inverse = None if order is None else torch.argsort(order)

    def to_global(self, x: Tensor) -> Tensor:
        """Rows of ``x`` ([B, N, S, D]) from rank order to the local attention's order."""
        return x if self._inverse is None else x.index_select(2, self._inverse.to(x.device))

    def to_rank_order(self, x: Tensor) -> Tensor:
        return x if self._order is None else x.index_select(2, self._order.to(x.device))


def _gathered(plan: CallPlan, where: "_Groups", local_seq: int) -> _Gathered:
    """Dense: equal shards, head-tail under load balancing (undone for the local call). Packed
    documents: the layout's lengths of this Ulysses group's members; on one CP dimension the
    placement's positions (undone for the local call, which takes the documents in order); on
    two, an outer rank's share cut contiguously (gathered in the order the packed ring takes)."""
    u = plan.ulysses_size
    if not plan.packed:
        return _Gathered(None, sequence_order(u, local_seq, True) if plan.load_balance else None)
    cu, placement, mesh = plan.documents, plan.document_placement, plan.document_mesh
    lengths = local_lengths(cu, mesh, placement)[where.ring_rank * u:(where.ring_rank + 1) * u]
    ordered = len(mesh) == 2 or placement == CONTIGUOUS
    return _Gathered(lengths, None if ordered else placement_order(tuple(cu), mesh, placement))


def _lse_bnsd(lse: Tensor, layout: str) -> Tensor:
    """An LSE ([B, N, S]; TND: [T, N]) as [B, N, S]."""
    return lse.t().unsqueeze(0) if layout == L.TND else lse


def _lse_from_bnsd(lse: Tensor, layout: str) -> Tensor:
    return lse[0].t() if layout == L.TND else lse


# ---------------------------------------------------------------- the local part


def _check_mask(plan: CallPlan, mask: Optional[Tensor], seq: int) -> None:
    """A given mask must cover the whole sequence (``seq``: the global length) and be shared by
    the heads (each rank computes other heads)."""
    if not plan.mask.given:
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


def _ring_mask_rows(plan: CallPlan, groups: "_Groups", mask: Optional[Tensor], seq: int) -> Optional[Tensor]:
    """Hybrid: the given mask's rows of this rank's contiguous block (the ring plans the rest)."""
    if not plan.mask.given:
        return None
    rows = seq // groups.ring_size
    return mask.narrow(mask.dim() - 2, groups.ring_rank * rows, rows)


def _local_mask(plan: CallPlan, mask: Optional[Tensor], seq: int) -> tuple[str, StepMask]:
    """The mask of the local full-sequence call (``seq``: the global length)."""
    if plan.mask.given:
        _check_mask(plan, mask, seq)
        block = mask.bool()
        if plan.mask.window:  # sparse_mode 0: the band applies on top of the mask
            i = torch.arange(seq, device=mask.device).view(-1, 1)
            j = torch.arange(seq, device=mask.device).view(1, -1)
            block = block | (j - i > plan.mask.next_tockens) | (i - j > plan.mask.pre_tockens)
        return "masked", StepMask("given", block=block)
    if plan.mask.causal:
        return "causal", StepMask("causal")
    if plan.mask.window:
        return "band", StepMask("band", pre_tockens=plan.mask.pre_tockens, next_tockens=plan.mask.next_tockens)
    return "full", StepMask("none")


def _advance_rng(device: torch.device, draws: int) -> None:
    for _ in range(draws):
        torch.rand(1, device=device)


@dataclass(frozen=True)
class _Groups:
    ulysses_rank: int
    ring_size: int
    ring_rank: int


def _groups(plan: CallPlan, groups: Sequence) -> _Groups:
    """This rank's place in its Ulysses group (the innermost of ``groups``) and in the ring
    over the outer ones (hybrid), checked against the process groups."""
    u = plan.ulysses_size
    if u < 1 or plan.world_size % u:
        raise ValueError(f"ulysses_size={u} does not divide world_size={plan.world_size}")
    ulysses_rank, ring_size, ring_rank = plan.rank % u, plan.world_size // u, plan.rank // u
    own, ring_group = own_group(groups), own_group(groups[:-1])
    for name, g, size, rank in (("group", own, u, ulysses_rank), ("ring_group", ring_group, ring_size, ring_rank)):
        if size == 1:
            continue
        if g is None:
            raise ValueError(f"{name} is None but that dimension has {size} ranks")
        if (dist.get_world_size(g), dist.get_rank(g)) != (size, rank):
            raise ValueError(
                f"{name} has rank {dist.get_rank(g)} of {dist.get_world_size(g)}; the plan "
                f"(world_size={plan.world_size}, rank={plan.rank}, ulysses_size={u}) gives {rank} of {size}"
            )
    return _Groups(ulysses_rank, ring_size, ring_rank)


def _check(q: Tensor, k: Tensor, v: Tensor, plan: CallPlan, mask: Optional[Tensor]) -> HeadPlan:
    seq_dim = L.seq_dim(plan.layout)
    local_seq = q.size(seq_dim)
    _check_mask(plan, mask, local_seq * plan.world_size)
    # the ring's checks but for its mask rows (here: the whole mask, checked above)
    qd, nkv = check_qkv(replace(plan, mask=replace(plan.mask, given=False)), q, k, v)
    if plan.mask.given and k.size(seq_dim) != local_seq:
        raise ValueError(f"masked Ulysses attention needs equal local query and key lengths, got "
                         f"{local_seq} and {k.size(seq_dim)}")
    if plan.ulysses_size > 1 and plan.world_size > plan.ulysses_size and plan.load_balance:
        raise NotImplementedError(
            "cp_cache hybrid (Ulysses x ring) attention lays the sequence out contiguously; load "
            "balancing (torch's _cp_options.enable_load_balance) with causal, band or masked attention "
            "is not supported with it yet: turn load balancing off"
        )
    return head_plan(qd.heads, nkv, plan.ulysses_size)


def _bnsd(x: Tensor, layout: str, heads: int) -> Tensor:
    return L.to_bnsd(x, layout, heads)


def _kv_bnsd(x: Tensor, plan: CallPlan, heads: HeadPlan) -> Tensor:
    x = _bnsd(x, plan.layout, heads.nkv)
    return x.repeat_interleave(heads.kv_repeats, dim=1) if heads.kv_repeats > 1 else x


@dataclass
class _Local:
    """What the local computation between the two all-to-alls gave."""

    out: Tensor
    lse: Tensor
    steps: list[RingStep]
    bytes_sent: int = 0
    wait_seconds: float = 0.0
    bytes_received: int = 0


class Ulysses:
    """Ulysses over the innermost of the given process groups; with ``inner`` (a strategy: the
    ring) hybrid, the inner strategy running over the outer groups between the all-to-alls."""

    def __init__(self, inner=None):
        self.inner = inner

    def fake(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Empty (out, lse) of the shapes ``forward`` returns: for tracing with fake tensors."""
        return empty_outputs(plan, q, k, v)

    # ------------------------------------------------------------ forward

    def check_forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor,
                      mask: Optional[Tensor] = None) -> HeadPlan:
        """This rank's inputs of a forward; the head split."""
        return self._heads(q, k, v, plan, mask)

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, plan: CallPlan, mask: Optional[Tensor]) -> HeadPlan:
        if plan.packed:  # the packed ring's checks: the documents, this rank's length in their layout
            self.inner.check_forward(plan, q, k, v)
            return head_plan(plan.head_num, k.size(1), plan.ulysses_size)
        return _check(q, k, v, plan, mask)

    def check_backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       steps: list[RingStep], mask: Optional[Tensor] = None) -> HeadPlan:
        """This rank's inputs of a backward and the forward's records; the head split."""
        split = self._heads(q, k, v, plan, mask)
        check_backward_operands(plan, dout, q, k, v, out, lse)
        if plan.ulysses_size == plan.world_size and len(steps) != 1:
            raise RuntimeError(f"a Ulysses backward needs the forward's 1 attention record, got {len(steps)}")
        return split

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups: Sequence, kernel: StepKernel,
                mask: Optional[Tensor] = None, checked: HeadPlan, agreement) -> ForwardResult:
        """Ulysses (``plan.ulysses_size == plan.world_size``) or hybrid attention of the local
        sequence shards; returns, like the ring, the output (input layout and dtype), the float32
        LSE [B, Nq, s], the records of the attention calls (one step for Ulysses, the ring's
        steps for hybrid) and the bytes sent. ``mask``: with a given mask, the mask over the
        whole sequence in global order, [S, S], [1, 1, S, S] or [B, 1, S, S] (True = masked
        out). ``checked``: the head split ``check_forward`` returned; ``agreement``: the ranks'
        (on every CP group), waited for before the first all-to-all."""
        where = _groups(plan, groups)
        u, heads = plan.ulysses_size, checked
        agreement.lengths()
        if heads.kv_repeats > 1:
            log.info("cp_cache Ulysses: %d K/V heads over %d ranks: each K/V head repeated %d times",
                     heads.nkv, u, heads.kv_repeats)
        started = time.perf_counter()
        gathered = _gathered(plan, where, q.size(L.seq_dim(plan.layout)))
        (qh, kh, vh), sent = exchange_heads([_bnsd(q, plan.layout, heads.nq), _kv_bnsd(k, plan, heads),
                                             _kv_bnsd(v, plan, heads)], own_group(groups), u, to_heads=True,
                                            lengths=gathered.lengths)
        exchanged = time.perf_counter()
        qh, kh, vh = (gathered.to_global(t) for t in (qh, kh, vh))
        with _OwnDropoutDraws(plan, q.device, where):
            local = self._local_forward(plan, qh, kh, vh, heads, where, groups, kernel, mask)
        computed = time.perf_counter()
        out_h = gathered.to_rank_order(local.out)
        lse_h = gathered.to_rank_order(local.lse.float().unsqueeze(-1))
        (out_b, lse), back = exchange_heads([out_h, lse_h], own_group(groups), u, to_heads=False,
                                            lengths=gathered.lengths)
        finished = time.perf_counter()
        log.debug("ulysses forward rank %d/%d (ring %d): %d bytes sent", where.ulysses_rank, u, where.ring_size,
                  sent + back + local.bytes_sent)
        return ForwardResult(out=own_storage(L.from_bnsd(out_b.to(q.dtype), plan.layout)),
                             lse=own_storage(_lse_from_bnsd(lse.squeeze(-1), plan.layout)), steps=local.steps,
                             bytes_sent=sent + back + local.bytes_sent,
                             bytes_received=sent + back + local.bytes_received,  # the all-to-alls are symmetric
                             compute_seconds=(computed - exchanged) - local.wait_seconds,
                             wait_seconds=(exchanged - started) + (finished - computed) + local.wait_seconds)

    def _local_forward(self, plan, qh, kh, vh, heads: HeadPlan, where: _Groups, groups, kernel, mask) -> _Local:
        """Attention of the gathered head shards ([B, N/U, S, D]): one kernel call, or the inner
        ring (hybrid); the output [B, N/U, S, Dv] and the LSE [B, N/U, S]."""
        lay = plan.layout
        if where.ring_size == 1 and not plan.packed:
            part, step_mask = _local_mask(plan, mask, qh.size(2))
            res = kernel.forward(qh, kh, vh, layout=_BNSD, head_num=heads.local_nq, scale=plan.scale,
                                 keep_prob=plan.keep_prob, mask=step_mask)
            rng = ((res.seed, res.offset),) if res.seed is not None else ()
            return _Local(res.out, res.lse, [RingStep(index=0, part=part, rng=rng)])
        # the inner strategy over the outer ranks (hybrid); packed documents on one CP dimension:
        # the packed ring of one rank, the documents whole in one kernel call
        ring_plan = plan.ring_part(where.ring_size, where.ring_rank, heads.local_nq)
        ring_mask = _ring_mask_rows(plan, where, mask, qh.size(2) * where.ring_size)
        qr, kr, vr = _local_layout(lay, qh, kh, vh)
        ring = self.inner.forward(ring_plan, qr, kr, vr, groups=groups[:-1], kernel=kernel, mask=ring_mask,
                                  checked=self.inner.check_forward(ring_plan, qr, kr, vr, ring_mask),
                                  agreement=_ring_agreed(ring_plan, qh, kh, where))
        return _Local(_from_local_layout(lay, ring.out), _lse_bnsd(ring.lse, lay), ring.steps,
                      ring.bytes_sent, ring.wait_seconds, ring.bytes_received)

    # ------------------------------------------------------------ backward

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps: list[RingStep], *, groups: Sequence, kernel: StepKernel,
                 mask: Optional[Tensor] = None, checked: HeadPlan, agreement) -> BackwardResult:
        """Gradients of the local q, k, v shards; ``steps``, ``mask``, ``checked`` (from
        ``check_backward``) and ``agreement`` as in the forward."""
        where = _groups(plan, groups)
        u, heads = plan.ulysses_size, checked
        agreement.lengths()
        started = time.perf_counter()
        lay = plan.layout
        sequence = _gathered(plan, where, q.size(L.seq_dim(lay)))
        tensors = [_bnsd(q, lay, heads.nq), _kv_bnsd(k, plan, heads), _kv_bnsd(v, plan, heads),
                   _bnsd(out, lay, heads.nq), _bnsd(dout, lay, heads.nq), _lse_bnsd(lse.float(), lay).unsqueeze(-1)]
        exchanged_in, sent = exchange_heads(tensors, own_group(groups), u, to_heads=True, lengths=sequence.lengths)
        exchanged = time.perf_counter()
        gathered = [sequence.to_global(t) for t in exchanged_in]
        gathered[5] = gathered[5].squeeze(-1)
        grads, (ring_bytes, ring_received), ring_wait = self._local_backward(plan, gathered, steps, heads, where,
                                                                             groups, kernel, mask)
        computed = time.perf_counter()
        grads = [sequence.to_rank_order(t) for t in grads]
        if heads.kv_repeats > 1:  # the repeated heads' gradients are summed: send them in float32
            grads[1], grads[2] = grads[1].float(), grads[2].float()
        (dq_b, dk_b, dv_b), back = exchange_heads(grads, own_group(groups), u, to_heads=False,
                                                  lengths=sequence.lengths)
        if heads.kv_repeats > 1:  # dK and dV each at their own head size (MLA)
            dk_b, dv_b = (t.view(t.size(0), heads.nkv, heads.kv_repeats, *t.shape[2:]).sum(2) for t in (dk_b, dv_b))
        finished = time.perf_counter()
        return BackwardResult(
            dq=own_storage(L.from_bnsd(dq_b.to(q.dtype), lay)), dk=own_storage(L.from_bnsd(dk_b.to(k.dtype), lay)),
            dv=own_storage(L.from_bnsd(dv_b.to(v.dtype), lay)), bytes_sent=sent + back + ring_bytes,
            bytes_received=sent + back + ring_received,
            compute_seconds=(computed - exchanged) - ring_wait,
            wait_seconds=(exchanged - started) + (finished - computed) + ring_wait,
        )

    def _local_backward(self, plan, gathered, steps, heads: HeadPlan, where: _Groups, groups, kernel, mask):
        """(dq, dk, dv) of the gathered head shards, (bytes the inner ring sent, received), its wait."""
        qh, kh, vh, outh, douth, lseh = gathered
        lay = plan.layout
        q_, k_, v_, out_, dout_ = _local_layout(lay, qh, kh, vh, outh, douth)
        lse_ = _lse_from_bnsd(lseh, lay)
        if where.ring_size == 1 and not plan.packed:
            _, step_mask = _local_mask(plan, mask, qh.size(2))
            (seed, offset), = steps[0].rng or ((None, None),)
            grads = kernel.backward(qh, kh, vh, douth, outh, lseh, layout=_BNSD, head_num=heads.local_nq,
                                    scale=plan.scale, keep_prob=plan.keep_prob, mask=step_mask,
                                    seed=seed, offset=offset)
            return list(grads), (0, 0), 0.0
        ring_plan = plan.ring_part(where.ring_size, where.ring_rank, heads.local_nq)
        ring_mask = _ring_mask_rows(plan, where, mask, qh.size(2) * where.ring_size)
        ring = self.inner.backward(ring_plan, dout_, q_, k_, v_, out_, lse_, steps, groups=groups[:-1],
                                   kernel=kernel, mask=ring_mask,
                                   checked=self.inner.check_backward(ring_plan, dout_, q_, k_, v_, out_, lse_,
                                                                     steps, ring_mask),
                                   agreement=_ring_agreed(ring_plan, qh, kh, where))
        grads = [_from_local_layout(lay, g) for g in (ring.dq, ring.dk, ring.dv)]
        return grads, (ring.bytes_sent, ring.bytes_received), ring.wait_seconds


def _local_layout(layout: str, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Gathered head shards ([B, N/U, S, D]) as the local attention takes them: as they are (BNSD),
    packed documents as TND."""
    if layout != L.TND:
        return tensors
    return tuple(L.from_bnsd(t, L.TND) for t in tensors)


def _from_local_layout(layout: str, x: Tensor) -> Tensor:
    """A result of the local attention as [B, N/U, S, D] (TND: a batch of one)."""
    return L.to_bnsd(x, L.TND, x.size(1)) if layout == L.TND else x


def _ring_agreed(ring_plan: CallPlan, qh: Tensor, kh: Tensor, where: _Groups) -> Agreement:
    """The inner ring's agreement: reached with the call's (on every CP group, before the
    all-to-all); its ranks hold equal lengths (packed documents: the placement's shares)."""
    if ring_plan.packed:
        shares = local_lengths(ring_plan.documents, ring_plan.world_size, ring_plan.document_placement)
        return Agreement.reached([(n, n) for n in shares])
    return Agreement.reached([(qh.size(2), kh.size(2))] * where.ring_size)


class _OwnDropoutDraws:
    """Dropout: every rank of a Ulysses group computes different heads, so no two may share a
    mask: rank u advances the generator of the query's device by u draws before its attention
    call(s) and by U-1-u after them (every rank leaves it in the same state)."""

    def __init__(self, plan: CallPlan, device: torch.device, where: _Groups):
        self._draws = (where.ulysses_rank, plan.ulysses_size - 1 - where.ulysses_rank) if plan.keep_prob < 1.0 \
            else (0, 0)
        self._device = device

    def __enter__(self):
        _advance_rng(self._device, self._draws[0])

    def __exit__(self, *exc):
        if exc[0] is None:
            _advance_rng(self._device, self._draws[1])
        return False


ULYSSES = Ulysses()
