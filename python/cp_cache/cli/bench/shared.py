"""What the bench sections share: the ``Section`` record each section module declares, the
worlds a section runs at, the plan entries several sections read, and the attention calls
several sections make."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["Section", "every_world", "several_ranks", "largest_world_only", "common_plan", "collect",
           "attention_call", "causal_call"]


def every_world(plan: dict, world: int) -> bool:
    return True


def several_ranks(plan: dict, world: int) -> bool:
    return world > 1


def largest_world_only(plan: dict, world: int) -> bool:
    return world == max(plan["worlds"]) and world > 1


@dataclass(frozen=True)
class Section:
    """One bench section, declared by its module (the registry lists them).

    ``name``: what ``--only`` takes; ``about``: one line for ``--help`` and the package's
    docstring; ``quick`` / ``full``: the plan entries it adds (top-level keys of the plan,
    which also holds ``common_plan``'s); ``key``: where the report keeps its rows (default
    ``name``). On ranks: ``rank(plan, rank, W, mesh)`` gives one rank's rows at each W where
    ``runs_at(plan, W)``, the report keeps rank 0's or (``all_ranks``) every rank's. In this
    process: ``local(plan)`` gives the report's value. ``derived(plan, value)`` adds keys
    beside it; ``summary(report)`` prints it; ``plots``: (file name, ``draw(report, path)``,
    False when it drew nothing); ``panels``: ``draw(ax, report)`` of each of its panels of
    ``bench.png``."""

    name: str
    about: str
    quick: dict = field(default_factory=dict)
    full: dict = field(default_factory=dict)
    key: Optional[str] = None
    rank: Optional[Callable[[dict, int, int, Any], list]] = None
    runs_at: Callable[[dict, int], bool] = every_world
    all_ranks: bool = True
    local: Optional[Callable[[dict], Any]] = None
    derived: Optional[Callable[[dict, Any], dict]] = None
    summary: Optional[Callable[[dict], None]] = None
    plots: tuple = ()
    panels: tuple = ()

    def __post_init__(self):
        if (self.rank is None) == (self.local is None):
            raise ValueError(f"bench section {self.name}: give exactly one of rank= and local=")

    @property
    def report_key(self) -> str:
        return self.key or self.name

    @property
    def on_ranks(self) -> bool:
        return self.rank is not None


def common_plan(quick: bool, worlds: list[int] | None) -> dict:
    """The plan entries of no one section: the worlds, the repeats and the attention shape
    several sections time (memory, calls, accuracy, windows, overlap, agreement)."""
    if quick:
        return dict(worlds=worlds or [1, 2], repeats=3, warmup=1, attn=dict(batch=1, heads=4, seq=64, head_dim=16))
    return dict(worlds=worlds or [1, 2, 4], repeats=5, warmup=1, attn=dict(batch=1, heads=8, seq=1024, head_dim=64))


def collect(per_world: list[list[dict]], key: str, all_ranks: bool = False) -> list[dict]:
    """The rows under ``key`` of every W's rank 0 (or of every rank)."""
    rows = []
    for results in per_world:
        for r in results if all_ranks else results[:1]:
            rows.extend(r.get(key, []))
    return rows


def attention_call(plan_attn: dict, kv_heads: int, dtype, mesh, world_size: int, seed: int = 0):
    """One causal CP attention call (forward + backward) through the v3 op on DTensors.
    Returns the gathered output and gradients in global order, and the inputs."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from ...npu_ops import causal_arguments
    from ...testing.reference import head_tail_positions

    a = plan_attn
    g = torch.Generator().manual_seed(seed)
    b, n, s, d = a["batch"], a["heads"], a["seq"], a["head_dim"]
    q = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64)
    dy = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    order = head_tail_positions(s, world_size)
    inverse = torch.argsort(order)
    dist_ = [distribute_tensor(t.index_select(2, order).to(dtype), mesh, [Shard(2)]) for t in (q, k, v, dy)]
    qd, kd, vd = (t.requires_grad_() for t in dist_[:3])
    out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, n, "BNSD", scale=1.0 / math.sqrt(d),
                                                **causal_arguments("cpu"))[0]
    out.backward(dist_[3])
    gathered = [t.detach().full_tensor().index_select(2, inverse) for t in (out, qd.grad, kd.grad, vd.grad)]
    return gathered, (q, k, v, dy)


def causal_call(shape: dict, mesh, world_size: int, rank: int, seed: int = 0):
    """Local causal q, k, v, dy as DTensors (Shard(2), BNSD, fp32) and the v3 call on them (v and dy
    at ``shape["v_head_dim"]`` when given: MLA)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from ...npu_ops import causal_arguments

    b, n, s, d = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
    dv = shape.get("v_head_dim", d)
    g = torch.Generator().manual_seed(seed + rank)
    local = [torch.randn(b, n, s // world_size, dim, generator=g) for dim in (d, d, dv, dv)]
    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]).requires_grad_() for t in local[:3])
    dy = DTensor.from_local(local[3], mesh, [Shard(2)])
    causal = causal_arguments("cpu")

    def call():
        return torch.ops.npu.npu_fusion_attention_v3(q, k, v, n, "BNSD", scale=1.0 / math.sqrt(d), **causal)[0]

    return (q, k, v, dy, causal["atten_mask"]), call
