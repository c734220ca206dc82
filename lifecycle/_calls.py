"""The module calls a step is running, and the record key of each pack: one implementation.

A record key is ``(module path, call index, ordinal)``: the innermost running module's path,
which call of that module in the step it is (counted from 0), and which pack of that call (every
pack counts: parameters, small and kept ones too). Packs while no module runs are keyed
``(OUTSIDE, 0, n)``. ``lifecycle.Recorder`` numbers the records of a trace so, and offload's
manager numbers a planned step's packs so to find each one's decision in the plan: both use
:class:`CallStack`, so the two cannot drift (a drift would silently misplace planned records).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

OUTSIDE = "<outside>"  # the module path of packs made while no module runs (a functional loss)
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while an autograd backward runs in this thread (recomputation, double backward)."""
    return _current_graph_task_id is not None and _current_graph_task_id() != -1


def _no_graph_task() -> int:
    return -1


# The id of the autograd backward (graph task) running in this thread, -1 outside one: torch's
# own function where it has one (asked per unpack, so no wrapper around it).
graph_task: Callable[[], int] = _current_graph_task_id or _no_graph_task


def foreign_call(thread: int | None) -> bool:
    """Whether a module call now belongs to no step run on ``thread`` (a ``threading.get_ident()``;
    ``None``: every thread's calls are the step's).

    Another thread's module call outside a backward (an evaluation or data thread calling a
    submodule of the model while a step runs) is not the step's: counted, it shifted the step's
    call indices, and so its record keys. Calls from inside a backward count on any thread: on
    CUDA backward (checkpoint recomputation, among others) runs on autograd's device thread.

    While dynamo traces (a model compiled after the hooks were attached), neither is asked: it
    cannot trace ``threading.get_ident()`` or the graph task id (``fullgraph=True`` fails on
    either, and without it each is a graph break), and the compiled code runs on the thread
    that calls it.
    """
    if thread is None or torch.compiler.is_compiling():
        return False
    return threading.get_ident() != thread and not in_backward()


@dataclass
class Frame:
    """One module call being run: its path, its call index, and the packs it has made so far."""

    module: str
    call_index: int
    packs: int = 0


class UnendedCalls:
    """Entries of a module-call ``stack`` pushed by calls a backward runs (checkpoint's
    recomputation). Non-reentrant checkpoint stops recomputing once backward has what it needs,
    so such a call's forward hook may never come: its entry would stay on the stack, and the
    step's later packs (a forward after a backward in one step) would be named after it. The end
    of that backward (a final callback) drops them. The recorder and offload's manager each keep
    one over their own stack, which they mutate in place; ``lock`` guards it, if any."""

    def __init__(self, stack: list[Any], lock: Any = None) -> None:
        self._stack, self._lock = stack, lock
        self._entries: list[Any] = []

    def add(self, entry: Any) -> None:
        """``entry``, just pushed, belongs to a call the current backward runs."""
        if not self._entries:
            torch.autograd.Variable._execution_engine.queue_callback(self._drop)
        self._entries.append(entry)

    def clear(self) -> None:
        """The stack was cleared (a step began or ended; a backward that raised runs no final
        callback)."""
        self._entries.clear()

    def _drop(self) -> None:
        with self._lock if self._lock is not None else contextlib.nullcontext():
            stale = {id(e) for e in self._entries}
            self._entries.clear()
            self._stack[:] = [e for e in self._stack if id(e) not in stale]


class CallStack:
    """The running module calls (``frames``, innermost last), the calls counted per module, and
    the packs made outside any module: everything a record key is numbered from.

    Example:
        >>> calls = CallStack()
        >>> calls.push(Frame("blocks.0", calls.call_index("blocks.0")))
        >>> calls.next_key(), calls.next_key()
        (('blocks.0', 0, 0), ('blocks.0', 0, 1))
        >>> _ = calls.pop()
        >>> calls.next_key()
        ('<outside>', 0, 0)
    """

    __slots__ = ("counts", "frames", "outside_packs", "unended")

    def __init__(self, lock: Any = None) -> None:
        self.frames: list[Any] = []
        self.counts: dict[str, int] = {}
        self.outside_packs = 0
        self.unended = UnendedCalls(self.frames, lock)

    def call_index(self, module: str, count: bool = True) -> int:
        """The index of this call of ``module`` in the step; ``count=False``: not counted (the
        next call gets the same index)."""
        idx = self.counts.get(module, 0)
        if count:
            self.counts[module] = idx + 1
        return idx

    def push(self, frame: Any, in_backward: bool = False) -> None:
        """``frame`` (a :class:`Frame`) begins; ``in_backward``: a backward runs the call (see
        :class:`UnendedCalls`)."""
        self.frames.append(frame)
        if in_backward:
            self.unended.add(frame)

    def pop(self) -> Any:
        return self.frames.pop()

    @property
    def top(self) -> Any:
        """The innermost running call's frame, or None."""
        return self.frames[-1] if self.frames else None

    def next_key(self) -> tuple[str, int, int]:
        """The record key of the next pack, counted."""
        if self.frames:
            top = self.frames[-1]
            ordinal = top.packs
            top.packs = ordinal + 1
            return (top.module, top.call_index, ordinal)
        ordinal = self.outside_packs
        self.outside_packs = ordinal + 1
        return (OUTSIDE, 0, ordinal)

    def clear(self) -> None:
        """No call runs (a step began or ended); the counts stay."""
        self.frames.clear()
        self.unended.clear()

    def reset(self) -> None:
        """A new step: no call runs and none was counted."""
        self.clear()
        self.counts.clear()
        self.outside_packs = 0
