"""Budget mode's per-signature state: one :class:`SigState` per input signature, with a
transition table, owned by :class:`Budget`, which also holds each signature's profile, plan and
strikes, and chooses how each step runs (NOTE [ Budget mode ] in _planned.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import torch

from offload import lifecycle
from offload._errors import OffloadError, from_infeasible
from offload._planned import (
    MAX_SHARED_SIGNATURES,
    MAX_SIGNATURES,
    ActivePlan,
    Profiler,
    describe,
    make_plan,
    merged_trace,
    retimed,
)
from offload._planning import resolve_hardware
from offload._points import point
from offload._structure import Structures
from offload._verify import RecomputeVerifier
from offload._warnings import (
    _infeasible_text,
    _overlap_text,
    _recompute_differs_text,
    _signatures_text,
    _unfinished_text,
    _unplanned_text,
)
from offload.lifecycle import HardwareModel, Placement, Plan, Trace

if TYPE_CHECKING:
    from offload._config import OffloadConfig
    from offload._executor import Executor
    from offload._hooks import StepEnd
    from offload._pack import Packer
    from offload._pipelining import PipelineRound
    from offload._step import Step
    from offload._warnings import WarnOnce

log = logging.getLogger("offload")

# Profiles of one signature cut short by overlapping steps before it runs in min-memory mode.
_UNFINISHED_PROFILES = 2
# Steps of one signature not profiled because older steps' tensors lived on, before it runs in
# min-memory mode.
_OVERLAP_SKIPS = 8
# Budgeted steps in a row run in min-memory mode for overlapping steps before the manager says
# that budget mode is not planning (NOTE [ Overlapping steps ]).
_UNPLANNED_STEPS = 16


class SigState(enum.Enum):
    """Where one input signature is in budget mode (NOTE [ Signature states ])."""

    NEW = "new"  # not met, or forgotten (kept in no table)
    PROFILING = "profiling"  # its step is being recorded, in min-memory mode
    PROFILED = "profiled"  # recorded; planned at the next step's start (or by mgr.plan)
    PLANNED = "planned"  # planned from its profile; its next step is timed (NOTE [ Refinement ])
    TIMING = "timing"  # a planned step being recorded for its timings
    TIMED = "timed"  # timings recorded; re-planned from them at the next step's start
    SETTLED = "settled"  # its plan is final (refined, or kept as it was)
    GIVEN = "given"  # runs the plan given with plan=
    SHARED = "shared"  # runs the merged plan (past MAX_SIGNATURES profiled signatures)
    INFEASIBLE = "infeasible"  # its budget cannot be met: min-memory mode for good
    STRUCK = "struck"  # its profiles never finish: min-memory mode (NOTE [ Overlapping steps ])


# NOTE [ Signature states ]
#     A signature's state decides how its next step runs (Budget._begin_signature): with a
#     plan (PLANNED, which times it; TIMED, SETTLED, GIVEN, SHARED), profiled (NEW), in
#     min-memory mode (PROFILED until planned, INFEASIBLE, STRUCK). The transitions:
#       NEW        -> PROFILING (its step is recorded), GIVEN, SHARED, STRUCK (overlap skips)
#       PROFILING  -> PROFILED (its backward ended), NEW (dropped: the step raised, or another
#                     began before its backward ended; a re-profile found a known structure),
#                     PROFILED (dropped, with an earlier profile of it standing)
#       PROFILED   -> PLANNED, SETTLED (planned, its signature the given plan's), INFEASIBLE,
#                     NEW (planning raised: profiled again if met again)
#       PLANNED    -> TIMING, PROFILED (its plan recomputes a module found to differ)
#       TIMING     -> TIMED, SETTLED (the timing step was dropped: the plan stands), PLANNED
#                     (it left its plan's sequence: timed again later), PROFILING (its plan
#                     was dropped: the recording is a profile now)
#       TIMED      -> SETTLED (refined, or refining failed), PROFILED (plan dropped)
#       SETTLED    -> PROFILED (plan dropped)
#       SHARED     -> NEW (forgotten past MAX_SHARED_SIGNATURES)
#       STRUCK     -> NEW (forgotten past MAX_SIGNATURES), SHARED (past MAX_SIGNATURES)
#       GIVEN, INFEASIBLE: for good.
#     Any other transition is a bug and raises. Data that goes with a state stays beside it:
#     the profile's step in the trace (``_profiled``), the timing step (``_timed``), the plan
#     (``_plans``), the order in which struck and shared signatures are forgotten.
_NEXT: dict[SigState, frozenset[SigState]] = {
    SigState.NEW: frozenset({SigState.PROFILING, SigState.GIVEN, SigState.SHARED, SigState.STRUCK}),
    SigState.PROFILING: frozenset({SigState.PROFILED, SigState.NEW}),
    SigState.PROFILED: frozenset(
        {SigState.PLANNED, SigState.SETTLED, SigState.INFEASIBLE, SigState.NEW}
    ),
    SigState.PLANNED: frozenset({SigState.TIMING, SigState.PROFILED}),
    SigState.TIMING: frozenset(
        {SigState.TIMED, SigState.SETTLED, SigState.PLANNED, SigState.PROFILING}
    ),
    SigState.TIMED: frozenset({SigState.SETTLED, SigState.PROFILED}),
    SigState.SETTLED: frozenset({SigState.PROFILED}),
    SigState.GIVEN: frozenset(),
    SigState.SHARED: frozenset({SigState.NEW}),
    SigState.INFEASIBLE: frozenset(),
    SigState.STRUCK: frozenset({SigState.NEW, SigState.SHARED}),
}


class SignatureStates:
    """The :class:`SigState` of each signature met (NEW ones are kept in no table)."""

    __slots__ = ("_of",)

    def __init__(self) -> None:
        self._of: dict[str, SigState] = {}

    def get(self, sig: str) -> SigState:
        return self._of.get(sig, SigState.NEW)

    def any(self, state: SigState) -> bool:
        return state in self._of.values()

    def to(self, sig: str, new: SigState) -> None:
        """Move ``sig`` to ``new``; raises OffloadError if the table does not allow it."""
        old = self.get(sig)
        if new not in _NEXT[old]:
            allowed = sorted(s.value for s in _NEXT[old])
            raise OffloadError(
                f"signature {sig!r}: no transition {old.value} -> {new.value}; from "
                f"{old.value} only {allowed or 'none'} (NOTE [ Signature states ])"
            )
        if new is SigState.NEW:
            del self._of[sig]
        else:
            self._of[sig] = new

    def forget(self, sig: str) -> None:
        """``sig`` is met as a new signature from now on (a legal move to NEW)."""
        if sig in self._of:
            self.to(sig, SigState.NEW)

    def rename(self, old: str, new: str) -> None:
        """A step recorded as ``old`` (a structure not yet named) is ``new``'s."""
        state = self.get(old)
        self.forget(old)
        self.to(new, state)


class Budget(Structures):
    """Everything budget mode knows per signature, and the profiler and planner it uses."""

    def __init__(
        self,
        *,
        config: OffloadConfig,
        device: torch.device,
        budget_bytes: int | None,
        user_plan: Plan | None,
        hardware_arg: Any,
        warn: WarnOnce,
        task_ends: dict[int, StepEnd],
        packer: Packer,
        install_recompute: Callable[[ActivePlan], None],
    ) -> None:
        self.config, self.device = config, device
        self._budget_bytes, self._user_plan = budget_bytes, user_plan
        self._warn, self._task_ends, self._packer = warn, task_ends, packer
        self._install_recompute = install_recompute
        self._hardware_arg = hardware_arg
        # A path is read now: a bad file should fail here, not at the first plan.
        self._hardware: HardwareModel | None = (
            None if hardware_arg is None else resolve_hardware(hardware_arg, device)
        )
        if self._hardware is None and budget_bytes is not None:
            # Measured now, before training allocates: on CUDA the probe holds 2 x 256 MiB on
            # the device and pinned, and empties the allocators' caches when done. Lazily, at the
            # first plan (the second step's entry, or in a pipeline round with microbatches'
            # activations alive), it emptied them mid-training.
            self._hardware = resolve_hardware(None, device)
        self._states = SignatureStates()  # NOTE [ Signature states ]
        self._plans: dict[str, Plan] = {}
        self._active_plans: dict[str, ActivePlan] = {}
        # Struck signatures (NOTE [ Overlapping steps ]): the most recent MAX_SIGNATURES, least
        # recent first, each with whether a warning named it.
        self._struck: collections.OrderedDict[str, bool] = collections.OrderedDict()
        # Budgeted steps in a row run in min-memory mode for overlapping steps, and the
        # signatures of the first _UNPLANNED_STEPS of them (NOTE [ Overlapping steps ]).
        self._unplanned_run = 0
        self._unplanned_sigs: set[str] = set()
        self._over_budget: set[str | None] = set()
        self._profiler: Profiler | None = None
        self._profiled: dict[str, int] = {}  # signature -> its step in the profiler's trace
        # Past MAX_SIGNATURES: the merged plan, once it was tried (None: it could not be made).
        self._merged: Plan | None = None
        self._merge_tried = False
        # Signatures that run the merged plan, least recently met first (see _share).
        self._shared: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._verifier = RecomputeVerifier()  # NOTE [ Verified recomputation ] in _verify.py
        # NOTE [ Refinement ] in _planned.py: signature -> its timing step in the trace.
        self._timed: dict[str, int] = {}
        self._profiling: str | None = None  # the signature the current step is recorded for
        # Profiles cut short by a step that began before their backward ended, per signature
        # (see _drop_unfinished_profile), and whether this step began so.
        self._unfinished: dict[str, int] = {}
        self._overlapping = False
        self._overlap_skips: dict[str, int] = {}  # steps not profiled for it, per signature
        self._last_signature: str | None = None
        self._init_structures()

    def oom_note(self, active: ActivePlan | None) -> str:
        """What an out-of-memory error inside a step should say about offload (docs/design.md:
        "Never newly broken")."""
        if self._budget_bytes is None:
            return (
                "offload: this step ran in min-memory mode (every eligible saved tensor "
                "offloaded); what remains on the device is parameters, gradients, optimizer state "
                "and transients"
            )
        if active is None:
            return (
                f"offload: gpu_budget={self._budget_bytes} bytes; this step was profiling its "
                "signature in min-memory mode"
            )
        plan = active.plan
        kept: dict[str, int] = {}
        for e in plan.entries:
            if e.placement is Placement.KEEP:
                kept[e.module] = kept.get(e.module, 0) + e.nbytes
        top = sorted(kept.items(), key=lambda kv: -kv[1])[:5]
        return (
            f"offload: gpu_budget={plan.gpu_budget_bytes} bytes, predicted peak "
            f"{plan.predicted_peak_bytes} bytes; largest kept modules: "
            + ", ".join(f"{m or '<root>'} {b} bytes" for m, b in top)
        )

    def state(self, sig: str | None) -> SigState:
        return SigState.NEW if sig is None else self._states.get(sig)

    def _discard_recording(self) -> None:
        """The current step's recording is thrown away (its step raised, or it cannot describe
        one step): a profile is as if never begun, a timing step's plan stands as it is."""
        sig = self._profiling
        if sig is None:
            return
        self._profiling = None
        if self._profiler is not None:
            self._profiler.discard()
        state = self._states.get(sig)
        if state is SigState.TIMING:
            self._states.to(sig, SigState.SETTLED)
        elif state is SigState.PROFILING:
            self._states.to(sig, SigState.PROFILED if sig in self._profiled else SigState.NEW)

    # NOTE [ Top-level calls ]
    #     A budgeted step's signature is that of the first call with grad of a module of the
    #     model entered while no other module of it runs: the root's forward, or, when the step
    #     never calls it (``model.head(model.backbone(x))``, a LightningModule whose
    #     ``training_step`` calls ``self.net(x)``), the first child entered at the top level,
    #     named with its path (``"backbone(float32[8,32])"``, so it never takes a root call's
    #     plan). Its profiler begins there too, so the record keys count the same calls in the
    #     profiled and the planned steps. The decision is made at that call, before the first
    #     pack: top-level calls after it (the head's) are part of its structure, not of its
    #     signature (NOTE [ Structure ] checks them). A step that enters no module of the model
    #     and saves tensors has nothing to plan: warned once (_warn_no_module).

    def _begin_signature(
        self, sig: str, step: Step, ex: Executor, rnd: PipelineRound | None
    ) -> None:
        """At the step's first top-level forward (NOTE [ Top-level calls ]): choose how this
        step runs, from the state of its signature ``sig`` (NOTE [ Signature states ])."""
        if rnd is not None:
            sig += rnd.label
        elif self._begin_structure(sig, step):
            return  # its structure is profiled again (NOTE [ Structure ])
        else:
            sig = self._structure.get(sig, sig)
        self._last_signature = sig
        state = self._states.get(sig)
        plan = self._plans.get(sig)
        user = self._user_plan
        # The given plan: for its own signature whenever it comes, or, when it names none, for
        # the first signature met.
        if (
            plan is None
            and user is not None
            and (user.signature == sig or (user.signature == "" and not self._plans))
        ):
            plan = self._plans[sig] = user.with_signature(sig)
            self._states.to(sig, SigState.GIVEN)
        elif state is SigState.SHARED:
            self._shared.move_to_end(sig)
        elif state in _MERGEABLE and len(self._profiled) >= MAX_SIGNATURES:
            plan = self._merged_plan()
            if plan is not None:
                self._share(sig, plan)
        if plan is not None:
            self._run_plan(sig, plan, step, ex, rnd)
        else:
            _UNPLANNED[self._states.get(sig)](self, sig, step, ex, rnd)

    def _run_plan(
        self, sig: str, plan: Plan, step: Step, ex: Executor, rnd: PipelineRound | None
    ) -> None:
        """The step of ``sig`` runs ``plan``; the first planned step of a profiled signature
        (PLANNED) is recorded for its timings."""
        stats = step.stats
        self._end_unplanned_run()
        active = self._active_plans.get(sig)
        if active is None or active.plan is not plan:
            # One lookup table per plan: past MAX_SIGNATURES every new signature shares the
            # merged plan's.
            active = next(
                (a for a in self._active_plans.values() if a.plan is plan), None
            ) or ActivePlan(plan)
            self._active_plans[sig] = active
        step.active = active
        if ex.step is not None:
            ex.step.windowed = False  # see _StepState.windowed
            if rnd is not None:
                rnd.triggers = ex.step.triggers
        self._install_recompute(active)
        state = self._states.get(sig)
        if rnd is None and state not in (SigState.GIVEN, SigState.SHARED):
            step.cursor = 0  # followed through the plan's sequence (NOTE [ Structure ])
        stats.predicted_peak_bytes = plan.predicted_peak_bytes
        stats.predicted_step_s = plan.predicted_step_s
        if (
            state is SigState.PLANNED
            and self._profiler is not None
            and not self._overlapping
            and torch.is_grad_enabled()
            and not ex.capture.capturing()  # its packs pass through: no plan's timings
        ):
            # The first planned step of a profiled signature: recorded for its timings.
            self._states.to(sig, SigState.TIMING)
            self._profiler.begin(step.thread)
            self._profiling = sig

    def _run_infeasible(
        self, sig: str, step: Step, ex: Executor, rnd: PipelineRound | None
    ) -> None:
        # docs/design.md "Budget": such a step runs in min-memory mode, warned, and counted.
        step.stats.min_memory_steps = 1

    def _run_struck(self, sig: str, step: Step, ex: Executor, rnd: PipelineRound | None) -> None:
        # NOTE [ Overlapping steps ]
        named = self._struck.get(sig)
        self._struck.move_to_end(sig)
        step.stats.min_memory_steps = 1
        if not named:
            self._count_unplanned(sig)

    def _run_profiled(self, sig: str, step: Step, ex: Executor, rnd: PipelineRound | None) -> None:
        return  # min-memory: its profile is not planned yet

    def _run_new(self, sig: str, step: Step, ex: Executor, rnd: PipelineRound | None) -> None:
        """A signature not met yet (or forgotten) without a plan: its step is profiled."""
        stats = step.stats
        if len(self._profiled) >= MAX_SIGNATURES:
            stats.min_memory_steps = 1  # past the cap, no merged plan could be made (said once)
            return
        if self._profiler is None:
            return  # the model is gone
        if not torch.is_grad_enabled() or ex.capture.capturing():
            return  # nothing is saved to plan (inside a CUDA graph capture, packs pass through)
        if not self._overlapping:
            self._overlap_skips.pop(sig, None)  # only steps in a row count
        else:  # see _drop_unfinished_profile
            stats.min_memory_steps = 1
            self._count_unplanned(sig)
            self._count_toward_min_memory(
                self._overlap_skips,
                sig,
                _OVERLAP_SKIPS,
                "overlap",
                _overlap_text(sig, _OVERLAP_SKIPS),
            )
            return
        self._profiler.begin(step.thread)
        self._profiling = sig
        self._states.to(sig, SigState.PROFILING)
        if rnd is None:
            step.step_keys = []  # its structure (NOTE [ Structure ])

    def _drop_profile(self, name: str) -> None:
        """Forget the recording of the current step (a profile or a timing step)."""
        if self._profiling == name:
            self._profiling = None
            if self._profiler is not None:
                self._profiler.discard()
        self._profiled.pop(name, None)
        self._timed.pop(name, None)

    def _share(self, sig: str, plan: Plan) -> None:
        """``sig`` runs the merged plan. Only the ``MAX_SHARED_SIGNATURES`` most recent such
        signatures are named in ``plans`` (a step counter among the root's arguments makes one
        per step, NOTE [ Signatures ]); a forgotten one met again is given the same plan."""
        self._plans[sig] = plan
        self._shared[sig] = None
        self._states.to(sig, SigState.SHARED)
        while len(self._shared) > MAX_SHARED_SIGNATURES:
            old, _ = self._shared.popitem(last=False)
            self._states.forget(old)
            self._plans.pop(old, None)
            self._active_plans.pop(old, None)
            self._over_budget.discard(old)

    # NOTE [ Overlapping steps ]
    #     A profile describes one step with its backward, so a step that begins before the
    #     profiled step's backward ended (gradient accumulation with every microbatch's forward
    #     first, a forward never run backward, a backward that raised) drops it, and no step is
    #     profiled while an older step's saved tensors are alive. A signature struck
    #     ``_UNFINISHED_PROFILES`` times (dropped profiles) or ``_OVERLAP_SKIPS`` in a row (steps
    #     not profiled) runs in min-memory mode, said once.
    #     Strikes are per signature, and a step counter among the root's arguments makes a new
    #     signature per step (NOTE [ Signatures ]): with two forwards before their backwards
    #     each one was struck once, never reaching a limit, so no plan was ever made and
    #     nothing said so (48 steps of a 3-module model: no warning, ``min_memory_steps`` 0).
    #     So the manager also counts budgeted steps in a row run in min-memory mode for this
    #     (dropped profiles, steps not profiled, steps of signatures struck out silently; a step
    #     that runs a plan or a profile that finishes ends the run), and at
    #     ``_UNPLANNED_STEPS`` says once that budget mode is not planning, naming both causes.
    #     Steps of the signature a strike's warning named do not count: that warning said it.
    #     Struck signatures are kept apart from ``_infeasible`` (budget cannot be met) and only
    #     the ``MAX_SIGNATURES`` most recent of them (one per step or two under a counter: 200
    #     after 400 optimizer steps). One forgotten and met again starts fresh: its next step
    #     is profiled, in min-memory mode as every profiling step is, so it holds no more memory
    #     than a struck step, gradients are exact either way, and nothing is planned unless that
    #     profile finishes (then the loop no longer overlaps, and a plan is what was wanted); if
    #     it is cut short again the signature is struck again, silently. ``_infeasible`` is not
    #     capped: its signatures stay among ``_profiled`` (at most ``MAX_SIGNATURES``), and
    #     ``_plan_profiled`` plans every profiled signature not in it, so forgetting one would
    #     plan it again at every step (and a first one would raise).

    def _drop_unfinished_profile(
        self, ex: Executor | None, raised: Container[str | None] = ()
    ) -> None:
        """At a step's start: a profile still open is one whose backward has not ended (two
        forwards before their backwards, a forward never run backward, or a backward that
        raised). It cannot describe one step: drop it (NOTE [ Overlapping steps ]). Until no
        older step's saved tensor is left (their backwards ran), steps are not profiled: an
        older backward running inside one would be recorded as its own. After two such
        profiles the signature stays in min-memory mode, said once.

        ``raised``: the signatures being profiled when backwards that raised began (their end
        never ran). Such a profile is dropped without counting: a fault, as when it raises
        inside the step's block, not a way of training that no profile can follow; this step
        is profiled if nothing of the failed one is alive."""
        self._overlapping = self._overlapping and ex is not None and ex.live_families() > 0
        sig = self._profiling
        if sig is None:
            return
        timing = self._states.get(sig) is SigState.TIMING
        self._discard_recording()
        if sig in raised:
            self._overlapping = ex is not None and ex.live_families() > 0
            return
        self._overlapping = True
        if timing:
            return  # a timing step (NOTE [ Refinement ]): the plan stands as it is
        # Its forward's structure, named at its block's end, goes with it (NOTE [ Structure ]:
        # a first profile's; a planned signature's structures returned above).
        self._structures.pop(sig, None)
        self._count_unplanned(sig)
        self._count_toward_min_memory(
            self._unfinished,
            sig,
            _UNFINISHED_PROFILES,
            "unfinished",
            _unfinished_text(sig, _UNFINISHED_PROFILES),
        )

    def _count_toward_min_memory(
        self, counts: dict[str, int], sig: str, limit: int, key: str, why: str
    ) -> None:
        """One more strike for ``sig`` in ``counts``; at ``limit`` it runs in min-memory mode
        from now on, and ``why`` is said (once per ``key``)."""
        counts[sig] = counts.pop(sig, 0) + 1  # the most recently struck last
        if counts[sig] >= limit:
            self._struck[sig] = key not in self._warn  # named by the warning below
            if self._states.get(sig) is SigState.NEW:
                self._states.to(sig, SigState.STRUCK)
            self._warn(key, why)
            self._unfinished.pop(sig, None)
            self._overlap_skips.pop(sig, None)
            if len(self._struck) > MAX_SIGNATURES:
                old, _ = self._struck.popitem(last=False)  # met again, it starts fresh
                if self._states.get(old) is SigState.STRUCK:
                    self._states.forget(old)
        # A step counter among the root's arguments makes a new signature per step (NOTE
        # [ Signatures ]), each struck once: only the most recent are counted.
        while len(counts) > MAX_SIGNATURES:
            del counts[next(iter(counts))]

    def _count_unplanned(self, sig: str) -> None:
        """One more budgeted step in a row run in min-memory mode for overlapping steps; at
        ``_UNPLANNED_STEPS`` say once why budget mode is not planning (NOTE [ Overlapping
        steps ])."""
        if "unplanned" in self._warn:
            return
        self._unplanned_run += 1
        self._unplanned_sigs.add(sig)
        if self._unplanned_run < _UNPLANNED_STEPS:
            return
        sigs = sorted(self._unplanned_sigs)
        self._end_unplanned_run()
        self._warn("unplanned", _unplanned_text(_UNPLANNED_STEPS, sigs))

    def _end_unplanned_run(self) -> None:
        self._unplanned_run = 0
        self._unplanned_sigs.clear()

    def _profile_ended(self, sig: str, step: Step) -> None:
        """The profiling (or timing) step's backward ended (autograd's final callback)."""
        if self._profiler is None or self._profiling != sig:
            return
        # Its backward ran inside the step: the structure is named first, while the step is
        # still being recorded, so that a re-profile finding a known one is discarded (NOTE
        # [ Structure ]); ended first, each such step stayed in the recorder for good.
        self._close_structure(sig, step)
        name = self._profiling  # a new structure's name, or None: dropped
        if name is None:
            return
        with point("profile_end", name):
            recorded = self._profiler.end()
        if self._states.get(name) is SigState.TIMING:
            self._timed[name] = recorded  # NOTE [ Refinement ]
            self._states.to(name, SigState.TIMED)
        else:
            self._profiled[name] = recorded
            self._states.to(name, SigState.PROFILED)
            self._end_unplanned_run()  # see NOTE [ Overlapping steps ]
        self._profiling = None

    def _merged_plan(self) -> Plan | None:
        """Past ``MAX_SIGNATURES`` profiled signatures: one plan for every new one, from per-key
        byte maxima (NOTE [ Budget mode ]); made once. None when it cannot be made."""
        if self._merge_tried:
            return self._merged
        planned = [s for s in self._profiled if s in self._plans]
        if not planned or self._profiler is None or self._profiler.recording:
            return None
        trace, step, group = merged_trace(
            self._profiler.trace(), [self._profiled[s] for s in planned]
        )
        try:
            with point("plan", "merged"):
                plan = self._make_plan(trace, step, f"<per-key maxima of {len(group)} signatures>")
        except lifecycle.BudgetInfeasibleError as e:
            self._merge_tried = True
            self._warn(
                "signatures",
                _signatures_text(MAX_SIGNATURES, e),
            )
            return None
        self._merged, self._merge_tried = plan, True
        log.warning(
            "offload: %d input signatures profiled (the most): new ones run one plan made from "
            "the per-key byte maxima of the %d with the same record keys; a record larger than "
            "its key's maximum goes to the first tier with room (stats.unplanned_records). %s",
            len(self._profiled),
            len(group),
            describe(plan),
        )
        return plan

    def _plan_profiled(self) -> None:
        """Plan every profiled signature not planned yet (between steps)."""
        if self._budget_bytes is None:
            return
        self._verifier_found()  # may drop plans: made again below
        if not self._profiled:
            return
        if self._profiler is None or self._profiler.recording:
            return
        infeasible = SigState.INFEASIBLE
        if not self._timed and all(
            s in self._plans or self._states.get(s) is infeasible for s in self._profiled
        ):
            return  # nothing new: do not rebuild the trace (every step comes here)
        trace = self._profiler.trace()
        self._refine(trace)
        for sig, step in list(self._profiled.items()):
            if sig in self._plans or self._states.get(sig) is infeasible:
                continue
            first = not (self._plans or self._states.any(infeasible) or self._struck)
            try:
                with point("plan", sig):
                    plan = self._make_plan(trace, step, sig)
            except lifecycle.BudgetInfeasibleError as e:
                if first or self.config.on_infeasible == "raise":
                    # Profiled again if the user lowers their batch and tries once more.
                    del self._profiled[sig]
                    self._states.forget(sig)
                    raise from_infeasible(e) from None
                self._states.to(sig, infeasible)
                self._warn(
                    f"infeasible:{sig}",
                    _infeasible_text(sig, e),
                )
                continue
            self._plans[sig] = plan
            if self._user_plan is None or sig != self._user_plan.signature:
                self._states.to(sig, SigState.PLANNED)  # its next step is timed
            else:
                self._states.to(sig, SigState.SETTLED)
            log.info("%s", describe(plan))

    def _verifier_found(self) -> None:
        """Between steps: warn about modules found to recompute other values than their forward
        saved, and drop the profiled signatures' plans that recompute them (made again by the
        caller, less them; NOTE [ Verified recomputation ] in _verify.py)."""
        with point("verify"):
            found = self._verifier.settle()
        for name in found:
            self._warn(
                f"recompute-differs:{name}",
                _recompute_differs_text(name),
            )
        if not found:
            return
        for sig, plan in list(self._plans.items()):
            if sig not in self._profiled or self._states.get(sig) is SigState.GIVEN:
                continue
            if any(m in self._verifier.differing for m, _ in plan.recompute_calls):
                del self._plans[sig]
                self._active_plans.pop(sig, None)
                self._timed.pop(sig, None)
                timing = self._states.get(sig) is SigState.TIMING  # its recording: a profile
                self._states.to(sig, SigState.PROFILING if timing else SigState.PROFILED)

    def _refine(self, trace: Trace) -> None:
        """Re-plan, once, each signature whose first planned step was timed (NOTE
        [ Refinement ])."""
        timed, self._timed = self._timed, {}
        for sig, timing in timed.items():
            self._states.to(sig, SigState.SETTLED)
            if sig not in self._profiled:
                continue
            step = self._profiled[sig]
            old = self._plans[sig]
            rebuild_s = None
            if self.device.type == "cuda":
                # The device clock timed the planned rebuilds; the plan adds them itself (on CPU
                # they were taken out of the clock: ComputeClock).
                rate = self._hardware_model().pointwise_bytes_per_s
                rebuild_s = {
                    k: 2 * e.nbytes / rate  # input and output: one shape and dtype
                    for e in old.entries
                    if e.placement is Placement.REBUILD
                    for k in e.keys
                }
            try:
                with point("refine", sig):
                    plan = self._make_plan(retimed(trace, step, timing, rebuild_s), step, sig)
            except (lifecycle.BudgetInfeasibleError, ValueError) as e:
                log.info("offload: signature %s keeps its first plan (refining failed: %s)", sig, e)
                continue
            plan = dataclasses.replace(
                plan,
                metadata={
                    **plan.metadata,
                    "refined": True,
                    "first_plan_step_s": old.predicted_step_s,
                },
            )
            self._plans[sig] = plan
            self._active_plans.pop(sig, None)
            log.info(
                "offload: refined the plan of signature %s from its first planned step's "
                "timings: predicted step %.2f -> %.2f ms. %s",
                sig,
                old.predicted_step_s * 1e3,
                plan.predicted_step_s * 1e3,
                describe(plan),
            )

    def _make_plan(self, trace: Trace, step: int, signature: str) -> Plan:
        """:func:`lifecycle.plan` of one profiled step with this manager's settings."""
        assert self._budget_bytes is not None
        if self._verifier.differing:  # NOTE [ Verified recomputation ] in _verify.py
            differing = sorted(self._verifier.differing)
            trace = dataclasses.replace(
                trace, metadata={**trace.metadata, "recompute_mismatch_modules": differing}
            )
        return make_plan(
            trace,
            step=step,
            budget=self._budget_bytes,
            hardware=self._hardware_model(),
            tiers=tuple("cpu" if t == "cpu" else "nvme" for t in self.config.tiers),
            cpu_budget_bytes=self.config.cpu_budget_bytes,
            min_offload_bytes=self.config.min_offload_bytes,
            max_inflight_bytes=self.config.max_inflight_bytes,
            signature=signature,
            # Tensor parallel: recomputing a block would issue its collectives again.
            recompute=not self._packer.saw_dtensor,
        )

    def _hardware_model(self) -> HardwareModel:
        if self._hardware is None:
            self._hardware = resolve_hardware(self._hardware_arg, self.device)
        return self._hardware


_MERGEABLE = frozenset({SigState.NEW, SigState.STRUCK})  # met without a profile or a plan
# How a step of a signature without a plan runs, by its state (NOTE [ Signature states ]).
_UNPLANNED: dict[SigState, Callable[[Budget, str, Step, Executor, PipelineRound | None], None]] = {
    SigState.NEW: Budget._run_new,
    SigState.PROFILED: Budget._run_profiled,
    SigState.INFEASIBLE: Budget._run_infeasible,
    SigState.STRUCK: Budget._run_struck,
}
