"""Memory figures computed from shapes (no measurement)."""

from __future__ import annotations

from ..npu_ops import STATS_WIDTH

FP32 = 4


def torch_npu_entry_bytes(batch: int, heads: int, local_seq: int, head_dim: int, elem_bytes: int,
                          world_size: int) -> dict:
    """Bytes of one entry of torch_npu's original CP stack (one attention call, one rank).

    The entry holds the merged attention output [B, N, S_local, D] in the activation
    dtype, the merged LSE [B, N, S_local] float32, and, for each of the W ring steps, a
    clone of the merged softmax max and sum [B, N, S_local, 8] float32:

        out + lse + W * 2 * B*N*S_local*8*4
    """
    out = batch * heads * local_seq * head_dim * elem_bytes
    lse = batch * heads * local_seq * FP32
    stats = world_size * 2 * batch * heads * local_seq * STATS_WIDTH * FP32
    return dict(out=out, lse=lse, stats=stats, total=out + lse + stats)


FORMULA = ("B*N*S_local*D*elem (merged output) + B*N*S_local*4 (merged LSE, fp32) "
           "+ W * 2 * B*N*S_local*8*4 (a clone of the merged max and sum [B, N, S_local, 8] fp32 "
           "per ring step)")
