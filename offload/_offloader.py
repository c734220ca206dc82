"""``offload.ActivationOffloader`` and ``offload.activations()``: the manager users hold.

A step is one ``with mgr:`` block: saved-tensor hooks are active only inside it, the forward runs
inside it, backward inside or after it. The manager decides which saved tensors move (everything
eligible, in this min-memory mode) and when backward is about to need them; the executor moves
the bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from offload import storage
from offload._budget import Budget, SigState
from offload._config import (
    _config_of,
    _kept_modules,
    _plan_and_budget,
)
from offload._device import RoomProbe, compute_device
from offload._errors import OffloadError
from offload._executor import Executor
from offload._hooks import ForwardPost, ForwardPre, ForwardRaised, StepEnd, StepHooks
from offload._pack import Packer
from offload._pipelining import PipelineAttachment, PipelineRound
from offload._planned import (
    ActivePlan,
    Profiler,
    signature_of,
)
from offload._points import point
from offload._recompute import Recomputes
from offload._resources import _close_resources, _make_executor
from offload._stats import OffloadStats, StepStats
from offload._step import Step
from offload._unpack import Unpacker
from offload._warnings import (
    WarnOnce,
    _check_compiled_share,
    _check_device,
    _check_given_plan,
    _warn_foreign_around,
    _warn_no_module,
    _warn_traced,
    _warn_uncompiled,
)
from offload.lifecycle import Plan
from offload.lifecycle._blocks import within
from offload.lifecycle._calls import foreign_call
from offload.lifecycle._module_hooks import outer_calls, register_forward_hooks
from offload.lifecycle._tensors import (
    NormOutputs,
    ParameterStorages,
    is_compiled,
    named_modules_stop_at_compiled,
    tensors_in,
)

log = logging.getLogger("offload")

_autograd = torch._C._autograd
_top_hooks = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_pop_hooks = getattr(_autograd, "_pop_saved_tensors_default_hooks", None)
_push_hooks = getattr(_autograd, "_push_saved_tensors_default_hooks", None)


class ActivationOffloader(StepHooks):
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
        self.config = _config_of(
            model,
            hardware=hardware,
            tiers=tiers,
            cpu_budget=cpu_budget,
            nvme_dir=nvme_dir,
            min_offload_bytes=min_offload_bytes,
            keep=keep,
            max_inflight_bytes=max_inflight_bytes,
            on_infeasible=on_infeasible,
        )
        self._model_ref = weakref.ref(model)
        self._cpu_budget_default = cpu_budget is None
        self.device = compute_device(model)
        # Budget mode (see NOTE [ Budget mode ] in _planned.py).
        user_plan, self._budget_bytes = _plan_and_budget(
            plan, gpu_budget, model, self.device, self.config
        )
        self._norms = NormOutputs()
        self._engine = _copy_engine
        self._room = _room  # the device's room probe; None: room_probe(device)
        self._tiers: list[storage.Tier] | None = None  # made at the first step
        self._executor: Executor | None = None
        self._done = StepStats()  # steps before the last one
        self._step_index = 0
        # The current step (offload/_step.py): the running one, else the last one, whose
        # backward may still run; made by _begin_step.
        self._step: Step | None = None
        self._paused = 0
        self._closed = False
        # The thread that installed the manager (NOTE [ Installed steps ] in _hooks.py), or None.
        self._installed: int | None = None
        self._installed_handles: list[Any] = []  # ForwardRaised hooks (in _module_handles too)
        self._lock = threading.RLock()
        self._warn = WarnOnce()
        self._params = ParameterStorages()
        self._task_ends: dict[int, StepEnd] = {}  # backward graph task -> its end callback
        self._packer = Packer(
            self.device, self.config.min_offload_bytes, self._params, self._norms, self._warn
        )
        self._packer.keyed = self._budget_bytes is not None or user_plan is not None
        self._unpacker = Unpacker(self._task_ends, self._on_backward_begin)
        # Budget mode (NOTE [ Budget mode ] in _planned.py): per signature, how its steps run.
        self._budget = Budget(
            config=self.config,
            device=self.device,
            budget_bytes=self._budget_bytes,
            user_plan=user_plan,
            hardware_arg=hardware,
            warn=self._warn,
            task_ends=self._task_ends,
            packer=self._packer,
            install_recompute=self._install_recompute,
        )
        self._recomputes = Recomputes(self._model_ref, self._budget, lambda: self._step)
        self._module_handles = self._install_module_hooks(model)
        # See NOTE [ One compiled leaf holding the step ] in _warnings.py.
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
        self._traced = False  # dynamo traced a module hook (see ForwardPre, _warn_traced)
        # Each step resets the device's peak counters (stats.peak_allocated_bytes is per step);
        # not under a pipeline, whose steps overlap (see PipelineAttachment).
        self._reset_peaks = True
        # A budgeted pipeline stage's schedule round (see NOTE [ Pipelining ]): its forward chunks
        # are steps of the executor but one step of the profile and the plan.
        self._round: PipelineRound | None = None
        # Pipeline stages attached to (close() gives them their own methods back).
        self._attachments: weakref.WeakSet[PipelineAttachment] = weakref.WeakSet()
        # Closed on garbage collection and at exit too; the finalizer holds only the resources.
        self._resources: list[Any] = []
        self._finalizer = weakref.finalize(
            self,
            _close_resources,
            self._module_handles,
            self._resources,
            self._recomputes.installed,
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
            if last.steps and self._step is not None and not self._step.added:  # not at close
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
            budget = self._budget
            budget._plan_profiled()
            if budget._last_signature is None:
                return None
            return budget._plans.get(budget._last_signature)

    @property
    def plans(self) -> dict[str, Plan]:
        """The plans made or given so far, by input signature (a copy). Past ``MAX_SIGNATURES``
        profiled signatures, only the 64 most recent of the later ones (which share one plan)
        are named."""
        with self._lock:
            self._budget._plan_profiled()
            return dict(self._budget._plans)

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

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` is in effect."""
        return self._installed is not None

    def install(self) -> None:
        """Find the steps without ``with mgr:``: from now on each forward of the model with grad,
        entered through any of its modules, together with the backward that consumes it, is
        one step (what a trainer's loop, callback or ``training_step`` needs). Forwards under
        ``no_grad`` or ``inference_mode`` (evaluation) are left alone; each gradient
        accumulation micro-batch is a step; budget mode profiles, plans and refines as with
        ``with mgr:``. Top-level calls before the backward (``model.head(model.backbone(x))``)
        are one step. Calling it again on the same thread changes nothing.

        The forwards must run on the thread that calls ``install()``; ``with mgr:`` still
        makes one step of its block (a step an installed forward left open ends first).
        :meth:`uninstall` (or :meth:`close`) ends it. See NOTE [ Installed steps ] in
        ``offload/_hooks.py``.

        Raises:
            OffloadError: the manager is closed, a ``with mgr:`` block is running, or it is
                installed on another thread.

        Example:
            >>> import torch, offload
            >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU())
            >>> mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
            >>> mgr.install()
            >>> model(torch.randn(256, 512)).sum().backward()
            >>> mgr.stats.total.steps, mgr.stats.last.bytes_offloaded_cpu > 0
            (1, True)
            >>> mgr.close()
        """
        with self._lock:
            if self._closed:
                raise OffloadError("this ActivationOffloader is closed; make a new one")
            if self._installed is not None:
                if self._installed != threading.get_ident():
                    raise OffloadError(
                        "this ActivationOffloader is installed on another thread; its steps "
                        "run on the thread that installed it (uninstall() there first)"
                    )
                return
            if self._in_step:
                raise OffloadError(
                    "install() inside `with mgr:`: leave the block first (an installed manager "
                    "finds its steps itself)"
                )
            # Made now, not at the first step's begin: the step begins inside a module's
            # pre-hook, and hooks the profiler registered there would miss that call.
            if self._executor is None:
                self._executor = self._make_executor()
            self._attach_profiler()
            model = self._model_ref()
            if model is not None:
                self._installed_handles = [
                    mod.register_forward_hook(ForwardRaised(self, name), always_call=True)
                    for name, mod in named_modules_stop_at_compiled(model)
                    if not is_compiled(mod)
                ]
                # Removed by the finalizer too, when the manager goes without close().
                self._module_handles += self._installed_handles
            self._installed = threading.get_ident()

    def uninstall(self) -> None:
        """Undo :meth:`install`: steps are ``with mgr:`` blocks again. A step an installed forward
        began ends here, as a block ends before its backward (which may still run). Does
        nothing when not installed."""
        with self._lock:
            self._installed = None
            for h in self._installed_handles:
                h.remove()
                self._module_handles.remove(h)
            self._installed_handles = []
            step = self._step
            if step is not None and step.running and step.installed:
                self._end_step(step, None, None)

    @property
    def _in_step(self) -> bool:
        """Whether a step's block is running."""
        step = self._step
        return step is not None and step.running

    def __enter__(self) -> ActivationOffloader:
        with self._lock:
            if self._closed:
                raise OffloadError("this ActivationOffloader is closed; make a new one")
            step = self._step
            if step is not None and step.running and step.installed and not step.calls.frames:
                self._end_step(step, None, None)  # see NOTE [ Installed steps ] in _hooks.py
            if step is not None and step.running:
                if step.thread != threading.get_ident():
                    raise OffloadError(
                        "a step of this manager is running on another thread; a manager runs "
                        "one step at a time, entered and run on one thread. Give each thread "
                        "that trains its own model and manager, or run this thread's forward "
                        "outside `with mgr:` (its module calls are not counted as the step's)"
                    )
                raise OffloadError("a step of this manager is already running; steps do not nest")
            self._begin_step()
            return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        with self._lock:
            step = self._step
            if step is None or not step.running:
                return
            self._end_step(step, exc_type, exc)

    def _begin_step(self) -> None:
        """A step begins (``with mgr:``): plan what the last profiled step recorded, make the
        step's state and push the saved-tensor hooks."""
        with point("step_begin", f"step {self._step_index + 1}"):
            self._begin_step_in_point()

    def _begin_step_in_point(self) -> None:
        if self._traced:  # a compiled call outside steps (evaluation) traced the hooks
            _warn_traced(self._warn)
        self._reinstate_outer_calls()
        rnd = self._round
        continuing = rnd is not None and rnd.steps > 0
        if self._budget_bytes is not None and not continuing:
            # Plans the last profiling step (its backward has ended): may raise
            # BudgetInfeasibleError, before this step has changed any state.
            self._budget._plan_profiled()
        if self._executor is None:
            self._executor = self._make_executor()
        self._attach_profiler()
        self._account_last()
        self._step_index += 1
        stats = self._executor.begin_step(self._step_index)
        # No backward runs while a step begins: an end left here is from a backward that
        # raised before its final callback (it would hold that step's state).
        raised = {end.profiling for end in self._task_ends.values()}
        self._task_ends.clear()
        prev = self._step
        step = self._step = Step(
            self._step_index,
            stats,
            threading.get_ident(),
            carried=prev if continuing else None,
        )
        if continuing:
            assert rnd is not None
            self._continue_round(rnd)
        else:
            self._budget._drop_unfinished_profile(self._executor, raised)
        if rnd is not None:
            rnd.steps += 1
        self._refresh_params()
        _check_device(self._warn, self._model_ref(), self.device)
        if self.device.type == "cuda" and self._reset_peaks:
            torch.cuda.reset_peak_memory_stats(self.device)
        if _top_hooks is not None and _top_hooks(False) is not None:
            _warn_foreign_around(self._warn)
        self._maybe_hide_from_compile()
        step.hooks_cm = torch.autograd.graph.saved_tensors_hooks(self._pack_fn, self._unpack_fn)
        step.hooks_cm.__enter__()

    def _end_step(self, step: Step, exc_type: Any, exc: Any) -> None:
        """The step's block ended (its backward may come later): pop the hooks, store what
        waits, run the checks of its end; or, if it raised, fail it."""
        with point("step_end", f"step {step.index}"):
            self._end_step_in_point(step, exc_type, exc)

    def _end_step_in_point(self, step: Step, exc_type: Any, exc: Any) -> None:
        step.running = False
        step.again = None  # no more packs: its member goes with autograd's (NOTE [ Packed again ])
        cm, step.hooks_cm = step.hooks_cm, None
        if step.hooks_popped:
            step.hooks_popped = False  # paused() took the pair off the stack already
        elif cm is not None:  # (None: an installed step between its calls)
            cm.__exit__(None, None, None)
        ex = self._executor
        assert ex is not None
        failed = None
        if exc_type is None and step.deferred:
            try:
                self._flush_deferred()  # backward runs after the step's exit
            except BaseException as e:  # a full tier: the step failed as if its block had
                failed = exc = e  # raised (its handles live on with the loss)
                exc_type = type(e)
        if exc_type is not None:
            if isinstance(exc, torch.OutOfMemoryError):
                _add_note(exc, self._budget.oom_note(step.active))
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
            step.deferred.clear()
            ex.fail_step()
            self._budget._discard_recording()
        else:
            ex.poll()
            _check_given_plan(
                self._warn,
                step.active,
                self._budget.state(self._budget._last_signature) is SigState.GIVEN,
                step.keys_looked_up,
                step.keys_matched,
                self._model_ref(),
            )
            _check_compiled_share(self._warn, ex, self._compiled_leaves)
            self._budget._end_structure(step)
            if self._budget_bytes is not None and not step.signature_begun and self._round is None:
                _warn_no_module(self._warn, step.calls.outside_packs, self._model_ref())
        step.calls.clear()
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
        step = self._step
        running = step is not None and step.running
        if running and foreign_call(step.thread):  # type: ignore[union-attr]
            # Counted, the pause turned the running step's own offloading off.
            yield
            return
        with self._lock:
            # Pop only our own pair: a foreign pair on top shadows ours already (only the
            # innermost fires), and popping it would take its packs away and leave ours on top.
            top = _top_hooks(False) if running and _top_hooks is not None else None
            ours = top is not None and top[0] is self._pack_fn and _push_hooks is not None
            if ours and _pop_hooks is not None:
                _pop_hooks()
                step.hooks_popped = True  # type: ignore[union-attr]
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                # Unless the step ended inside the region (its __exit__ saw the pair gone).
                if ours and step.hooks_popped and _push_hooks is not None:  # type: ignore[union-attr]
                    _push_hooks(self._pack_fn, self._unpack_fn)
                    step.hooks_popped = False  # type: ignore[union-attr]

    def close(self) -> None:
        """Release every byte this manager holds off the device and its threads. Idempotent.

        Saved tensors of graphs still alive become unusable (their unpack raises).
        """
        with self._lock:
            if self._closed:
                return
            self.uninstall()
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
            self._recomputes.uninstall()
            if self._budget._profiler is not None:
                self._budget._profiler.close()
                self._budget._profiler = None

    def __repr__(self) -> str:
        mode = "min-memory" if self._budget_bytes is None else f"gpu_budget={self._budget_bytes}"
        state = "closed" if self._closed else f"{self._step_index} steps"
        return (
            f"ActivationOffloader(device={self.device}, {mode}, tiers={self.config.tiers}, {state})"
        )

    # -- setup ---------------------------------------------------------------------------------

    def _make_executor(self) -> Executor:
        ex, self._tiers, resources = _make_executor(
            self.config,
            self.device,
            cpu_budget_default=self._cpu_budget_default,
            engine=self._engine,
            room=self._room,
        )
        ex.meter = self._meter
        ex.warn_once = self._warn
        self._resources[:] = resources
        return ex

    def _install_module_hooks(self, model: nn.Module) -> list[Any]:
        handles = []
        # See NOTE [ Keep covers the module tree ].
        kept = _kept_modules(self.config, model)
        for name, mod in named_modules_stop_at_compiled(model):
            pre = ForwardPre(self, name, within(name, kept), is_compiled(mod))
            # Around a ``mod.compile()``d call, not in it (NOTE [ Hooks of a compiled call ]).
            # With kwargs: the first module entered at the top level names the step's signature,
            # the root or another (NOTE [ Top-level calls ] in _budget.py).
            handles += register_forward_hooks(mod, pre, ForwardPost(self), with_kwargs=True)
        return handles

    def _attach_profiler(self) -> None:
        if self._budget_bytes is not None and self._budget._profiler is None:
            # Attached before any forward, so its module hooks run after the manager's (the
            # root's pre-hook begins a profiled step that the recorder's then sees).
            model = self._model_ref()
            if model is not None:
                assert self._executor is not None
                self._budget._profiler = Profiler(
                    model,
                    self.device,
                    self._executor.device_saved_bytes,
                    _kept_modules(self.config, model),
                )

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
        step = self._step
        return StepStats() if step is None else step.snapshot(self._executor, self.device)

    def _account_last(self) -> None:
        # A step's counters grow until its backward ends, which may be after its block; they are
        # folded into the running total when the next step starts (or at close). A count moved
        # after that (a write that failed late) comes in the executor's ``late``.
        ex = self._executor
        step = self._step
        if step is not None and not step.added:
            with ex.lock if ex is not None else contextlib.nullcontext():
                self._done.add(self._snapshot_last(), median=False)  # see stats
                step.added = True
                if ex is not None:
                    ex.count_step()
        if ex is not None:
            self._done.add(ex.take_late(), median=False)

    # -- budget mode (NOTE [ Budget mode ] in _planned.py) -------------------------------------

    def _continue_round(self, rnd: PipelineRound) -> None:
        """A later forward chunk of a pipeline round: record keys, the plan and the profile
        carry on from the round's first chunk (NOTE [ Pipelining ])."""
        step = self._current
        ex, stats, active = self._executor, step.stats, step.active
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
            budget = self._budget
            if budget._profiling is not None:
                budget._profile_ended(budget._profiling, self._current)
            self._round = None

    def _abandon_round(self) -> None:
        """A chunk of the round raised: drop its partial profile; the next round starts over."""
        with self._lock:
            self._budget._discard_recording()
            self._round = None

    def _hold_stage_inputs(self, args: Any, kwargs: Any) -> None:
        """From a pipeline attachment, before a stage's module runs a forward chunk: the stage
        holds each microbatch's inputs until its backward (its forward cache), so copying them
        out would free nothing. They are kept, and are no activations to plan."""
        if not self._in_step or self._paused:
            return
        held = list(tensors_in((args, kwargs)))
        self._params.add_tensors(held)
        prof = self._recording()
        if prof is not None:
            prof.recorder.add_held(held)

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

    def _begin_signature(self, args: Any, kwargs: Any = None, module: str = "") -> None:
        """At the step's first top-level forward (NOTE [ Top-level calls ] in _budget.py):
        its signature chooses how this step runs."""
        sig = signature_of(args, kwargs) + self._modes()
        if module:
            sig = f"{module}({sig})"
        ex = self._executor
        assert ex is not None
        self._budget._begin_signature(sig, self._current, ex, self._round)

    def _install_recompute(self, active: ActivePlan) -> None:
        self._recomputes.install(active)


def _add_note(exc: BaseException, note: str) -> None:
    # BaseException.add_note is Python >= 3.11.
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
