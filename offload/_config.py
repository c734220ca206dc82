"""``OffloadConfig`` (the manager's settings as numbers) and the checks of the manager's arguments.

Bad arguments raise ``TypeError`` / ``ValueError`` here, at the API boundary, naming the value
and what would be accepted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offload import storage
from offload._info import check_nvme_dir
from offload._planned import load_plan, rooted_plan
from offload._planning import resolve_budget
from offload._warnings import (
    _warn_keep_covers_nothing,
    _warn_nvme_dir_ignored,
    _warn_plan_without_kept,
)
from offload.lifecycle import HardwareModel, Plan
from offload.lifecycle._tensors import named_modules_stop_at_compiled
from offload.lifecycle._units import parse_bytes, size_note

_TIERS = ("cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """The manager's settings, validated and resolved to numbers (units in the names)."""

    tiers: tuple[str, ...]
    cpu_budget_bytes: int
    nvme_dir: str | None
    min_offload_bytes: int
    keep_names: frozenset[str]
    keep_types: tuple[type, ...]
    max_inflight_bytes: int  # 0 = 2 x the largest record, at least 256 MiB
    on_infeasible: str

    def __post_init__(self) -> None:
        _check_tiers(self.tiers)
        if "nvme" in self.tiers and self.nvme_dir is None:
            raise ValueError("nvme_dir is required when 'nvme' is in tiers")
        if self.nvme_dir is not None:
            check_nvme_dir(self.nvme_dir)  # NvmeDirError (a ValueError) says what is wrong
        if self.tiers == ("cpu",) and self.cpu_budget_bytes == 0:
            raise ValueError(
                "cpu_budget 0 leaves the only tier, 'cpu', no room; give a positive cpu_budget, "
                "None for the node-aware default, or add 'nvme' to tiers"
            )
        if self.on_infeasible not in ("raise", "min_memory"):
            raise ValueError(
                f"on_infeasible must be 'raise' or 'min_memory'; got {self.on_infeasible!r}"
            )


def _check_tiers(tiers: tuple[str, ...]) -> None:
    if not tiers:
        raise ValueError("tiers must name at least one of 'cpu', 'nvme'")
    for t in tiers:
        if t not in _TIERS:
            raise ValueError(f"tiers: {t!r} is not a tier; use 'cpu' and/or 'nvme'")
    if len(set(tiers)) != len(tiers):
        raise ValueError(f"tiers: {tiers!r} names a tier twice")


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")


def _tiers_arg(tiers: Any) -> tuple[str, ...]:
    if isinstance(tiers, str):
        tiers = (tiers,)
    if not isinstance(tiers, Iterable) or isinstance(tiers, (bytes, bytearray)):
        raise TypeError(
            f"tiers must be 'cpu', 'nvme' or a sequence of them; got {type(tiers).__name__}"
        )
    tiers = tuple(tiers)
    _check_tiers(tiers)
    return tiers


def _check_nvme_dir_type(nvme_dir: Any) -> None:
    if nvme_dir is not None and not isinstance(nvme_dir, (str, os.PathLike)):
        raise TypeError(
            f"nvme_dir must be a directory path (str or os.PathLike) or None; got "
            f"{type(nvme_dir).__name__}"
        )


def _inflight_arg(value: Any) -> int:
    """``max_inflight_bytes`` as the config holds it: 0 for automatic (``None``)."""
    if value is None:
        return 0
    # 1 byte lets one record out at a time; 0 would mean "automatic" in the config.
    return parse_bytes(
        value,
        name="max_inflight_bytes",
        positive=True,
        or_none="automatic: twice the largest record, at least 256 MiB",
    )


def _keep_arg(keep: Any) -> tuple[frozenset[str], tuple[type, ...]]:
    if isinstance(keep, (str, type)):
        keep = (keep,)
    try:
        items = tuple(keep)
    except TypeError:
        raise TypeError(
            f"keep must be module names or nn.Module types; got {type(keep).__name__}"
        ) from None
    names, types = [], []
    for k in items:
        if isinstance(k, str):
            names.append(k)
        elif isinstance(k, type) and issubclass(k, nn.Module):
            types.append(k)
        else:
            raise TypeError(f"keep: {k!r} is neither a module name (str) nor an nn.Module subclass")
    return frozenset(names), tuple(types)


def _check_hardware_arg(hardware: Any) -> None:
    if hardware is not None and not isinstance(hardware, (HardwareModel, str, os.PathLike)):
        raise TypeError(
            "hardware must be a lifecycle.HardwareModel, a path to one saved as JSON, or None "
            f"(probe this machine at the first plan); got {type(hardware).__name__}"
        )


def _check_keep_names(model: nn.Module, keep_names: frozenset[str]) -> None:
    unknown = keep_names - {n for n, _ in model.named_modules()}
    if unknown:
        raise ValueError(
            f"keep: no module named {sorted(unknown)!r} in the model; keep takes names as "
            "model.named_modules() gives them ('blocks', 'blocks.0.mlp', '' for the root) "
            "or nn.Module types"
        )


def _check_user_plan(
    user_plan: Plan,
    *,
    gpu_budget: Any,
    budget_bytes: int,
    budget_given: bool,
    tiers: tuple[str, ...],
    model: nn.Module,
) -> None:
    """The plan given with ``plan=`` fits this manager: its budget, its tiers, its model."""
    if budget_given and user_plan.predicted_peak_bytes > budget_bytes:
        # The plan is run as it is (no profiling for its signature): it cannot hold a
        # smaller budget than it was made for.
        given = (
            size_note(gpu_budget, budget_bytes)
            if isinstance(gpu_budget, str)
            else f"{gpu_budget!r} ({budget_bytes} bytes)"
        )
        raise ValueError(
            f"plan: the given plan predicts a peak of {user_plan.predicted_peak_bytes} "
            f"bytes, above gpu_budget={given}; "
            "plan offline for this budget, or leave gpu_budget out to use the plan's"
        )
    missing = [
        t for t in ("cpu", "nvme") if user_plan.bytes_by_placement()[t] > 0 and t not in tiers
    ]
    if missing:
        raise ValueError(
            f"plan: the given plan moves records to {missing!r}, which are not in "
            f"tiers={tiers!r}; add them to tiers (with nvme_dir for "
            "'nvme'), or plan offline with this manager's tiers"
        )
    names = {n for n, _ in named_modules_stop_at_compiled(model)} - {""}
    unknown_calls = sorted({m for m, _ in user_plan.recompute_calls} - names)
    if unknown_calls:
        raise ValueError(
            f"plan: recompute_calls name {unknown_calls}, which are not modules of this "
            "model below its root (or lie inside a compiled one): a plan is made for the "
            "model it was profiled on"
        )


def _keeps(config: OffloadConfig, name: str, mod: nn.Module) -> bool:
    """Whether ``keep=`` names module ``name`` (by name or type), or it is an ``nn.RReLU``:
    in training its op saves its noise tensor before its kernel fills it, and the fill
    leaves the version counter as it was (torch 2.13), so a copy taken at pack holds the
    bytes from before the fill and no check can tell: kept, always (see NOTE [ Fill after
    pack ] in lifecycle's recorder, which names them in a trace's kept modules)."""
    return name in config.keep_names or isinstance(mod, (*config.keep_types, nn.RReLU))


# NOTE [ Keep covers the module tree ]: a module named in keep= (or of a type in it) keeps
# everything saved inside it and inside its descendants, decided by name prefix over the
# module tree (lifecycle's ``within``, as the planner reads a trace's kept modules), not by
# the module being called: an ``nn.ModuleList`` or ``nn.ModuleDict`` has no forward, so its
# own hooks never run, and only its children's calls can carry the keep.


def _kept_modules(config: OffloadConfig, model: nn.Module) -> list[str]:
    return [
        name for name, mod in named_modules_stop_at_compiled(model) if _keeps(config, name, mod)
    ]


def _config_of(
    model: Any,
    *,
    hardware: Any,
    tiers: Any,
    cpu_budget: Any,
    nvme_dir: Any,
    min_offload_bytes: Any,
    keep: Any,
    max_inflight_bytes: Any,
    on_infeasible: str,
) -> OffloadConfig:
    """The manager's arguments checked (in this order: a bad one raises naming it) and resolved
    to an :class:`OffloadConfig`; warns about those that would do nothing."""
    _check_model(model)
    _check_hardware_arg(hardware)
    tiers = _tiers_arg(tiers)  # checked before the warning below, which reads them
    _check_nvme_dir_type(nvme_dir)
    if nvme_dir is not None and "nvme" not in tiers:
        _warn_nvme_dir_ignored(nvme_dir, tiers)
        nvme_dir = None
    keep_names, keep_types = _keep_arg(keep)
    config = OffloadConfig(
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
    return config


def _plan_and_budget(
    plan: Any, gpu_budget: Any, model: nn.Module, device: torch.device, config: OffloadConfig
) -> tuple[Plan | None, int | None]:
    """The plan given with ``plan=`` (loaded, rooted at ``model``, checked against this
    manager) and the budget in bytes (``None``: min-memory mode)."""
    user_plan = load_plan(plan)
    if user_plan is not None:
        user_plan = rooted_plan(user_plan, model)
    budget_given = gpu_budget is not None
    if gpu_budget is None and user_plan is not None:
        gpu_budget = user_plan.gpu_budget_bytes
    # No step fits in no memory: 0 is refused here, not by the plan after the profiling step.
    budget_bytes = (
        None
        if gpu_budget is None
        else resolve_budget(gpu_budget, device, positive=True, or_none="min-memory mode")
    )
    if user_plan is not None:
        assert budget_bytes is not None
        _check_user_plan(
            user_plan,
            gpu_budget=gpu_budget,
            budget_bytes=budget_bytes,
            budget_given=budget_given,
            tiers=config.tiers,
            model=model,
        )
        unplanned = set(_kept_modules(config, model)) - set(
            user_plan.metadata.get("kept_modules") or ()
        )
        if unplanned:
            _warn_plan_without_kept(unplanned)
    return user_plan, budget_bytes
