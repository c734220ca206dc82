"""The exceptions users can catch."""

from __future__ import annotations


class OffloadError(RuntimeError):
    """Base class of every error offload raises on purpose."""
