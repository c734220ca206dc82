"""The lifecycle points of a step, each under one ``offload::<name>`` label.

A point is logged at debug level on the ``offload`` logger and, while torch's profiler runs, is
a ``record_function`` range of the same name, so a user's profiler trace (Perfetto, TensorBoard)
shows where offload worked. Points are per step or per event, never per saved tensor: a pack
or an unpack is not a point (the hot path pays nothing here).

    >>> from offload._points import point
    >>> with point("plan", "signature 0"):
    ...     pass
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger("offload")

# Every name a point may have; a name outside this set is a bug (the docs list these).
POINTS = frozenset(
    {
        "step_begin",  # a step's state is made: window, plan, executor step
        "profile_end",  # a profiled step's trace is complete
        "plan",  # a plan is made from a profiled trace
        "refine",  # a plan is remade from a measured step
        "verify",  # a recomputed block is compared with its originals
        "prefetch",  # reloads are started ahead of backward
        "fault",  # a tier failed: fallback, retry or quarantine
        "drain",  # the step's copies are waited for
        "step_end",  # the step's statistics are final
    }
)

_profiling = torch._C._autograd._profiler_enabled


# The context of a point nobody watches (no debug log, no profiler): it does nothing, and one
# serves every such point (a planned step's reload triggers are many).
_QUIET = contextlib.nullcontext()


def point(name: str, detail: str = "") -> contextlib.AbstractContextManager[None]:
    """Run the enclosed work as lifecycle point ``name`` (one of :data:`POINTS`)."""
    if name not in POINTS:
        raise ValueError(f"point: name must be one of {sorted(POINTS)}, got {name!r}")
    debug = log.isEnabledFor(logging.DEBUG)
    if not debug and not _profiling():
        return _QUIET
    return _watched(name, detail, debug)


@contextlib.contextmanager
def _watched(name: str, detail: str, debug: bool) -> Iterator[None]:
    label = "offload::" + name
    if debug:
        log.debug("%s%s", label, f" {detail}" if detail else "")
    if _profiling():
        with torch.profiler.record_function(label):
            yield
    else:
        yield
