"""``mgr.attach(stage)``: run a ``torch.distributed.pipelining`` stage's chunks as offload steps.

NOTE [ Pipelining ]
    A pipeline schedule runs, per rank, forward chunks (F), backward chunks (B, or I then W in
    zero-bubble schedules) of many microbatches, interleaved: under 1F1B stage 0 holds up to
    ``stages`` microbatches' activations at once, each waiting several slots for its backward.
    The attachment wraps the stage's ``forward_one_chunk``, ``backward_one_chunk`` and
    ``backward_weight_one_chunk`` (instance attributes; ``detach()`` restores them):
      * F of microbatch m is one step of the manager (``with mgr:``): what it saves leaves the
        device as it is packed, and the step's state is kept under (stage, m);
      * B or I of microbatch m first starts the reloads of m's families (the look-ahead window,
        from the last packed: the first backward needs), then runs; module triggers inside it
        keep the window moving as in any step;
      * W (zero-bubble) unpacks the weight-path tensors a second time: the window restarts from
        the end before it. Bytes are released when the graph of m dies (after B, or after W).
    Everything else is the manager's own: the schedule's first-step shape inference and the last
    stage's loss run outside any F and are not offloaded, and each rank's manager is its own.
    A forward-only run (``schedule.eval()``: the stage's ``has_backward`` is False, its B
    chunks return at once) offloads its F chunks in min-memory mode as any other; in budget
    mode its chunks run as they are (see below).

    Budget mode (``gpu_budget``, or ``plan=``): a round is one pass of the schedule over the
    stage's ``chunks`` microbatches, from the forward of the first to the last backward (B, or
    W). Each F is still a step of the executor (its own handles, released with its own graph),
    but the round is one step of the profile and of the plan: record keys (module, call,
    ordinal) count calls across the round, so microbatch m's records are distinct keys, and the
    profiled timeline is the stage's real one, with every microbatch's wait for its backward
    and the gaps where the stage waits for its neighbours. The planner then decides per
    microbatch (a long-waiting one of stage 0 leaves; a short one may stay) against this stage's
    own ``gpu_budget``, and planned reload triggers may be events of another microbatch (one
    trigger table per round). The first round of a signature (the root's input shapes, the stage
    and the microbatch count) runs in min-memory mode while it is recorded; later rounds run the
    plan. One manager per stage: a rank with several stages (interleaved, zero-bubble V) gives at
    most one of them a budget, since a budget bounds the whole device and the other stages'
    memory is taken as the fixed part of the profile (which holds only while they run in
    min-memory mode). A round cut short by an exception is dropped (its partial profile with
    it): one raised in a chunk at once, one raised outside the chunks (the loss function, the
    schedule between chunks) when the next schedule step forwards a microbatch the round
    already forwarded. Forward-only chunks (``schedule.eval()``) are no part of any round: no
    backward comes to end one or to use a plan, and a stage whose first run is forward-only
    does not know its microbatch count yet (``stage.chunks`` is set with the backward's
    set-up; a round begun there raised). They run as they are, neither offloaded nor profiled.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from offload._errors import OffloadError
from offload.lifecycle._inert import ModuleHook

_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def stages_of(target: Any) -> list[Any]:
    """The pipeline stages of a ``PipelineStage`` or a schedule (single- or multi-stage)."""
    if all(hasattr(target, m) for m in _METHODS) and hasattr(target, "stage_index"):
        return [target]
    stages = getattr(target, "_stages", None)
    if stages is None and getattr(target, "_stage", None) is not None:
        stages = [target._stage]
    if not stages or not all(hasattr(s, m) for s in stages for m in _METHODS):
        raise TypeError(
            "attach() takes a torch.distributed.pipelining PipelineStage or a pipeline schedule "
            f"(ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ...); got "
            f"{type(target).__name__}"
        )
    return list(stages)


class PipelineAttachment:
    """What :meth:`ActivationOffloader.attach` returns; ``detach()`` undoes it (idempotent).

    See NOTE [ Pipelining ] in this module.
    """

    def __init__(self, mgr: Any, target: Any) -> None:
        self._mgr = mgr
        self._stages = stages_of(target)
        for stage in self._stages:
            for name in _METHODS:
                if isinstance(stage.__dict__.get(name), _Wrapper):
                    raise OffloadError(
                        f"stage {stage.stage_index} is already attached to an offload manager"
                    )
        self._budgeted = mgr._budget_bytes is not None
        if self._budgeted:
            self._check_budgeted(mgr)
        self._done: set[int] = set()  # microbatches of the round whose last backward ended
        self._forwarded: set[int] = set()  # microbatches of the round whose forward ran
        # Microbatch steps overlap: resetting the CUDA peak counters at each forward chunk would
        # wipe the peak a caller measures over the schedule.
        mgr._reset_peaks = False
        self._steps: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> executor step
        self._wrapped: list[tuple[Any, str, Callable[..., Any]]] = []
        # The stage keeps each microbatch's inputs until its backward (its forward cache):
        # copying them out would free nothing. A hook on the stage's own module finds them,
        # whichever module the manager was made on (the stage's, or a container of several).
        self._input_hooks: list[Any] = []
        for stage in self._stages:
            submod = getattr(stage, "submod", None)
            if isinstance(submod, nn.Module):
                self._input_hooks.append(
                    submod.register_forward_pre_hook(_HoldInputs(mgr), with_kwargs=True)
                )
            self._wrap(stage, "forward_one_chunk", self._forward)
            self._wrap(stage, "backward_one_chunk", self._backward)
            self._wrap(stage, "backward_weight_one_chunk", self._backward_weight)

    def _check_budgeted(self, mgr: Any) -> None:
        if len(self._stages) != 1:
            raise OffloadError(
                f"attach(): a manager with gpu_budget runs one pipeline stage; this target has "
                f"{len(self._stages)} on this rank. Attach each stage to its own manager (made "
                "on that stage's module), at most one of them with gpu_budget."
            )
        stage = self._stages[0]
        model = mgr._model_ref()
        if getattr(stage, "submod", None) is not model:
            raise OffloadError(
                f"attach(): stage {stage.stage_index}'s module is not the module this manager "
                "was made on; a budgeted manager plans the calls of its own module. Make it "
                "with ActivationOffloader(stage.submod, gpu_budget=...)."
            )
        for other in list(_budgeted_attachments):
            if other.attached and other._mgr.device == mgr.device:
                raise OffloadError(
                    f"attach(): another budgeted manager already runs a pipeline stage on "
                    f"{mgr.device}; a budget bounds the whole device, so at most one stage per "
                    "device can have one (the others run in min-memory mode)."
                )
        _budgeted_attachments.add(self)

    @property
    def attached(self) -> bool:
        return bool(self._wrapped)

    def detach(self) -> None:
        """Give the stages their own methods back. Microbatches in flight keep their handles."""
        for stage, name, wrapper in self._wrapped:
            if stage.__dict__.get(name) is wrapper:
                del stage.__dict__[name]
        for hook in self._input_hooks:
            hook.remove()
        self._input_hooks.clear()
        if self._wrapped:
            self._mgr._reset_peaks = True
            self._abandon_round()  # a round cut short leaves no partial profile behind
        self._wrapped.clear()

    def __enter__(self) -> PipelineAttachment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _wrap(self, stage: Any, name: str, how: Callable[..., Any]) -> None:
        original = getattr(stage, name)
        wrapper = _Wrapper(functools.partial(how, stage, original))
        stage.__dict__[name] = wrapper
        self._wrapped.append((stage, name, wrapper))

    # -- the chunks ------------------------------------------------------------------------

    def _forward(self, stage: Any, original: Callable[..., Any], mb: int, *a: Any, **k: Any) -> Any:
        mgr = self._mgr
        if self._budgeted and not getattr(stage, "has_backward", True):
            # Forward only (``schedule.eval()``): no backward chunk comes to end a round or to
            # use a plan, and a stage first run this way does not know its microbatch count
            # yet. The chunk runs as it is (NOTE [ Pipelining ]).
            return original(mb, *a, **k)
        if self._budgeted and mgr._round is not None and mb in self._forwarded:
            # A round runs each microbatch's forward once: this is the next schedule step, and
            # the round was cut short outside any chunk (the loss function, or the schedule
            # between chunks, raised), where no wrapper saw it. Continued, it took the next
            # round's chunks as its own (a profile and plan of twice the microbatches).
            self._abandon_round()
        if self._budgeted and mgr._round is None:
            self._begin_round(stage)
        self._forwarded.add(mb)
        try:
            with mgr:
                out = original(mb, *a, **k)
                ex = mgr._executor
                if ex is not None and ex.step is not None:
                    self._steps[(stage.stage_index, mb)] = ex.step
        except BaseException:
            self._abandon_round()
            raise
        return out

    def _backward(
        self, stage: Any, original: Callable[..., Any], mb: int, *a: Any, **k: Any
    ) -> Any:
        if self._budgeted and not getattr(stage, "has_backward", True):
            return original(mb, *a, **k)  # forward only: the stage skips it (see _forward)
        key = (stage.stage_index, mb)
        self._prefetch(key, restart=False)
        full = k.get("full_backward", a[1] if len(a) > 1 else True)
        try:
            out = original(mb, *a, **k)
        except BaseException:
            self._steps.pop(key, None)
            self._abandon_round()
            raise
        if full:
            self._steps.pop(key, None)
            self._backward_done(stage, mb)
        return out

    def _backward_weight(
        self, stage: Any, original: Callable[..., Any], mb: int, *a: Any, **k: Any
    ) -> Any:
        key = (stage.stage_index, mb)
        self._prefetch(key, restart=True)
        try:
            out = original(mb, *a, **k)
        except BaseException:
            self._abandon_round()
            raise
        finally:
            self._steps.pop(key, None)
        self._backward_done(stage, mb)
        return out

    # -- rounds (budget mode) ------------------------------------------------------------------

    def _begin_round(self, stage: Any) -> None:
        chunks = getattr(stage, "chunks", None)
        if not isinstance(chunks, int) or chunks < 1:
            raise OffloadError(
                f"attach(): stage {stage.stage_index} does not know its number of microbatches "
                "(stage.chunks); run it through a torch.distributed.pipelining schedule"
            )
        self._done.clear()
        self._forwarded.clear()
        self._mgr._round = PipelineRound(
            label=f" (pipeline stage {stage.stage_index}, {chunks} microbatches)", chunks=chunks
        )

    def _backward_done(self, stage: Any, mb: int) -> None:
        rnd = self._mgr._round
        if not self._budgeted or rnd is None:
            return
        self._done.add(mb)
        if len(self._done) >= rnd.chunks:
            self._done.clear()
            self._forwarded.clear()
            self._mgr._end_round()

    def _abandon_round(self) -> None:
        if self._budgeted and self._mgr._round is not None:
            self._done.clear()
            self._forwarded.clear()
            self._mgr._abandon_round()

    def _prefetch(self, key: tuple[int, int], *, restart: bool) -> None:
        ex = self._mgr._executor
        step = self._steps.get(key)
        if ex is not None and step is not None:
            ex.prefetch_step(step, restart=restart)


@dataclass(eq=False)
class PipelineRound:
    """One pass of a budgeted stage's schedule (NOTE [ Pipelining ]), as the manager sees it."""

    label: str  # appended to the round's input signature
    chunks: int  # microbatches in the round
    steps: int = 0  # forward chunks entered so far
    # The plan's reload triggers of every microbatch of the round (set at its first chunk).
    triggers: dict[Any, Any] = field(default_factory=dict)


_budgeted_attachments: weakref.WeakSet[PipelineAttachment] = weakref.WeakSet()


class _Wrapper:
    """A stage method replaced by the attachment (a class, so detach can recognise it)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _HoldInputs(ModuleHook):
    """A forward pre-hook on a stage's module: its inputs are the stage's to hold (its manager
    is held weakly, as the manager's own module hooks hold it; a copy of the module gets a hook
    that does nothing)."""

    __slots__ = ("mgr",)

    def __init__(self, mgr: Any) -> None:
        self.mgr = weakref.ref(mgr)

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        mgr = self.mgr()
        if mgr is not None:
            mgr._hold_stage_inputs(args, kwargs)
