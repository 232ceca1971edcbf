"""Every layer that mixes tokens under CP besides the attention floors (DESIGN §20): the kinds of sequence mixer
(``kinds``), the region's guard that serves or refuses each (``guard``), and each served kind's own module."""

from . import gated_delta, mamba1, mamba2, short_conv  # noqa: F401  (the kinds they serve register themselves)
from .guard import Found, check_model, install, refusal, scan, set_active, uninstall
from .kinds import KINDS, SERVERS, Kind, kind_of

__all__ = ["Found", "Kind", "KINDS", "SERVERS", "check_model", "install", "kind_of", "refusal", "scan", "set_active",
           "uninstall"]
