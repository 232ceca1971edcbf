"""DTensor custom-op handlers for the NPU fused attention ops.

* ``arguments``: binding a handler's (args, kwargs) to the op's argument names;
* ``checks``: which mask arguments and shardings the handlers accept;
* ``step_records``: the step cache's contents, written by forward, read by backward;
* ``calls``: per-call measurements;
* ``attention``: the two handlers, bound to one ``CPConfig``.
"""

from .attention import AttentionHandlers
from .calls import CallLog, CallRecord

__all__ = ["AttentionHandlers", "CallLog", "CallRecord"]
