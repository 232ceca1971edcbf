"""DTensor custom-op handlers for the NPU fused attention ops.

* ``attention``: the two handlers, bound to one ``CPConfig``: route, read, run, wrap;
* ``spec``: one call read once (its CallSpec: mask, sharding, documents, sinks, the CallPlan)
  and the DTensor wrapping;
* ``ops``: the custom ops that run the strategies and the step cache, and the call log.
"""

from .attention import AttentionHandlers
from .ops import CallLog, CallRecord

__all__ = ["AttentionHandlers", "CallLog", "CallRecord"]
