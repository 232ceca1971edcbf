"""CPU emulation of torch_npu's fused attention ops.

A product feature: on a machine without torch_npu, ``install_npu_emulator()`` makes
``cp_cache.enable()`` and every CP call run on CPU (plain torch kernels), which is how
the tests, ``python -m cp_cache demo | bench | compare`` and users without an NPU run
cp_cache.  ``cp_cache.enable()`` names this function when the NPU ops are missing.
It imports nothing from ``cp_cache.testing`` or ``cp_cache.cli``.

``install_npu_emulator()`` defines, under ``torch.ops.npu``, the operators

* ``npu_fusion_attention_v3`` / ``npu_fusion_attention_grad_v3``, and
* ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (v1), with the schemas
  torch_npu ships today (op-plugin master): the v1 forward has the same inputs as
  v3 except that ``prefix``, ``actual_seq_qlen`` and ``actual_seq_kvlen`` are
  ``int[]?``; it returns ``(Tensor, Tensor, Tensor, Tensor, int, int, int)``
  (seed, offset, numels as ints) and its grad takes ``int seed, int offset,
  int numels`` (the real schema, as torch-npu 2.13.0 writes it).

Each op has a CPU kernel in plain torch, a fake (meta) kernel and, for the
forward ops, the autograd formula of op-plugin's derivatives.yaml: the backward
calls ``torch.ops.npu.npu_fusion_attention_grad(_v3)`` with the forward's saved
outputs (attention_out as ``attention_in``, softmax_max/sum, softmax_out as
``softmax_in``, seed, offset), the very tensors saved for backward.

Emulated semantics
------------------
* layouts BNSD, BSND, BSH, SBH (BSH/SBH: ``H = N * D``; ``D = Hq / head_num``;
  the kv head count is ``Hkv / D``).  TND (packed segments, ``actual_seq_qlen`` /
  ``actual_seq_kvlen`` cumulative ends; statistics ``[T, N, 8]``): ``varlen_math``.
* MLA: value's head size ``Dv`` may differ from query/key's ``D`` (BSH/SBH: value hidden
  ``Nkv * Dv``); the output has ``Dv`` (BSH/SBH: ``Nq * Dv``), as torch_npu's meta functions
  give it. Key and value agree on every other dim.
* GQA: key/value may have ``Nkv`` heads with ``Nq % Nkv == 0``; query head ``h``
  uses kv head ``h // (Nq // Nkv)``; dk/dv are summed over each group.
* ``scale`` multiplies ``Q K^T`` (op default 1.0).
* ``atten_mask``: bool/uint8, True/1 = masked out; shapes SS, 11SS, B1SS, BNSS.
* sparse_mode 0: mask as given plus the band ``j - i <= next_tockens`` and
  ``i - j <= pre_tockens`` (left-up origin); 1: mask as given, pre/next ignored;
  2: left-up causal (``j <= i``); 3: right-down causal (``j <= i + Skv - Sq``);
  4: band with the right-down origin (Ascend docs: "the part between preTokens
  and nextTokens, parameter starting point is the lower right corner"), i.e.
  with ``d = Skv - Sq``: keep ``j - i <= next_tockens + d`` and
  ``i - j <= pre_tockens - d`` (for a square call, d = 0:
  query i sees key j iff i - pre <= j <= i + next; pinned by
  tests/python/test_windows_masks.py).  Modes 2/3/4 require the compressed 2048x2048
  mask; its values are not used, the pattern comes from the mode.  Without an
  atten_mask the op computes full attention whatever sparse_mode says.
  Modes 5..8 raise ``NotImplementedError``; others ``ValueError``.
* dtypes: fp16/bf16/fp32 computed in float32, fp64 computed in float64; outputs
  in the input dtype.  softmax_max/softmax_sum are float32 ``[B, Nq, Sq, 8]``
  (float64 for float64 inputs, so that gradcheck is exact), the 8 values
  replicated, ``LSE = max + log(sum)``.  softmax_out is an empty ``[0]`` tensor.
* dropout: ``keep_prob`` in (0, 1].  With ``keep_prob < 1`` the forward draws
  ``seed, offset = torch.randint(0, 2**62, (2,))`` from the *default* CPU
  generator (so ``torch.utils.checkpoint``'s RNG preservation replays it) and
  the keep mask is ``dropout_keep_mask(seed, offset, [B, Nq, Sq, Skv],
  keep_prob)``: a private ``torch.Generator`` seeded from (seed, offset), then
  ``torch.rand(shape) < keep_prob``.  Kept probabilities are scaled by
  ``1 / keep_prob``.  With ``keep_prob == 1`` seed = offset = ``tensor([0])``
  and the default generator is untouched.
* grad op: standard flash backward from the GIVEN statistics and
  ``attention_in``: ``P = exp(S - LSE)`` with ``LSE = softmax_max[..., 0] +
  log(softmax_sum[..., 0])``, ``D = rowsum(dy * attention_in)``,
  ``dS = P * (dP - D)``.  ``softmax_max = LSE, softmax_sum = 1`` gives the
  same result.  dpse is an empty ``[0]`` tensor; dsink, without a sink, a float32 0-d
  zero from v3 and ``[0]`` from v1 (the shapes of torch_npu's meta functions).
* sink (gpt-oss's attention sinks): a floating tensor ``[head_num]``, one logit per
  query head.  Row i of head h takes its softmax over the allowed SCALED scores and one
  more logit, ``sink[h]`` itself (raw, not scaled); the sink's column is dropped before
  multiplying by V.  The statistics include it (``softmax_max = max(row max, sink[h])``,
  ``softmax_sum`` adds ``exp(sink[h] - max)``, so ``LSE`` is the LSE with the sink), and
  the grad op, given them, returns ``dsink[h] = -sum_i exp(sink[h] - LSE_i) *
  rowsum(dy * attention_in)_i`` (the same formula with dropout) in the sink's shape and
  dtype.  THIS IS THE CONVENTION ASSUMED FOR THE REAL OP (the op-plugin schemas take
  ``sink``; what its kernels compute has not been checked on an NPU yet): where the
  real kernels differ, the emulator and cp_cache's CP sink follow this one.

Fully masked rows (every key masked): attention_out = 0, gradients 0,
``softmax_max`` = the float32 lowest finite value (-3.4028235e38) and
``softmax_sum`` = 0, so ``LSE = max + log(sum) = -inf`` and nothing is NaN
(a merge with such a block gives it weight ``exp(lowest - m) = 0``).

Raises ``NotImplementedError`` (naming the argument and its value) for pse,
padding_mask, prefix, actual_seq_qlen/kvlen outside TND, a non-empty softmax_layout,
an explicit mask with TND and sparse modes 5..8; ``ValueError`` for bad inputs (rank for the
layout, head_num mismatch, ``Nq % Nkv``, key/value shape (all but the head size), batch, head dim,
keep_prob, unknown layout or sparse_mode, mask dtype/shape).

With ``route_sdpa=True``, ``torch.nn.functional.scaled_dot_product_attention``
is replaced by a function of the same name that sends CPU tensors (and DTensors
whose local tensors are on CPU) to ``torch.ops.npu.npu_fusion_attention_v3``
the way torch_npu does on an NPU.
"""

from __future__ import annotations

import logging
import threading

from ..npu_ops import op_exists
from .attention_math import dropout_keep_mask
from .registration import define_ops
from .sdpa_route import install_route, routed, scaled_dot_product_attention, uninstall_route

__all__ = [
    "install_npu_emulator",
    "uninstall_npu_emulator",
    "emulator_installed",
    "dropout_keep_mask",
    "scaled_dot_product_attention",
]

logger = logging.getLogger("cp_cache")

_STATE_LOCK = threading.RLock()
_LIBS: list = []


def emulator_installed() -> bool:
    """True while the emulator's ops are installed."""
    return bool(_LIBS)


def install_npu_emulator(route_sdpa: bool = True) -> bool:
    """Define the NPU fused attention ops on CPU (idempotent).

    Returns False (and changes nothing) when ``torch.ops.npu.npu_fusion_attention_v3``
    already exists and was not defined by this module (torch_npu is present).
    With ``route_sdpa`` also routes ``F.scaled_dot_product_attention`` to the v3 op.
    """
    with _STATE_LOCK:
        if not _LIBS:
            if op_exists("npu_fusion_attention_v3"):
                logger.info(
                    "npu emulator not installed: torch.ops.npu.npu_fusion_attention_v3 already exists "
                    "(torch_npu or another library defines it)"
                )
                return False
            _LIBS.append(define_ops())
            logger.info("npu emulator installed (route_sdpa=%s)", route_sdpa)
        if route_sdpa and not routed():
            install_route()
        return True


def uninstall_npu_emulator() -> None:
    """Restore SDPA and remove the emulator's op definitions (install works again afterwards)."""
    with _STATE_LOCK:
        uninstall_route()
        while _LIBS:
            _LIBS.pop()._destroy()
