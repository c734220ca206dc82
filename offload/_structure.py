"""The forward structures of a signature (NOTE [ Structure ]): a planned step follows its plan's
sequence of record keys, and one that leaves it has its signature profiled again.

:class:`Structures` is the part of :class:`offload._budget.Budget` that tracks them (one object:
the per-signature state lives in the budget).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from offload._warnings import (
    _futile_text,
    _left_plan_text,
    _structures_text,
)

if TYPE_CHECKING:
    from offload._budget import SignatureStates
    from offload._hooks import StepEnd
    from offload._planned import Profiler
    from offload._step import Step
    from offload._warnings import WarnOnce

log = logging.getLogger("offload")

# NOTE [ Structure ]: forward structures profiled per signature, and re-profiles in a row that
# found the structure that had just diverged, before a signature is no longer profiled again.
MAX_STRUCTURES = 4
_FUTILE_REPROFILES = 2
_NEW_STRUCTURE = " [structure ?]"  # the name of a step profiling a structure not yet named


# NOTE [ Structure ]
#     A signature names what the root call was given (NOTE [ Signatures ] in _planned.py),
#     not everything that picks the forward's structure: a float that switches a branch
#     (``if p > 0``), a module attribute or a global flag set between steps, data-dependent
#     control flow. A plan met by another structure misplaces records: keys shift within a
#     call, so a pack takes another tensor's decision, and two members of one storage can get
#     two (kept and moved: the storage stays and a reloaded copy joins it). Measured on CPU
#     (three Linears with an extra branch in the root's forward under a budget of 192 KiB):
#     6 records unplanned and 249,856 saved bytes held, above the budget and above keeping
#     everything (180,224), every such step, said nowhere.
#     So a planned step follows its plan's sequence (``ActivePlan.sequence``, the keys in pack
#     order; packs of recomputed calls and of backwards are not in it): at the first pack off
#     it, the rest of the step is not the plan's: every later record goes to the first tier
#     with room (``stats.unplanned_records``; one whose storage the plan kept earlier in the
#     step stays kept: it is on the device anyway), and no call is recomputed. A warning
#     (once per signature) names the causes and the fix, and the signature's next step is
#     profiled again in min-memory mode. Its keys name its structure: a new one gets a plan of
#     its own, ``"<signature> [structure N]"`` in ``mgr.plans`` (it counts toward
#     ``MAX_SIGNATURES``), a known one its plan back; later steps of the signature run the
#     plan of the structure last profiled. A structure cannot be known before the forward
#     runs, so a forward whose structure changes at every step keeps running tails off its
#     plan: after ``_FUTILE_REPROFILES`` re-profiles in a row that found the structure that
#     had just diverged, or past ``MAX_STRUCTURES`` structures, the signature is no longer
#     re-profiled (said once). Plans given with ``plan=``, the merged plan past
#     ``MAX_SIGNATURES`` and pipeline rounds are not followed.


class Structures:
    """Per signature, the name of the plan of its current structure (the signature itself for
    the first), the forward's record keys of each profiled structure, signatures whose next
    step profiles its structure again, those no longer profiled again, and re-profiles in a row
    that found the structure that had diverged."""

    # The budget's, which this is part of (see Budget.__init__).
    _profiler: Profiler | None
    _profiling: str | None
    _overlapping: bool
    _last_signature: str | None
    _states: SignatureStates
    _task_ends: dict[int, StepEnd]
    _warn: WarnOnce

    def _init_structures(self) -> None:
        self._structure: dict[str, str] = {}
        self._structures: dict[str, dict[tuple[tuple[str, int, int], ...], str]] = {}
        self._reprofile: dict[str, str] = {}  # signature -> the structure that diverged
        self._structure_fixed: set[str] = set()
        self._futile: dict[str, int] = {}

    def _drop_profile(self, name: str) -> None:
        raise NotImplementedError  # Budget's

    def _begin_structure(self, sig: str, step: Step) -> bool:
        """At a step's start: True when it profiles ``sig``'s structure again (NOTE
        [ Structure ])."""
        if (
            sig not in self._reprofile
            or self._profiler is None
            or self._overlapping
            or not torch.is_grad_enabled()
        ):
            return False
        from offload._budget import SigState  # (which imports this module)

        self._last_signature = self._profiling = sig + _NEW_STRUCTURE
        self._states.to(self._profiling, SigState.PROFILING)
        self._profiler.begin(step.thread)
        step.step_keys = []
        return True

    def _end_structure(self, step: Step) -> None:
        """At a step's end (NOTE [ Structure ]): name the structure a profiling step packed;
        a planned step that left its plan's sequence has its signature profiled again."""
        self._close_structure(self._profiling, step)
        diverged = step.diverged
        if diverged is None:
            return
        at, got, expected = diverged
        sig = self._last_signature
        base = next((b for b, n in self._structure.items() if n == sig), sig)
        assert sig is not None and base is not None
        if self._profiling == sig:
            # Its first planned step, timed for refinement: not its structure's times.
            from offload._budget import SigState  # (which imports this module)

            self._drop_profile(sig)
            self._states.to(sig, SigState.PLANNED)  # its next planned step is timed
        self._warn(
            f"structure:{base}",
            _left_plan_text(base, at, got, expected),
        )
        if base not in self._structure_fixed:
            self._reprofile[base] = sig

    def _close_structure(self, name: str | None, step: Step) -> None:
        """A profiling step's forward or profile ended, whichever came first: its keys so far
        are its structure."""
        keys, step.step_keys = step.step_keys, None
        if keys is not None and name is not None:
            self._name_structure(name, tuple(keys))

    def _name_structure(self, name: str, keys: tuple[tuple[str, int, int], ...]) -> None:
        if not name.endswith(_NEW_STRUCTURE):
            self._structures.setdefault(name, {})[keys] = name  # a signature's first profile
            return
        base = name[: -len(_NEW_STRUCTURE)]
        diverged = self._reprofile.pop(base, None)
        structures = self._structures.setdefault(base, {})
        known = structures.get(keys)
        if known is None and len(structures) < MAX_STRUCTURES:
            new = f"{base} [structure {len(structures) + 1}]"
            structures[keys] = self._structure[base] = new
            self._futile.pop(base, None)
            self._last_signature = new
            if self._profiling == name:
                self._profiling = new
                self._states.rename(name, new)
            for end in self._task_ends.values():
                if end.profiling == name:
                    end.profiling = new
            return
        self._drop_profile(name)
        self._states.forget(name)
        if known is None:
            self._structure_fixed.add(base)
            self._warn(
                f"structures:{base}",
                _structures_text(base, MAX_STRUCTURES),
            )
            return
        self._structure[base] = self._last_signature = known
        if known != diverged:
            self._futile.pop(base, None)
            log.info("offload: signature %s runs the plan of its structure %s again", base, known)
            return
        futile = self._futile[base] = self._futile.get(base, 0) + 1
        if futile >= _FUTILE_REPROFILES:
            self._structure_fixed.add(base)
            self._warn(
                f"structures:{base}",
                _futile_text(base, futile),
            )
