"""The lifecycle recorder: logs every tensor autograd saves during a step, and when it is used.

The recorder observes only. Its pack hook returns a small handle holding ``t.detach()``; its unpack
hook returns that tensor. Module hooks give the module path, forward spans and, through pre-hooks
on the outputs' ``grad_fn``, backward spans. Time and memory come from an injected clock and
memory probe, so this module makes no CUDA call.

NOTE [ Alias families ]
    A family is one live storage at one version: it is keyed on the storage's Python object
    (held weakly) plus ``t._version``, and, for a tensor that is no view yet spans less than its
    storage (pieces made by ``unsafe_chunk``, as GRU cells make them, each with a version counter
    of its own: equal versions there are no evidence of equal bytes), on that tensor too (held
    weakly); never on ``data_ptr()``. Once a saved tensor
    dies, the allocator hands its address to the next tensor of the step, so an address key would
    merge unrelated tensors. ``t.untyped_storage()`` returns the same Python object for every view
    of a storage for as long as the storage lives, so ``id()`` of a live one is a unique key; the
    weak reference tells us whether it is still that storage.
NOTE [ Retained graphs ]
    A plan frees a kept tensor at its last use. ``backward(retain_graph=True)`` and
    ``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty) keep every saved tensor
    of the graph until the graph dies instead: planned so, the first backward with
    ``retain_graph=True`` held 377,600 saved bytes against the 312,064 predicted. Autograd does
    not say whether a backward keeps its graph, so the recorder looks: at the first recorded
    unpack of each backward it takes a weak reference to what autograd holds for that record
    (the packed object) and, in a final callback of that backward, sees whether it is still
    alive. A backward that frees its graph has freed it by then (a node's saved variables are
    released right after the node runs); one that keeps it has not. The step the record belongs
    to is then listed in ``Trace.retained_steps``. One weak reference per backward: the hot path
    only tests whether one is pending. A backward with ``create_graph=True`` runs with grad
    mode on (autograd sets it to ``create_graph``), and the graph it builds saves what it
    unpacks again (a reloaded buffer held that way kept a gradient penalty's step at 592,128
    saved bytes against 575,232 predicted): seen at the same unpack, its step is listed in
    ``Trace.create_graph_steps`` too.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from offload.lifecycle._calls import CallStack, in_backward
from offload.lifecycle._clock import Clock, MonotonicClock
from offload.lifecycle._inert import BoundHook
from offload.lifecycle._module_hooks import outer_calls, register_forward_hooks
from offload.lifecycle._recorder_calls import CallHooks
from offload.lifecycle._rows import (
    _CODE,
    _NF,
    _R_DIMS,
    _R_DTYPE,
    _R_NBYTES,
    _R_NDIM,
    _R_OFFSET,
    _R_STEP,
    _R_STORAGE_NBYTES,
    frozen_rows,
)
from offload.lifecycle._tensors import (
    ACTIVATION_NODES,
    NormOutputs,
    ParameterStorages,
    activation_output,
    dtensor_spec,
    is_compiled,
    is_parameter,
    local_tensor,
    named_modules_stop_at_compiled,
    parameter_cast,
    wraps_parameter,
)
from offload.lifecycle._trace import EventKind, Trace
from offload.lifecycle._units import check_count

MemoryProbe = Callable[[], int]
# Nodes whose outputs may be rebuilt from another record (activation_output): the activations'
# own, autocast's casts (of a norm output, for one), and ``DTensor.from_local`` of a plain one.
_LINKABLE = frozenset(ACTIVATION_NODES) | {"ToCopyBackward0", "_FromTorchTensorBackward"}

LIVE_SAVED_BYTES = "live_saved_bytes"
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


class StepBoundary(str, enum.Enum):
    """How the recorder finds the end of a step."""

    MANUAL = "manual"  # begin_step() / end_step() (``offload.profile``)
    BACKWARD = "backward"  # each completed backward pass ends a step (``offload profile`` CLI)


class Recorder(CallHooks):
    """Records the life of every saved tensor over one or more steps.

    Use it through :func:`offload.profile` or the ``offload profile`` CLI; direct use:

    Args:
        clock: where times come from (default: :class:`MonotonicClock`).
        memory_probe: ``() -> int`` bytes in use at each event (``torch.cuda.memory_allocated`` on
            GPU); ``None`` reports live saved activation bytes (each alias family counted once,
            from its first pack to its last use).
        boundary: ``"manual"`` (steps are :meth:`begin_step` / :meth:`end_step`) or
            ``"backward"`` (each completed backward pass ends a step).
        max_steps: stop recording after this many steps (0 = no limit).
        warmup_steps: steps recorded and then thrown away before the first kept one (under
            ``boundary="backward"`` the recorder must watch them to see where they end).
        pause_gc: switch Python's cyclic garbage collector off while a step is recorded (it is
            switched back on at the step's end), so that a collection pause does not land in a
            module's measured duration.

    Example:
        >>> import torch
        >>> from offload.lifecycle import Recorder
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
        pause_gc: bool = True,
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
        check_count(max_steps, name="max_steps", minimum=0)
        check_count(warmup_steps, name="warmup_steps", minimum=0)
        self._warmup_left = warmup_steps
        self._pause_gc = bool(pause_gc)
        self._gc_paused = False
        self._clock = clock or MonotonicClock()
        self._by_backward = self._boundary is StepBoundary.BACKWARD
        # A plain MonotonicClock stamps perf_counter(): called directly, one frame less per event.
        self._stamp = (
            time.perf_counter if type(self._clock) is MonotonicClock else self._clock.stamp
        )
        self._probe = memory_probe
        self._max_steps = max_steps
        self._lock = threading.RLock()
        # Timeline.
        # See NOTE [ Recorder allocations ]. Events: rows of 3 in one flat list, (what, stamp,
        # memory bytes), each added by one ``extend`` (atomic under the GIL, so pack, unpack and
        # module hooks need no lock even when backward runs on the autograd device thread);
        # ``what`` is the record's seq for a pack (an int >= 0), ~seq for an unpack, else (kind
        # code, module, call_index). Records: rows of _NF in _RECORD_FIELDS order, added by the
        # forward thread only; each one's shape and stride are ints in _dims.
        self._events: list[Any] = []
        self._records: list[Any] = []
        self._dims: list[int] = []
        self._n_records = 0
        self._steps_done = 0
        self._recording = False
        # Per step.
        # id(detached tensor handed to autograd) -> record seq; see NOTE [ Recorder allocations ].
        self._seq_of: dict[int, int] = {}
        self._norms = NormOutputs()  # norm outputs and their arguments, from module hooks
        # A family's key (see _record) -> its weak storage (and piece), and -> (family id,
        # storage bytes).
        self._family_ref: dict[Any, Any] = {}
        self._family_info: dict[Any, tuple[int, int]] = {}
        self._next_family = 0
        self._calls = CallStack(self._lock)  # of _Call frames: see lifecycle/_calls.py
        self._graph_task: int | None = None
        self._thread: int | None = None  # the step's thread (see begin_step)
        # Parameters and buffers, by storage (see NOTE [ Alias families ] for why Python objects).
        self._params = ParameterStorages()
        self._param_refs = self._params.by_id  # read on the hot path without a call
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._roots: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()
        # Class names given to roots by attach_global: its module paths start with them, where a
        # manager's (attach) start below its model. Plans carry them so a manager can tell.
        self._global_roots: set[str] = set()
        self._on_step_end: list[Callable[[int, bool], None]] = []
        self._step_first = (0, 0, 0)
        # Modules whose forward updated running statistics in a recorded step (BatchNorm in
        # training), or changed any buffer of their own in place (a spectral norm's power
        # iteration): the trace names them, so that no plan recomputes them.
        self._stateful: set[str] = set()
        # Modules called under a checkpoint the model entered itself (NOTE [ Model
        # checkpoints ]), and modules whose forward wrote one of its tensor arguments in place
        # (a block opening with LeakyReLU(inplace=True)): recomputing it would read the written
        # argument, which checkpoint's saved input check refuses. No plan recomputes either.
        self._checkpointed: set[str] = set()
        self._writes_input: set[str] = set()
        # nn.RReLU modules called in a recorded step: offload keeps their saved tensors on the
        # device (NOTE [ Fill after pack ] in offload/_pack.py), so the trace names them as kept modules.
        self._fill_after_pack: set[str] = set()
        self._compiled: set[int] = set()  # ids of the compiled modules attached (leaves)
        # The compiled calls our hooks run around (see NOTE [ Hooks of a compiled call ]).
        self._outer_calls: list[Any] = []
        # See NOTE [ Retained graphs ]: each begun step's serial (a warm-up or discarded step's
        # index is taken again by the next one), the serials of the kept steps, in order, those
        # seen retained, and the backward being watched (a _Watch), if any.
        self._serial = 0
        self._kept_serials: list[int] = []
        self._retained: set[int] = set()
        self._create_graph: set[int] = set()  # serials, as _retained
        self._watch: _Watch | None = None

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

    def begin_step(self, *, thread: int | None = None) -> None:
        """Start recording a step; a no-op while one is being recorded or once done.

        Args:
            thread: the ``threading.get_ident()`` of the thread that runs the step's forward:
                module calls from other threads outside a backward (an evaluation or data
                thread calling a submodule meanwhile) are not the step's and are not recorded.
                ``None``: every thread's calls are. Under ``boundary="backward"`` the steps begun
                after this one keep it.
        """
        with self._lock:
            if self._recording or self.done:
                return
            self._recording = True
            self._thread = thread
            self._calls.reset()
            self._family_ref.clear()
            self._family_info.clear()
            self._graph_task = None
            self._serial += 1
            # A watch still pending is of a backward that raised (its final callbacks never
            # ran), or of another thread's: either way a new one may begin.
            self._watch = None
            self._step_first = (len(self._events), self._n_records, len(self._dims))
            for call in self._outer_calls:  # a module compiled again meanwhile
                call.reinstate()
            if self._pause_gc and gc.isenabled():
                # A full collection with torch loaded took 0.2 s on the CI machine: inside a
                # recorded step it lands in some module's span and corrupts the durations the
                # planner reads (and it made up a third of the recorder's per-pack cost).
                # Reference counting still frees everything acyclic; collection resumes at the
                # end of the step.
                gc.disable()
                self._gc_paused = True
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
            self._calls.clear()
            if self._warmup_left:
                self._warmup_left -= 1
                self._discard_current()
                warmup = True
            else:
                self._event(EventKind.STEP_END)
                self._kept_serials.append(self._serial)
                self._steps_done += 1
                self._step_first = (len(self._events), self._n_records, len(self._dims))
                warmup = False
            callbacks = list(self._on_step_end)
            self._resume_gc()
        for fn in callbacks:
            fn(self._steps_done, warmup)
        if self._boundary is StepBoundary.BACKWARD:
            self.begin_step(thread=self._thread)

    def discard_partial_step(self) -> None:
        """Throw away a step still being recorded (the script raised in the middle of it)."""
        with self._lock:
            if self._recording:
                self._recording = False
                self._calls.clear()
                self._discard_current()
            self._resume_gc()

    def _resume_gc(self) -> None:
        if self._gc_paused:
            self._gc_paused = False
            gc.enable()

    def _discard_current(self) -> None:
        n_events, n_records, n_dims = self._step_first
        del self._events[n_events:], self._records[n_records * _NF :], self._dims[n_dims:]
        self._n_records = n_records
        # Handles of thrown-away records must not log unpacks into later steps.
        self._seq_of.clear()

    def add_parameters(self, module: nn.Module) -> None:
        """Treat ``module``'s parameters and buffers (by storage) as parameters, not activations."""
        self._params.add(module)

    def add_held(self, tensors: Iterable[torch.Tensor]) -> None:
        """Treat the storages of ``tensors`` as parameters too: something else holds them for
        the whole step (a pipeline stage keeps each microbatch's inputs until its backward), so
        their records are not activations a plan could move."""
        self._params.add_tensors(tensors)

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
        for name, mod in named_modules_stop_at_compiled(model):
            self._names[mod] = name
            if is_compiled(mod):
                self._compiled.add(id(mod))
            handles += register_forward_hooks(
                mod, BoundHook(self._forward_pre_hook), BoundHook(self._forward_hook)
            )
        self.add_parameters(model)
        calls = outer_calls(handles)
        self._outer_calls += calls
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._outer_calls = [c for c in self._outer_calls if c not in calls]

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
            events, records = frozen_rows(
                self._events, self._rows(), self._dims, self._clock.seconds(self._events[1::3])
            )
            meta = {
                "torch_version": torch.__version__,
                "clock": type(self._clock).__name__,
                "memory_probe": LIVE_SAVED_BYTES
                if self._probe is None
                else getattr(self._probe, "__name__", "custom"),
            }
            if self._stateful:
                meta["stateful_modules"] = sorted(self._stateful)
            if self._checkpointed:
                meta["checkpointed_modules"] = sorted(self._checkpointed)
            if self._writes_input:
                meta["input_writing_modules"] = sorted(self._writes_input)
            if self._global_roots:
                meta["root_modules"] = sorted(self._global_roots)
            kept = self._fill_after_pack.union((metadata or {}).get("kept_modules") or ())
            meta.update(metadata or {})
            if kept:
                meta["kept_modules"] = sorted(kept)
            trace = Trace(
                records=tuple(records),
                events=tuple(events),
                steps=self._steps_done,
                metadata=meta,
                retained_steps=tuple(
                    i for i, s in enumerate(self._kept_serials) if s in self._retained
                ),
                create_graph_steps=tuple(
                    i for i, s in enumerate(self._kept_serials) if s in self._create_graph
                ),
            )
        if self._probe is None:
            # Without a device memory probe, memory in use is the live saved activation bytes
            # (pack to last use, each alias family once), known only now that last uses are.
            live = dict(trace.live_saved_bytes())
            trace = dataclasses.replace(
                trace,
                events=tuple(
                    dataclasses.replace(e, memory_bytes=live[e.index]) for e in trace.events
                ),
            )
        return trace

    # -- events ------------------------------------------------------------------------------

    def _rows(self) -> list[tuple[Any, ...]]:
        """Every record row as a tuple in _RECORD_FIELDS order (caller holds the lock)."""
        flat = self._records
        return [tuple(flat[i : i + _NF]) for i in range(0, len(flat), _NF)]

    def _event(self, kind: EventKind, module: str = "", call_index: int = -1) -> None:
        # Caller holds the lock. Module events only: packs and unpacks add their own rows.
        self._events.extend(
            ((_CODE[kind], module, call_index), self._stamp(), self._probe() if self._probe else 0)
        )

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

    def record_pack(
        self, t: torch.Tensor, *, parameter: bool = False, rebuild_from: int = -1
    ) -> int:
        """Record a pack made by someone else's saved-tensor hooks; returns its ``seq`` (give it
        to :meth:`record_unpack`), or -1 when no step is being recorded.

        For a manager whose own hooks must run (only the innermost pair of saved-tensor hooks
        fires): ``offload.ActivationOffloader`` records its profiling step this way.
        ``parameter=True`` records it as a parameter and a weight cast
        (``TensorRecord.weight_cast``): the caller rebuilds it from a parameter at unpack
        (``offload``'s autocast weight casts), so no plan needs to place it. ``rebuild_from``:
        the ``seq`` of the record ``t`` can be rebuilt from (an activation output and the input
        its node saved; ``TensorRecord.rebuild_from``), or -1.
        """
        if not self._recording:
            return -1
        return self._record(t, parameter, rebuild_from)

    def record_unpack(self, seq: int, held: Any = None) -> None:
        """Record the unpack of the pack :meth:`record_pack` numbered ``seq`` (-1: ignored).

        ``held``: what the caller's pack hook returned for it (what autograd holds), from which
        the recorder learns whether the graph outlives this backward (NOTE [ Retained graphs ]);
        ``None``, or an object without weak references: not looked at.
        """
        if seq >= 0 and self._recording and seq < self._n_records:
            self._events.extend((~seq, self._stamp(), self._probe() if self._probe else 0))
            if self._by_backward:
                self._backward_signal()
            if self._watch is None and held is not None:
                self._watch_backward(held, seq)

    def _watch_backward(self, held: Any, seq: int) -> None:
        """See NOTE [ Retained graphs ]: watch ``held`` (record ``seq``'s packed object) until
        the end of the backward that unpacks it."""
        if not in_backward():
            return  # an unpack outside backward (``grad_fn._saved_self``)
        try:
            ref = weakref.ref(held)
        except TypeError:
            return  # no weak references: the next unpack may do
        step = self._records[seq * _NF + _R_STEP]
        if step == self._steps_done:
            serial = self._serial if self._recording else -1
        else:
            serial = self._kept_serials[step]
        if serial >= 0 and torch.is_grad_enabled():
            self._create_graph.add(serial)  # autograd runs the backward in create_graph's mode
        watch = self._watch = _Watch(self, ref, serial)
        torch.autograd.Variable._execution_engine.queue_callback(watch)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Hot path: see NOTE [ Recorder allocations ] before adding work here. Autograd keeps
        # what this returns; ``t.detach()`` (never ``t`` itself: an output saved by its own
        # grad_fn would form a reference cycle).
        d = t.detach()
        if not self._recording:
            self._seq_of.pop(id(d), None)
            return d
        parent = -1
        cast = False
        base = t._base
        fn = t.grad_fn
        # Linear on 3-D input saves a 2-D view of an output: the output's node tells.
        out_fn = fn if base is None else base.grad_fn
        if out_fn is not None and type(out_fn).__name__ in _LINKABLE:  # a cheap first filter
            # An autocast weight cast is made again from its parameter, never stored: as offload
            # records it (NOTE [ Weight casts ] there), so offline plans see the same step.
            cast = parameter_cast(t, self._params) is not None
            parent = -1 if cast else self._parent_of(t)
        self._seq_of[id(d)] = self._record(t, cast, parent, fn, base)
        return d

    def _parent_of(self, t: torch.Tensor) -> int:
        """The record ``t`` can be rebuilt from (a GELU / SiLU output, or the output of an
        ``nn.LayerNorm`` / ``nn.RMSNorm`` whose forward these module hooks saw, from the input
        its own node saved, packed by these hooks in this step), or -1."""
        found = activation_output(t, self._norms)
        if found is None:
            return -1
        packed, out = found.packed, found.out
        seq = self._seq_of.get(id(packed), -1)
        rows, at = self._records, seq * _NF
        if seq < 0 or seq >= self._n_records or rows[at + _R_STEP] != self._steps_done:
            return -1
        if dtensor_spec(packed) != found.spec:  # a DTensor function's input: one alike
            return -1
        # The recipe runs the function on the input as it is: a dense tensor of the same shape
        # and dtype (see offload's ActivationRecipe).
        if rows[at + _R_DTYPE] != out.dtype or rows[at + _R_OFFSET] != 0:
            return -1
        if rows[at + _R_NBYTES] != rows[at + _R_STORAGE_NBYTES]:
            return -1
        d, ndim = rows[at + _R_DIMS], rows[at + _R_NDIM]
        if self._dims[d : d + 2 * ndim] != [*out.shape, *out.stride()]:
            return -1
        return seq

    def _record(
        self,
        t: torch.Tensor,
        parameter: bool = False,
        rebuild_from: int = -1,
        fn: Any = None,
        base: torch.Tensor | None = None,
    ) -> int:
        # ``fn`` and ``base``: ``t.grad_fn`` and ``t._base`` when the caller read them already
        # (``_pack``), else read here. Every attribute read of a tensor counts on this path.
        if type(t) is torch.Tensor:
            local, subclass_param = t, False
            if fn is None:
                fn, base = t.grad_fn, t._base
        else:  # a DTensor (its local shard), a Parameter, another subclass
            local = local_tensor(t)
            fn, base = t.grad_fn, local._base
            subclass_param = is_parameter(local) or wraps_parameter(t)
        backward = _current_graph_task_id is not None and _current_graph_task_id() != -1
        shape: Iterable[Any]
        stride: Iterable[Any]
        nbytes: Any
        offset: Any
        try:
            storage = local.untyped_storage()
            shape, stride = local.shape, local.stride()
        except (NotImplementedError, RuntimeError):
            # Sparse and strided-nested tensors: no plain storage to key a family on, nor bytes
            # a plan could move (offload keeps them). A family of its own, of 0 bytes.
            storage = None
        if storage is None:
            fam = (self._next_family, 0)
            self._next_family += 1
            nbytes = offset = 0
            shape, stride = (), ()
            is_param = parameter or subclass_param
            base = None
        else:
            sid = id(storage)
            version = local._version
            ref = self._param_refs.get(sid)
            is_param = (
                parameter
                or (ref is not None and ref() is storage)
                or subclass_param
                or (base is not None and is_parameter(base))
            )
            # See NOTE [ Alias families ]. A tensor that is no view and spans less than its
            # storage (an ``unsafe_chunk`` piece) has a version counter of its own: it is named
            # in the key, and held weakly. Only then: a weak reference to every saved tensor made
            # each one's deallocation dearer (2-4 us per pack in bench_hooks). Views and whole
            # tensors key on the storage, as before. (Views of pieces, or two whole tensors of
            # one storage with counters of their own, ``set_``, would share a family here: a
            # planning estimate only; the executor tells them apart exactly.)
            nbytes, offset = local.nbytes, local.storage_offset()
            storage_nbytes = storage.nbytes()
            piece = (offset != 0 or nbytes != storage_nbytes) and base is None
            key: Any
            if piece:
                key = (sid, id(local), version)
                refs = self._family_ref.get(key)
                known = refs is not None and refs[0]() is storage and refs[1]() is local
            else:
                # A version counter is 32 bits: the int is the pair (storage, version).
                key = (sid << 32) | version
                ref = self._family_ref.get(key)
                known = ref is not None and ref() is storage
            if known:
                fam = self._family_info[key]
            else:
                # Two dicts, so that only the weak references stay tracked by the GC.
                self._family_ref[key] = (
                    (weakref.ref(storage), weakref.ref(local)) if piece else weakref.ref(storage)
                )
                fam = self._family_info[key] = (self._next_family, storage_nbytes)
                self._next_family += 1
        module, call_index, ordinal = self._calls.next_key()
        seq = self._n_records
        self._n_records = seq + 1
        self._events.extend((seq, self._stamp(), self._probe() if self._probe else 0))
        dims = self._dims
        at = len(dims)
        dims += shape
        dims += stride
        self._records.extend(
            (
                seq,
                self._steps_done,
                fam[0],
                module,
                call_index,
                ordinal,
                nbytes,
                fam[1],
                offset,
                at,
                (len(dims) - at) >> 1,  # ndim
                local.dtype,  # named at trace(): a dtype is a singleton, a str costs a lookup
                local.device,
                is_param,
                type(fn).__name__ if fn is not None else "",
                backward,
                rebuild_from,
                base is not None,
                parameter,  # only a weight cast is recorded as a parameter by its caller's word
            )
        )
        return seq

    def _unpack(self, d: torch.Tensor) -> torch.Tensor:
        # Hot path, like _pack.
        if self._recording:
            seq = self._seq_of.get(id(d))
            if seq is not None:
                self._events.extend((~seq, self._stamp(), self._probe() if self._probe else 0))
                if self._by_backward:
                    self._backward_signal()
                if self._watch is None:
                    self._watch_backward(d, seq)
        return d


class _Watch:
    """A final callback of one backward: was the packed object of its first recorded unpack
    still alive at its end (NOTE [ Retained graphs ])?"""

    __slots__ = ("rec", "ref", "serial")

    def __init__(self, rec: Recorder, ref: weakref.ref[Any], serial: int) -> None:
        self.rec, self.ref, self.serial = rec, ref, serial

    def __call__(self) -> None:
        rec = self.rec
        if rec._watch is self:
            rec._watch = None
        if self.ref() is not None and self.serial >= 0:
            rec._retained.add(self.serial)
