"""(a) Correctness on one rank: each case's output and gradients, and the directional-derivative
check of the gradients under dropout (with its validation on one process)."""

from __future__ import annotations

from .catalogue import DROPOUT_CASE, DROPOUT_OK_BELOW, RNG_SEED
from .inputs import case_spec, full_inputs, local_shard, mask_for
from .patches import set_load_balance
from .systems import Unsupported, op_kwargs


def refusal(e: BaseException) -> dict:
    """A system's refusal of an input, as recorded: the exception's type and first line."""
    text = str(e).strip().splitlines()
    return dict(status="refused", error_type=type(e).__name__, message=(text[0] if text else "")[:240])


def run_case(system, spec: dict, rank: int, world: int) -> dict:
    """One forward and backward of the case on this rank: its local output and gradients in BNSD
    float64 (with the positions they hold), or the refusal."""
    from ... import layout as L
    from ...testing.reference import rank_positions

    set_load_balance(spec["lb"])
    pos = rank_positions(world, rank, spec["s_local"], spec["lb"])
    q, k, v, dout = full_inputs(spec, world)
    ql, kl, vl = (local_shard(t, spec, pos, True) for t in (q, k, v))
    dl = local_shard(dout, spec, pos, False)
    mask = mask_for(spec, world)
    try:
        out = system.attention(ql, kl, vl, spec, mask)
        out.backward(dl)
    except Unsupported as e:
        return dict(status="not supported", message=str(e))
    except Exception as e:  # noqa: BLE001 - a refusal is a result
        return refusal(e)
    finally:
        system.clear_stack()
    heads = {"out": spec["heads"], "dq": spec["heads"], "dk": spec["kv_heads"], "dv": spec["kv_heads"]}
    local = {name: L.to_bnsd(t.detach(), spec["layout"], heads[name]).double()
             for name, t in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
    return dict(status="accepted", pos=pos, local=local)


def _all_reduce_sum(x: float) -> float:
    """The sum of ``x`` over the ranks."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def run_dropout(system, spec: dict, rank: int, world: int, plan: dict) -> dict:
    """The directional-derivative check of the gradients under dropout on this rank (every rank
    takes part: the losses are summed over the ranks)."""
    import torch

    from ...testing.reference import directional_derivative_errors, rank_positions

    set_load_balance(spec["lb"])
    pos = rank_positions(world, rank, spec["s_local"], spec["lb"])
    q, k, v, _ = full_inputs(spec, world)
    params = [local_shard(t, spec, pos, True) for t in (q, k, v)]
    mask = mask_for(spec, world)
    g = torch.Generator().manual_seed(77 + rank)
    projection = None

    def loss_fn():
        nonlocal projection
        torch.manual_seed(RNG_SEED + rank)
        out = system.attention(*params, spec, mask)
        if projection is None:
            projection = torch.randn(out.shape, generator=g, dtype=torch.float64)
        return (out.double() * projection).sum()

    try:
        errors = directional_derivative_errors(loss_fn, params, directions=plan["directions"], eps=plan["eps"],
                                               reduce=_all_reduce_sum)
    except Unsupported as e:
        return dict(status="not supported", message=str(e))
    except Exception as e:  # noqa: BLE001
        return refusal(e)
    finally:
        left = system.stack_entries()
        system.clear_stack()
    return dict(status="accepted", errors=errors, max_error=max(errors), stack_entries_left=left,
                ok=max(errors) < DROPOUT_OK_BELOW)


def validate_directional_check(plan: dict) -> dict:
    """The dropout check on one process (no CP): the emulator's op with its own derivative
    (errors must be small) and a deliberately wrong backward (another dropout mask; errors
    must be large)."""
    import torch

    from ...emulator import install_npu_emulator
    from ...testing.reference import directional_derivative_errors

    install_npu_emulator(route_sdpa=False)
    spec = case_spec(dict(DROPOUT_CASE, lb=False), plan["cases"])
    q, k, v, _ = full_inputs(spec, 2)
    params = [t.float().requires_grad_() for t in (q, k, v)]
    mask = mask_for(spec, 2)
    kw = op_kwargs(spec, mask)
    projection = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    class WrongBackward(torch.autograd.Function):
        """The op forward; backward with a different dropout mask (seed + 1)."""

        @staticmethod
        def forward(ctx, a, b, c):
            res = torch.ops.npu.npu_fusion_attention_v3(a, b, c, spec["heads"], "BNSD", **kw)
            ctx.save_for_backward(a, b, c, res[0], res[1], res[2], res[4], res[5])
            return res[0]

        @staticmethod
        def backward(ctx, dy):
            a, b, c, out, smax, ssum, seed, offset = ctx.saved_tensors
            g = torch.ops.npu.npu_fusion_attention_grad_v3(
                a, b, c, dy, spec["heads"], "BNSD", atten_mask=mask, softmax_max=smax, softmax_sum=ssum,
                attention_in=out, scale_value=kw["scale"], keep_prob=kw["keep_prob"], sparse_mode=kw["sparse_mode"],
                next_tockens=kw["next_tockens"], seed=seed + 1, offset=offset)
            return g[0], g[1], g[2]

    def loss(fn):
        def f():
            torch.manual_seed(RNG_SEED)
            return (fn(*params).double() * projection).sum()
        return f

    right = directional_derivative_errors(
        loss(lambda a, b, c: torch.ops.npu.npu_fusion_attention_v3(a, b, c, spec["heads"], "BNSD", **kw)[0]),
        params, directions=plan["directions"], eps=plan["eps"])
    wrong = directional_derivative_errors(loss(WrongBackward.apply), params, directions=plan["directions"],
                                          eps=plan["eps"])
    return dict(dense_op_errors=right, dense_op_max=max(right), wrong_backward_errors=wrong,
                wrong_backward_max=max(wrong), passes=max(right) < DROPOUT_OK_BELOW < max(wrong),
                threshold=DROPOUT_OK_BELOW,
                note="one process, the emulator's op on the full sequence (no CP); the negative control "
                     "replays the backward with seed + 1 (another dropout mask)")

