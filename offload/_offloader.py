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
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import storage
from lifecycle._tensors import ParameterStorages, named_modules_stop_at_compiled, tensors_in
from lifecycle._units import parse_bytes
from offload._device import compute_device
from offload._errors import OffloadError
from offload._executor import Executor
from offload._stats import OffloadStats, StepStats

log = logging.getLogger("offload")

_TIERS = ("cpu", "nvme")
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_autograd = torch._C._autograd
_top_hooks = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_pop_hooks = getattr(_autograd, "_pop_saved_tensors_default_hooks", None)
_push_hooks = getattr(_autograd, "_push_saved_tensors_default_hooks", None)


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
        if not self.tiers:
            raise ValueError("tiers must name at least one of 'cpu', 'nvme'")
        for t in self.tiers:
            if t not in _TIERS:
                raise ValueError(f"tiers: {t!r} is not a tier; use 'cpu' and/or 'nvme'")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers: {self.tiers!r} names a tier twice")
        if "nvme" in self.tiers and self.nvme_dir is None:
            raise ValueError("nvme_dir is required when 'nvme' is in tiers")
        if self.nvme_dir is not None and not os.path.isdir(self.nvme_dir):
            raise ValueError(f"nvme_dir {self.nvme_dir!r} is not an existing directory")
        if self.on_infeasible not in ("raise", "min_memory"):
            raise ValueError(
                f"on_infeasible must be 'raise' or 'min_memory'; got {self.on_infeasible!r}"
            )


def _bytes_arg(name: str, value: Any, default: int) -> int:
    return default if value is None else parse_bytes(value, name=name)


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


class ActivationOffloader:
    """Moves the tensors autograd saves for backward off the device and back, one step at a time.

    In this release the manager runs in min-memory mode: every eligible saved tensor leaves the
    device during forward (bounded by ``max_inflight_bytes`` of copies in flight) and comes back
    ahead of its use in backward (a look-ahead window of the same size). Eligible: on the
    manager's compute device (the parameters' device: a CPU-only run exercises the whole path),
    not a parameter or buffer (decided by storage, so ``weight.t()`` counts), at least
    ``min_offload_bytes``, not saved inside a module listed in ``keep``, not saved while a
    backward runs. Views of one storage are stored once. Gradients are bitwise equal to a run
    without the manager.

    Args:
        model: the module whose forward runs inside the steps.
        gpu_budget: a device-memory budget; needs the planner, which is not built yet, so only
            ``None`` (min-memory mode) is accepted now.
        tiers: where bytes may go, in spill and fallback order: ``("cpu",)``, ``("nvme",)``,
            ``("cpu", "nvme")``, ``("nvme", "cpu")``.
        cpu_budget: the most bytes this manager keeps in host memory (int or "8GiB"); ``None``
            = half of the available RAM (cgroup aware) divided by the local ranks.
        nvme_dir: an existing directory on a fast disk; required with ``"nvme"``. The manager
            works in a private subdirectory (0700) with unlinked files (0600).
        min_offload_bytes: smaller saved tensors stay where they are.
        plan, hardware: reserved for the planner (must be ``None`` now).
        keep: module names (as in ``named_modules()``) or ``nn.Module`` types whose saved
            tensors never move.
        max_inflight_bytes: bound on copies out in flight and on the reload look-ahead; ``None``
            = 2 x the largest record seen, at least 256 MiB.
        on_infeasible: what to do for a budget that cannot be met ("raise" or "min_memory");
            used with budgets.

    Raises:
        TypeError / ValueError: a bad argument (the message names it and what is accepted).
        NotImplementedError: ``gpu_budget``, ``plan`` or ``hardware`` given.

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        for name, value in (("gpu_budget", gpu_budget), ("plan", plan), ("hardware", hardware)):
            if value is not None:
                raise NotImplementedError(
                    f"{name}= needs the budget planner, which is not built yet; leave it None for "
                    "min-memory mode (every eligible saved tensor is offloaded)"
                )
        if isinstance(tiers, str):
            tiers = (tiers,)
        keep_names, keep_types = _keep_arg(keep)
        self.config = OffloadConfig(
            tiers=tuple(tiers),
            cpu_budget_bytes=_bytes_arg("cpu_budget", cpu_budget, 0)
            or storage.default_cpu_budget_bytes(),
            nvme_dir=None if nvme_dir is None else os.fspath(nvme_dir),
            min_offload_bytes=parse_bytes(min_offload_bytes, name="min_offload_bytes"),
            keep_names=keep_names,
            keep_types=keep_types,
            max_inflight_bytes=_bytes_arg("max_inflight_bytes", max_inflight_bytes, 0),
            on_infeasible=on_infeasible,
        )
        unknown = keep_names - {n for n, _ in model.named_modules()}
        if unknown:
            raise ValueError(f"keep: no module named {sorted(unknown)!r} in the model")
        self._model_ref = weakref.ref(model)
        self.device = compute_device(model)
        self._engine = _copy_engine
        self._tiers: list[storage.Tier] | None = None  # made at the first step
        self._executor: Executor | None = None
        self._done = StepStats()  # steps before the last one
        self._step_index = 0
        self._in_step = False
        self._paused = 0
        self._closed = False
        self._lock = threading.RLock()
        self._hooks_cm: Any = None
        self._step_stats: StepStats | None = None
        self._step_added = True
        self._backward_seen = False
        # [module path, kept, families this call packed itself (offloaded ones, in pack order)]
        self._stack: list[list[Any]] = []
        self._warned: set[str] = set()
        self._params = ParameterStorages()
        self._module_handles = self._install_module_hooks(model)
        self._pack_fn, self._unpack_fn = self._pack, self._unpack
        # Closed on garbage collection and at exit too; the finalizer holds only the resources.
        self._resources: list[Any] = []
        self._finalizer = weakref.finalize(
            self, _close_resources, self._module_handles, self._resources
        )

    # -- public --------------------------------------------------------------------------------

    @property
    def stats(self) -> OffloadStats:
        """``OffloadStats(last=..., total=...)``: a snapshot; ``last`` is the most recent step
        (its backward counts once it ran)."""
        with self._lock:
            last = self._snapshot_last()
            total = dataclasses.replace(self._done, _leads=list(self._done._leads))
            if last.steps:
                total.add(last)
            return OffloadStats(last=last, total=total)

    @property
    def plan(self) -> None:
        """The plan of the last step's signature: ``None`` in min-memory mode (no planner yet)."""
        return None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ActivationOffloader:
        with self._lock:
            if self._closed:
                raise OffloadError("this ActivationOffloader is closed; make a new one")
            if self._in_step:
                raise OffloadError("a step of this manager is already running; steps do not nest")
            if self._executor is None:
                self._executor = self._make_executor()
            self._account_last()
            self._step_index += 1
            self._step_stats = self._executor.begin_step(self._step_index)
            self._step_added = False
            self._backward_seen = False
            self._stack.clear()
            self._refresh_params()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            if _top_hooks is not None and _top_hooks(False) is not None:
                self._warn_once(
                    "foreign",
                    "another saved_tensors_hooks context is active around this step; offload's "
                    "hooks take precedence inside it",
                )
            self._maybe_hide_from_compile()
            self._hooks_cm = torch.autograd.graph.saved_tensors_hooks(
                self._pack_fn, self._unpack_fn
            )
            self._hooks_cm.__enter__()
            self._in_step = True
            return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        with self._lock:
            if not self._in_step:
                return
            self._in_step = False
            cm, self._hooks_cm = self._hooks_cm, None
            cm.__exit__(None, None, None)
            assert self._executor is not None
            if exc_type is not None:
                # The traceback keeps the graph (and every packed handle) alive: release now.
                self._executor.fail_step()
            else:
                self._executor.poll()
            self._stack.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Turn the hooks off for a region (``torch.func`` transforms, eval, code to keep)."""
        with self._lock:
            # Pop only our own pair: a foreign pair on top shadows ours already (only the
            # innermost fires), and popping it would take its packs away and leave ours on top.
            top = _top_hooks(False) if self._in_step and _top_hooks is not None else None
            ours = top is not None and top[0] is self._pack_fn and _push_hooks is not None
            if ours and _pop_hooks is not None:
                _pop_hooks()
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if ours and _push_hooks is not None:
                    _push_hooks(self._pack_fn, self._unpack_fn)

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
            self._account_last()
            self._finalizer.detach()
            for h in self._module_handles:
                h.remove()
            if self._executor is not None:
                self._executor.close()
            for tier in self._tiers or ():
                tier.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._step_index} steps"
        return f"ActivationOffloader(device={self.device}, tiers={self.config.tiers}, {state})"

    # -- setup ---------------------------------------------------------------------------------

    def _make_executor(self) -> Executor:
        cfg = self.config
        inflight = cfg.max_inflight_bytes  # 0: the executor's automatic bound
        # NVMe records pass through pinned staging on their way out and back in: the pool holds
        # room for that (copies out in flight plus the reload window) beyond the host tier's
        # cpu_budget, so a full host tier can still spill.
        staging = 2 * (inflight or 256 << 20) if "nvme" in cfg.tiers else 0
        pool = storage.shared_host_pool(
            cfg.cpu_budget_bytes + staging, pin_memory=self.device.type == "cuda"
        )
        tiers: list[storage.Tier] = []
        for name in cfg.tiers:
            if name == "cpu":
                tiers.append(storage.HostTier(pool, copy_engine=self._engine))
            else:
                assert cfg.nvme_dir is not None
                tiers.append(storage.NvmeTier(cfg.nvme_dir, pool=pool, copy_engine=self._engine))
        self._tiers = tiers
        ex = Executor(
            device=self.device,
            tiers=tiers,
            cpu_budget_bytes=cfg.cpu_budget_bytes,
            max_inflight_bytes=inflight,
            prefetch_bytes=inflight,
            pool=pool,
            staging_bytes=staging,
        )
        self._resources[:] = [ex, *tiers]
        return ex

    def _install_module_hooks(self, model: nn.Module) -> list[Any]:
        handles = []
        for name, mod in named_modules_stop_at_compiled(model):
            kept = name in self.config.keep_names or isinstance(mod, self.config.keep_types)
            handles.append(mod.register_forward_pre_hook(_ForwardPre(self, name, kept)))
            handles.append(mod.register_forward_hook(_ForwardPost(self)))
        return handles

    def _refresh_params(self) -> None:
        # By storage, refreshed every step: FSDP2 and users swap parameters between steps.
        model = self._model_ref()
        self._params.clear()
        if model is not None:
            self._params.add(model)

    def _maybe_hide_from_compile(self) -> None:
        # Pack and unpack are torch.compiler.disable'd, but only once dynamo is in use: importing
        # it costs seconds, and without it nothing can trace them.
        if self._pack_fn is self._pack and "torch._dynamo" in sys.modules:
            self._pack_fn = torch.compiler.disable(self._pack)
            self._unpack_fn = torch.compiler.disable(self._unpack)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"offload: {msg}", RuntimeWarning, stacklevel=3)

    def _snapshot_last(self) -> StepStats:
        s = self._step_stats
        if s is None:
            return StepStats()
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
        # folded into the running total when the next step starts (or at close).
        if self._step_stats is not None and not self._step_added:
            self._done.add(self._snapshot_last())
            self._step_added = True

    # -- hooks ---------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        ex = self._executor
        stats = self._step_stats
        if ex is None or stats is None or self._paused:
            return t.detach()
        stats.records += 1
        if _current_graph_task_id is not None and _current_graph_task_id() != -1:
            stats.records_kept += 1  # packed by a backward (recomputation, double backward)
            return t.detach()
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._warn_once("graphs", "CUDA graph capture: saved tensors are left in place")
            stats.records_kept += 1
            return t.detach()
        dtensor = None
        local = t
        if type(t) is not torch.Tensor and hasattr(t, "_local_tensor"):  # a DTensor: its shard
            local = t._local_tensor
            dtensor = (t.device_mesh, t.placements, t.shape, t.stride())  # type: ignore[attr-defined]
        module, kept = (
            (self._stack[-1][0], self._stack[-1][1]) if self._stack else ("<outside>", False)
        )
        if (
            kept
            or local.device != self.device
            or local.numel() * local.element_size() < self.config.min_offload_bytes
            or local.numel() == 0
            or self._params.holds(local, local.untyped_storage())
        ):
            stats.records_kept += 1
            return t.detach()
        member = ex.offload(local.detach(), module, dtensor)
        if self._stack:
            own = self._stack[-1][2]
            if not own or own[-1] is not member.family:
                own.append(member.family)
        return member

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if (
            not self._backward_seen
            and self._step_stats is not None
            # Unpack also runs outside backward (``grad_fn._saved_self``), where queue_callback
            # raises "Final callbacks can only be installed during backward pass".
            and (_current_graph_task_id is None or _current_graph_task_id() != -1)
        ):
            self._backward_seen = True
            # The end of this backward ends the step's clock.
            torch.autograd.Variable._execution_engine.queue_callback(
                _StepEnd(self, self._step_stats, time.perf_counter)
            )
        return packed.executor.unpack(packed)


class _ForwardPre:
    __slots__ = ("kept", "mgr", "name")

    def __init__(self, mgr: ActivationOffloader, name: str, kept: bool) -> None:
        self.mgr, self.name, self.kept = mgr, name, kept

    def __call__(self, module: nn.Module, args: Any) -> None:
        mgr = self.mgr
        if not mgr._in_step or mgr._paused:
            return
        outer_kept = bool(mgr._stack) and mgr._stack[-1][1]
        mgr._stack.append([self.name, self.kept or outer_kept, []])
        if mgr._executor is not None:
            mgr._executor.poll()


class _ForwardPost:
    __slots__ = ("mgr",)

    def __init__(self, mgr: ActivationOffloader) -> None:
        self.mgr = mgr

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        mgr = self.mgr
        if not mgr._in_step or mgr._paused or not mgr._stack:
            return
        _, _, own = mgr._stack.pop()
        ex = mgr._executor
        if ex is None or ex.step is None or not torch.is_grad_enabled():
            return
        ex.poll()
        if not own:
            return
        # Backward of this module needs the families it packed itself (not its children's:
        # their own triggers fire when their backward comes); start those, and the look-ahead
        # window, from a pre-hook on its outputs' grad_fn, which fires right before the module's
        # backward and leaves the graph alone.
        trigger = _BackwardTrigger(mgr, own, ex.step)
        seen: set[int] = set()
        for t in tensors_in(output):
            fn = t.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(trigger)


class _BackwardTrigger:
    __slots__ = ("families", "mgr", "step")

    def __init__(self, mgr: ActivationOffloader, families: list[Any], step: Any) -> None:
        # ``step``: the executor's state of the step whose forward registered this trigger; by
        # the time its backward runs, another step may have begun.
        self.mgr, self.families, self.step = mgr, families, step

    def __call__(self, grad_outputs: Any) -> None:
        ex = self.mgr._executor
        if ex is not None:
            ex.prefetch(self.families, self.step)


class _StepEnd:
    __slots__ = ("clock", "mgr", "stats")

    def __init__(self, mgr: ActivationOffloader, stats: StepStats, clock: Any) -> None:
        self.mgr, self.stats, self.clock = mgr, stats, clock

    def __call__(self) -> None:
        ex = self.mgr._executor
        if ex is not None and ex.step is not None and ex.step.stats is self.stats:
            self.stats.step_s = self.clock() - ex.step.started_s


def _close_resources(handles: list[Any], resources: list[Any]) -> None:
    for h in handles:
        with contextlib.suppress(Exception):
            h.remove()
    for r in resources:  # the executor first, then the tiers
        with contextlib.suppress(Exception):
            r.close()


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

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Linear(256, 256)
        >>> with offload.activations(model, min_offload_bytes=0):
        ...     loss = model(torch.randn(64, 256, requires_grad=True)).pow(2).sum()
        >>> loss.backward()
        >>> offload.activations(model, min_offload_bytes=0) is offload.activations(model, min_offload_bytes=0)
        True
    """
    tiers = (tiers,) if isinstance(tiers, str) else tuple(tiers)
    key = (tiers, None if nvme_dir is None else os.fspath(nvme_dir), min_offload_bytes)
    with _cache_lock:
        per_model = _cache.setdefault(model, {})
        mgr = per_model.get(key)
        if mgr is None or mgr.closed:
            mgr = per_model[key] = ActivationOffloader(
                model, tiers=tiers, nvme_dir=nvme_dir, min_offload_bytes=min_offload_bytes
            )
        return mgr
