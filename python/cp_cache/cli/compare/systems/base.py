"""What every compared system answers, and the v3 op's keyword arguments for a case."""

from __future__ import annotations

import math


class Unsupported(Exception):
    """The system has no way to express this input (recorded as "not supported", not run)."""


def op_kwargs(spec: dict, mask) -> dict:
    """The keyword arguments of ``npu_fusion_attention_v3`` for the case ``spec``."""
    from ....npu_ops import INT_MAX

    kw = dict(atten_mask=mask, scale=1.0 / math.sqrt(spec["head_dim"]), keep_prob=spec.get("keep_prob", 1.0),
              sparse_mode=spec["mode"])
    kw["next_tockens"] = 0 if spec["mode"] in (2, 3) else INT_MAX
    return kw


class System:
    """What every system answers besides ``attention``: the state it keeps outside autograd
    (none by default), read around a forward."""

    def held_tensors(self) -> list:
        return []

    def store_bytes(self) -> int:
        return 0

    def stack_entries(self) -> int | None:
        return None

    def clear_stack(self) -> None:
        pass

    def reported_sent_bytes(self) -> dict | None:
        """The bytes the system itself reports as sent, by direction (None: it reports none)."""
        return None


class DTensorSystem(System):
    """A system reached by calling the v3 op on DTensors sharded on the sequence (cp_cache,
    torch_npu): the handler found in DTensor's table runs."""

    name = ""

    def __init__(self, mesh):
        self.mesh = mesh

    def attention(self, q, k, v, spec: dict, mask):
        import torch
        from torch.distributed.tensor import DTensor, Shard

        from .... import layout as L

        sd = L.seq_dim(spec["layout"])
        qd, kd, vd = (DTensor.from_local(t, self.mesh, [Shard(sd)], run_check=False) for t in (q, k, v))
        out = torch.ops.npu.npu_fusion_attention_v3(qd, kd, vd, spec["heads"], spec["layout"], **op_kwargs(spec, mask))
        out = out[0]
        return out.to_local() if isinstance(out, DTensor) else out
