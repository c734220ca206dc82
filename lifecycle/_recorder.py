"""The lifecycle recorder: logs every tensor autograd saves during a step, and when it is used.

The recorder observes only. Its pack hook returns a small handle holding ``t.detach()``; its unpack
hook returns that tensor. Module hooks give the module path, forward spans and, through pre-hooks
on the outputs' ``grad_fn``, backward spans. Time and memory come from an injected clock and
memory probe, so this module makes no CUDA call.

NOTE [ Alias families ]
    A family is one live storage at one version: it is keyed on the storage's Python object (held
    weakly) plus ``t._version``, never on ``data_ptr()``. Once a saved tensor dies, the allocator
    hands its address to the next tensor of the step, so an address key would merge unrelated
    tensors. ``t.untyped_storage()`` returns the same Python object for every view of a storage for
    as long as the storage lives, so ``id()`` of a live one is a unique key; the weak reference
    tells us whether it is still that storage.
"""

from __future__ import annotations

import enum
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lifecycle._clock import Clock, MonotonicClock
from lifecycle._trace import Event, EventKind, TensorRecord, Trace

MemoryProbe = Callable[[], int]

_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while an autograd backward runs in this thread (recomputation, double backward)."""
    return _current_graph_task_id is not None and _current_graph_task_id() != -1


class StepBoundary(str, enum.Enum):
    """How the recorder finds the end of a step."""

    MANUAL = "manual"  # begin_step() / end_step() (``offload.profile``)
    BACKWARD = "backward"  # each completed backward pass ends a step (``offload profile`` CLI)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes: a DTensor's local shard, else ``t``."""
    if type(t) is not torch.Tensor and hasattr(t, "_local_tensor"):
        return t._local_tensor
    return t


class _Packed:
    """What the recorder's pack hook returns: the tensor, and which record it is."""

    __slots__ = ("__weakref__", "epoch", "family", "recorder", "seq", "tensor")

    def __init__(
        self, tensor: torch.Tensor, seq: int, family: int, recorder: Recorder | None, epoch: int
    ):
        self.tensor = tensor
        self.epoch = epoch
        self.seq = seq
        self.family = family
        self.recorder = recorder

    def __del__(self) -> None:
        rec = self.recorder
        if rec is not None:
            rec._release(self.family)


@dataclass
class _Family:
    storage_ref: weakref.ref
    version: int
    family: int
    storage_nbytes: int
    handles: int = 0


@dataclass
class _Call:
    """One module call being run: where packs go and what its backward hooks refer to."""

    module: str
    call_index: int
    packs: int = 0


@dataclass
class _Pending:
    """A record under construction (unpacks are appended while backward runs)."""

    fields: dict[str, Any]
    pack_stamp: object
    unpack_events: list[int] = field(default_factory=list)
    unpack_stamps: list[object] = field(default_factory=list)


class Recorder:
    """Records the life of every saved tensor over one or more steps.

    Use it through :func:`offload.profile` or the ``offload profile`` CLI; direct use:

    Args:
        clock: where times come from (default: :class:`MonotonicClock`).
        memory_probe: ``() -> int`` bytes in use at each event (``torch.cuda.memory_allocated`` on
            GPU); ``None`` reports the bytes of the storages saved tensors hold alive.
        boundary: ``"manual"`` (steps are :meth:`begin_step` / :meth:`end_step`) or
            ``"backward"`` (each completed backward pass ends a step).
        max_steps: stop recording after this many steps (0 = no limit).
        warmup_steps: steps recorded and then thrown away before the first kept one (under
            ``boundary="backward"`` the recorder must watch them to see where they end).

    Example:
        >>> import torch
        >>> from lifecycle import Recorder
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> rec = Recorder()
        >>> with rec.attach(model), rec.hooks():
        ...     rec.begin_step()
        ...     model(torch.randn(2, 4)).sum().backward()
        ...     rec.end_step()
        >>> trace = rec.trace()
        >>> [r.module for r in trace.activation_records]
        ['0', '1']
    """

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        memory_probe: MemoryProbe | None = None,
        boundary: StepBoundary | str = StepBoundary.MANUAL,
        max_steps: int = 0,
        warmup_steps: int = 0,
    ) -> None:
        if clock is not None and not isinstance(clock, Clock):
            raise TypeError(f"clock must provide stamp() and seconds(); got {type(clock).__name__}")
        if memory_probe is not None and not callable(memory_probe):
            raise TypeError(
                f"memory_probe must be a callable returning bytes; got {memory_probe!r}"
            )
        try:
            self._boundary = StepBoundary(boundary)
        except ValueError:
            raise ValueError(f"boundary must be 'manual' or 'backward'; got {boundary!r}") from None
        if not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"max_steps must be an int >= 0; got {max_steps!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0; got {warmup_steps!r}")
        self._warmup_left = warmup_steps
        self._clock = clock or MonotonicClock()
        self._probe = memory_probe
        self._max_steps = max_steps
        self._lock = threading.RLock()
        # Timeline.
        self._events: list[dict[str, Any]] = []
        self._stamps: list[object] = []
        self._records: list[_Pending] = []
        self._steps_done = 0
        self._recording = False
        # Bumped whenever recorded data is thrown away; handles of older epochs are ignored.
        self._epoch = 0
        # Per step.
        self._families: dict[int, list[_Family]] = {}
        self._by_id: dict[int, _Family] = {}
        self._next_family = 0
        self._live_bytes = 0
        self._stack: list[_Call] = []
        self._call_counts: dict[str, int] = {}
        self._graph_task: int | None = None
        # Parameters and buffers, by storage (see NOTE [ Alias families ] for why Python objects).
        self._param_storages: dict[int, weakref.ref] = {}
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._roots: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()
        self._on_step_end: list[Callable[[int, bool], None]] = []
        self._step_first = (0, 0)

    # -- public control ----------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        """True between :meth:`begin_step` and :meth:`end_step`."""
        return self._recording

    @property
    def steps_recorded(self) -> int:
        return self._steps_done

    @property
    def done(self) -> bool:
        """True once ``max_steps`` steps have been recorded."""
        return bool(self._max_steps) and self._steps_done >= self._max_steps

    def on_step_end(self, fn: Callable[[int, bool], None]) -> None:
        """Call ``fn(steps_recorded, was_warmup)`` after each step ends (the CLI shows progress)."""
        self._on_step_end.append(fn)

    def begin_step(self) -> None:
        """Start recording a step; a no-op while one is being recorded or once done."""
        with self._lock:
            if self._recording or self.done:
                return
            self._recording = True
            self._stack.clear()
            self._call_counts.clear()
            self._families.clear()
            self._graph_task = None
            self._step_first = (len(self._events), len(self._records))
            self._event(EventKind.STEP_START)

    def end_step(self) -> None:
        """Finish the current step; a no-op when none is being recorded.

        A warm-up step is thrown away here. Under ``boundary="backward"`` the next step begins at
        once (until ``max_steps`` are recorded).
        """
        with self._lock:
            if not self._recording:
                return
            self._recording = False
            self._stack.clear()
            if self._warmup_left:
                self._warmup_left -= 1
                self._discard_current()
                warmup = True
            else:
                self._event(EventKind.STEP_END)
                self._steps_done += 1
                self._step_first = (len(self._events), len(self._records))
                warmup = False
            callbacks = list(self._on_step_end)
        for fn in callbacks:
            fn(self._steps_done, warmup)
        if self._boundary is StepBoundary.BACKWARD:
            self.begin_step()

    def discard_partial_step(self) -> None:
        """Throw away a step still being recorded (the script raised in the middle of it)."""
        with self._lock:
            if self._recording:
                self._recording = False
                self._stack.clear()
                self._discard_current()

    def _discard_current(self) -> None:
        n_events, n_records = self._step_first
        del self._events[n_events:], self._stamps[n_events:], self._records[n_records:]
        self._epoch += 1

    def add_parameters(self, module: nn.Module) -> None:
        """Treat ``module``'s parameters and buffers (by storage) as parameters, not activations."""
        for t in _params_and_buffers(module):
            st = local_tensor(t).untyped_storage()
            self._param_storages[id(st)] = weakref.ref(st)

    @contextmanager
    def attach(self, model: nn.Module) -> Iterator[Recorder]:
        """Module hooks on ``model`` and its submodules (names from ``named_modules()``).

        A compiled submodule (``torch.compile``) is a leaf: no hooks go inside it, because hooks
        inside a compiled region split its graph.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        handles = []
        self._roots[model] = None
        for name, mod in _named_modules_stop_at_compiled(model):
            self._names[mod] = name
            handles.append(mod.register_forward_pre_hook(self._forward_pre_hook))
            handles.append(mod.register_forward_hook(self._forward_hook))
        self.add_parameters(model)
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def attach_global(self) -> Iterator[Recorder]:
        """Module hooks on every module of the process (the CLI's mode).

        A module first seen with no module running is a root: it is named by its class, its
        submodules ``Class.child.grandchild``, and its parameters are registered.
        """
        pre = nn.modules.module.register_module_forward_pre_hook(self._global_pre_hook)
        post = nn.modules.module.register_module_forward_hook(self._forward_hook)
        try:
            yield self
        finally:
            pre.remove()
            post.remove()

    @contextmanager
    def hooks(self) -> Iterator[Recorder]:
        """The saved-tensor hooks (thread-local: enter them in the thread that runs forward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def trace(self, metadata: dict[str, Any] | None = None) -> Trace:
        """Freeze what was recorded into a :class:`Trace`.

        Under ``boundary="manual"`` a step still being recorded is ended first; under
        ``"backward"`` it is incomplete (no backward finished it) and is thrown away.
        """
        if self._boundary is StepBoundary.BACKWARD:
            self.discard_partial_step()
        else:
            self.end_step()
        with self._lock:
            seconds = self._clock.seconds(self._stamps)
            by_stamp = dict(zip(map(id, self._stamps), seconds, strict=True))
            events = []
            for i, (e, s) in enumerate(zip(self._events, seconds, strict=True)):
                events.append(Event(index=i, time_s=s, **e))
            records = []
            for p in self._records:
                records.append(
                    TensorRecord(
                        **p.fields,
                        pack_time_s=by_stamp[id(p.pack_stamp)],
                        unpack_events=tuple(p.unpack_events),
                        unpack_times_s=tuple(by_stamp[id(s)] for s in p.unpack_stamps),
                    )
                )
            meta = {
                "torch_version": torch.__version__,
                "clock": type(self._clock).__name__,
                "memory_probe": "live_saved_storage_bytes"
                if self._probe is None
                else getattr(self._probe, "__name__", "custom"),
            }
            meta.update(metadata or {})
            return Trace(
                records=tuple(records), events=tuple(events), steps=self._steps_done, metadata=meta
            )

    # -- events ------------------------------------------------------------------------------

    def _event(
        self, kind: EventKind, module: str = "", call_index: int = -1, record: int = -1
    ) -> int:
        # Caller holds the lock. Stamps are objects so ``id()`` maps them back after resolving.
        stamp = self._clock.stamp()
        if type(stamp) is float:
            stamp = _FloatStamp(stamp)
        mem = self._probe() if self._probe is not None else self._live_bytes
        self._stamps.append(stamp)
        self._events.append(
            {
                "kind": kind,
                "step": self._steps_done,
                "memory_bytes": int(mem),
                "module": module,
                "call_index": call_index,
                "record": record,
            }
        )
        return len(self._events) - 1

    # -- module hooks ------------------------------------------------------------------------

    def _global_pre_hook(self, module: nn.Module, args: Any) -> None:
        if module not in self._names:
            if not self._stack:
                root = type(module).__name__
                self._roots[module] = None
                for name, mod in _named_modules_stop_at_compiled(module):
                    if mod not in self._names:
                        self._names[mod] = f"{root}.{name}" if name else root
                self.add_parameters(module)
            else:
                parent = self._stack[-1].module
                self._names[module] = f"{parent}.<{type(module).__name__}>"
                self.add_parameters(module)
        self._forward_pre_hook(module, args)

    def _forward_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not self._recording:
            return
        name = self._names.get(module, type(module).__name__)
        with self._lock:
            idx = self._call_counts.get(name, 0)
            self._call_counts[name] = idx + 1
            self._stack.append(_Call(name, idx))
            self._event(EventKind.FORWARD_START, name, idx)
            if in_backward() or not torch.is_grad_enabled():
                return
        # The gradient of the first differentiable input marks the end of the module's backward.
        for t in _tensors(args):
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(_BackwardEnd(self, name, idx))
                break

    def _forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._recording:
            return
        with self._lock:
            if not self._stack:
                return
            call = self._stack.pop()
            self._event(EventKind.FORWARD_END, call.module, call.call_index)
            if in_backward() or not torch.is_grad_enabled():
                return
        # A pre-hook on the outputs' grad_fn fires right before the module's backward starts and,
        # unlike register_full_backward_pre_hook, leaves the graph alone (an in-place op after the
        # module keeps working).
        seen: set[int] = set()
        hook = _BackwardStart(self, call.module, call.call_index)
        for t in _tensors(output):
            fn = t.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(hook)

    def _backward_signal(self) -> None:
        # Called from backward (unpack or module pre-hook). Under boundary="backward", the first
        # signal of a new graph task queues the end of the step at the end of that backward.
        if self._boundary is not StepBoundary.BACKWARD or _current_graph_task_id is None:
            return
        task = _current_graph_task_id()
        if task == -1 or task == self._graph_task:
            return
        self._graph_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self.end_step)

    # -- saved-tensor hooks ------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> _Packed:
        if not self._recording:
            return _Packed(t.detach(), -1, -1, None, -1)
        local = local_tensor(t)
        storage = local.untyped_storage()
        sid = id(storage)
        backward = in_backward()
        with self._lock:
            is_param = self._is_param(t, sid, storage)
            version = local._version
            fam = None
            for f in self._families.get(sid, ()):
                if f.storage_ref() is storage and f.version == version:
                    fam = f
                    break
            if fam is None:
                fam = _Family(weakref.ref(storage), version, self._next_family, storage.nbytes())
                self._next_family += 1
                self._families.setdefault(sid, []).append(fam)
                if not is_param:
                    self._by_id[fam.family] = fam
            if not is_param:
                if fam.handles == 0:
                    self._live_bytes += fam.storage_nbytes
                fam.handles += 1
            call = self._stack[-1] if self._stack else None
            module, call_index = (call.module, call.call_index) if call else ("", 0)
            ordinal = 0
            if call is not None:
                ordinal = call.packs
                call.packs += 1
            seq = len(self._records)
            ev = self._event(EventKind.PACK, module, call_index, seq)
            fn = t.grad_fn
            self._records.append(
                _Pending(
                    fields={
                        "seq": seq,
                        "step": self._steps_done,
                        "family": fam.family,
                        "module": module,
                        "call_index": call_index,
                        "ordinal": ordinal,
                        "nbytes": local.numel() * local.element_size(),
                        "storage_nbytes": fam.storage_nbytes,
                        "storage_offset": local.storage_offset(),
                        "shape": tuple(local.shape),
                        "stride": tuple(local.stride()),
                        "dtype": str(local.dtype),
                        "device": str(local.device),
                        "is_parameter": is_param,
                        "grad_fn": type(fn).__name__ if fn is not None else "",
                        "in_backward": backward,
                        "pack_event": ev,
                    },
                    pack_stamp=self._stamps[ev],
                )
            )
        return _Packed(t.detach(), seq, fam.family if not is_param else -1, self, self._epoch)

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        if packed.seq >= 0 and self._recording and packed.epoch == self._epoch:
            with self._lock:
                p = self._records[packed.seq]
                f = p.fields
                ev = self._event(EventKind.UNPACK, f["module"], f["call_index"], packed.seq)
                p.unpack_events.append(ev)
                p.unpack_stamps.append(self._stamps[ev])
            self._backward_signal()
        return packed.tensor

    def _release(self, family: int) -> None:
        if family < 0:
            return
        with self._lock:
            f = self._by_id.get(family)
            if f is None:
                return
            f.handles -= 1
            if f.handles == 0:
                self._live_bytes -= f.storage_nbytes
                del self._by_id[family]

    def _is_param(self, t: torch.Tensor, sid: int, storage: Any) -> bool:
        ref = self._param_storages.get(sid)
        if ref is not None and ref() is storage:
            return True
        # FSDP2 and ``weight.t()`` hand over views whose base is the Parameter.
        return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class _FloatStamp(float):
    """A float stamp with its own identity (``id()`` of equal floats may coincide)."""

    __slots__ = ()


class _BackwardStart:
    __slots__ = ("call_index", "fired", "module", "rec")

    def __init__(self, rec: Recorder, module: str, call_index: int):
        self.rec, self.module, self.call_index, self.fired = rec, module, call_index, False

    def __call__(self, grad_outputs: Any) -> None:
        rec = self.rec
        if self.fired or not rec._recording:
            return None
        self.fired = True
        with rec._lock:
            rec._event(EventKind.BACKWARD_START, self.module, self.call_index)
        rec._backward_signal()
        return None


class _BackwardEnd:
    __slots__ = ("call_index", "module", "rec")

    def __init__(self, rec: Recorder, module: str, call_index: int):
        self.rec, self.module, self.call_index = rec, module, call_index

    def __call__(self, grad: torch.Tensor) -> None:
        rec = self.rec
        if rec._recording:
            with rec._lock:
                rec._event(EventKind.BACKWARD_END, self.module, self.call_index)
        return None


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _params_and_buffers(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _named_modules_stop_at_compiled(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``named_modules()``, without descending into compiled modules."""
    # Only look for compiled modules when dynamo was imported (importing it costs seconds).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ()) if eval_frame else ()

    def walk(prefix: str, mod: nn.Module) -> Iterable[tuple[str, nn.Module]]:
        yield prefix, mod
        if optimized and isinstance(mod, optimized):
            return
        for name, child in mod.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)

    return walk("", model)
