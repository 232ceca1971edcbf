"""Ulysses: one all-to-all over U ranks turns sequence shards into head shards (with Nkv < U each K/V head repeated),
one full-sequence kernel call runs and one all-to-all brings output and LSE back. Hybrid: Ulysses around the ring."""

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
from ..kernels.base import repeat_kv_heads, sum_kv_heads
from ..placement import CONTIGUOUS
from ..plan import CallPlan, HeadPlan, head_plan

__all__ = ["Ulysses", "ULYSSES"]

log = logging.getLogger("cp_cache")

_BNSD = "BNSD"  # the head shards' layout


def _gathered(plan: CallPlan, where: "_Groups", local_seq: int) -> tuple[Optional[list[int]], Optional[Tensor]]:
    """(each member's length where they may differ; each gathered row's global position where the local attention
    needs another order: head-tail under load balancing, a packed placement's on one CP dimension), else None."""
    u = plan.ulysses_size
    if not plan.packed:
        return None, sequence_order(u, local_seq, True) if plan.load_balance else None
    cu, placement, mesh = plan.documents, plan.document_placement, plan.document_mesh
    lengths = local_lengths(cu, mesh, placement)[where.ring_rank * u:(where.ring_rank + 1) * u]
    return lengths, None if len(mesh) == 2 or placement == CONTIGUOUS else placement_order(tuple(cu), mesh, placement)


def _rows(x: Tensor, index: Optional[Tensor]) -> Tensor:
    return x if index is None else x.index_select(2, index.to(x.device))


def _as_bnsd(x: Tensor, layout: str) -> Tensor:
    """Packed documents ([T, N, D], LSE [T, N]) as a batch of one; the dense layouts' LSE is already so."""
    if layout != L.TND:
        return x
    return x.t().unsqueeze(0) if x.dim() == 2 else L.to_bnsd(x, L.TND, x.size(1))


def _from_bnsd(x: Tensor, layout: str) -> Tensor:
    if layout != L.TND:
        return x
    return x[0].t() if x.dim() == 3 else L.from_bnsd(x, L.TND)


def _check_mask(plan: CallPlan, mask: Optional[Tensor], seq: int) -> None:
    """A given mask must cover the whole sequence and be shared by the heads (each rank computes other heads)."""
    if not plan.mask.given:
        return
    if mask is not None and mask.dim() == 4 and mask.size(1) != 1:
        raise NotImplementedError(f"cp_cache Ulysses attention takes a mask shared by the heads ([S, S], [1, 1, S, S] "
                                  f"or [B, 1, S, S]), not a per-head mask of shape {tuple(mask.shape)} yet; use "
                                  "algorithm='ring'")
    if mask is None or mask.dim() not in (2, 4) or tuple(mask.shape[-2:]) != (seq, seq):
        raise ValueError(f"a Ulysses call with a given mask needs it over the whole sequence "
                         f"[..., {seq}, {seq}]; got {None if mask is None else tuple(mask.shape)}")


def _inner_part(plan: CallPlan, heads: HeadPlan, where: "_Groups", mask: Optional[Tensor], qh: Tensor,
                kh: Tensor) -> tuple[CallPlan, Optional[Tensor], Agreement]:
    """The inner strategy's plan, a given mask's rows of this rank's block of the gathered sequence, its agreement."""
    ring_plan = plan.ring_part(where.ring_size, where.ring_rank, heads.local_nq)
    rows = qh.size(2)
    ring_mask = mask.narrow(mask.dim() - 2, where.ring_rank * rows, rows) if plan.mask.given else None
    if ring_plan.packed:
        shares = local_lengths(ring_plan.documents, ring_plan.world_size, ring_plan.document_placement)
        return ring_plan, ring_mask, Agreement.reached([(n, n) for n in shares])
    return ring_plan, ring_mask, Agreement.reached([(qh.size(2), kh.size(2))] * where.ring_size)


def _local_mask(plan: CallPlan, mask: Optional[Tensor], seq: int) -> tuple[str, StepMask]:
    """The mask of the local full-sequence call (``seq``: the global length): (step part, StepMask)."""
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


@dataclass(frozen=True)
class _Groups:
    ulysses_rank: int
    ring_size: int
    ring_rank: int


def _groups(plan: CallPlan, groups: Sequence) -> _Groups:
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
            raise ValueError(f"{name} has rank {dist.get_rank(g)} of {dist.get_world_size(g)}; the plan (world_size="
                             f"{plan.world_size}, rank={plan.rank}, ulysses_size={u}) gives {rank} of {size}")
    return _Groups(ulysses_rank, ring_size, ring_rank)


def _kv_bnsd(x: Tensor, plan: CallPlan, heads: HeadPlan) -> Tensor:
    return repeat_kv_heads(L.to_bnsd(x, plan.layout, heads.nkv), heads.kv_repeats)


class Ulysses:
    """Ulysses over the innermost group; ``inner`` (the ring, or the packed ring) runs over the outer ones between."""
    def __init__(self, inner=None):
        self.inner = inner

    def fake(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return empty_outputs(plan, q, k, v)

    def check_forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> HeadPlan:
        if plan.packed:  # the packed ring's checks: the documents, this rank's length in their layout
            self.inner.check_forward(plan, q, k, v)
            return head_plan(plan.head_num, k.size(1), plan.ulysses_size)
        seq_dim = L.seq_dim(plan.layout)
        local_seq = q.size(seq_dim)
        _check_mask(plan, mask, local_seq * plan.world_size)
        qd, nkv = check_qkv(replace(plan, mask=replace(plan.mask, given=False)), tuple(q.shape), tuple(k.shape),
                            tuple(v.shape))  # the ring's checks but for its mask rows (the whole mask: checked above)
        if plan.mask.given and k.size(seq_dim) != local_seq:
            raise ValueError(f"masked Ulysses attention needs equal local query and key lengths, got "
                             f"{local_seq} and {k.size(seq_dim)}")
        if plan.ulysses_size > 1 and plan.world_size > plan.ulysses_size and plan.load_balance:
            raise NotImplementedError("cp_cache hybrid (Ulysses x ring) attention lays the sequence out contiguously; "
                                      "load balancing (torch's _cp_options.enable_load_balance) with causal, band or "
                                      "masked attention is not supported with it yet: turn load balancing off")
        return head_plan(qd.heads, nkv, plan.ulysses_size)

    def check_backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       steps: list[RingStep], mask: Optional[Tensor] = None) -> HeadPlan:
        split = self.check_forward(plan, q, k, v, mask)
        check_backward_operands(plan, dout, q, k, v, out, lse)
        if plan.ulysses_size == plan.world_size and len(steps) != 1:
            raise RuntimeError(f"a Ulysses backward needs the forward's 1 attention record, got {len(steps)}")
        return split

    def forward(self, plan: CallPlan, q: Tensor, k: Tensor, v: Tensor, *, groups: Sequence, kernel: StepKernel,
                mask: Optional[Tensor] = None, checked: HeadPlan, agreement) -> ForwardResult:
        """``mask``: over the whole sequence in global order, [S, S], [1, 1, S, S] or [B, 1, S, S] (True: masked)."""
        where, heads, lay = _groups(plan, groups), checked, plan.layout
        agreement.lengths()
        if heads.kv_repeats > 1:
            log.info("cp_cache Ulysses: %d K/V heads over %d ranks: each K/V head repeated %d times",
                     heads.nkv, plan.ulysses_size, heads.kv_repeats)
        def local(qh: Tensor, kh: Tensor, vh: Tensor) -> tuple[ForwardResult, list[Tensor]]:
            """With dropout rank u draws u times before, U-1-u after: masks differ by head, generators end alike."""
            u = plan.ulysses_size
            before, after = (where.ulysses_rank, u - 1 - where.ulysses_rank) if plan.keep_prob < 1.0 else (0, 0)
            for _ in range(before):
                torch.rand(1, device=q.device)
            if where.ring_size == 1 and not plan.packed:
                part, step_mask = _local_mask(plan, mask, qh.size(2))
                res = kernel.forward(qh, kh, vh, layout=_BNSD, head_num=heads.local_nq, scale=plan.scale,
                                     keep_prob=plan.keep_prob, mask=step_mask)
                rng = ((res.seed, res.offset),) if res.seed is not None else ()
                res = ForwardResult(res.out, res.lse, [RingStep(index=0, part=part, rng=rng)], bytes_sent=0)
            else:  # hybrid: the ring over the outer ranks; packed documents on one CP dimension: a packed ring
                ring_plan, ring_mask, agreed = _inner_part(plan, heads, where, mask, qh, kh)
                qr, kr, vr = (_from_bnsd(t, lay) for t in (qh, kh, vh))
                res = self.inner.forward(ring_plan, qr, kr, vr, groups=groups[:-1], kernel=kernel, mask=ring_mask,
                                         checked=self.inner.check_forward(ring_plan, qr, kr, vr, ring_mask),
                                         agreement=agreed)
            for _ in range(after):
                torch.rand(1, device=q.device)
            return res, [_as_bnsd(res.out, lay), _as_bnsd(res.lse, lay).float().unsqueeze(-1)]
        started = time.perf_counter()
        tensors = [L.to_bnsd(q, lay, heads.nq), _kv_bnsd(k, plan, heads), _kv_bnsd(v, plan, heads)]
        (out, lse), res, accounted = _round_trip(plan, groups, where, q, tensors, local, started)
        log.debug("ulysses forward rank %d/%d (ring %d): %d bytes sent", where.ulysses_rank, plan.ulysses_size,
                  where.ring_size, accounted["bytes_sent"])
        return ForwardResult(out=own_storage(L.from_bnsd(out.to(q.dtype), lay)),
                             lse=own_storage(_from_bnsd(lse.squeeze(-1), lay)), steps=res.steps, **accounted)

    def backward(self, plan: CallPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 steps: list[RingStep], *, groups: Sequence, kernel: StepKernel,
                 mask: Optional[Tensor] = None, checked: HeadPlan, agreement) -> BackwardResult:
        where, heads, lay = _groups(plan, groups), checked, plan.layout
        agreement.lengths()
        def local(qh: Tensor, kh: Tensor, vh: Tensor, outh: Tensor, douth: Tensor,
                  lseh: Tensor) -> tuple[BackwardResult, list[Tensor]]:
            lseh = lseh.squeeze(-1)
            if where.ring_size == 1 and not plan.packed:
                _, step_mask = _local_mask(plan, mask, qh.size(2))
                (seed, offset), = steps[0].rng or ((None, None),)
                res = BackwardResult(*kernel.backward(qh, kh, vh, douth, outh, lseh, layout=_BNSD,
                                                      head_num=heads.local_nq, scale=plan.scale,
                                                      keep_prob=plan.keep_prob, mask=step_mask, seed=seed,
                                                      offset=offset), bytes_sent=0)
            else:
                q_, k_, v_, out_, dout_, lse_ = (_from_bnsd(t, lay) for t in (qh, kh, vh, outh, douth, lseh))
                ring_plan, ring_mask, agreed = _inner_part(plan, heads, where, mask, qh, kh)
                checked = self.inner.check_backward(ring_plan, dout_, q_, k_, v_, out_, lse_, steps, ring_mask)
                res = self.inner.backward(ring_plan, dout_, q_, k_, v_, out_, lse_, steps, groups=groups[:-1],
                                          kernel=kernel, mask=ring_mask, checked=checked, agreement=agreed)
            grads = [_as_bnsd(g, lay) for g in (res.dq, res.dk, res.dv)]
            if heads.kv_repeats > 1:  # the repeated heads' gradients are summed: send them in float32
                grads[1], grads[2] = grads[1].float(), grads[2].float()
            return res, grads
        started = time.perf_counter()
        tensors = [L.to_bnsd(q, lay, heads.nq), _kv_bnsd(k, plan, heads), _kv_bnsd(v, plan, heads),
                   L.to_bnsd(out, lay, heads.nq), L.to_bnsd(dout, lay, heads.nq),
                   _as_bnsd(lse.float(), lay).unsqueeze(-1)]
        (dq, dk, dv), _, accounted = _round_trip(plan, groups, where, q, tensors, local, started)
        dk, dv = sum_kv_heads(dk, heads.kv_repeats), sum_kv_heads(dv, heads.kv_repeats)
        return BackwardResult(dq=own_storage(L.from_bnsd(dq.to(q.dtype), lay)),
                              dk=own_storage(L.from_bnsd(dk.to(k.dtype), lay)),
                              dv=own_storage(L.from_bnsd(dv.to(v.dtype), lay)), **accounted)


def _round_trip(plan: CallPlan, groups: Sequence, where: _Groups, q: Tensor, tensors: list[Tensor], local,
                started: float) -> tuple[list[Tensor], object, dict]:
    """To head shards, ``local(*those) -> (result, tensors)``, back: (those, the result, its bytes and seconds)."""
    u = plan.ulysses_size
    lengths, order = _gathered(plan, where, q.size(L.seq_dim(plan.layout)))
    inverse = None if order is None else torch.argsort(order)  # from rank order to the local attention's
    heads, sent = exchange_heads(tensors, own_group(groups), u, to_heads=True, lengths=lengths)
    exchanged = time.perf_counter()
    res, results = local(*(_rows(t, inverse) for t in heads))
    computed = time.perf_counter()
    results, back = exchange_heads([_rows(t, order) for t in results], own_group(groups), u, to_heads=False,
                                   lengths=lengths)
    finished = time.perf_counter()
    return results, res, dict(bytes_sent=sent + back + res.bytes_sent,
                              bytes_received=sent + back + res.bytes_received,  # the all-to-alls are symmetric
                              compute_seconds=(computed - exchanged) - res.wait_seconds,
                              wait_seconds=(exchanged - started) + (finished - computed) + res.wait_seconds)


ULYSSES = Ulysses()
