"""``offload.plan``: :func:`lifecycle.plan` with the hardware probed and budgets resolved here.

``lifecycle.plan`` is pure and takes everything as data; this wrapper fills in what only a live
process knows: the measured hardware (``probe_hardware()``, cached) when none is given, a hardware
file path, and a budget given as a share of the device's memory ("85%").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from offload import lifecycle
from offload._errors import from_infeasible
from offload._probe import probe_hardware
from offload.lifecycle import HardwareModel, Plan, Trace
from offload.lifecycle._units import parse_bytes

_T = TypeVar("_T")


def load_arg_file(load: Callable[[str], _T], path: str | os.PathLike[str], name: str) -> _T:
    """``load(path)`` for the argument ``name``, whose errors name it and the file: a missing
    file raised a bare ``[Errno 2] No such file or directory``, a wrong one "not valid JSON",
    with nothing saying which argument. The exception's type is kept."""
    shown = f"{name}={os.fspath(path)!r}"
    try:
        return load(os.fspath(path))
    except OSError as e:
        raise type(e)(f"{shown}: cannot read it: {e.strerror or e}") from e
    except ValueError as e:
        raise ValueError(f"{shown}: {e}") from e


def resolve_hardware(
    hardware: HardwareModel | str | os.PathLike[str] | None, device: torch.device
) -> HardwareModel:
    """A model as given, read from a path, or probed on ``device`` (cached) when ``None``."""
    if hardware is None:
        return probe_hardware(device=device)
    if isinstance(hardware, HardwareModel):
        return hardware
    if isinstance(hardware, (str, os.PathLike)):
        return load_arg_file(HardwareModel.load, hardware, "hardware")
    raise TypeError(
        "hardware must be a lifecycle.HardwareModel, a path to one saved as JSON, or None (probe "
        f"this machine); got {type(hardware).__name__}"
    )


def resolve_budget(
    gpu_budget: int | str, device: torch.device, *, positive: bool = False, or_none: str = ""
) -> int:
    """Bytes for an int, a size string, or a percentage of ``device``'s memory
    (``positive`` and ``or_none`` as for :func:`lifecycle._units.parse_bytes`)."""
    if isinstance(gpu_budget, bool) or not isinstance(gpu_budget, (int, str)):
        # Checked here: parse_bytes offers a percentage only when it has the total at hand.
        raise TypeError(
            "gpu_budget must be an int (bytes) or a string like '12GiB' or '85%' (of a CUDA "
            f"device's memory); got {type(gpu_budget).__name__}"
        )
    total = None
    if isinstance(gpu_budget, str) and gpu_budget.strip().endswith("%"):
        if device.type != "cuda":
            raise ValueError(
                f"gpu_budget={gpu_budget!r}: a percentage needs a CUDA device; give bytes or a "
                "size such as '512MiB' on CPU"
            )
        total = torch.cuda.get_device_properties(device).total_memory
    return parse_bytes(
        gpu_budget, name="gpu_budget", total=total, positive=positive, or_none=or_none
    )


def trace_device(trace: Trace) -> torch.device:
    """The device a trace was recorded on, if this process has it; else the CPU."""
    name = str(trace.metadata.get("device", ""))
    if not name and trace.records:
        name = trace.records[0].device
    if name.startswith("cuda") and torch.cuda.is_available():
        return torch.device(name)
    return torch.device("cpu")


def plan(
    trace: Trace,
    gpu_budget: int | str,
    hardware: HardwareModel | str | os.PathLike[str] | None = None,
    *,
    tiers: Iterable[str] = ("cpu",),
    cpu_budget: int | str | None = None,
    nvme_bytes: int | str | None = None,
    min_offload_bytes: int | str = 1 << 20,
    margin: int | str | None = None,
    max_inflight_bytes: int | str | None = None,
    step: int = -1,
    simulate_records: int = 20_000,
    signature: str = "",
) -> Plan:
    """Plan where each activation of a traced step waits so that the step fits ``gpu_budget``.

    :func:`lifecycle.plan` (see it for every argument) with: ``hardware=None`` probing this
    machine once (:func:`offload.probe_hardware`, cached on disk) or a path loading a saved
    model, ``gpu_budget`` also accepting a percentage of the device's memory (``"85%"``), and
    :class:`offload.BudgetInfeasibleError` raised for a budget no plan meets.

    Example:
        >>> import torch, offload
        >>> nn = torch.nn
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(3)])
        >>> trace = offload.profile(lambda: model(torch.randn(512, 256)).sum().backward(), model)
        >>> p = offload.plan(trace, trace.peak_memory_bytes // 2, offload.HardwareModel.h200(),
        ...                  min_offload_bytes=0, margin=0)
        >>> p.predicted_peak_bytes <= trace.peak_memory_bytes // 2
        True
        >>> try:
        ...     offload.plan(trace, 1, offload.HardwareModel.h200(), min_offload_bytes=0, margin=0)
        ... except offload.BudgetInfeasibleError as e:
        ...     print(e.min_feasible_bytes > 1)
        True
    """
    if not isinstance(trace, Trace):  # checked first: the device and the hardware come from it
        raise TypeError(
            "trace must be a lifecycle.Trace (offload.Trace.load(path) reads a saved one); got "
            f"{type(trace).__name__}"
        )
    device = trace_device(trace)
    hw = resolve_hardware(hardware, device)
    budget = resolve_budget(gpu_budget, device)
    try:
        return lifecycle.plan(
            trace,
            budget,
            hw,
            tiers=tiers,
            cpu_budget=cpu_budget,
            nvme_bytes=nvme_bytes,
            min_offload_bytes=min_offload_bytes,
            margin=margin,
            max_inflight_bytes=max_inflight_bytes,
            step=step,
            simulate_records=simulate_records,
            signature=signature,
        )
    except lifecycle.BudgetInfeasibleError as e:
        raise from_infeasible(e) from None
