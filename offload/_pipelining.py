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
    Budget mode (``gpu_budget``) is not built for pipelines yet: a microbatch's plan would need
    to know how long it waits for its backward; ``attach`` refuses a budgeted manager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from offload._errors import OffloadError

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
        if mgr._budget_bytes is not None:
            raise OffloadError(
                "attach(): a pipeline stage runs in min-memory mode; gpu_budget (planning each "
                "microbatch's wait) is not built for pipelines yet. Make the manager without "
                "gpu_budget and plan=."
            )
        self._mgr = mgr
        self._stages = stages_of(target)
        # Microbatch steps overlap: resetting the CUDA peak counters at each forward chunk would
        # wipe the peak a caller measures over the schedule.
        mgr._reset_peaks = False
        self._steps: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> executor step
        self._wrapped: list[tuple[Any, str, Callable[..., Any]]] = []
        for stage in self._stages:
            for name in _METHODS:
                if isinstance(stage.__dict__.get(name), _Wrapper):
                    raise OffloadError(
                        f"stage {stage.stage_index} is already attached to an offload manager"
                    )
            self._wrap(stage, "forward_one_chunk", self._forward)
            self._wrap(stage, "backward_one_chunk", self._backward)
            self._wrap(stage, "backward_weight_one_chunk", self._backward_weight)

    @property
    def attached(self) -> bool:
        return bool(self._wrapped)

    def detach(self) -> None:
        """Give the stages their own methods back. Microbatches in flight keep their handles."""
        for stage, name, wrapper in self._wrapped:
            if stage.__dict__.get(name) is wrapper:
                del stage.__dict__[name]
        if self._wrapped:
            self._mgr._reset_peaks = True
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
        with mgr:
            out = original(mb, *a, **k)
            ex = mgr._executor
            if ex is not None and ex.step is not None:
                self._steps[(stage.stage_index, mb)] = ex.step
        return out

    def _backward(
        self, stage: Any, original: Callable[..., Any], mb: int, *a: Any, **k: Any
    ) -> Any:
        key = (stage.stage_index, mb)
        self._prefetch(key, restart=False)
        try:
            return original(mb, *a, **k)
        finally:
            full = k.get("full_backward", a[1] if len(a) > 1 else True)
            if full:
                self._steps.pop(key, None)

    def _backward_weight(
        self, stage: Any, original: Callable[..., Any], mb: int, *a: Any, **k: Any
    ) -> Any:
        key = (stage.stage_index, mb)
        self._prefetch(key, restart=True)
        try:
            return original(mb, *a, **k)
        finally:
            self._steps.pop(key, None)

    def _prefetch(self, key: tuple[int, int], *, restart: bool) -> None:
        ex = self._mgr._executor
        step = self._steps.get(key)
        if ex is not None and step is not None:
            ex.prefetch_step(step, restart=restart)


class _Wrapper:
    """A stage method replaced by the attachment (a class, so detach can recognise it)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)
