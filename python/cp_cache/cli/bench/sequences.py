"""The ``sequences`` section of ``python -m cp_cache bench``: the bytes each call of a sequence of
different calls receives, counted at the process group's backend, against the mask's lower bound.

A model's layers do not repeat one call: gpt-oss alternates a sliding and a full layer, Gemma-3
runs five sliding to one full. Two sequences on one CP group (head-tail, W = 4), each call a
forward and backward through the op on DTensors:

* "alternating": a causal window of 12 and full causal attention, alternating; each call's bytes
  against the same call repeated alone (a ratio of 1: nothing of another call travels with it);
* "mixed": causal, a window of 12, a block-diagonal mask of 4 documents ([S, S]) and packed
  documents (TND, balanced placement), in turn; each against its lower bound (the rows its
  queries may attend to that the rank does not hold, from the mask: ``exchanged_rows``).

Bytes are counted below torch.distributed, at ``ProcessGroup`` and the gloo backend's own
``send``/``recv`` (``BackendCounter``): every message a rank receives, whoever posts it.
"""

from __future__ import annotations

import math
import statistics

from .._common import table
from .shared import Section, largest_world_only

__all__ = ["SECTION", "BackendCounter", "sequences_rank", "summary"]

DOCUMENTS = (20, 64, 100, 128)  # of S = 128 (scaled): the block-diagonal mask's and the packed batch's ends
WINDOW = 12


class BackendCounter:
    """Bytes received (and sent) by point-to-point messages while active, counted at the process
    group and at the gloo backend itself (a post that bypasses torch.distributed's functions is
    counted too; one through them is counted once, at the process group)."""

    def __init__(self):
        self.received = 0
        self.sent = 0
        self._saved: list = []

    def __enter__(self):
        import torch.distributed as dist

        for cls in (dist.ProcessGroup, dist.ProcessGroupGloo):
            for name, counts in (("recv", "received"), ("send", "sent")):
                # the class's own descriptor (pybind's method wrapper; None: inherited), put back on exit
                self._saved.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, self._counting(getattr(cls, name), counts))
        return self

    def _counting(self, original, counts: str):
        def call(group, tensors, *args, **kwargs):
            setattr(self, counts, getattr(self, counts) + sum(t.nbytes for t in tensors))
            return original(group, tensors, *args, **kwargs)
        return call

    def __exit__(self, *exc):
        for cls, name, own in reversed(self._saved):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
        self._saved.clear()


def _scaled(seq: int) -> tuple:
    return tuple(e * seq // 128 for e in DOCUMENTS)


def _masked(kind: str, seq: int):
    import torch

    from ...testing.reference import band_masked
    from ...testing.varlen_reference import document_masked

    if kind == "causal":
        return torch.ones(seq, seq, dtype=torch.bool).triu(1)
    if kind == "window":
        return band_masked(seq, WINDOW - 1, 0)
    if kind == "given":
        return document_masked(_scaled(seq), _scaled(seq), "full")
    return document_masked(_scaled(seq), _scaled(seq), "left_up")  # packed documents, causal


class _Calls:
    """The four kinds of call on this rank, each a forward and backward through the op."""

    def __init__(self, shape: dict, mesh, rank: int, world: int):
        import torch

        import cp_cache

        self.shape, self.mesh, self.rank, self.world = shape, mesh, rank, world
        b, n, s, d = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
        g = torch.Generator().manual_seed(7)
        self.full = [torch.randn(b, n, s, d, generator=g) for _ in range(4)]
        self.dense = [cp_cache.shard_sequence(t, mesh, 2, load_balance=True) for t in self.full]
        tnd = [t[0].transpose(0, 1).contiguous() for t in self.full]
        self.ends = _scaled(s)
        self.packed = [self._tnd(t) for t in tnd]

    def _tnd(self, t):
        from torch.distributed.tensor import DTensor, Shard

        import cp_cache

        local = cp_cache.shard_documents(t, self.ends, self.mesh)
        return DTensor.from_local(local, self.mesh, [Shard(0)], shape=t.shape, stride=t.stride())

    def held(self, kind: str, rank: int):
        import cp_cache
        from ...testing.reference import rank_positions

        if kind == "tnd":
            return cp_cache.document_layout(self.ends, self.world)[rank]
        return rank_positions(self.world, rank, self.shape["seq"] // self.world, True)

    def run(self, kind: str) -> None:
        import torch

        from ...npu_ops import SparseMode, band_arguments, causal_arguments

        n, d = self.shape["heads"], self.shape["head_dim"]
        scale = 1.0 / math.sqrt(d)
        if kind == "tnd":
            q, k, v, dy = self.packed
            lengths = torch.tensor(self.ends, dtype=torch.int64)
            args = dict(causal_arguments("cpu"), actual_seq_qlen=lengths, actual_seq_kvlen=lengths)
            layout = "TND"
        else:
            q, k, v, dy = self.dense
            layout = "BNSD"
            if kind == "causal":
                args = causal_arguments("cpu")
            elif kind == "window":
                args = band_arguments("cpu", WINDOW - 1)
            else:
                args = dict(atten_mask=_masked("given", self.shape["seq"]), sparse_mode=int(SparseMode.ALL_MASK))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = torch.ops.npu.npu_fusion_attention_v3(*leaves, n, layout, scale=scale, **args)[0]
        out.backward(dy)


def _measured(calls: _Calls, sequence: list[str], counter_class) -> list[dict]:
    """Each call of ``sequence``: bytes received, forward and backward together."""
    import torch.distributed as dist

    rows = []
    for kind in sequence:
        dist.barrier()
        with counter_class() as counter:
            calls.run(kind)
        rows.append(dict(kind=kind, received=counter.received))
    return rows


def sequences_rank(plan: dict, rank: int, world_size: int, mesh=None) -> list[dict]:
    """The sequences on this rank (``plan["sequences"]``: batch, heads, head_dim, seq, rounds)."""
    import cp_cache
    from ...testing.reference import exchanged_rows
    from torch.distributed.device_mesh import init_device_mesh

    shape = plan["sequences"]
    mesh = mesh if mesh is not None and mesh.ndim == 1 else init_device_mesh("cpu", (world_size,))
    row_bytes = 2 * shape["batch"] * shape["heads"] * shape["head_dim"] * 4  # a K row and a V row, fp32
    rounds = shape["rounds"]
    with cp_cache.context_parallel(mesh):
        calls = _Calls(shape, mesh, rank, world_size)
        bound = {}
        for kind in ("causal", "window", "given", "tnd"):
            held = [calls.held(kind, r) for r in range(world_size)]
            _, received = exchanged_rows(_masked(kind, shape["seq"]), held)
            bound[kind] = received[rank] * row_bytes  # forward: the rows; backward: again, and partials back
        rows = []
        for name, sequence in (("window alone", ["window"] * 2 * rounds), ("causal alone", ["causal"] * 2 * rounds),
                               ("alternating", ["window", "causal"] * rounds),
                               ("mixed", ["causal", "window", "given", "tnd"] * rounds)):
            for i, row in enumerate(_measured(calls, sequence, BackendCounter)):
                rows.append(dict(row, sequence=name, call=i, rank=rank, world_size=world_size,
                                 forward_bound=bound[row["kind"]], **shape))
    return rows


# ---------------------------------------------------------------- report


def summary(rows: list[dict]) -> list[dict]:
    """Per sequence and kind of call, the steady state (the calls after the first round): bytes
    received over all ranks against the same call alone and against three times the forward
    bound (forward: the rows; backward: the rows again and their float32 partials back, which at
    equal dtypes weigh as much again)."""
    out = []
    for name in dict.fromkeys(r["sequence"] for r in rows):
        for kind in dict.fromkeys(r["kind"] for r in rows if r["sequence"] == name):
            group = [r for r in rows if r["sequence"] == name and r["kind"] == kind]
            first_round = min(r["call"] for r in group) + (2 if name != "mixed" else 4)
            steady = [r for r in group if r["call"] >= first_round] or group
            calls = sorted({r["call"] for r in steady})
            per_call = [sum(r["received"] for r in steady if r["call"] == c) for c in calls]
            bound = sum(r["forward_bound"] for r in steady if r["call"] == calls[0])
            out.append(dict(sequence=name, kind=kind, world_size=group[0]["world_size"],
                            received=statistics.median(per_call), bound=3 * bound))
    alone = {c["kind"]: c["received"] for c in out if c["sequence"].endswith("alone")}
    for c in out:
        c["vs_alone"] = c["received"] / alone[c["kind"]] if alone.get(c["kind"]) else math.nan
        c["vs_bound"] = c["received"] / c["bound"] if c["bound"] else math.nan
    return out


def print_summary(report: dict) -> None:
    cells = summary(report["sequences"])
    if not cells:
        return
    r0 = report["sequences"][0]
    print(f"\nSequences of different calls on one CP group (W={r0['world_size']}, head-tail, S={r0['seq']}, fp32): "
          "bytes received per call (forward + backward, all ranks), counted at the backend")
    body = [[c["sequence"], c["kind"], int(c["received"]), f"{c['vs_alone']:.2f}", f"{c['vs_bound']:.2f}"]
            for c in cells]
    print(table(["sequence", "call", "received B", "vs alone", "vs 3x forward bound"], body))


SECTION = Section(
    name="sequences",
    about="bytes each call of a sequence of different calls receives on one CP group (alternating window / full "
          "layers; causal, window, block-diagonal mask and packed documents in turn), counted at the backend, "
          "against the same call alone and the mask's lower bound",
    quick=dict(sequences=dict(batch=1, heads=4, head_dim=16, seq=128, rounds=3)),
    full=dict(sequences=dict(batch=1, heads=4, head_dim=16, seq=128, rounds=3)),
    rank=sequences_rank, runs_at=largest_world_only,
    derived=lambda plan, rows: {"sequences_summary": summary(rows)},
    summary=print_summary,
)
