"""The handler floor: ``attention`` (the DTensor handlers and the custom ops that run the local
work) and ``spec`` (one call read once, and the DTensor wrapping)."""

from .attention import AttentionHandlers, CallLog, CallRecord

__all__ = ["AttentionHandlers", "CallLog", "CallRecord"]
