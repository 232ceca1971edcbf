"""DTensor custom-op handlers for the NPU fused attention ops.

* ``checks``: which mask arguments and shardings the handlers accept;
* ``call``: one prepared call (its CallPlan, sharding, mask rows) and the DTensor wrapping;
* ``ops``: the custom ops that run the strategies and the step cache;
* ``calls``: per-call measurements;
* ``attention``: the two handlers, bound to one ``CPConfig``.
"""

from .attention import AttentionHandlers
from .call_log import CallLog, CallRecord

__all__ = ["AttentionHandlers", "CallLog", "CallRecord"]
