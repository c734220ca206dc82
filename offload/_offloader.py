"""``offload.ActivationOffloader`` and ``offload.activations()``: the manager users hold.

A step is one ``with mgr:`` block: saved-tensor hooks are active only inside it, the forward runs
inside it, backward inside or after it. The manager decides which saved tensors move (everything
eligible, in this min-memory mode) and when backward is about to need them; the executor moves
the bytes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from offload import lifecycle, storage
from offload._config import (
    OffloadConfig,
    _check_hardware_arg,
    _check_keep_names,
    _check_model,
    _check_nvme_dir_type,
    _check_user_plan,
    _inflight_arg,
    _keep_arg,
    _tiers_arg,
)
from offload._device import RoomProbe, compute_device, room_probe
from offload._errors import OffloadError, from_infeasible, modified_after_save
from offload._executor import Executor, _Member
from offload._family import span_of
from offload._pipelining import PipelineAttachment, PipelineRound
from offload._planned import (
    KEEP,
    MAX_SHARED_SIGNATURES,
    MAX_SIGNATURES,
    REBUILD,
    ActivePlan,
    Profiler,
    RecomputeForward,
    describe,
    load_plan,
    make_plan,
    merged_trace,
    retimed,
    rooted_plan,
    signature_of,
)
from offload._planning import resolve_budget, resolve_hardware
from offload._recipe import (
    ActivationRecipe,
    SharedRebuild,
    WeightCast,
    hold_norm_weights,
    weight_cast,
)
from offload._stats import OffloadStats, StepStats
from offload._verify import RecomputeVerifier
from offload._warnings import (
    WarnOnce,
    _check_compiled_share,
    _check_device,
    _check_foreign_hooks,
    _check_given_plan,
    _warn_foreign_around,
    _warn_keep_covers_nothing,
    _warn_no_module,
    _warn_nvme_dir_ignored,
    _warn_plan_without_kept,
    _warn_traced,
    _warn_uncompiled,
)
from offload.lifecycle import HardwareModel, Placement, Plan, Trace
from offload.lifecycle._blocks import within
from offload.lifecycle._inert import ModuleHook
from offload.lifecycle._module_hooks import outer_calls, register_forward_hooks
from offload.lifecycle._recorder import UnendedCalls, foreign_call
from offload.lifecycle._tensors import (
    NormOutputs,
    ParameterStorages,
    activation_output,
    dtensor_spec,
    is_compiled,
    local_tensor,
    named_modules_stop_at_compiled,
    tensors_in,
    wraps_parameter,
)
from offload.lifecycle._units import parse_bytes
from offload.storage._transfer import close_later, in_gc_pass, start_closer

log = logging.getLogger("offload")

# Profiles of one signature cut short by overlapping steps before it runs in min-memory mode.
_UNFINISHED_PROFILES = 2
# Steps of one signature not profiled because older steps' tensors lived on, before it runs in
# min-memory mode.
_OVERLAP_SKIPS = 8
# Budgeted steps in a row run in min-memory mode for overlapping steps before the manager says
# that budget mode is not planning (NOTE [ Overlapping steps ]).
_UNPLANNED_STEPS = 16
# NOTE [ Structure ]: forward structures profiled per signature, and re-profiles in a row that
# found the structure that had just diverged, before a signature is no longer profiled again.
MAX_STRUCTURES = 4
_FUTILE_REPROFILES = 2
_NEW_STRUCTURE = " [structure ?]"  # the name of a step profiling a structure not yet named
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_autograd = torch._C._autograd
_top_hooks = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_pop_hooks = getattr(_autograd, "_pop_saved_tensors_default_hooks", None)
_push_hooks = getattr(_autograd, "_push_saved_tensors_default_hooks", None)
# The number the next autograd node of this thread will get (see NOTE [ Fill after pack ]).
_sequence_nr = getattr(_autograd, "_get_sequence_nr", None)


class ActivationOffloader:
    """Moves the tensors autograd saves for backward off the device and back, one step at a time.

    Without ``gpu_budget`` the manager runs in min-memory mode: every eligible saved tensor leaves
    the device during forward (bounded by ``max_inflight_bytes`` of copies in flight) and comes
    back ahead of its use in backward (a look-ahead window: see ``max_inflight_bytes``). With a
    budget, the first step of each input signature runs that way while it is recorded; it is then planned
    (:func:`lifecycle.plan`: per alias family keep / cpu / nvme / recompute / rebuild, and when
    each reload starts) and later steps of the signature carry the plan out (NOTE [ Budget mode ] in
    ``offload/_planned.py``). Eligible: on the
    manager's compute device (the parameters' device: a CPU-only run exercises the whole path),
    not a parameter or buffer (decided by storage, so ``weight.t()`` counts), at least
    ``min_offload_bytes``, not saved inside a module listed in ``keep``, not saved while a
    backward runs. Views of one storage are stored once. Gradients are bitwise equal to a run
    without the manager.

    Args:
        model: the module whose forward runs inside the steps.
        gpu_budget: device memory a step may use, everything included (int bytes > 0,
            ``"12GiB"``, or ``"85%"`` of the device's memory); ``None``: min-memory mode.
        tiers: where bytes may go, in spill and fallback order: ``("cpu",)``, ``("nvme",)``,
            ``("cpu", "nvme")``, ``("nvme", "cpu")``.
        cpu_budget: the most bytes this manager keeps in host memory (int or "8GiB"); ``None``
            = half of the available RAM (cgroup aware) divided by the local ranks; 0 = none
            (with ``"nvme"`` in ``tiers``: every record goes there). With ``"nvme"``, the pool
            also holds pinned staging for NVMe copies (2 x ``max_inflight_bytes``) beyond it.
        nvme_dir: an existing directory on a fast disk that this process can create files in
            (checked here); required with ``"nvme"``, ignored without it (a RuntimeWarning
            says so). The manager works in a private subdirectory (0700) with unlinked files
            (0600).
        min_offload_bytes: smaller saved tensors stay where they are.
        plan: a :class:`Plan` (or a path to one) to use instead of profiling: for its signature,
            or for the first signature met when it has none. Its budget is the default
            ``gpu_budget``; a given ``gpu_budget`` below its predicted peak, or ``tiers``
            without one it moves records to, raises ``ValueError``.
        hardware: the :class:`HardwareModel` (or a path to one, read here) to plan with;
            ``None``: measure this machine once with :func:`offload.probe_hardware` (cached on
            disk), here, when a budget is given (on CUDA the probe allocates 2 x 256 MiB on the
            device and pinned, then empties torch's device and pinned caches).
        keep: module names (as in ``named_modules()``) or ``nn.Module`` types whose saved
            tensors never move: each covers what is saved inside that module and its
            descendants (an ``nn.ModuleList`` too, which has no forward). An unknown name
            raises ``ValueError``; a type no module has warns that it keeps nothing.
        max_inflight_bytes: bound on copies out in flight (on a CPU device also those whose
            tensor backward has released already) and on the reload look-ahead; ``None``: copies
            out by 2 x the largest record seen, at least 256 MiB, and the look-ahead by a
            quarter of the bytes the step stored, at least 2 x its largest record and at most
            that in-flight bound.
        on_infeasible: for a signature met after the first whose budget cannot be met:
            ``"raise"`` :class:`BudgetInfeasibleError`, or ``"min_memory"`` (run its steps with
            everything offloaded, warn once, count them in ``stats``). The first signature
            always raises.

    Raises:
        TypeError / ValueError: a bad argument (the message names it and what is accepted).
        BudgetInfeasibleError: (from the step after a signature's profiling step, or from
            ``mgr.plan``) the budget cannot be met; ``.min_feasible_bytes`` says what can.

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 1))
        >>> mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
        >>> with mgr:
        ...     loss = model(torch.randn(256, 512)).sum()
        >>> loss.backward()
        >>> mgr.stats.last.bytes_offloaded_cpu > 0
        True
        >>> mgr.close()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        gpu_budget: int | str | None = None,
        tiers: Iterable[str] = ("cpu",),
        cpu_budget: int | str | None = None,
        nvme_dir: str | os.PathLike[str] | None = None,
        min_offload_bytes: int | str = 1 << 20,
        plan: Any = None,
        hardware: Any = None,
        keep: Iterable[str | type] = (),
        max_inflight_bytes: int | str | None = None,
        on_infeasible: str = "raise",
        _copy_engine: storage.CopyEngine | None = None,
        _room: RoomProbe | None = None,
    ) -> None:
        _check_model(model)
        _check_hardware_arg(hardware)
        tiers = _tiers_arg(tiers)  # checked before the warning below, which reads them
        _check_nvme_dir_type(nvme_dir)
        if nvme_dir is not None and "nvme" not in tiers:
            _warn_nvme_dir_ignored(nvme_dir, tiers)
            nvme_dir = None
        keep_names, keep_types = _keep_arg(keep)
        self.config = OffloadConfig(
            tiers=tiers,
            cpu_budget_bytes=storage.default_cpu_budget_bytes()
            if cpu_budget is None
            else parse_bytes(cpu_budget, name="cpu_budget"),
            nvme_dir=None if nvme_dir is None else os.fspath(nvme_dir),
            min_offload_bytes=parse_bytes(min_offload_bytes, name="min_offload_bytes"),
            keep_names=keep_names,
            keep_types=keep_types,
            max_inflight_bytes=_inflight_arg(max_inflight_bytes),
            on_infeasible=on_infeasible,
        )
        _check_keep_names(model, keep_names)
        _warn_keep_covers_nothing(model, keep_names, keep_types)
        self._model_ref = weakref.ref(model)
        self._cpu_budget_default = cpu_budget is None
        self.device = compute_device(model)
        self._cuda = self.device.type == "cuda"  # read at every pack
        # Budget mode (see NOTE [ Budget mode ] in _planned.py).
        user_plan = load_plan(plan)
        if user_plan is not None:
            user_plan = rooted_plan(user_plan, model)
        budget_given = gpu_budget is not None
        if gpu_budget is None and user_plan is not None:
            gpu_budget = user_plan.gpu_budget_bytes
        # No step fits in no memory: 0 is refused here, not by the plan after the profiling step.
        self._budget_bytes = (
            None
            if gpu_budget is None
            else resolve_budget(gpu_budget, self.device, positive=True, or_none="min-memory mode")
        )
        self._user_plan = user_plan
        if user_plan is not None:
            assert self._budget_bytes is not None
            _check_user_plan(
                user_plan,
                gpu_budget=gpu_budget,
                budget_bytes=self._budget_bytes,
                budget_given=budget_given,
                tiers=self.config.tiers,
                model=model,
            )
            unplanned = set(self._kept_modules(model)) - set(
                user_plan.metadata.get("kept_modules") or ()
            )
            if unplanned:
                _warn_plan_without_kept(unplanned)
        self._hardware_arg = hardware
        # A path is read now: a bad file should fail here, not at the first plan.
        self._hardware: HardwareModel | None = (
            None if hardware is None else resolve_hardware(hardware, self.device)
        )
        if self._hardware is None and self._budget_bytes is not None:
            # Measured now, before training allocates: on CUDA the probe holds 2 x 256 MiB on
            # the device and pinned, and empties the allocators' caches when done. Lazily, at the
            # first plan (the second step's entry, or in a pipeline round with microbatches'
            # activations alive), it emptied them mid-training.
            self._hardware = resolve_hardware(None, self.device)
        self._plans: dict[str, Plan] = {}
        self._active_plans: dict[str, ActivePlan] = {}
        # Signatures run in min-memory mode because their budget cannot be met (on_infeasible=
        # "min_memory"): profiled ones, so at most MAX_SIGNATURES, kept for good; and those
        # struck out because their profiles never finish, the most recent MAX_SIGNATURES, least
        # recent first, each with whether a warning named it (NOTE [ Overlapping steps ]).
        self._infeasible: set[str] = set()
        self._struck: collections.OrderedDict[str, bool] = collections.OrderedDict()
        # Budgeted steps in a row run in min-memory mode for overlapping steps, and the
        # signatures of the first _UNPLANNED_STEPS of them (NOTE [ Overlapping steps ]).
        self._unplanned_run = 0
        self._unplanned_sigs: set[str] = set()
        self._over_budget: set[str | None] = set()
        self._profiler: Profiler | None = None
        self._profiled: dict[str, int] = {}  # signature -> its step in the profiler's trace
        self._merged: Plan | bool | None = None  # past MAX_SIGNATURES (False: could not be made)
        # Signatures that run the merged plan, least recently met first (see _share).
        self._shared: collections.OrderedDict[str, None] = collections.OrderedDict()
        # NOTE [ Refinement ] in _planned.py: signatures planned from their profile whose next
        # step is recorded for its timings, and those recorded and not re-planned yet
        # (signature -> its step in the profiler's trace).
        self._refine_next: set[str] = set()
        self._verifier = RecomputeVerifier()  # NOTE [ Verified recomputation ] in _verify.py
        self._timed: dict[str, int] = {}
        self._profiling: str | None = None  # signature being profiled in the current step
        # Profiles cut short by a step that began before their backward ended, per signature
        # (see _drop_unfinished_profile), and whether this step began so.
        self._unfinished: dict[str, int] = {}
        self._overlapping = False
        self._overlap_skips: dict[str, int] = {}  # steps not profiled for it, per signature
        self._last_signature: str | None = None
        self._active: ActivePlan | None = None
        # NOTE [ Structure ]: per signature, the name of the plan of its current structure
        # (the signature itself for the first), the forward's record keys of each profiled
        # structure, signatures whose next step profiles its structure again, those no longer
        # profiled again, and re-profiles in a row that found the structure that had diverged.
        # Per step: the keys a profiling step packed, where a planned step is in its plan's
        # sequence (-1: not followed), the first key off it, and storages the plan kept.
        self._structure: dict[str, str] = {}
        self._structures: dict[str, dict[tuple[tuple[str, int, int], ...], str]] = {}
        self._reprofile: dict[str, str] = {}  # signature -> the structure that diverged
        self._structure_fixed: set[str] = set()
        self._futile: dict[str, int] = {}
        self._step_keys: list[tuple[str, int, int]] | None = None
        self._cursor = -1
        self._diverged: tuple[int, tuple[str, int, int], Any] | None = None
        self._plan_kept: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        # Signatures running the plan given with plan=, and this step's (or pipeline round's)
        # eligible packs under a plan and how many of their keys the plan knew (see
        # _check_given_plan).
        self._given: set[str] = set()
        self._keys_looked_up = self._keys_matched = 0
        # Module name -> (module, its RecomputeForward), both weakly, and whether the forward it
        # wraps was the module's own attribute (set on the instance: close() puts it back).
        self._recompute: dict[str, tuple[weakref.ref[nn.Module], weakref.ref[Any], bool]] = {}
        # Per step: calls per module and packs outside any module (record keys), and the
        # profiler's numbers of packs returned as plain tensors.
        self._calls: dict[str, int] = {}
        self._signature_begun = False  # this step's (or pipeline round's): see _ForwardPre
        self._outside_packs = 0
        self._kept_seq: dict[int, int] = {}
        # Under a plan that rebuilds: what this step's kept packs returned, by id (a rebuilt
        # record's input may be one of them; see _activation_recipe).
        self._kept_refs: dict[int, weakref.ref[torch.Tensor]] = {}
        # Packs whose copy waits for their op to return, and the autograd sequence number when
        # the last of them was packed (NOTE [ Fill after pack ]).
        self._deferred: list[weakref.ref[_Deferred]] = []
        self._deferred_at = -1
        # Norm outputs and what they were made with (eps is not on their autograd node).
        self._norms = NormOutputs()
        # Per step: the outputs recipes stood for, by id (one rebuild serves all their packs).
        self._rebuilds: dict[int, tuple[weakref.ref[torch.Tensor], int, SharedRebuild]] = {}
        self._engine = _copy_engine
        self._room = _room  # the device's room probe; None: room_probe(device)
        self._tiers: list[storage.Tier] | None = None  # made at the first step
        self._executor: Executor | None = None
        self._done = StepStats()  # steps before the last one
        self._step_index = 0
        self._in_step = False
        # The thread that entered the running step (its forward's): other threads' module calls
        # outside a backward are not the step's (see lifecycle's foreign_call).
        self._step_thread: int | None = None
        self._paused = 0
        self._closed = False
        self._lock = threading.RLock()
        self._hooks_cm: Any = None
        self._hooks_popped = False  # paused() took this step's hook pair off the stack
        self._step_stats: StepStats | None = None
        self._step_added = True
        # [module path, kept, families this call packed itself (offloaded ones, in pack order)]
        self._stack: list[list[Any]] = []
        self._backward_entries = UnendedCalls(self._stack)
        self._warn = WarnOnce()
        self._params = ParameterStorages()
        self._module_handles = self._install_module_hooks(model)
        # See NOTE [ One compiled leaf holding the step ].
        self._compiled_leaves = {
            n for n, m in named_modules_stop_at_compiled(model) if is_compiled(m)
        }
        self._outer_calls = outer_calls(self._module_handles)
        # The root and every module with buffers (whose train / eval mode may decide whether its
        # forward changes them): their modes are part of a budgeted step's signature.
        self._mode_modules = [
            weakref.ref(m)
            for n, m in named_modules_stop_at_compiled(model)
            if n == "" or m._buffers
        ]
        self._pack_fn, self._unpack_fn = self._pack, self._unpack
        self._hidden_from_compile = False
        self._traced = False  # dynamo traced a module hook (see _ForwardPre, _warn_traced)
        # Each step resets the device's peak counters (stats.peak_allocated_bytes is per step);
        # not under a pipeline, whose steps overlap (see PipelineAttachment).
        self._reset_peaks = True
        self._saw_dtensor = False  # a DTensor was saved: tensor parallel, no block recompute
        # A budgeted pipeline stage's schedule round (see NOTE [ Pipelining ]): its forward chunks
        # are steps of the executor but one step of the profile and the plan.
        self._round: PipelineRound | None = None
        self._meter: Any = None  # offload._live.SavedBytes while one counts (tests, benchmarks)
        self._task_ends: dict[int, _StepEnd] = {}  # backward graph task -> its end callback
        # Pipeline stages attached to (close() gives them their own methods back).
        self._attachments: weakref.WeakSet[PipelineAttachment] = weakref.WeakSet()
        # Closed on garbage collection and at exit too; the finalizer holds only the resources.
        self._resources: list[Any] = []
        self._finalizer = weakref.finalize(
            self, _close_resources, self._module_handles, self._resources, self._recompute
        )

    # -- public --------------------------------------------------------------------------------

    @property
    def stats(self) -> OffloadStats:
        """``OffloadStats(last=..., total=...)``: a snapshot; ``last`` is the most recent step
        (its backward counts once it ran).

        Final when read: the read first waits for the file writes still running (NVMe writes
        end on I/O threads, often after backward) and accounts for each that failed, so a
        record counted in ``bytes_offloaded_nvme`` is one whose bytes reached the file (or it
        moved to the tier that took it, with ``fallbacks``). The wait is the disk time of the
        writes in flight, at most ``max_inflight_bytes`` (GPU: the pinned staging bound) at
        disk speed; none without the NVMe tier."""
        with self._lock:
            if self._executor is not None and not self._closed:
                self._executor.settle()
            last = self._snapshot_last()
            if self._executor is not None:
                self._done.add(self._executor.take_late(), median=False)
            total = dataclasses.replace(self._done, _leads=list(self._done._leads))
            if last.steps and not self._step_added:  # added at close already
                total.add(last, median=False)
            # The median once per read: the running totals skip it at each step (two sorts of
            # up to 10,000 lead times per step, a millisecond or two each, were most of a step's
            # fixed cost).
            total.finish()
            return OffloadStats(last=last, total=total)

    @property
    def plan(self) -> Plan | None:
        """The plan of the last step's signature; ``None`` in min-memory mode, before the first
        profiling step's backward ended, or for a signature run in min-memory mode.

        Raises:
            BudgetInfeasibleError: planning the profiled step found the budget cannot be met.
        """
        with self._lock:
            self._plan_profiled()
            if self._last_signature is None:
                return None
            return self._plans.get(self._last_signature)

    @property
    def plans(self) -> dict[str, Plan]:
        """The plans made or given so far, by input signature (a copy). Past ``MAX_SIGNATURES``
        profiled signatures, only the 64 most recent of the later ones (which share one plan)
        are named."""
        with self._lock:
            self._plan_profiled()
            return dict(self._plans)

    def attach(self, target: Any) -> PipelineAttachment:
        """Run a pipeline stage's chunks (``torch.distributed.pipelining``) as steps of this
        manager: each forward chunk of a microbatch is a step whose saved tensors leave the
        device, and each backward chunk (B, I, W) first starts the reloads of its microbatch.

        With ``gpu_budget`` the first schedule round (every microbatch's forward and backward on
        this stage) is profiled in min-memory mode and planned as one step against this stage's
        budget, so each microbatch's wait for its backward decides where its tensors wait; later
        rounds run the plan.

        Args:
            target: a ``PipelineStage``, or a schedule (all of its stages on this rank; one stage
                with ``gpu_budget``). Without a budget the manager may be made on a container
                of the stages' modules; each stage's inputs are left to the stage, which holds
                them until their backward.

        Returns:
            A handle whose ``detach()`` (or ``with`` exit) restores the stages.

        Raises:
            TypeError: ``target`` is neither a stage nor a schedule.
            OffloadError: a stage is already attached; or, with ``gpu_budget``: the target has
                several stages on this rank, the stage's module is not this manager's, or
                another budgeted manager already runs a stage on this device.

        See NOTE [ Pipelining ] in ``offload/_pipelining.py``. Tensor parallel and FSDP2 need no
        attach: build the manager on the already parallelised model.
        """
        with self._lock:
            if self._closed:
                raise OffloadError("this ActivationOffloader is closed; make a new one")
            attachment = PipelineAttachment(self, target)
            self._attachments.add(attachment)
            return attachment

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ActivationOffloader:
        with self._lock:
            if self._closed:
                raise OffloadError("this ActivationOffloader is closed; make a new one")
            if self._in_step:
                if self._step_thread != threading.get_ident():
                    raise OffloadError(
                        "a step of this manager is running on another thread; a manager runs "
                        "one step at a time, entered and run on one thread. Give each thread "
                        "that trains its own model and manager, or run this thread's forward "
                        "outside `with mgr:` (its module calls are not counted as the step's)"
                    )
                raise OffloadError("a step of this manager is already running; steps do not nest")
            if self._traced:  # a compiled call outside steps (evaluation) traced the hooks
                _warn_traced(self._warn)
            self._reinstate_outer_calls()
            rnd = self._round
            continuing = rnd is not None and rnd.steps > 0
            if self._budget_bytes is not None and not continuing:
                # Plans the last profiling step (its backward has ended): may raise
                # BudgetInfeasibleError, before this step has changed any state.
                self._plan_profiled()
            if self._executor is None:
                self._executor = self._make_executor()
            if self._budget_bytes is not None and self._profiler is None:
                # Attached before any forward, so its module hooks run after the manager's (the
                # root's pre-hook begins a profiled step that the recorder's then sees).
                model = self._model_ref()
                if model is not None:
                    self._profiler = Profiler(
                        model,
                        self.device,
                        self._executor.device_saved_bytes,
                        self._kept_modules(model),
                    )
            self._account_last()
            self._step_index += 1
            self._step_stats = self._executor.begin_step(self._step_index)
            self._step_added = False
            # No backward runs while a step begins: an end left here is from a backward that
            # raised before its final callback (it would hold that step's state).
            raised = {end.profiling for end in self._task_ends.values()}
            self._task_ends.clear()
            self._stack.clear()
            self._backward_entries.clear()
            self._deferred.clear()
            if continuing:
                assert rnd is not None
                self._continue_round(rnd)
            else:
                self._calls.clear()
                self._signature_begun = False
                self._outside_packs = 0
                self._kept_seq.clear()
                self._kept_refs.clear()
                self._rebuilds.clear()
                self._active = None
                self._keys_looked_up = self._keys_matched = 0
                self._step_keys, self._cursor, self._diverged = None, -1, None
                self._plan_kept.clear()
                self._drop_unfinished_profile(raised)
            if rnd is not None:
                rnd.steps += 1
            self._refresh_params()
            _check_device(self._warn, self._model_ref(), self.device)
            if self.device.type == "cuda" and self._reset_peaks:
                torch.cuda.reset_peak_memory_stats(self.device)
            if _top_hooks is not None and _top_hooks(False) is not None:
                _warn_foreign_around(self._warn)
            self._maybe_hide_from_compile()
            self._hooks_cm = torch.autograd.graph.saved_tensors_hooks(
                self._pack_fn, self._unpack_fn
            )
            self._hooks_cm.__enter__()
            self._step_thread = threading.get_ident()
            self._in_step = True
            return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        with self._lock:
            if not self._in_step:
                return
            self._in_step = False
            cm, self._hooks_cm = self._hooks_cm, None
            if self._hooks_popped:
                self._hooks_popped = False  # paused() took the pair off the stack already
            else:
                cm.__exit__(None, None, None)
            assert self._executor is not None
            failed = None
            if exc_type is None and self._deferred:
                try:
                    self._flush_deferred()  # backward runs after the step's exit
                except BaseException as e:  # a full tier: the step failed as if its block had
                    failed = exc = e  # raised (its handles live on with the loss)
                    exc_type = type(e)
            if exc_type is not None:
                if isinstance(exc, torch.OutOfMemoryError):
                    _add_note(exc, self._oom_note())
                unsupported = getattr(sys.modules.get("torch._dynamo.exc"), "Unsupported", ())
                if unsupported and isinstance(exc, unsupported):
                    # fullgraph=True on a model compiled after the manager fails at the hooks
                    # before anything runs that _warn_traced could tell from.
                    _add_note(
                        exc,
                        "offload: if the model was compiled after its ActivationOffloader was "
                        "made, dynamo traced the manager's module hooks, which it cannot compile: "
                        "compile first, then make the manager on the compiled model",
                    )
                # The traceback keeps the graph (and every packed handle) alive: release now.
                self._deferred.clear()
                self._executor.fail_step()
                if self._profiling is not None and self._profiler is not None:
                    self._profiler.discard()
                    self._profiling = None
            else:
                self._executor.poll()
                _check_given_plan(
                    self._warn,
                    self._active,
                    self._last_signature in self._given,
                    self._keys_looked_up,
                    self._keys_matched,
                    self._model_ref(),
                )
                _check_compiled_share(self._warn, self._executor, self._compiled_leaves)
                self._end_structure()
                if (
                    self._budget_bytes is not None
                    and not self._signature_begun
                    and self._round is None
                ):
                    _warn_no_module(self._warn, self._outside_packs, self._model_ref())
            self._stack.clear()
            self._backward_entries.clear()
            if self._traced:
                _warn_traced(self._warn)
            if failed is not None:
                raise failed

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Turn the hooks off for a region (``torch.func`` transforms, eval, code to keep).

        On the thread that runs the step (or inside its backward). Entered on another thread
        while a step runs, it changes nothing: saved-tensor hooks are per thread, so that
        thread's saves never reached the step's hooks, and its module calls are not the step's.
        """
        if self._in_step and foreign_call(self._step_thread):
            # Counted, the pause turned the running step's own offloading off.
            yield
            return
        with self._lock:
            # Pop only our own pair: a foreign pair on top shadows ours already (only the
            # innermost fires), and popping it would take its packs away and leave ours on top.
            top = _top_hooks(False) if self._in_step and _top_hooks is not None else None
            ours = top is not None and top[0] is self._pack_fn and _push_hooks is not None
            if ours and _pop_hooks is not None:
                _pop_hooks()
                self._hooks_popped = True
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                # Unless the step ended inside the region (its __exit__ saw the pair gone).
                if ours and self._hooks_popped and _push_hooks is not None:
                    _push_hooks(self._pack_fn, self._unpack_fn)
                    self._hooks_popped = False

    def close(self) -> None:
        """Release every byte this manager holds off the device and its threads. Idempotent.

        Saved tensors of graphs still alive become unusable (their unpack raises).
        """
        with self._lock:
            if self._closed:
                return
            if self._in_step:
                self.__exit__(None, None, None)
            self._closed = True
            for attachment in list(self._attachments):
                attachment.detach()  # the stages run as they are from now on
            self._account_last()
            self._finalizer.detach()
            for h in self._module_handles:
                h.remove()
            for r in self._resources:  # the executor, its tiers, its claim on the host pool
                r.close()
            self._uninstall_recompute()
            if self._profiler is not None:
                self._profiler.close()
                self._profiler = None

    def __repr__(self) -> str:
        mode = "min-memory" if self._budget_bytes is None else f"gpu_budget={self._budget_bytes}"
        state = "closed" if self._closed else f"{self._step_index} steps"
        return (
            f"ActivationOffloader(device={self.device}, {mode}, tiers={self.config.tiers}, {state})"
        )

    # -- setup ---------------------------------------------------------------------------------

    def _make_executor(self) -> Executor:
        cfg = self.config
        inflight = cfg.max_inflight_bytes  # 0: the executor's automatic bound
        # NVMe records pass through pinned staging on their way out and back in: the pool holds
        # room for that (copies out in flight plus the reload window) beyond the host tier's
        # cpu_budget, so a full host tier can still spill.
        staging = 2 * (inflight or 256 << 20) if "nvme" in cfg.tiers else 0
        # The process-wide pool, with room for this manager's own budget beside the others'
        # (pipeline stages on one rank each have a manager); its free slabs go back to the host
        # when the last manager closes. Staging room is claimed for at least 256 MiB each way
        # (the automatic in-flight bound's floor): a record larger than a small explicit bound
        # still goes out, alone.
        share = storage.claim_shared_host_pool(
            cfg.cpu_budget_bytes,
            staging_bytes=max(staging, 2 * (256 << 20)) if staging else 0,
            default=self._cpu_budget_default,
            pin_memory=self.device.type == "cuda",
        )
        pool = share.pool
        tiers: list[storage.Tier] = []
        try:
            for name in cfg.tiers:
                if name == "cpu":
                    tiers.append(storage.HostTier(pool, copy_engine=self._engine))
                else:
                    assert cfg.nvme_dir is not None
                    # File writes can stall for long: a close from a GC pass hands its wait
                    # to the closer, started here, where starting a thread is safe.
                    start_closer()
                    tiers.append(
                        storage.NvmeTier(
                            cfg.nvme_dir,
                            pool=pool,
                            copy_engine=self._engine,
                            # Its I/O threads wait on this device's events: see cuda_device.
                            cuda_device=self.device.index if self._cuda else None,
                        )
                    )
            ex = Executor(
                device=self.device,
                tiers=tiers,
                cpu_budget_bytes=cfg.cpu_budget_bytes,
                max_inflight_bytes=inflight,
                prefetch_bytes=inflight,
                pool=pool,
                staging_bytes=staging,
                room=self._room if self._room is not None else room_probe(self.device),
            )
        except BaseException:
            # Nothing holds these yet (an nvme_dir removed since the manager was made, say):
            # each later step would try again and claim room on the shared pool again.
            _close_all([*tiers, share])
            raise
        self._tiers = tiers
        ex.meter = self._meter
        ex.warn_once = self._warn
        self._resources[:] = [ex, *tiers, share]
        return ex

    def _keeps(self, name: str, mod: nn.Module) -> bool:
        """Whether ``keep=`` names module ``name`` (by name or type), or it is an ``nn.RReLU``:
        in training its op saves its noise tensor before its kernel fills it, and the fill
        leaves the version counter as it was (torch 2.13), so a copy taken at pack holds the
        bytes from before the fill and no check can tell: kept, always (see NOTE [ Fill after
        pack ] in lifecycle's recorder, which names them in a trace's kept modules)."""
        return name in self.config.keep_names or isinstance(
            mod, (*self.config.keep_types, nn.RReLU)
        )

    # NOTE [ Keep covers the module tree ]: a module named in keep= (or of a type in it) keeps
    # everything saved inside it and inside its descendants, decided by name prefix over the
    # module tree (lifecycle's ``within``, as the planner reads a trace's kept modules), not by
    # the module being called: an ``nn.ModuleList`` or ``nn.ModuleDict`` has no forward, so its
    # own hooks never run, and only its children's calls can carry the keep.

    def _kept_modules(self, model: nn.Module) -> list[str]:
        return [
            name for name, mod in named_modules_stop_at_compiled(model) if self._keeps(name, mod)
        ]

    def _install_module_hooks(self, model: nn.Module) -> list[Any]:
        handles = []
        # See NOTE [ Keep covers the module tree ].
        kept = self._kept_modules(model)
        for name, mod in named_modules_stop_at_compiled(model):
            pre = _ForwardPre(self, name, within(name, kept), is_compiled(mod))
            # Around a ``mod.compile()``d call, not in it (NOTE [ Hooks of a compiled call ]).
            # With kwargs: the first module entered at the top level names the step's signature,
            # the root or another (NOTE [ Top-level calls ]).
            handles += register_forward_hooks(mod, pre, _ForwardPost(self), with_kwargs=True)
        return handles

    def _reinstate_outer_calls(self) -> None:
        # Before anything of the step (the profiler's hooks join ours): see NOTE [ Hooks of a
        # compiled call ] for ``mod.compile()`` called again.
        for call in self._outer_calls:
            if not call.reinstate():
                _warn_uncompiled(self._warn, call, self._model_ref())

    def _refresh_params(self) -> None:
        # By storage, refreshed every step: FSDP2 and users swap parameters between steps.
        model = self._model_ref()
        self._params.clear()
        if model is not None:
            self._params.add(model)

    def _maybe_hide_from_compile(self) -> None:
        # Pack and unpack are torch.compiler.disable'd, but only once dynamo is in use: importing
        # it costs seconds, and without it nothing can trace them.
        # (A flag, not ``self._pack_fn is self._pack``: each attribute access makes a new bound
        # method, so that test was never true.)
        if not self._hidden_from_compile and "torch._dynamo" in sys.modules:
            self._hidden_from_compile = True
            self._pack_fn = torch.compiler.disable(self._pack)
            self._unpack_fn = torch.compiler.disable(self._unpack)

    def _snapshot_last(self) -> StepStats:
        s = self._step_stats
        if s is None:
            return StepStats()
        ex = self._executor
        if ex is not None and ex.step is not None and ex.step.stats is s and not self._step_added:
            ex.count_host_allocations()
        if self.device.type == "cuda" and self._step_index and not self._step_added:
            s.peak_allocated_bytes = max(
                s.peak_allocated_bytes, torch.cuda.max_memory_allocated(self.device)
            )
            s.peak_reserved_bytes = max(
                s.peak_reserved_bytes, torch.cuda.max_memory_reserved(self.device)
            )
        s.finish()
        return dataclasses.replace(s, _leads=list(s._leads))

    def _account_last(self) -> None:
        # A step's counters grow until its backward ends, which may be after its block; they are
        # folded into the running total when the next step starts (or at close). A count moved
        # after that (a write that failed late) comes in the executor's ``late``.
        ex = self._executor
        if self._step_stats is not None and not self._step_added:
            with ex.lock if ex is not None else contextlib.nullcontext():
                self._done.add(self._snapshot_last(), median=False)  # see stats
                self._step_added = True
                if ex is not None:
                    ex.count_step()
        if ex is not None:
            self._done.add(ex.take_late(), median=False)

    # -- budget mode (NOTE [ Budget mode ] in _planned.py) -------------------------------------

    def _continue_round(self, rnd: PipelineRound) -> None:
        """A later forward chunk of a pipeline round: record keys, the plan and the profile
        carry on from the round's first chunk (NOTE [ Pipelining ])."""
        ex, stats, active = self._executor, self._step_stats, self._active
        if active is None or ex is None or ex.step is None or stats is None:
            return
        ex.step.windowed = False
        # One trigger table for the round: a family's planned reload may start at an event of
        # another microbatch.
        ex.step.triggers = rnd.triggers
        stats.predicted_peak_bytes = active.plan.predicted_peak_bytes
        stats.predicted_step_s = active.plan.predicted_step_s

    def _end_round(self) -> None:
        """The round's last backward chunk ended: its profile (if any) ends with it."""
        with self._lock:
            if self._profiling is not None:
                self._profile_ended(self._profiling)
            self._round = None

    def _abandon_round(self) -> None:
        """A chunk of the round raised: drop its partial profile; the next round starts over."""
        with self._lock:
            if self._profiling is not None and self._profiler is not None:
                self._profiler.discard()
            self._profiling = None
            self._round = None

    def _hold_stage_inputs(self, args: Any, kwargs: Any) -> None:
        """From a pipeline attachment, before a stage's module runs a forward chunk: the stage
        holds each microbatch's inputs until its backward (its forward cache), so copying them
        out would free nothing. They are kept, and are no activations to plan."""
        if not self._in_step or self._paused:
            return
        held = list(tensors_in((args, kwargs)))
        self._params.add_tensors(held)
        if self._profiling is not None and self._profiler is not None:
            self._profiler.recorder.add_held(held)

    def _modes(self) -> str:
        """The train / eval modes of the root and of the modules with buffers, for a step's
        signature: "" when all train, else which. A plan profiled in eval mode, where BatchNorm
        leaves its running statistics alone, may recompute it; in train mode that would update
        them twice."""
        modes = [m.training for m in (ref() for ref in self._mode_modules) if m is not None]
        if all(modes):
            return ""
        if not any(modes):
            return " (eval)"
        return " (train: " + "".join("1" if t else "0" for t in modes) + ")"

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

    def _begin_signature(self, args: Any, kwargs: Any = None, module: str = "") -> None:
        """At the step's first top-level forward (NOTE [ Top-level calls ]): choose how this
        step runs."""
        sig = signature_of(args, kwargs) + self._modes()
        if module:
            sig = f"{module}({sig})"
        if self._round is not None:
            sig += self._round.label
        elif self._begin_structure(sig):
            return  # its structure is profiled again (NOTE [ Structure ])
        else:
            sig = self._structure.get(sig, sig)
        self._last_signature = sig
        ex, stats = self._executor, self._step_stats
        assert ex is not None and stats is not None
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
            self._given.add(sig)
        if sig in self._shared:
            self._shared.move_to_end(sig)
        if plan is None and sig not in self._profiled and len(self._profiled) >= MAX_SIGNATURES:
            plan = self._merged_plan()
            if plan is not None:
                self._share(sig, plan)
        if plan is not None:
            self._end_unplanned_run()
            active = self._active_plans.get(sig)
            if active is None or active.plan is not plan:
                # One lookup table per plan: past MAX_SIGNATURES every new signature shares the
                # merged plan's.
                active = next(
                    (a for a in self._active_plans.values() if a.plan is plan), None
                ) or ActivePlan(plan)
                self._active_plans[sig] = active
            self._active = active
            if ex.step is not None:
                ex.step.windowed = False  # see _StepState.windowed
                if self._round is not None:
                    self._round.triggers = ex.step.triggers
            self._install_recompute(active)
            if self._round is None and sig not in self._given and sig not in self._shared:
                self._cursor = 0  # followed through the plan's sequence (NOTE [ Structure ])
            stats.predicted_peak_bytes = plan.predicted_peak_bytes
            stats.predicted_step_s = plan.predicted_step_s
            if (
                sig in self._refine_next
                and self._profiler is not None
                and not self._overlapping
                and torch.is_grad_enabled()
                and not ex.capture.capturing()  # its packs pass through: no plan's timings
            ):
                # The first planned step of a profiled signature: recorded for its timings.
                self._refine_next.discard(sig)
                self._profiler.begin(self._step_thread)
                self._profiling = sig
            return
        if sig in self._infeasible:
            # DESIGN.md "Budget": such a step runs in min-memory mode, warned, and counted.
            stats.min_memory_steps = 1
            return
        named = self._struck.get(sig)
        if named is not None:  # NOTE [ Overlapping steps ]
            self._struck.move_to_end(sig)
            stats.min_memory_steps = 1
            if not named:
                self._count_unplanned(sig)
            return
        if sig in self._profiled:
            return  # min-memory: its profile is not planned yet
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
                f"signature {sig} was not profiled in {_OVERLAP_SKIPS} steps in a row: an older "
                "step's saved tensors were still alive at each start (a graph kept without its "
                "backward, or retain_graph=True); it runs in min-memory mode. Free old graphs "
                "before the next step, or plan offline and pass plan=",
            )
            return
        self._profiler.begin(self._step_thread)
        self._profiling = sig
        if self._round is None:
            self._step_keys = []  # its structure (NOTE [ Structure ])

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

    def _begin_structure(self, sig: str) -> bool:
        """At a step's start: True when it profiles ``sig``'s structure again (NOTE
        [ Structure ])."""
        if (
            sig not in self._reprofile
            or self._profiler is None
            or self._overlapping
            or not torch.is_grad_enabled()
        ):
            return False
        self._last_signature = self._profiling = sig + _NEW_STRUCTURE
        self._profiler.begin(self._step_thread)
        self._step_keys = []
        return True

    def _follow(self, key: tuple[str, int, int]) -> None:
        """A pack of a planned step: is it the next key of its plan's sequence? (NOTE
        [ Structure ])"""
        active = self._active
        if active is None or (key[0], key[1]) in active.recompute_calls:
            return
        seq, at = active.sequence, self._cursor
        if at < len(seq) and seq[at] == key:
            self._cursor = at + 1
            return
        if at < len(seq):
            self._diverged = (at, key, seq[at])
        # else: packs past the plan's whole sequence (a second forward in the block) shift no
        # key of it: unknown keys, unplanned as they are.
        self._cursor = -1

    def _kept_by_plan(self, local: torch.Tensor) -> bool:
        st = local.untyped_storage()
        ref = self._plan_kept.get(st._cdata)
        return ref is not None and ref() is st

    def _end_structure(self) -> None:
        """At a step's end (NOTE [ Structure ]): name the structure a profiling step packed;
        a planned step that left its plan's sequence has its signature profiled again."""
        self._close_structure(self._profiling)
        if self._diverged is None:
            return
        at, got, expected = self._diverged
        sig = self._last_signature
        base = next((b for b, n in self._structure.items() if n == sig), sig)
        assert sig is not None and base is not None
        if self._profiling == sig:
            # Its first planned step, timed for refinement: not its structure's times.
            self._drop_profile(sig)
            self._refine_next.add(sig)
        self._warn(
            f"structure:{base}",
            f"a planned step of signature {base} left its plan at pack {at} (saved key {got}, "
            f"the plan's next: {expected}): the forward's structure changed while its "
            "signature did not. Likely causes: a float argument that switches a branch (a float "
            "counts by its type only), a module attribute or global flag set between steps, or "
            "data-dependent control flow. The rest of that step went unplanned to the first "
            "tier with room (stats.unplanned_records), and the signature's next step profiles "
            "its structure again. Pass such a switch to the model as a bool, int or str "
            "argument (part of the signature), or keep= the module whose saves vary",
        )
        if base not in self._structure_fixed:
            self._reprofile[base] = sig

    def _close_structure(self, name: str | None) -> None:
        """A profiling step's forward or profile ended, whichever came first: its keys so far
        are its structure."""
        keys, self._step_keys = self._step_keys, None
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
            for end in self._task_ends.values():
                if end.profiling == name:
                    end.profiling = new
            return
        self._drop_profile(name)
        if known is None:
            self._structure_fixed.add(base)
            self._warn(
                f"structures:{base}",
                f"signature {base} showed more than {MAX_STRUCTURES} forward structures; it is "
                "no longer profiled again, and steps off their plan run their rest unplanned. "
                "Pass what switches the structure to the model as a bool, int or str argument",
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
                f"signature {base} changes its forward's structure from step to step: "
                f"{futile} re-profiles in a row found the structure that had just diverged. It "
                "is no longer profiled again; steps off their plan run their rest unplanned "
                "(slower, and not planned for the budget). Pass what switches the structure to "
                "the model as a bool, int or str argument",
            )

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
        while len(self._shared) > MAX_SHARED_SIGNATURES:
            old, _ = self._shared.popitem(last=False)
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

    def _drop_unfinished_profile(self, raised: Container[str | None] = ()) -> None:
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
        ex = self._executor
        self._overlapping = self._overlapping and ex is not None and ex.live_families() > 0
        sig = self._profiling
        if sig is None:
            return
        self._profiling = None
        if self._profiler is not None:
            self._profiler.discard()
        if sig in raised:
            self._overlapping = ex is not None and ex.live_families() > 0
            return
        self._overlapping = True
        if sig in self._plans:
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
            f"a step of signature {sig} began before the backward of the step being profiled "
            "ended (forwards run before their backwards, a forward never run backward, or a "
            "backward that raised), "
            f"{_UNFINISHED_PROFILES} times; gpu_budget profiles one step with its backward, so "
            "this signature runs in min-memory mode. Run each backward before the next forward, "
            "or plan offline (offload.profile, offload.plan) and pass plan=",
        )

    def _count_toward_min_memory(
        self, counts: dict[str, int], sig: str, limit: int, key: str, why: str
    ) -> None:
        """One more strike for ``sig`` in ``counts``; at ``limit`` it runs in min-memory mode
        from now on, and ``why`` is said (once per ``key``)."""
        counts[sig] = counts.pop(sig, 0) + 1  # the most recently struck last
        if counts[sig] >= limit:
            self._struck[sig] = key not in self._warn  # named by the warning below
            self._warn(key, why)
            self._unfinished.pop(sig, None)
            self._overlap_skips.pop(sig, None)
            if len(self._struck) > MAX_SIGNATURES:
                self._struck.popitem(last=False)  # met again, it starts fresh
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
        msg = (
            f"gpu_budget has not been planned for in {_UNPLANNED_STEPS} steps in a row: each "
            "ran in min-memory mode (everything eligible offloaded: slower than a plan) because "
            "the profiles of their signatures were cut short by steps that began before the "
            "profiled step's backward ended. Forwards run before their backwards (gradient "
            "accumulation with every microbatch's forward first) never let a profile finish: "
            "give each microbatch's forward its own `with mgr:` block and run its backward "
            "before the next microbatch's forward (the gradients accumulate in .grad just the "
            "same; README: gradient accumulation); for a pipeline schedule use "
            "mgr.attach(stage), which profiles a whole round"
        )
        if len(sigs) > 1:
            msg += (
                f". Those steps also came with {len(sigs)} input signatures ({sigs[0]!r}, "
                f"{sigs[1]!r}, ...): a plain argument of the root that changes from step to "
                "step (an int step counter) makes each step a signature of its own, profiled "
                "afresh; pass it as a float (counted by its type only) or a tensor (by its dtype "
                "and shape), or keep it out of the root module's call"
            )
        self._warn("unplanned", msg)

    def _end_unplanned_run(self) -> None:
        self._unplanned_run = 0
        self._unplanned_sigs.clear()

    def _profile_ended(self, sig: str) -> None:
        """The profiling (or timing) step's backward ended (autograd's final callback)."""
        if self._profiler is None or self._profiling != sig:
            return
        # Its backward ran inside the step: the structure is named first, while the step is
        # still being recorded, so that a re-profile finding a known one is discarded (NOTE
        # [ Structure ]); ended first, each such step stayed in the recorder for good.
        self._close_structure(sig)
        name = self._profiling  # a new structure's name, or None: dropped
        if name is None:
            return
        step = self._profiler.end()
        if name in self._plans:
            self._timed[name] = step  # NOTE [ Refinement ]
        else:
            self._profiled[name] = step
            self._end_unplanned_run()  # see NOTE [ Overlapping steps ]
        self._profiling = None

    def _merged_plan(self) -> Plan | None:
        """Past ``MAX_SIGNATURES`` profiled signatures: one plan for every new one, from per-key
        byte maxima (NOTE [ Budget mode ]); made once. None when it cannot be made."""
        if self._merged is not None:
            return self._merged if isinstance(self._merged, Plan) else None
        planned = [s for s in self._profiled if s in self._plans]
        if not planned or self._profiler is None or self._profiler.recording:
            return None
        trace, step, group = merged_trace(
            self._profiler.trace(), [self._profiled[s] for s in planned]
        )
        try:
            plan = self._make_plan(trace, step, f"<per-key maxima of {len(group)} signatures>")
        except lifecycle.BudgetInfeasibleError as e:
            self._merged = False
            self._warn(
                "signatures",
                f"more than {MAX_SIGNATURES} input signatures, and the plan of their per-key byte "
                f"maxima cannot meet gpu_budget ({e}): new signatures run in min-memory mode",
            )
            return None
        self._merged = plan
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
        if not self._timed and all(
            s in self._plans or s in self._infeasible for s in self._profiled
        ):
            return  # nothing new: do not rebuild the trace (every step comes here)
        trace = self._profiler.trace()
        self._refine(trace)
        for sig, step in list(self._profiled.items()):
            if sig in self._plans or sig in self._infeasible:
                continue
            first = not (self._plans or self._infeasible or self._struck)
            try:
                plan = self._make_plan(trace, step, sig)
            except lifecycle.BudgetInfeasibleError as e:
                if first or self.config.on_infeasible == "raise":
                    # Profiled again if the user lowers their batch and tries once more.
                    del self._profiled[sig]
                    raise from_infeasible(e) from None
                self._infeasible.add(sig)
                self._warn(
                    f"infeasible:{sig}",
                    f"signature {sig} cannot meet gpu_budget ({e}); its steps run in min-memory "
                    "mode (on_infeasible='min_memory')",
                )
                continue
            self._plans[sig] = plan
            if self._user_plan is None or sig != self._user_plan.signature:
                self._refine_next.add(sig)
            log.info("%s", describe(plan))

    def _verifier_found(self) -> None:
        """Between steps: warn about modules found to recompute other values than their forward
        saved, and drop the profiled signatures' plans that recompute them (made again by the
        caller, less them; NOTE [ Verified recomputation ] in _verify.py)."""
        found = self._verifier.settle()
        for name in found:
            self._warn(
                f"recompute-differs:{name}",
                f"module {name!r}, which the plan recomputed (non-reentrant checkpoint), "
                "recomputed other values than its forward saved (a torch.Generator of its own, "
                "or state that changed since its forward): that step used the values its "
                "forward saved, so its gradients are exact, and no plan of this manager "
                "recomputes it again. Signatures planned from their profile are planned again "
                "without it; others run it as it is",
            )
        if not found:
            return
        for sig, plan in list(self._plans.items()):
            if sig not in self._profiled or sig in self._given:
                continue
            if any(m in self._verifier.differing for m, _ in plan.recompute_calls):
                del self._plans[sig]
                self._active_plans.pop(sig, None)
                self._timed.pop(sig, None)
                self._refine_next.discard(sig)

    def _refine(self, trace: Trace) -> None:
        """Re-plan, once, each signature whose first planned step was timed (NOTE
        [ Refinement ])."""
        timed, self._timed = self._timed, {}
        for sig, timing in timed.items():
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
            recompute=not self._saw_dtensor,
        )

    def _hardware_model(self) -> HardwareModel:
        if self._hardware is None:
            self._hardware = resolve_hardware(self._hardware_arg, self.device)
        return self._hardware

    def _install_recompute(self, active: ActivePlan) -> None:
        model = self._model_ref()
        if model is None or not active.recompute_modules:
            return
        # torch.utils.checkpoint.checkpoint imports torch._dynamo at its first call (its
        # disable-dynamo wrapper). That import leaves reference cycles through the frames it
        # runs under, up to the model's forward; run inside the first planned step, which the
        # recorder times with the cyclic GC off (NOTE [ Refinement ]), they held the forward's
        # locals (saved tensors autograd had released) until the step ended. Here, before the
        # recorder begins, the frames are the step's caller's and the root call's.
        import torch._dynamo  # noqa: F401

        modules = dict(named_modules_stop_at_compiled(model))
        for name in active.recompute_modules - self._recompute.keys():
            mod = modules.get(name)
            if mod is None:
                continue
            own = "forward" in mod.__dict__  # ``module.forward = ...`` by the user (or a tool)
            wrapper = RecomputeForward(self, name, mod.forward)
            mod.forward = wrapper  # type: ignore[method-assign]
            # Weakly (the finalizer holds this dict): the model's lifetime is its owner's.
            self._recompute[name] = (weakref.ref(mod), weakref.ref(wrapper), own)

    def _checkpoint_context(self, name: str, module: Any) -> Callable[[], tuple[Any, Any]]:
        """Called by a RecomputeForward about to checkpoint a call of ``name`` (``module``):
        checkpoint's ``context_fn`` (NOTE [ Verified recomputation ] in _verify.py)."""
        return self._verifier.context_fn(self._last_signature or "", name, module)

    def _uninstall_recompute(self) -> None:
        _uninstall_forwards(self._recompute)

    def _recompute_this(self, name: str) -> tuple[str, int] | None:
        """Called by a RecomputeForward: the (module, call) to checkpoint now, or None."""
        active = self._active
        if active is None or not self._in_step or not self._stack or not torch.is_grad_enabled():
            return None
        if name in self._verifier.differing:
            return None  # see NOTE [ Verified recomputation ] in _verify.py
        if foreign_call(self._step_thread):
            return None  # another thread's call: as it is (no stack entry of its own is on top)
        if _current_graph_task_id is not None and _current_graph_task_id() != -1:
            return None  # a recomputation or double backward runs it: as it is
        if self._diverged is not None:
            return None  # off the plan's sequence (NOTE [ Structure ])
        top = self._stack[-1]
        call = (top[0], top[3])
        if top[0] != name or call not in active.recompute_calls:
            return None
        if self._step_stats is not None:
            self._step_stats.bytes_recomputed = active.recompute_bytes
        return call

    # -- hooks ---------------------------------------------------------------------------------

    def _oom_note(self) -> str:
        """What an out-of-memory error inside a step should say about offload (DESIGN.md:
        "Never newly broken")."""
        active = self._active
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

    def _held_clock(self) -> Any:
        """During a CPU profiling step: the clock that offload's own copies are taken out of."""
        if self._profiling is None or self._profiler is None:
            return None
        return self._profiler.compute_clock

    def _next_key(self) -> tuple[str, int, int]:
        # The record key, as lifecycle.Recorder numbers it: every pack counts (parameters, small
        # and kept ones too), in the innermost running module's call.
        if self._stack:
            top = self._stack[-1]
            ordinal = top[4]
            top[4] = ordinal + 1
            return (top[0], top[3], ordinal)
        ordinal = self._outside_packs
        self._outside_packs = ordinal + 1
        return (_OUTSIDE, 0, ordinal)

    def _keep(self, t: torch.Tensor, stats: StepStats) -> torch.Tensor:
        stats.records_kept += 1
        d = _kept(t)
        meter = self._meter
        if meter is not None:
            local = local_tensor(t)
            if local.device == self.device and _has_storage(local):
                st = local.untyped_storage()
                if not self._params.holds(local, st) and (local is t or not wraps_parameter(t)):
                    meter.watch(st)
        if self._profiling is not None and self._profiler is not None:
            seq = self._profiler.recorder.record_pack(t)
            if seq >= 0:
                self._kept_seq[id(d)] = seq
        active = self._active
        if active is not None and active.rebuilds:
            self._kept_refs[id(d)] = weakref.ref(d)
        return d

    def _pack(self, t: torch.Tensor) -> Any:
        ex = self._executor
        stats = self._step_stats
        if ex is None or stats is None or self._paused:
            return _kept(t)
        key = self._next_key()
        stats.records += 1
        if _current_graph_task_id is not None and _current_graph_task_id() != -1:
            return self._keep(t, stats)  # packed by a backward (recomputation, double backward)
        if self._step_keys is not None:
            self._step_keys.append(key)  # a profiling step's structure (NOTE [ Structure ])
        elif self._cursor >= 0:
            self._follow(key)
        if ex.capture.capturing():  # see NOTE [ No query while capturing ] in _device.py
            self._warn("graphs", "CUDA graph capture: saved tensors are left in place")
            return self._keep(t, stats)
        if self._deferred and _sequence_nr is not None and _sequence_nr() != self._deferred_at:
            self._flush_deferred()  # an op that made a node since: theirs has returned
        dtensor = None
        local = t
        if type(t) is not torch.Tensor and hasattr(t, "_local_tensor"):  # a DTensor: its shard
            dtensor = (t.device_mesh, t.placements, t.shape, t.stride())  # type: ignore[attr-defined]
            self._saw_dtensor = True
        if type(t) is not torch.Tensor:
            local = local_tensor(t)
            if type(local) is not torch.Tensor and not _has_storage(local):
                # A wrapper subclass without bytes of its own: nothing to copy. (One with bytes
                # comes back as a plain tensor: so it does through any saved-tensor hooks,
                # torch's save_on_cpu or an identity pair included.)
                self._warn(
                    f"subclass:{type(local).__name__}",
                    f"saved tensors of type {type(local).__name__} have no storage to copy; "
                    "they stay where they are",
                )
                return self._keep(t, stats)
        module, kept = (
            (self._stack[-1][0], self._stack[-1][1]) if self._stack else (_OUTSIDE, False)
        )
        if (
            kept
            or local.device != self.device
            or local.numel() * local.element_size() < self.config.min_offload_bytes
            or local.numel() == 0
            or local.layout is not torch.strided  # sparse: no one storage to copy
            or local.is_nested
            or self._params.holds(local, local.untyped_storage())
            or (dtensor is not None and wraps_parameter(t))
        ):
            return self._keep(t, stats)
        active = self._active
        recipe = weight_cast(t, self._params)
        if recipe is not None:
            # NOTE [ Weight casts ] in _recipe.py: cast again at unpack, never stored or copied.
            stats.records_rebuilt += 1
            stats.bytes_rebuilt += recipe.nbytes
            if self._profiling is not None and self._profiler is not None:
                recipe.seq = self._profiler.recorder.record_pack(t, parameter=True)
            return recipe
        if active is None:
            # Min-memory mode, a budget's profiling step included (NOTE [ Activation recipes ]).
            rebuilt = self._activation_recipe(t, ex, stats)
            if rebuilt is not None:
                return rebuilt
        tier = None
        if active is not None:
            tier = active.action.get(key)
            if key[0] != _OUTSIDE:  # the loss's packs match whatever the model is
                self._keys_looked_up += 1
                if tier is not None or (key[0], key[1]) in active.recompute_calls:
                    self._keys_matched += 1
            if self._diverged is not None:
                # Off the plan's sequence: the rest of the step is not the plan's to place
                # (NOTE [ Structure ]), save a storage it kept, which stays on the device anyway.
                tier = KEEP if self._kept_by_plan(local) else None
            elif tier is not None and _extent(local) > active.limit[key]:
                tier = None  # larger than planned (DESIGN.md: Keys and signatures)
            if tier == REBUILD:
                # See NOTE [ Activation recipes ] in _recipe.py; if its conditions fail, the
                # record is not the plan's to place: to the first tier with room.
                rebuilt = self._activation_recipe(t, ex, stats, key)
                if rebuilt is not None:
                    return rebuilt
                tier = None
            if (
                tier is None
                and self._diverged is None
                and (key[0], key[1]) in active.recompute_calls
            ):
                # Non-reentrant checkpoint saves the recomputed call's inputs itself, as packs
                # of that call: kept, as the planner assumed (its inputs stay on the device).
                tier = KEEP
            if tier is None:
                stats.unplanned_records += 1  # to the first tier with room
            elif tier == KEEP:
                if self._cursor >= 0:
                    st = local.untyped_storage()
                    self._plan_kept[st._cdata] = weakref.ref(st)
                return self._keep(t, stats)
        # Reloaded when the backward of the module that saved it starts (and the look-ahead
        # window). Not a record the plan placed: that one reloads at its planned trigger, or at
        # its unpack, since a module's backward starts before its children's, and a parent
        # running ops of its own (the root, a block's residual) would bring it back before the
        # plan's kept tensors are freed. An unplanned record has no trigger.
        own = self._stack[-1][2] if self._stack and (active is None or tier is None) else None
        if not t.requires_grad:
            # NOTE [ Fill after pack ]: no gradient, so possibly an op's buffer that the op
            # itself fills after saving it: copied once the op has returned.
            d = _Deferred(t, local, module, dtensor, tier, key, own)
            d.stream = ex.streams.current()  # the op's stream: its fill is queued there
            self._deferred.append(weakref.ref(d))
            if _sequence_nr is not None:
                self._deferred_at = _sequence_nr()
            if self._profiling is not None and self._profiler is not None:
                d.seq = self._profiler.recorder.record_pack(t)
            return d
        member = self._offload(ex, local, module, dtensor, tier, key, own, -1)
        if self._profiling is not None and self._profiler is not None:
            member.seq = self._profiler.recorder.record_pack(
                t, rebuild_from=self._rebuild_link(t, ex)
            )
        return member

    def _offload(
        self,
        ex: Executor,
        local: torch.Tensor,
        module: str,
        dtensor: Any,
        tier: str | None,
        key: tuple[str, int, int],
        own: list[Any] | None,
        seq: int,
        stream: Any = None,
    ) -> _Member:
        """Store ``local`` (a pack's tensor, or its DTensor's shard) and return its handle;
        ``stream``: the stream its op ran on, when not the current one (a deferred pack)."""
        held = self._held_clock()
        started = time.perf_counter() if held is not None else 0.0
        member = ex.offload(local, module, dtensor, tier, stream)
        if held is not None:
            held.held_s += time.perf_counter() - started
        member.key, member.seq = key, seq
        fam = member.family
        active = self._active
        if active is not None and fam.members == 1:
            trigger = active.trigger.get(key)
            if trigger is not None and ex.step is not None:
                ex.step.triggers.setdefault(trigger, []).append(fam)
        if own is not None and (not own or own[-1] is not fam):
            own.append(fam)
        return member

    def _flush_deferred(self) -> None:
        """Store the deferred packs (NOTE [ Fill after pack ]): their ops have returned."""
        ex = self._executor
        if ex is not None and ex.capture.capturing():
            return  # no copy inside a CUDA graph: after the capture, or kept at unpack
        pending, self._deferred = self._deferred, []
        for ref in pending:
            d = ref()
            if d is None or d.tensor is None or ex is None or ex.step is None:
                continue  # its graph is gone already, or the step failed
            t, local = d.tensor, d.local
            assert local is not None
            if t._version != d.version:
                # Changed in place before its copy: autograd's check, as for any saved tensor.
                d.error = modified_after_save(f"a tensor saved by {d.module}", t, d.version)
                continue
            d.member = self._offload(
                ex, local, d.module, d.dtensor, d.tier, d.key, d.own, d.seq, d.stream
            )
            d.tensor = d.local = None
            d.own = d.stream = None

    def _keep_deferred(self) -> None:
        """Backward has begun: a pack still waiting stays where it is (copied now, it would
        come back at once)."""
        pending, self._deferred = self._deferred, []
        stats = self._step_stats
        for ref in pending:
            d = ref()
            if d is not None and d.tensor is not None and stats is not None:
                stats.records_kept += 1

    def _activation_recipe(
        self,
        t: torch.Tensor,
        ex: Executor,
        stats: StepStats,
        key: tuple[str, int, int] | None = None,
    ) -> ActivationRecipe | None:
        """An :class:`ActivationRecipe` for ``t`` if it is a GELU / SiLU / LayerNorm / RMSNorm
        output (or autocast's cast of a norm output) whose input this step offloaded, or (``key``:
        the plan rebuilds it) kept, else None (NOTE [ Activation recipes ] in _recipe.py)."""
        found = activation_output(t, self._norms)
        if found is None:
            return None
        parent, out = found.packed, found.out
        if type(parent) is _Deferred:  # an input without gradient, stored by now (this pack's
            parent = parent.member  # op came after its own)
        if isinstance(parent, _Member):
            if (
                parent.executor is not ex
                or not _same_layout(parent, out)
                or _member_spec(parent) != found.spec
            ):
                return None
            if self._profiling is not None and key is None and not _whole_input(parent, out):
                return None  # stored: a trace links only an input stored whole (_rebuild_link)
            held: Any = ex.share(parent)
            if held is None:
                return None
            link = parent.seq
        elif key is not None and self._kept_input(parent, out, found.spec):
            held = parent
            link = self._kept_seq.get(id(parent), -1)
        else:
            return None
        step = ex.step if key is not None else None  # whose trigger table the key is in
        shared = self._shared_rebuild(found.saved)
        recipe = ActivationRecipe(found, held, key=key, step=step, shared=shared)
        stats.records_rebuilt += 1
        if shared.members == 1:  # the output's bytes, once however many packs save it
            stats.bytes_rebuilt += recipe.nbytes
        if self._profiling is not None and self._profiler is not None:
            # A planned step timed for refinement (NOTE [ Refinement ] in _planned.py).
            recipe.seq = self._profiler.recorder.record_pack(t, rebuild_from=link)
        if key is None and self._stack:
            # Min-memory mode: the module saving the output now needs the input first in
            # backward: its backward trigger starts the input's reload (else the rebuild would
            # stall on it). Under a plan the input's planned trigger does.
            own = self._stack[-1][2]
            if held.family not in own:
                own.append(held.family)
        return recipe

    def _shared_rebuild(self, saved: torch.Tensor) -> SharedRebuild:
        """The rebuild of ``saved`` (an output another pack of this step already stored a
        recipe for, unchanged since), joined; else a new one."""
        got = self._rebuilds.get(id(saved))
        if got is not None and got[0]() is saved and got[1] == saved._version:
            got[2].members += 1
            return got[2]
        shared = SharedRebuild()
        self._rebuilds[id(saved)] = (weakref.ref(saved), saved._version, shared)
        return shared

    def _kept_input(self, parent: Any, out: torch.Tensor, spec: Any) -> bool:
        """Whether ``parent`` (what an activation's pack of its input returned) is a tensor this
        manager kept in this step, not a parameter, laid out as the activation's output ``out``
        (a DTensor's shard). ``spec``: ``(mesh, placements)`` where the activation ran on
        DTensors, whose input must then be a DTensor alike (NOTE [ DTensor activation
        recipes ]), else None (a plain input)."""
        if spec is None:
            if type(parent) is not torch.Tensor:
                return False
            local = parent
        elif dtensor_spec(parent) != spec:
            return False
        else:
            local = parent._local_tensor
            if type(local) is not torch.Tensor:
                return False
        ref = self._kept_refs.get(id(parent))
        if ref is None or ref() is not parent:
            return False  # packed by other hooks (only the innermost pair fires)
        return (
            local.device == out.device
            and local.dtype == out.dtype
            and local.shape == out.shape
            and local.stride() == out.stride()
            and not self._params.holds(local, local.untyped_storage())
        )

    def _rebuild_link(self, t: torch.Tensor, ex: Executor) -> int:
        """The profiler's ``seq`` of the record ``t`` can be rebuilt from
        (``TensorRecord.rebuild_from``), or -1: ``t`` is an output :func:`activation_output`
        recognises whose input this recorded step offloaded whole, as ``lifecycle.Recorder``
        links them (NOTE [ Activation recipes ] in _recipe.py)."""
        found = activation_output(t, self._norms)
        if found is None:
            return -1
        parent, out = found.packed, found.out
        if type(parent) is _Deferred:
            parent = parent.member
        if (
            not isinstance(parent, _Member)
            or parent.executor is not ex
            or not _same_layout(parent, out)
            or _member_spec(parent) != found.spec
            or not _whole_input(parent, out)
        ):
            return -1
        return parent.seq

    def _unpack(self, packed: Any) -> torch.Tensor:
        task = _current_graph_task_id() if _current_graph_task_id is not None else 0
        # Unpack also runs outside backward (``grad_fn._saved_self``), where queue_callback
        # raises "Final callbacks can only be installed during backward pass".
        if task != -1:
            end = self._task_ends.get(task)
            if end is None:
                ex = self._executor
                current = ex.step if ex is not None else None
                # The end of this backward ends a step's clock (and the current step's profile;
                # a pipeline round's profile ends with the round instead).
                end = self._task_ends[task] = _StepEnd(
                    self,
                    task,
                    current,
                    time.perf_counter,
                    self._profiling if self._round is None else None,
                )
                torch.autograd.Variable._execution_engine.queue_callback(end)
            if end.step is None:
                # Whose backward this is: the step that packed the first offloaded tensor it
                # unpacks (with two forwards before their backwards, pipelining or
                # accumulation, not the current one). Kept tensors do not say.
                fam = getattr(packed, "family", None)
                if fam is not None and fam.step_ref is not None:
                    end.step = fam.step_ref()
        if type(packed) is not _Member:  # an offloaded tensor, the common case, goes on below
            if type(packed) is _Deferred:
                if self._deferred and packed.tensor is not None:
                    # The backward of this step's last ops has begun (not an earlier step's,
                    # run inside this one: its packs were stored at its exit).
                    self._keep_deferred()
                if packed.seq >= 0 and self._profiler is not None:
                    self._profiler.recorder.record_unpack(packed.seq, held=packed)
                if packed.error is not None:
                    raise packed.error
                if packed.member is None:
                    assert packed.tensor is not None
                    if packed.tensor._version != packed.version:
                        raise modified_after_save(
                            f"a tensor saved by {packed.module}", packed.tensor, packed.version
                        )
                    return packed.tensor.detach()
                packed = packed.member
            elif isinstance(packed, torch.Tensor):
                _check_kept(packed)
                if self._kept_seq and self._profiler is not None:
                    self._profiler.recorder.record_unpack(
                        self._kept_seq.get(id(packed), -1), held=packed
                    )
                return packed
            if isinstance(packed, WeightCast):
                if packed.seq >= 0 and self._profiler is not None:
                    self._profiler.recorder.record_unpack(packed.seq, held=packed)
                return packed.rebuild()
            if isinstance(packed, ActivationRecipe):
                return self._rebuild(packed)
        elif packed.seq >= 0 and self._profiler is not None:
            # What autograd holds: the recorder learns from it whether the graph outlives this
            # backward (NOTE [ Retained graphs ] in lifecycle's recorder).
            self._profiler.recorder.record_unpack(packed.seq, held=packed)
        ex = packed.executor
        held = self._held_clock()
        started = time.perf_counter() if held is not None else 0.0
        try:
            return self._unpack_member(ex, packed)
        finally:
            if held is not None:
                held.held_s += time.perf_counter() - started

    def _rebuild(self, recipe: ActivationRecipe) -> torch.Tensor:
        """Unpack of an activation output: its input's bytes through the activation again."""
        if recipe.seq >= 0 and self._profiler is not None:
            self._profiler.recorder.record_unpack(recipe.seq, held=recipe)
        held = self._held_clock()
        started = time.perf_counter() if held is not None else 0.0
        try:
            parent, shared = recipe.parent, recipe.shared
            out = shared.out
            if out is not None:  # rebuilt for another pack of the same output
                family = getattr(parent, "family", None)
                ref = family.step_ref if family is not None else recipe.step_ref
                self._start_triggered(self._executor, ref() if ref else None, recipe.key)
            elif isinstance(parent, _Member):
                # The record's own reload trigger (its input's, as planned) fires first.
                out = recipe.rebuild(self._unpack_member(parent.executor, parent, recipe.key))
            else:
                ref = recipe.step_ref
                step = ref() if ref is not None else None
                self._start_triggered(self._executor, step, recipe.key)
                out = recipe.rebuild(recipe.kept_input())
            if shared.out is None:
                if self._meter is not None:  # the rebuilt bytes are held from here, as planned
                    self._meter.watch(out.untyped_storage())
                shared.hold(out)
            if shared.out is not None:
                shared.used()
            return recipe.view(out)
        finally:
            # A recorded planned step on CPU: the rebuild is the plan's cost, not the model's
            # (as a copy's; see ComputeClock in _planned.py).
            if held is not None:
                held.held_s += time.perf_counter() - started

    def _unpack_member(self, ex: Executor, packed: Any, key: Any = None) -> torch.Tensor:
        """``ex.unpack(packed)`` after the reloads planned to start at this unpack (of
        ``packed``'s key, or ``key``: the record a recipe stands for) have started."""
        ref = packed.family.step_ref
        step = ref() if ref is not None else None
        self._start_triggered(ex, step, key if key is not None else packed.key)
        return ex.unpack(packed)

    @staticmethod
    def _start_triggered(ex: Executor | None, step: Any, key: Any) -> None:
        if ex is not None and step is not None and step.triggers and key is not None:
            waiting = step.triggers.get(("unpack", *key))
            if waiting:
                ex.prefetch(waiting, step, window=False)


_OUTSIDE = "<outside>"  # lifecycle.Recorder's name for packs outside every module


def _same_layout(parent: _Member, out: torch.Tensor) -> bool:
    """An activation's offloaded input ``parent`` has its output's shape and dtype, dense."""
    return (
        parent.size == tuple(out.shape)
        and parent.dtype == out.dtype
        and parent.stride == _contiguous_strides(parent.size)
    )


def _whole_input(parent: _Member, out: torch.Tensor) -> bool:
    """An activation's offloaded input ``parent`` was recorded by this step's profiler and is
    its family's whole storage, as ``lifecycle.Recorder`` links an output to its input."""
    return (
        parent.seq >= 0
        and parent.offset_bytes == 0
        and parent.family.span_start == 0
        and parent.family.nbytes == out.numel() * out.element_size()
    )


def _member_spec(parent: _Member) -> tuple[Any, tuple[Any, ...]] | None:
    """``(mesh, placements)`` of the DTensor ``parent`` was offloaded from, else None (as
    ``lifecycle._tensors.dtensor_spec``)."""
    return None if parent.dtensor is None else (parent.dtensor[0], tuple(parent.dtensor[1]))


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(size):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def _extent(t: torch.Tensor) -> int:
    """Bytes of its storage that ``t``'s elements span (an expanded view spans fewer bytes than
    its elements)."""
    start, end = span_of(t)
    return end - start


# NOTE [ Kept tensors keep autograd's check ]: under saved-tensor hooks autograd no longer
# compares a saved tensor's version at unpack; for one the manager leaves in place (parameters,
# small or kept tensors, KEEP entries of a plan) it would then read whatever an in-place change
# (an optimizer step before backward) left there: a wrong gradient where PyTorch raises. The
# detached tensor handed to autograd carries the version it was saved at, checked at unpack.


def _kept(t: torch.Tensor) -> torch.Tensor:
    d = t.detach()
    d._offload_saved_version = t._version  # type: ignore[attr-defined]
    return d


def _check_kept(d: torch.Tensor) -> None:
    saved = getattr(d, "_offload_saved_version", None)
    if saved is not None and d._version != saved:
        raise modified_after_save("a saved tensor", d, saved)


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _add_note(exc: BaseException, note: str) -> None:
    # BaseException.add_note is Python >= 3.11.
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)


# NOTE [ Fill after pack ]
#     An op may save a buffer it fills itself afterwards, in the same call: F.rrelu in training
#     saves its noise tensor (from empty_like) and then writes the noise into it, and the write
#     leaves the version counter as it was (torch 2.13). A copy started at pack holds the bytes
#     from before the fill (on CUDA, a D2H copy ordered after an event recorded at pack can run
#     before the fill kernel), and no version check can tell. So a pack of a tensor that needs
#     no gradient (such buffers, masks, indices, a batch's inputs) returns a _Deferred and is
#     stored once its op has returned, which is at the first of:
#       * the next pack after a new autograd node: every op that saves creates its node before
#         saving, and the thread's sequence number (torch._C._autograd._get_sequence_nr) moves
#         only then; rrelu's own later pack (its input, saved after the noise) sees none;
#       * a module boundary (forward pre- or post-hook), or the step's exit;
#     and the first unpack of one still waiting keeps them all: backward has reached the ops
#     that packed them (copied then, they would come back at once). An earlier step's backward
#     run inside this step unpacks only stored ones (its exit stored them) and keeps none. The
#     wait is one op long in a model and costs no device memory that autograd did not hold
#     anyway. An in-place change before the copy (a version bump) raises at unpack, as
#     autograd would; a copy that fails (a full tier) raises where it runs, the step's exit
#     included, which then fails the step as an exception in its block does. nn.RReLU modules
#     stay kept as well (lifecycle/_recorder.py). The copy is ordered after the stream current
#     at the pack (the op's: its fill is queued there), remembered with it, not after the
#     stream current at the flush: a pack under torch.cuda.stream(s2) flushed by the next op
#     on the default stream would otherwise be copied before s2 wrote it.


class _Deferred:
    """What a pack returns for a tensor whose copy waits until its op has returned (NOTE [ Fill
    after pack ]): the tensor until then, the stored member after."""

    __slots__ = (
        "__weakref__",
        "dtensor",
        "error",
        "key",
        "local",
        "member",
        "module",
        "own",
        "seq",
        "stream",
        "tensor",
        "tier",
        "version",
    )

    def __init__(
        self,
        t: torch.Tensor,
        local: torch.Tensor,
        module: str,
        dtensor: Any,
        tier: str | None,
        key: tuple[str, int, int],
        own: list[Any] | None,
    ) -> None:
        self.tensor: torch.Tensor | None = t.detach()
        self.local: torch.Tensor | None = local
        self.version = t._version
        self.module, self.dtensor, self.tier, self.key, self.own = module, dtensor, tier, key, own
        self.member: _Member | None = None
        self.error: RuntimeError | None = None
        self.seq = -1
        self.stream: Any = None  # the stream current at the pack (the op's), until stored


# The module hooks hold their manager weakly: the model outlives a manager dropped without
# close(), whose finalizer must still run (the hooks are removed then).


class _ForwardPre(ModuleHook):
    __slots__ = ("compiled", "kept", "mgr", "name")

    def __init__(self, mgr: ActivationOffloader, name: str, kept: bool, compiled: bool) -> None:
        self.mgr, self.name, self.kept = weakref.ref(mgr), name, kept
        # A compiled leaf's own hooks may run under dynamo (``mod.compile()`` compiles the call
        # that runs them); no other's should.
        self.compiled = compiled

    def __call__(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        # ``kwargs``: part of the signature when this call begins it (NOTE [ Top-level calls ]).
        mgr = self.mgr()
        if mgr is None:
            return
        compiling = torch.compiler.is_compiling()
        if compiling and not self.compiled:
            # Dynamo traces this hook: the model was compiled after the manager was made. An
            # attribute store is all dynamo replays here without a graph break (fullgraph=True
            # stays possible outside steps); the warning comes from eager code (_warn_traced).
            mgr._traced = True
        if not mgr._in_step or foreign_call(mgr._step_thread):
            return
        budget = mgr._budget_bytes is not None and mgr._executor is not None
        grad = torch.is_grad_enabled()
        # Calls are numbered as lifecycle.Recorder numbers them: every call of the step from
        # its signature's start (the recorder begins there). Under a budget the step's
        # signature is that of the root's first call with grad: calls without grad before it
        # (a teacher's or an EMA target's forward through the same model) save nothing and
        # are not counted, so that the training forward after them is the one profiled and
        # planned, with the same record keys in every step.
        call = mgr._calls.get(self.name, 0)
        if not budget or mgr._signature_begun or grad:
            mgr._calls[self.name] = call + 1
        if mgr._paused:
            return
        if not compiling:
            _check_foreign_hooks(mgr._warn, self.name, mgr._pack_fn, mgr._hooks_popped)
        outer_kept = bool(mgr._stack) and mgr._stack[-1][1]
        if budget and grad and not mgr._stack and not mgr._signature_begun:
            mgr._signature_begun = True  # See NOTE [ Top-level calls ]
            mgr._begin_signature(args, kwargs, self.name)
        if mgr._deferred and not compiling:  # (traced, it would break the graph; a pack will)
            mgr._flush_deferred()  # packed in the caller: stored before this call's packs
        # [module path, kept, families this call packed itself, call index, packs so far]
        entry: list[Any] = [self.name, self.kept or outer_kept, [], call, 0]
        mgr._stack.append(entry)
        # (Dynamo cannot trace the graph task id, and traces no backward.)
        if not compiling and _current_graph_task_id is not None and _current_graph_task_id() != -1:
            mgr._backward_entries.add(entry)
        if mgr._executor is not None:
            mgr._executor.poll()


class _ForwardPost(ModuleHook):
    __slots__ = ("mgr",)

    def __init__(self, mgr: ActivationOffloader) -> None:
        self.mgr = weakref.ref(mgr)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        mgr = self.mgr()
        if mgr is None or not mgr._in_step or mgr._paused or not mgr._stack:
            return
        if foreign_call(mgr._step_thread):
            return
        if mgr._deferred and not torch.compiler.is_compiling():
            mgr._flush_deferred()  # this call's last ops have returned
        name, _, own, call, _ = mgr._stack.pop()
        noted = mgr._norms.note(module, output)
        if noted is not None:
            hold_norm_weights(mgr._norms, noted, output, mgr._params)
        ex = mgr._executor
        if ex is None or ex.step is None or not torch.is_grad_enabled():
            return
        ex.poll()
        active = mgr._active
        planned: list[Any] | None = None
        if active is not None and (name, call) in active.backward_triggers:
            planned = ex.step.triggers.setdefault(("backward", name, call, -1), [])
        if not own and planned is None:
            return
        # Backward of this module needs the families it packed itself (not its children's:
        # their own triggers fire when their backward comes); start those, and the look-ahead
        # window (or, under a plan, the reloads it starts here), from a pre-hook on its outputs'
        # grad_fn, which fires right before the module's backward and leaves the graph alone.
        families = own if planned is None else _Both(own, planned)
        trigger = _BackwardTrigger(mgr, families, ex.step, active is None)
        seen: set[int] = set()
        for t in tensors_in(output):
            fn = t.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(trigger)


class _Both:
    """Two family lists read as one, at the time the trigger fires (the planned one may still
    grow after it was registered)."""

    __slots__ = ("first", "second")

    def __init__(self, first: list[Any], second: list[Any]) -> None:
        self.first, self.second = first, second

    def __iter__(self) -> Iterator[Any]:
        yield from self.second  # planned ones first: they are the ones needed soonest
        yield from self.first


class _BackwardTrigger:
    __slots__ = ("families", "mgr", "step", "window")

    def __init__(self, mgr: ActivationOffloader, families: Any, step: Any, window: bool) -> None:
        # ``step``: the executor's state of the step whose forward registered this trigger; by
        # the time its backward runs, another step may have begun.
        self.mgr, self.families, self.step, self.window = mgr, families, step, window

    def __call__(self, grad_outputs: Any) -> None:
        mgr = self.mgr
        ex = mgr._executor
        if ex is None:
            return
        held = mgr._held_clock()
        started = time.perf_counter() if held is not None else 0.0
        ex.prefetch(list(self.families), self.step, window=self.window)
        if held is not None:
            held.held_s += time.perf_counter() - started


class _StepEnd:
    """Queued at a backward's first unpack, run when that backward ends: the step whose backward
    it was gets its ``step_s`` (once), and a profiling step its profile's end."""

    __slots__ = ("clock", "current", "mgr", "profiling", "step", "task")

    def __init__(
        self, mgr: ActivationOffloader, task: int, current: Any, clock: Any, profiling: str | None
    ) -> None:
        self.mgr, self.task, self.current, self.clock = mgr, task, current, clock
        self.profiling = profiling
        self.step: Any = None  # set by the first offloaded tensor the backward unpacks

    def __call__(self) -> None:
        mgr = self.mgr
        mgr._task_ends.pop(self.task, None)
        step = self.step if self.step is not None else self.current
        if step is None or step.backward_seen:
            return
        step.backward_seen = True
        stats = step.stats
        step_s = stats.step_s = self.clock() - step.started_s
        with mgr._lock:
            if stats is not mgr._step_stats:
                # Another step began before this one's backward ended (pipelining, gradient
                # accumulation): this one is already in the totals, without its time.
                mgr._done.step_s += step_s
        if self.profiling is not None and step is self.current:
            with mgr._lock:
                mgr._profile_ended(self.profiling)
        budget = mgr._budget_bytes
        if budget is not None and stats.predicted_peak_bytes and mgr.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(mgr.device)
            if peak > budget and mgr._last_signature not in mgr._over_budget:
                # DESIGN.md "Budget": no mid-run re-plan; say it once per signature.
                mgr._over_budget.add(mgr._last_signature)
                log.warning(
                    "offload: a planned step of signature %s peaked at %d bytes, above "
                    "gpu_budget=%d (predicted %d); lower the budget or raise the margin",
                    mgr._last_signature,
                    peak,
                    budget,
                    stats.predicted_peak_bytes,
                )


def _close_resources(handles: list[Any], resources: list[Any], recompute: dict[str, Any]) -> None:
    for h in handles:
        with contextlib.suppress(Exception):
            h.remove()
    _uninstall_forwards(recompute)
    close = functools.partial(_close_all, resources)
    # Closing waits for the transfers in flight. In a GC pass, which runs on whatever thread
    # allocated (the training thread, mid-step), a stalled disk write held it there: the wait
    # goes to the background closer (NOTE [ Closing in the background ] in storage/_transfer.py).
    running = any(isinstance(r, storage.Tier) and r.transfers_running for r in resources)
    if running and in_gc_pass() and close_later(close):
        return
    # A GC pass on one of storage's threads may run this: closing waits for the transfers in
    # flight, that thread's own among them (a deadlock), so it goes to a thread of its own.
    if not storage.finish_elsewhere(close):
        close()


def _close_all(resources: list[Any]) -> None:
    for r in resources:  # the executor first, then the tiers
        # The executor's close waits on its events, maybe on the closer thread, which has no
        # current CUDA device: there it would create a context on device 0 (see NvmeTier's
        # cuda_device), so its device is made current for it.
        cuda = getattr(r, "cuda", False) is True
        with (
            contextlib.suppress(Exception),
            torch.cuda.device(r.device) if cuda else contextlib.nullcontext(),
        ):
            r.close()


def _uninstall_forwards(
    installed: dict[str, tuple[weakref.ref[Any], weakref.ref[Any], bool]],
) -> None:
    """Give modules their own forward back where a RecomputeForward still stands in for it: the
    one set on the instance if there was one (dropping it ran the class's forward instead), else
    the class's."""
    for mod_ref, wrapper_ref, own in installed.values():
        mod, wrapper = mod_ref(), wrapper_ref()
        if mod is not None and wrapper is not None and mod.__dict__.get("forward") is wrapper:
            if own:
                mod.forward = wrapper.forward
            else:
                del mod.forward
    installed.clear()


_cache: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], ActivationOffloader]] = (
    weakref.WeakKeyDictionary()
)
_cache_lock = threading.Lock()


def activations(
    model: nn.Module,
    *,
    tiers: Iterable[str] = ("cpu",),
    nvme_dir: str | os.PathLike[str] | None = None,
    min_offload_bytes: int | str = 1 << 20,
) -> ActivationOffloader:
    """The manager for ``model`` with these settings, made once and reused (its host pool and
    files survive across steps); ``with offload.activations(model):`` is one step.

    Each distinct setting keeps its own manager, with its host pool claim and files, until the
    model is freed or that manager is closed; a closed manager is replaced at the next call.

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Linear(256, 256)
        >>> with offload.activations(model, min_offload_bytes=0):
        ...     loss = model(torch.randn(64, 256, requires_grad=True)).pow(2).sum()
        >>> loss.backward()
        >>> offload.activations(model, min_offload_bytes=0) is offload.activations(model, min_offload_bytes=0)
        True
    """
    # Checked before the cache is keyed on them (a model that is no module cannot be a key).
    _check_model(model)
    tiers = _tiers_arg(tiers)
    _check_nvme_dir_type(nvme_dir)
    # By meaning, not spelling: 0 and "0", or two spellings of one directory, are one manager.
    key = (
        tiers,
        None if nvme_dir is None else os.path.realpath(nvme_dir),
        parse_bytes(min_offload_bytes, name="min_offload_bytes"),
    )
    with _cache_lock:
        per_model = _cache.setdefault(model, {})
        mgr = per_model.get(key)
        if mgr is None or mgr.closed:
            mgr = per_model[key] = ActivationOffloader(
                model, tiers=tiers, nvme_dir=nvme_dir, min_offload_bytes=min_offload_bytes
            )
        return mgr
