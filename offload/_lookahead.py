"""The look-ahead: which reloads start when, ahead of the unpacks that need them.

A step's families are reloaded last packed first under a window of reloaded-but-unused bytes
(``window_bytes``): each backward trigger and each unpack (``prefetch``) starts the next that
fit. Under a plan (``window=False``) a trigger starts exactly what the plan names. A prefetch is
only ahead of time: one that does not fit the device now (the headroom probe, ``Executor.room``)
is skipped and its unpack reloads it. The executor's ``prefetch`` and ``prefetch_step`` run
these as ``offload::prefetch`` points (``_points.py``), once per trigger, never per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from offload import _reload, storage
from offload._family import ALIGN_BYTES, Family, Life
from offload.lifecycle._calls import graph_task
from offload.lifecycle._simulate import automatic_bounds

if TYPE_CHECKING:
    from offload._executor import Executor, _StepState


def window_bytes(ex: Executor, step: _StepState) -> int:
    """The look-ahead window for ``step``'s reloads: the given bound, else a quarter of
    the bytes ``step`` stored, at least twice the largest family and at most the automatic
    ``max_inflight_bytes``. A window of the automatic in-flight bound alone (at least 256
    MiB) brought every family of a smaller step back when its backward began, so min-memory
    mode peaked as high as keeping everything (a 4-block GPT-2-style step storing 52.4 MB:
    76,669,892 saved bytes held at once, as many as without offloading)."""
    if ex._prefetch_bytes:
        return ex._prefetch_bytes
    largest, stored = ex._largest, step.stored_bytes
    if largest != step.window_of[0] or stored != step.window_of[1]:  # (asked at most unpacks)
        step.window_of = (largest, stored)
        step.window = automatic_bounds(largest, stored)[1]  # as the simulator assumes
    return step.window


def prefetch(
    ex: Executor,
    needed: Sequence[Family] = (),
    step: _StepState | None = None,
    *,
    window: bool = True,
    used: Sequence[Family] = (),
) -> None:
    """Start the reloads of ``needed`` (backward is about to use them), then of the step's
    families below its look-ahead pointer while reloaded-but-unused bytes fit the window.

    ``step`` is the step that packed them (the current one by default): with two forwards
    before their backwards the current step may be another one. ``window=False`` (a plan
    names every reload's trigger): only ``needed``, and those of them still being copied
    out as soon as their copy completes. ``used``: the family an unpack just used (where a
    later backward's walk starts, see NOTE [ Later backward passes ]).
    """
    with ex.lock:
        if step is None:
            step = ex.step
        if step is None or step.failed:
            return
        if (ex.capture.possible or ex._in_capture) and ex._capturing():
            return  # (see NOTE [ No query while capturing ])
        window = window and step.windowed
        ex._poll()
        for fam in needed:
            if window:
                step.wanted[fam.order] = fam  # see NOTE [ Module triggers under the window ]
            elif fam.life is Life.COPYING_OUT:
                step.revisit.append(fam)
            else:
                begin_reload(ex, fam)
        if window and needed:
            latest = max(needed, key=lambda f: f.order)
            if not (latest.unpacked and latest.unpacked_task == graph_task()):
                begin_reload(ex, latest)  # needed first: starts beyond the window too
        if window:
            _walk(ex, step, needed, used)
        elif step.revisit:
            _revisit_planned(ex, step)


def after_unpack(ex: Executor, step: _StepState, used: Family, task: int) -> None:
    """``prefetch(ex, (), step, used=(used,))`` from an unpack in backward ``task``, which
    holds the lock already (once per saved tensor: the call's own preamble cost as much as the
    walk)."""
    if step.failed:
        return
    if (ex.capture.possible or ex._in_capture) and ex._capturing():
        return  # (see NOTE [ No query while capturing ])
    ex._poll()
    if step.windowed:
        stop = step.stopped
        if (
            stop is not None
            and stop[1] == ex._ahead_bytes
            and stop[0] is not used
            and stop[0].life is Life.OFF_DEVICE
            and stop[2] == ex._largest
            and task == step.walk_task
            and not step.revisit
            and not step.wanted
        ):
            return  # NOTE [ A walk that stops again ]
        _walk(ex, step, (), (used,), task)
    elif step.revisit:
        _revisit_planned(ex, step)


# NOTE [ A walk that stops again ]
#     Most unpacks leave the window as it was: the second member of a family (``x * x`` saves
#     x twice) uses bytes its first member's unpack took out of the window already. A walk
#     that stopped because the next family did not fit (``_StepState.stopped``: that family,
#     the bytes ahead then and the largest family then) stops there again while those are
#     unchanged, the family is still off the device and not the one just used, the same
#     backward runs and nothing waits to be revisited or was named by a trigger: the unpack
#     skips it. Any reload started, finished or used since changes the bytes ahead, and a
#     larger family the window's bound.


def _revisit_planned(ex: Executor, step: _StepState) -> None:
    """Under a plan: start the reloads of the named families whose copy out has completed
    since (the others wait for the next prefetch)."""
    waiting, step.revisit = step.revisit, []
    for fam in waiting:
        if fam.life is Life.COPYING_OUT:
            step.revisit.append(fam)
        else:
            begin_reload(ex, fam)


def _walk(
    ex: Executor,
    step: _StepState,
    needed: Sequence[Family],
    used: Sequence[Family],
    task: int | None = None,
) -> None:
    """The windowed part of ``prefetch``: the families passed while copying out, those the
    triggers named, then those below the look-ahead pointer, while they fit the window.
    ``task``: the running backward's graph task, when the caller read it."""
    step.stopped = None
    if step.revisit:
        # Passed while being copied out; needed before anything below the pointer.
        waiting = step.revisit
        step.revisit = [f for f in waiting if f.life is Life.COPYING_OUT]
        for fam in waiting:
            begin_reload(ex, fam)
    if task is None:
        task = graph_task()
    if task != -1 and task != step.walk_task:
        if step.walk_task != -1:
            # See NOTE [ Later backward passes ].
            named = [
                f.order for f in (*needed, *used) if f.step_ref is not None and f.step_ref() is step
            ]
            step.prefetch_next = max(named, default=len(step.families) - 1)
        step.walk_task = task
    if step.wanted:
        _reload_wanted(ex, step, task)
    bound = -1  # window_bytes(ex, step), asked once (the loop may not need it)
    while step.prefetch_next >= 0:
        fam = step.families[step.prefetch_next]
        if fam.life is Life.COPYING_OUT:
            step.revisit.append(fam)
        elif (
            fam.life is Life.OFF_DEVICE
            and fam.members > 0
            and not (fam.unpacked and fam.unpacked_task == task)
        ):
            # Not one every member of which this backward has unpacked since its reload (the
            # unpack before the walk reached it, backward's first): reused while autograd
            # still held that buffer, it stayed to the next backward.
            if bound < 0:
                bound = window_bytes(ex, step)
            if ex._ahead_bytes + fam.nbytes > bound:
                step.stopped = (fam, ex._ahead_bytes, ex._largest)
                break
            if not begin_reload(ex, fam):
                break  # memory is short: the window waits for unpacks to make room
        step.prefetch_next -= 1


# NOTE [ Module triggers under the window ]
#     A module's backward trigger names the families its own ops packed (a module without
#     children: all of them). In windowed mode they are reloaded under the look-ahead
#     window too, last packed first, never all at once: a module running 8 x (matmul, tanh)
#     would otherwise bring back every one of its saved tensors when its backward begins,
#     as much as keeping them all. Inside one module the unpacks are the only events, so
#     each prefetch (a trigger, and every unpack after it consumed a reload) starts the
#     next wanted families that fit. Two start beyond the window: the one a trigger names
#     that was packed last (the module's backward is about to unpack it), and the next one
#     whenever nothing is reloaded ahead (one larger than the window still comes). Under a
#     plan (``window=False``) the trigger starts what the plan said, at once. The simulator
#     models the same rule (lifecycle/_simulate.py, NOTE [ Reload policy ]).


def _reload_wanted(ex: Executor, step: _StepState, task: int) -> None:
    """Start the families backward triggers named, last packed first, while they fit the
    window (see NOTE [ Module triggers under the window ])."""
    window = window_bytes(ex, step)
    for order in sorted(step.wanted, reverse=True):
        fam = step.wanted[order]
        if (
            fam.life is Life.OFF_DEVICE
            and fam.members > 0
            and not (fam.unpacked and fam.unpacked_task == task)
        ):
            if ex._ahead_bytes and ex._ahead_bytes + fam.nbytes > window:
                return
            if not begin_reload(ex, fam):
                return  # memory is short: the unpacks make room
        # Reloading, resident, used by this backward, freed, or still copying out (its
        # unpack then uses the source): nothing more to start for it.
        del step.wanted[order]


# NOTE [ Later backward passes ]
#     A step may run several backwards over one graph (``l1.backward(retain_graph=True);
#     l2.backward()``). The look-ahead's pointer only moves down, and the first backward
#     takes it past the first packed family: the second would get no window, only the reloads
#     its modules' triggers and its unpacks ask for (8 x (Linear(128) + Tanh), a 4-family
#     window: 131,072 B reloaded ahead of need midway through the first, 0 in the second).
#     So the first prefetch under a new graph task (``torch._C._current_graph_task_id()``)
#     of a step that an earlier backward walked starts the walk over, and the walk skips a
#     family as already used only when this backward unpacked it (``unpacked_task``). It
#     starts at the family packed last among those that prefetch names (the trigger's, or
#     the one just unpacked), not at the top: the families above it were mostly saved by
#     ops only an earlier loss reaches (``l1 = y.pow(2).mean()`` saves y, which ``l2 = y.sum()``
#     never unpacks), and from the top the walk would bring them back to be held, counted
#     against the window, until the graph dies. One the later backward does not use but
#     that lies below the start is still brought back (the executor cannot tell: which
#     nodes a backward runs is the engine's, and holding nodes to ask it would tie the
#     graph into a reference cycle). Likewise a family some member of which only an
#     earlier loss's ops saved is never unpacked by all its members again: its reload
#     stays until the graph dies (lifecycle's simulator counts it so).


def prefetch_step(ex: Executor, step: _StepState, *, restart: bool = False) -> None:
    """Start ``step``'s look-ahead window (a pipeline's backward chunk of its microbatch is
    about to run); ``restart``: from its last packed family again (a zero-bubble W chunk
    unpacks what its I chunk already did)."""
    with ex.lock:
        if restart:
            step.prefetch_next = len(step.families) - 1
            for fam in step.families:
                if fam.life is Life.OFF_DEVICE:
                    fam.unpacked = 0  # unpacked by the I chunk: the walk brings it back
                    fam.unpack_round += 1
    prefetch(ex, (), step)


def begin_reload(ex: Executor, fam: Family) -> bool:
    """Prefetch ``fam``; False when memory for it is short now (a prefetch is only ahead of
    time: its unpack reloads it then, and raises there if memory is still short)."""
    if fam.life is Life.OFF_DEVICE and fam.members > 0 and not _reload.reuse(ex, fam):
        if ex.room is not None and not ex.room(fam.nbytes + ALIGN_BYTES):
            # See NOTE [ Prefetch under memory pressure ] in _device.py.
            if ex.step is not None:
                ex.step.stats.prefetches_skipped += 1
            return False
        try:
            _reload.start_reload(ex, fam)
        except (torch.OutOfMemoryError, storage.StorageFullError):
            return False
    return True
