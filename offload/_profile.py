"""``offload.profile``: ``lifecycle.profile`` with the model's device clock and memory probe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from offload._device import clock_and_probe, compute_device
from offload.lifecycle import Trace
from offload.lifecycle._profile import record_steps, warn_if_unused


def profile(
    step_fn: Callable[[], Any], model: nn.Module, *, warmup_steps: int = 1, steps: int = 1
) -> Trace:
    """Record the life of every tensor autograd saves during training steps.

    ``step_fn`` runs one whole step (forward and backward; an optimizer step too if you like). It
    is called ``warmup_steps`` times unobserved (first-call costs: allocator growth, autotuning,
    lazy initialisation), then ``steps`` times under the recorder. Nothing is offloaded. Times
    come from CUDA events and memory from the CUDA allocator when the model is on a GPU, from the
    host clock and the live saved bytes otherwise (:func:`lifecycle.profile` takes both injected).

    Args:
        step_fn: a callable with no arguments that runs forward and backward.
        model: the module whose submodules name the records.
        warmup_steps: unrecorded steps first (>= 0).
        steps: recorded steps (>= 1).

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
        >>> import torch, offload
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        >>> x = torch.randn(8, 16)
        >>> trace = offload.profile(lambda: model(x).sum().backward(), model)
        >>> sorted({r.module for r in trace.activation_records})
        ['0', '1', '2']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    clock, probe, label = clock_and_probe(compute_device(model))
    trace = record_steps(
        step_fn,
        model,
        warmup_steps=warmup_steps,
        steps=steps,
        clock=clock,
        memory_probe=probe,
        metadata={"device": label, "source": "offload.profile"},
    )
    warn_if_unused(trace, stacklevel=2)
    return trace
