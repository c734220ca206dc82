"""Clocks for the recorder. The recorder never reads a clock itself: one is injected.

A clock hands out opaque stamps cheaply during the step and converts them to seconds once, at
the end. The CPU clock stamps ``time.perf_counter()``; the CUDA clock (in ``offload``) records
CUDA events and resolves them after one synchronize, so stamping never blocks the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """What the recorder needs from a clock."""

    def stamp(self) -> object:
        """Mark "now" and return an opaque stamp."""
        ...

    def seconds(self, stamps: Sequence[object]) -> list[float]:
        """Seconds of each stamp relative to ``stamps[0]`` (the first is 0.0)."""
        ...


class MonotonicClock:
    """Host wall clock (``time.perf_counter``); right for CPU-only runs.

    Example:
        >>> c = MonotonicClock()
        >>> a, b = c.stamp(), c.stamp()
        >>> c.seconds([a, b])[0]
        0.0
    """

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, stamps: Sequence[object]) -> list[float]:
        if not stamps:
            return []
        t0 = float(stamps[0])  # type: ignore[arg-type]
        return [float(s) - t0 for s in stamps]  # type: ignore[arg-type]
