"""One step of the manager: the state a step's forward, its packs and its backward share.

A :class:`Step` is made when a step begins (``ActivationOffloader._begin_step``) and stays the
manager's current step until the next one begins: its backward, which may run after its block,
still reads it. Nothing in it is reset by hand: the next step is a new object. A later forward
chunk of a pipeline round (NOTE [ Pipelining ]) is a step of the executor but one step of the
profile and the plan: its Step carries on the round's record keys, plan and profile from the
previous one (``carried``).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from offload.lifecycle._calls import CallStack, Frame

if TYPE_CHECKING:
    from offload._executor import Executor
    from offload._planned import ActivePlan
    from offload._stats import StepStats


@dataclass
class Entry(Frame):
    """A module call the manager runs: its record-key frame, whether ``keep=`` covers it, and
    the families this call packed itself (offloaded ones, in pack order), which its backward
    trigger reloads."""

    kept: bool = False
    own: list[Any] = field(default_factory=list)


class Step:
    """The state of one step (a ``with mgr:`` block, or an installed manager's forward, and its
    backward)."""

    def __init__(
        self, index: int, stats: StepStats, thread: int, carried: Step | None = None
    ) -> None:
        self.index = index
        self.stats = stats
        # The thread that entered the step (its forward's): other threads' module calls
        # outside a backward are not the step's (see lifecycle's foreign_call).
        self.thread = thread
        self.running = True  # between _begin_step and _end_step (the block)
        self.added = False  # its counters are in the manager's totals (see _account_last)
        self.hooks_cm: Any = None
        self.hooks_popped = False  # paused() took this step's hook pair off the stack
        # Begun by an installed manager (NOTE [ Installed steps ] in _hooks.py): its hooks are
        # on only inside its top-level module calls (``between`` them, off), and it ends when
        # the backward that began after them ends.
        self.installed = False
        self.between = False
        self.backward_begun = False
        self.backwards = 0  # backwards ended while its block runs (a ``with`` step)
        # Packs whose copy waits for their op to return, and the autograd sequence number when
        # the last of them was packed (NOTE [ Fill after pack ] in _pack.py).
        self.deferred: list[weakref.ref[Any]] = []
        self.deferred_at = -1
        # What the last pack decided, for a pack of the same tensor by the same op (NOTE
        # [ Packed again ] in _pack.py): ``(sequence number, id, version, numel, element size,
        # member, thread)``, the member None where the plan kept it.
        self.again: tuple[Any, ...] | None = None
        if carried is not None:
            self._carry_on(carried)
            return
        # The running calls (Entry frames), calls per module and packs outside any module:
        # the record keys (lifecycle/_calls.py).
        self.calls = CallStack()
        self.signature_begun = False  # see NOTE [ Top-level calls ] in _budget.py
        # The profiler's numbers of packs returned as plain tensors.
        self.kept_seq: dict[int, int] = {}
        # Under a plan that rebuilds: what this step's kept packs returned, by id (a rebuilt
        # record's input may be one of them; see activation_recipe in _pack.py).
        self.kept_refs: dict[int, weakref.ref[torch.Tensor]] = {}
        # The outputs recipes stood for, by id (one rebuild serves all their packs).
        self.rebuilds: dict[int, tuple[weakref.ref[torch.Tensor], int, Any]] = {}
        self.active: ActivePlan | None = None  # the plan this step runs
        # Eligible packs under a plan and how many of their keys the plan knew (see
        # _check_given_plan in _warnings.py).
        self.keys_looked_up = self.keys_matched = 0
        # NOTE [ Structure ] in _structure.py: the keys a profiling step packed, where a planned
        # step is in its plan's sequence (-1: not followed), the first key off it, and
        # storages the plan kept.
        self.step_keys: list[tuple[str, int, int]] | None = None
        self.cursor = -1
        self.diverged: tuple[int, tuple[str, int, int], Any] | None = None
        self.plan_kept: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def _carry_on(self, prev: Step) -> None:
        """A later forward chunk of a pipeline round: the record keys, the plan and the profile
        carry on from the round's previous chunk; no call of it runs any more."""
        prev.calls.clear()
        self.calls = prev.calls
        self.signature_begun = prev.signature_begun
        self.kept_seq, self.kept_refs, self.rebuilds = prev.kept_seq, prev.kept_refs, prev.rebuilds
        self.active = prev.active
        self.keys_looked_up, self.keys_matched = prev.keys_looked_up, prev.keys_matched
        self.step_keys, self.cursor, self.diverged = prev.step_keys, prev.cursor, prev.diverged
        self.plan_kept = prev.plan_kept

    def snapshot(self, ex: Executor | None, device: torch.device) -> StepStats:
        """This step's counters as they are now (a copy), its peaks read from the device."""
        s, step = self.stats, self
        if ex is not None and ex.step is not None and ex.step.stats is s and not step.added:
            ex.count_host_allocations()
        if device.type == "cuda" and not step.added:
            s.peak_allocated_bytes = max(
                s.peak_allocated_bytes, torch.cuda.max_memory_allocated(device)
            )
            s.peak_reserved_bytes = max(
                s.peak_reserved_bytes, torch.cuda.max_memory_reserved(device)
            )
        s.finish()
        return dataclasses.replace(s, _leads=list(s._leads))

    @property
    def top(self) -> Entry | None:
        """The innermost module call of this step that is running, or None."""
        frames = self.calls.frames
        return frames[-1] if frames else None

    # -- NOTE [ Structure ] in _structure.py -------------------------------------------------

    def follow(self, key: tuple[str, int, int]) -> None:
        """A pack of a planned step: is it the next key of its plan's sequence? (NOTE
        [ Structure ])"""
        active = self.active
        if active is None:
            return
        recomputed = active.recompute_calls
        if recomputed and (key[0], key[1]) in recomputed:  # (a tuple only when there are some)
            return
        seq, at = active.sequence, self.cursor
        if at < len(seq) and seq[at] == key:
            self.cursor = at + 1
            return
        if at < len(seq):
            self.diverged = (at, key, seq[at])
        # else: packs past the plan's whole sequence (a second forward in the block) shift no
        # key of it: unknown keys, unplanned as they are.
        self.cursor = -1

    def kept_by_plan(self, local: torch.Tensor) -> bool:
        st = local.untyped_storage()
        ref = self.plan_kept.get(st._cdata)
        return ref is not None and ref() is st
