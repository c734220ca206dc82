"""The manager's hooks into a step: module forward pre- and post-hooks, the trigger before a
module's backward, and the end of a backward. Each says which lifecycle point it is and calls
the manager's method for it (``_on_forward_pre``, ``_on_forward_post``, ``_on_module_backward``,
``_on_backward_end``); none writes the manager's state itself.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload._pack import _kept
from offload._recipe import hold_norm_weights
from offload._step import Entry
from offload._warnings import _check_foreign_hooks, _warn_several_backwards
from offload.lifecycle._calls import foreign_call
from offload.lifecycle._inert import ModuleHook
from offload.lifecycle._tensors import NormOutputs, ParameterStorages, tensors_in

log = logging.getLogger("offload")
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)

if TYPE_CHECKING:
    from offload._budget import Budget
    from offload._executor import Executor
    from offload._offloader import ActivationOffloader
    from offload._pack import Packer
    from offload._pipelining import PipelineRound
    from offload._planned import Profiler
    from offload._stats import StepStats
    from offload._step import Step
    from offload._unpack import Unpacker
    from offload._warnings import WarnOnce

# The module hooks hold their manager weakly: the model outlives a manager dropped without
# close(), whose finalizer must still run (the hooks are removed then).


class ForwardPre(ModuleHook):
    __slots__ = ("compiled", "kept", "mgr", "name")

    def __init__(self, mgr: ActivationOffloader, name: str, kept: bool, compiled: bool) -> None:
        self.mgr, self.name, self.kept = weakref.ref(mgr), name, kept
        # A compiled leaf's own hooks may run under dynamo (``mod.compile()`` compiles the call
        # that runs them); no other's should.
        self.compiled = compiled

    def __call__(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        # ``kwargs``: part of the signature when this call begins it (NOTE [ Top-level calls ] in _budget.py).
        mgr = self.mgr()
        if mgr is None:
            return
        compiling = torch.compiler.is_compiling()
        if compiling and not self.compiled:
            # Dynamo traces this hook: the model was compiled after the manager was made. An
            # attribute store is all dynamo replays here without a graph break (fullgraph=True
            # stays possible outside steps); the warning comes from eager code (_warn_traced).
            mgr._on_traced()
        mgr._on_forward_pre(self, args, kwargs, compiling)


class ForwardPost(ModuleHook):
    __slots__ = ("mgr",)

    def __init__(self, mgr: ActivationOffloader) -> None:
        self.mgr = weakref.ref(mgr)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        mgr = self.mgr()
        if mgr is not None:
            mgr._on_forward_post(module, output)


class ForwardRaised(ModuleHook):
    """While installed: a post-hook run even when the call raised (``always_call``), so that an
    installed step whose forward raised ends (NOTE [ Installed steps ])."""

    __slots__ = ("mgr", "name")

    def __init__(self, mgr: ActivationOffloader, name: str) -> None:
        self.mgr, self.name = weakref.ref(mgr), name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        mgr = self.mgr()
        if mgr is not None:
            mgr._on_forward_raised(self.name)


class Both:
    """Two family lists read as one, at the time the trigger fires (the planned one may still
    grow after it was registered)."""

    __slots__ = ("first", "second")

    def __init__(self, first: list[Any], second: list[Any]) -> None:
        self.first, self.second = first, second

    def __iter__(self) -> Iterator[Any]:
        yield from self.second  # planned ones first: they are the ones needed soonest
        yield from self.first


class BackwardTrigger:
    """A pre-hook on a module call's outputs' ``grad_fn``: fires right before that call's
    backward."""

    __slots__ = ("families", "mgr", "step", "window")

    def __init__(self, mgr: ActivationOffloader, families: Any, step: Any, window: bool) -> None:
        # ``step``: the executor's state of the step whose forward registered this trigger; by
        # the time its backward runs, another step may have begun.
        self.mgr, self.families, self.step, self.window = mgr, families, step, window

    def __call__(self, grad_outputs: Any) -> None:
        self.mgr._on_module_backward(self.families, self.step, self.window)


class StepEnd:
    """Queued at a backward's first unpack, run when that backward ends: the step whose backward
    it was gets its ``step_s`` (once), and a profiling step its profile's end."""

    __slots__ = ("clock", "current", "installed", "mgr", "profiling", "step", "task")

    def __init__(
        self, mgr: ActivationOffloader, task: int, current: Any, clock: Any, profiling: str | None
    ) -> None:
        self.mgr, self.task, self.current, self.clock = mgr, task, current, clock
        self.profiling = profiling
        self.step: Any = None  # set by the first offloaded tensor the backward unpacks
        # The installed step this backward ends (NOTE [ Installed steps ]), or None.
        self.installed: Step | None = None

    def __call__(self) -> None:
        self.mgr._on_backward_end(self)
        if self.installed is not None:
            self.mgr._end_installed(self.installed)


class StepHooks:
    """The manager's methods its hooks call, one per lifecycle point of a step's forward and
    backward (and the saved-tensor hooks' own); part of :class:`ActivationOffloader`."""

    # The manager's, which these methods are part of (see ActivationOffloader.__init__).
    _step: Step | None
    _executor: Executor | None
    _budget: Budget
    _budget_bytes: int | None
    _packer: Packer
    _unpacker: Unpacker
    _paused: int
    _warn: WarnOnce
    _pack_fn: Any
    _unpack_fn: Any
    _norms: NormOutputs
    _params: ParameterStorages
    _task_ends: dict[int, StepEnd]
    _round: PipelineRound | None
    _lock: Any
    _done: StepStats
    _traced: bool
    _installed: int | None
    device: torch.device

    def _begin_signature(self, args: Any, kwargs: Any = None, module: str = "") -> None:
        raise NotImplementedError  # ActivationOffloader's

    def _begin_step(self) -> None:
        raise NotImplementedError  # ActivationOffloader's

    def _end_step(self, step: Step, exc_type: Any, exc: Any) -> None:
        raise NotImplementedError  # ActivationOffloader's

    # -- the step's saved-tensor hooks (offload/_pack.py, offload/_unpack.py) -------------------

    @property
    def _current(self) -> Step:
        """The current step, where one must exist (inside a step, or its backward)."""
        step = self._step
        assert step is not None
        return step

    @property
    def _meter(self) -> Any:
        """offload._live.SavedBytes while one counts (tests, benchmarks), else None."""
        return self._packer.meter

    @_meter.setter
    def _meter(self, meter: Any) -> None:
        self._packer.meter = self._unpacker.meter = meter

    def _recording(self) -> Profiler | None:
        """The profiler while the current step is recorded (profiled or timed), else None."""
        budget = self._budget
        return budget._profiler if budget._profiling is not None else None

    def _held_clock(self) -> Any:
        """During a CPU profiling step: the clock that offload's own copies are taken out of."""
        prof = self._recording()
        return None if prof is None else prof.compute_clock

    def _pack(self, t: torch.Tensor) -> Any:
        step, ex = self._step, self._executor
        if ex is None or step is None or self._paused:
            return _kept(t)
        budget = self._budget  # _recording(), inline: these two run once per saved tensor
        prof = budget._profiler if budget._profiling is not None else None
        return self._packer.pack(t, step, ex, prof)

    def _unpack(self, packed: Any) -> torch.Tensor:
        budget = self._budget
        profiler = budget._profiler
        prof = profiler if budget._profiling is not None else None
        return self._unpacker.unpack(packed, self._step, self._executor, profiler, prof)

    def _flush_deferred(self) -> None:
        """Store the current step's deferred packs (NOTE [ Fill after pack ] in _pack.py)."""
        self._packer.flush_deferred(self._current, self._executor, self._recording())

    # -- the step's module hooks (offload/_hooks.py) --------------------------------------------

    def _on_traced(self) -> None:
        self._traced = True

    # NOTE [ Installed steps ]
    #     After ``mgr.install()`` a step needs no ``with mgr:``: the first module call of the
    #     model with grad (not in inference mode, not paused, not inside a backward, on the
    #     thread that installed) entered while no step runs begins one, whichever module it is
    #     (the root, or a child when a wrapper's own forward never runs). The step's
    #     saved-tensor hooks are on only inside its top-level module calls: pushed at the
    #     outermost pre-hook, popped at its post-hook. A later top-level call before its
    #     backward whose inputs come out of a graph (``model.head(model.backbone(x))``) is the
    #     same step; the backward that begins after its calls ends it, at its final callback,
    #     as a ``with`` block whose backward ran inside it ends (its profile first, then the
    #     block's end). A top-level call with grad whose inputs carry no graph ends the open
    #     step as a block ends before its backward (a forward whose backward never comes:
    #     evaluation with grad, a backward that raised) and begins the next. Calls without
    #     grad (``no_grad``, ``inference_mode``) begin nothing and, between a step's calls,
    #     are not its. A top-level call that raised ends its step as a block that raised
    #     (ForwardRaised, registered only while installed).

    def _enter_installed(
        self, step: Step | None, args: Any, kwargs: Any, compiling: bool
    ) -> Step | None:
        """A module call while installed and no step's call runs: the step it begins or
        re-enters, else ``step`` as it was (NOTE [ Installed steps ])."""
        if (
            compiling
            or self._paused
            or threading.get_ident() != self._installed
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or (_current_graph_task_id is not None and _current_graph_task_id() != -1)
        ):
            return step
        with self._lock:
            if step is not None and step.running:
                joins = not step.backward_begun and any(
                    t.grad_fn is not None for t in tensors_in((args, kwargs))
                )
                if joins:  # another top-level call of the step
                    step.between = False
                    step.hooks_cm = torch.autograd.graph.saved_tensors_hooks(
                        self._pack_fn, self._unpack_fn
                    )
                    step.hooks_cm.__enter__()
                    return step
                self._end_step(step, None, None)
            self._begin_step()
            step = self._current
            step.installed = True
            return step

    def _on_forward_raised(self, name: str) -> None:
        """After a module call while installed: if it raised (its post-hook did not run), its
        frame goes; the step ends, failed, when its top-level call raised."""
        step = self._step
        if step is None or not step.installed or not step.running or step.between:
            return
        top = step.top
        exc_type, exc, _ = sys.exc_info()
        if top is None or top.module != name or exc_type is None or foreign_call(step.thread):
            return  # returned (ForwardPost took its frame), or not this step's call
        step.calls.pop()
        if not step.calls.frames:
            with self._lock:
                self._end_step(step, exc_type, exc)

    def _leave_installed(self, step: Step) -> None:
        """The installed step's top-level call returned: its hooks go off until the next."""
        step.between = True
        cm, step.hooks_cm = step.hooks_cm, None
        if step.hooks_popped:
            step.hooks_popped = False  # paused() took the pair off the stack already
        elif cm is not None:
            cm.__exit__(None, None, None)

    def _end_installed(self, step: Step) -> None:
        """The backward of an installed step ended (after ``_on_backward_end``)."""
        with self._lock:
            if step is self._step and step.running:
                self._end_step(step, None, None)

    def _on_forward_pre(self, hook: ForwardPre, args: Any, kwargs: Any, compiling: bool) -> None:
        """A module call of the model begins."""
        step = self._step
        if self._installed is not None and (step is None or not step.running or step.between):
            step = self._enter_installed(step, args, kwargs, compiling)
        if step is None or not step.running or step.between or foreign_call(step.thread):
            return
        budget = self._budget_bytes is not None and self._executor is not None
        grad = torch.is_grad_enabled()
        # Calls are numbered as lifecycle.Recorder numbers them: every call of the step from
        # its signature's start (the recorder begins there). Under a budget the step's
        # signature is that of the root's first call with grad: calls without grad before it
        # (a teacher's or an EMA target's forward through the same model) save nothing and
        # are not counted, so that the training forward after them is the one profiled and
        # planned, with the same record keys in every step.
        calls = step.calls
        call = calls.call_index(hook.name, count=not budget or step.signature_begun or grad)
        if self._paused:
            return
        if not compiling:
            _check_foreign_hooks(self._warn, hook.name, self._pack_fn, step.hooks_popped)
        top = step.top
        outer_kept = top is not None and top.kept
        if budget and grad and top is None and not step.signature_begun:
            step.signature_begun = True  # See NOTE [ Top-level calls ] in _budget.py
            self._begin_signature(args, kwargs, hook.name)
        if step.deferred and not compiling:  # (traced, it would break the graph; a pack will)
            self._flush_deferred()  # packed in the caller: stored before this call's packs
        # (Dynamo cannot trace the graph task id, and traces no backward.)
        backward = (
            not compiling and _current_graph_task_id is not None and _current_graph_task_id() != -1
        )
        if step.backwards and top is None and grad and not backward and not step.installed:
            _warn_several_backwards(self._warn)  # a training loop inside one ``with`` block
        calls.push(Entry(hook.name, call, kept=hook.kept or outer_kept), backward)
        if self._executor is not None:
            self._executor.poll()

    def _on_forward_post(self, module: nn.Module, output: Any) -> None:
        """A module call of the model returns."""
        step = self._step
        if step is None or not step.running or self._paused or not step.calls.frames:
            return
        if foreign_call(step.thread):
            return
        if step.deferred and not torch.compiler.is_compiling():
            self._flush_deferred()  # this call's last ops have returned
        entry = step.calls.pop()
        if step.installed and not step.calls.frames:
            self._leave_installed(step)
        name, own, call = entry.module, entry.own, entry.call_index
        noted = self._norms.note(module, output)
        if noted is not None:
            hold_norm_weights(self._norms, noted, output, self._params)
        ex = self._executor
        if ex is None or ex.step is None or not torch.is_grad_enabled():
            return
        ex.poll()
        active = step.active
        planned: list[Any] | None = None
        if active is not None and (name, call) in active.backward_triggers:
            got = ex.step.triggers.setdefault(("backward", name, call, -1), [])
            assert isinstance(got, list)  # (a backward trigger's families: a list, shared)
            planned = got
        if not own and planned is None:
            return
        # Backward of this module needs the families it packed itself (not its children's:
        # their own triggers fire when their backward comes); start those, and the look-ahead
        # window (or, under a plan, the reloads it starts here), from a pre-hook on its outputs'
        # grad_fn, which fires right before the module's backward and leaves the graph alone.
        families = own if planned is None else Both(own, planned)
        trigger = BackwardTrigger(self, families, ex.step, active is None)  # type: ignore[arg-type]
        seen: set[int] = set()
        for t in tensors_in(output):
            fn = t.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(trigger)

    def _on_module_backward(self, families: Any, step: Any, window: bool) -> None:
        """A module call's backward is about to run: start the reloads it needs."""
        ex = self._executor
        if ex is None:
            return
        held = self._held_clock()
        started = time.perf_counter() if held is not None else 0.0
        ex.prefetch(list(families), step, window=window)
        if held is not None:
            held.held_s += time.perf_counter() - started

    def _on_backward_begin(self, task: int) -> StepEnd:
        """The first unpack of backward ``task``: its end is queued."""
        ex = self._executor
        current = ex.step if ex is not None else None
        # The end of this backward ends a step's clock (and the current step's profile;
        # a pipeline round's profile ends with the round instead).
        end = self._task_ends[task] = StepEnd(
            self,  # type: ignore[arg-type]
            task,
            current,
            time.perf_counter,
            self._budget._profiling if self._round is None else None,
        )
        step = self._step
        if step is not None:
            step.again = None  # its member goes with autograd's use (NOTE [ Packed again ])
        if step is not None and step.running:
            if step.between:  # after its top-level calls: its backward (NOTE [ Installed steps ])
                step.backward_begun = True
                end.installed = step
            elif not step.installed:
                step.backwards += 1  # a backward inside a ``with`` block
        torch.autograd.Variable._execution_engine.queue_callback(end)
        return end

    def _on_backward_end(self, end: StepEnd) -> None:
        """A backward ended (autograd's final callback): the step whose backward it was gets
        its ``step_s`` (once), and a profiling step its profile's end."""
        self._task_ends.pop(end.task, None)
        step = end.step if end.step is not None else end.current
        if step is None or step.backward_seen:
            return
        step.backward_seen = True
        stats = step.stats
        step_s = stats.step_s = end.clock() - step.started_s
        with self._lock:
            if self._step is None or stats is not self._step.stats:
                # Another step began before this one's backward ended (pipelining, gradient
                # accumulation): this one is already in the totals, without its time.
                self._done.step_s += step_s
        if end.profiling is not None and step is end.current:
            with self._lock:
                self._budget._profile_ended(end.profiling, self._current)
        budget = self._budget_bytes
        if budget is not None and stats.predicted_peak_bytes and self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            sig = self._budget._last_signature
            if peak > budget and sig not in self._budget._over_budget:
                # docs/design.md "Budget": no mid-run re-plan; say it once per signature.
                self._budget._over_budget.add(sig)
                log.warning(
                    "offload: a planned step of signature %s peaked at %d bytes, above "
                    "gpu_budget=%d (predicted %d); lower the budget or raise the margin",
                    sig,
                    peak,
                    budget,
                    stats.predicted_peak_bytes,
                )
