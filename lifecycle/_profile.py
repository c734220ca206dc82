"""``lifecycle.profile``: record training steps of a model with an injected clock and probe."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from offload.lifecycle._clock import Clock
from offload.lifecycle._recorder import MemoryProbe, Recorder
from offload.lifecycle._trace import EventKind, Trace
from offload.lifecycle._units import check_count


def profile(
    step_fn: Callable[[], Any],
    model: nn.Module,
    *,
    warmup_steps: int = 1,
    steps: int = 1,
    clock: Clock | None = None,
    memory_probe: MemoryProbe | None = None,
    metadata: dict[str, Any] | None = None,
) -> Trace:
    """Record the life of every tensor autograd saves during training steps.

    ``step_fn`` runs one whole step (forward and backward; an optimizer step too if you like). It
    is called ``warmup_steps`` times unobserved (first-call costs: allocator growth, autotuning,
    lazy initialisation), then ``steps`` times under the recorder. Nothing is offloaded.
    ``offload.profile`` is this function with the model's device clock and memory probe chosen
    for you (CUDA events and the allocator on a GPU).

    Args:
        step_fn: a callable with no arguments that runs forward and backward.
        model: the module whose submodules name the records.
        warmup_steps: unrecorded steps first (>= 0).
        steps: recorded steps (>= 1).
        clock: where times come from (default: the host clock).
        memory_probe: ``() -> bytes`` in use at each event (default: live saved bytes).
        metadata: extra facts stored in the trace's ``metadata``.

    Returns:
        A :class:`Trace`.

    Warns:
        RuntimeWarning: the recorded steps saved no tensor for backward, or ran no backward
            (a ``step_fn`` that only runs forward): the trace is returned all the same.

    Raises:
        TypeError: ``step_fn`` is not callable, ``model`` is not an ``nn.Module``, or
            ``warmup_steps`` / ``steps`` is not an int (a float or a bool).
        ValueError: ``warmup_steps < 0`` or ``steps < 1``.

    Example:
        >>> import torch, lifecycle
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        >>> x = torch.randn(8, 16)
        >>> trace = lifecycle.profile(lambda: model(x).sum().backward(), model)
        >>> sorted({r.module for r in trace.activation_records})
        ['0', '1', '2']
    """
    trace = record_steps(
        step_fn,
        model,
        warmup_steps=warmup_steps,
        steps=steps,
        clock=clock,
        memory_probe=memory_probe,
        metadata=metadata,
    )
    warn_if_unused(trace, stacklevel=2)
    return trace


def record_steps(
    step_fn: Callable[[], Any],
    model: nn.Module,
    *,
    warmup_steps: int,
    steps: int,
    clock: Clock | None,
    memory_probe: MemoryProbe | None,
    metadata: dict[str, Any] | None,
) -> Trace:
    """:func:`profile` without its warnings (their callers' line differs)."""
    if not callable(step_fn):
        raise TypeError(
            f"step_fn must be a callable running forward and backward; got {type(step_fn).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    check_count(warmup_steps, name="warmup_steps", minimum=0)
    check_count(steps, name="steps", minimum=1)
    for _ in range(warmup_steps):
        step_fn()
    rec = Recorder(clock=clock, memory_probe=memory_probe)
    with rec.attach(model), rec.hooks():
        for _ in range(steps):
            # step_fn runs on this thread: other threads' module calls meanwhile are not its.
            rec.begin_step(thread=threading.get_ident())
            try:
                step_fn()
            finally:
                rec.end_step()
    return rec.trace({"warmup_steps": warmup_steps, **(metadata or {})})


def warn_if_unused(trace: Trace, *, stacklevel: int) -> None:
    """Warn (``RuntimeWarning``, at the caller's ``stacklevel``) when the recorded steps saved
    nothing for backward, or ran no backward: a plan from such a trace keeps or moves tensors no
    backward reads, and the mistake (a ``step_fn`` that only runs forward, or runs under
    ``no_grad``) is easier to see here than in a plan."""
    if not trace.records:
        why = (
            "saved no tensor for backward (did step_fn call the model, with grad enabled?); "
            "the trace is empty"
        )
    elif not any(e.kind is EventKind.UNPACK for e in trace.events):
        saved = sum(1 for r in trace.records if not r.is_parameter)
        why = (
            f"ran no backward: none of the {len(trace.records)} saved tensors ({saved} "
            "activations) was used. step_fn must run forward and backward, e.g. "
            "lambda: model(x).sum().backward()"
        )
    else:
        return
    warnings.warn(
        f"profile: the {trace.steps} recorded step(s) {why}",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )
