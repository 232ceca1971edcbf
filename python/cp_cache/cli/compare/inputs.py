"""The inputs every system gets: a case's spec, full and per-rank tensors, its mask, the resource shape."""

from __future__ import annotations

import zlib


def case_spec(case: dict, plan_cases: dict) -> dict:
    """A case of ``catalogue.CASES`` with the plan's shape (heads, kv_heads, head_dim, s_local, keep_prob)."""
    heads = plan_cases["heads"]
    return dict(case, heads=heads, kv_heads=heads // 2 if case["gqa"] else heads, head_dim=plan_cases["head_dim"],
                s_local=plan_cases["s_local"], keep_prob=case.get("keep_prob", 1.0))


def full_inputs(spec: dict, world: int):
    """Full-sequence q, k, v, dout [B, N, S, D] float64 (values rounded to float32), seeded by case and W."""
    import torch

    S = spec["s_local"] * world
    g = torch.Generator().manual_seed(zlib.crc32(f"compare/{spec['name']}/{world}".encode()))
    q = torch.randn(1, spec["heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    k = torch.randn(1, spec["kv_heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    v = torch.randn(1, spec["kv_heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    dout = torch.randn(1, spec["heads"], S, spec["head_dim"], generator=g, dtype=torch.float64)
    return [t.float().double() for t in (q, k, v, dout)]


def mask_for(spec: dict, world: int):
    """The case's atten_mask: the compressed causal mask, an all-False [S, S] mask, or None."""
    import torch

    from ...npu_ops import causal_mask

    if spec["mask"] == "causal":
        return causal_mask(torch.device("cpu"))
    if spec["mask"] == "all_false":
        S = spec["s_local"] * world
        return torch.zeros(S, S, dtype=torch.bool)
    return None


def local_shard(x_bnsd, spec: dict, pos, requires_grad: bool):
    """This rank's positions ``pos`` of a full BNSD tensor, float32 in the case's layout."""
    from ... import layout as L

    t = L.from_bnsd(x_bnsd.index_select(2, pos), spec["layout"]).float().contiguous()
    return t.requires_grad_(requires_grad)


def resource_inputs(plan: dict, rank: int, world: int):
    """q, k, v, dout and spec of the memory, time and traffic measurements (BNSD fp32, causal, balanced)."""
    import torch

    r = plan["resources"]
    s_local = r["seq"] // world
    g = torch.Generator().manual_seed(4242 + rank)
    shape = (r["batch"], r["heads"], s_local, r["head_dim"])
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=g)
    spec = dict(name="resources", layout="BNSD", gqa=False, mask="causal", mode=2, lb=True, heads=r["heads"],
                kv_heads=r["heads"], head_dim=r["head_dim"], s_local=s_local, keep_prob=1.0)
    return q, k, v, dout, spec
