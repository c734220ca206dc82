"""Budget mode of the manager: profile a signature once, plan it, and carry the plan out.

The manager (``_offloader.py``) owns the hooks; this module holds what budget mode adds to them:
the input signature of a step, the profiling step's recorder, the plans per signature, and the
lookup tables a plan becomes at execution (by record key, see docs/design.md "Keys and signatures").

NOTE [ Budget mode ]
    A step's signature is the shapes and dtypes of the root module's tensor arguments and the
    values of its plain settings (NOTE [ Signatures ]), known at
    the root's forward pre-hook, at its first call with grad in the step (calls without grad
    before it save nothing and are not counted in the record keys). The first step of a new signature runs in min-memory mode (every
    eligible saved tensor leaves, so a model that does not fit can still be profiled) while a
    :class:`lifecycle.Recorder` records it through the manager's own hooks (only the innermost
    saved-tensor hooks fire, so the recorder cannot use its own). When that step's backward has
    ended, the next step (or ``mgr.plan``) plans it with :func:`lifecycle.plan`; later steps of
    the signature execute the plan: each pack looks up its key (module path, call index,
    ordinal), KEEP returns the tensor, CPU / NVMe offload to that tier (the others remain as
    fallbacks), and each moved family's reload starts at its planned trigger (a module's
    backward start, or an unpack), or at its own unpack (a stall) when that trigger does not
    come; never at the backward start of the module that packed it, as in min-memory mode: a
    module's backward starts before its children's, so a parent running ops of its own (the
    root, a block's residual) would bring its families back before the kept tensors the plan
    frees first are gone. Module calls the plan recomputes run under non-reentrant checkpoint. A key the plan does not know,
    or a record larger than its family's planned bytes, goes to the first tier with room and is
    counted in ``stats.unplanned_records``. Unpack always returns the bytes of the handle made
    at that pack: a wrong match costs time, never correctness.
    At most ``MAX_SIGNATURES`` signatures are profiled. Every later one runs a single plan made
    once from :func:`merged_trace` of the profiled ones (the largest group with the same record
    keys, each key at the most bytes it had), announced in a log line; a new shape whose records
    are no larger needs no profiling step (docs/design.md, Keys and signatures; its other trigger,
    "most steps bring a new one", is this cap: such a run reaches it within 8 steps).
    A family the plan rebuilds (``Placement.REBUILD``: an activation output whose trace record
    links it to its input, ``TensorRecord.rebuild_from``) is stored as a recipe at its pack and
    run again at its unpack (NOTE [ Activation recipes ] in _recipe.py); it gets no reload
    trigger of its own: its input's (kept, or moved with its own planned trigger, which the
    planner puts before this unpack) is all it needs. A record whose recipe cannot be built
    (not an activation output, input not this manager's, another layout) is unplanned, as
    above. The profiling step, in min-memory mode, rebuilds such outputs as that mode does,
    where their input was stored whole (the trace links no other), and records each with its
    link; the rest it stores and records unlinked. (Its memory probe on a GPU sees a rebuilt
    output from its unpack on, as it sees a stored one brought back: it leaves out only the
    executor's reloads not yet unpacked and copies out in flight.) Autocast weight casts are
    rebuilt in both modes (NOTE [ Weight casts ]).

NOTE [ Refinement ]
    docs/design.md "Data flow" 2: the profiling step's times are not compute times (its own copy
    waits and back-pressure on a GPU, first-step autotuning and allocator growth anywhere), so
    the first planned step of a signature planned from its own profile is recorded too (through
    the same hooks, on the same clock: on CPU offload's own copies and rebuilds are taken out of
    it; its rebuilt records are recorded with their links, as the profile's were), and
    before the next step the signature is planned once more from the profile retimed by it
    (:func:`retimed`: module boundaries get the planned step's times, less any recomputation
    the plan added; records, bytes and memory stay the profile's). The refined plan replaces the
    first (``plan.metadata["refined"]``, with the first one's predicted step) and is not refined
    again; a plan given with ``plan=`` and the merged plan past ``MAX_SIGNATURES`` are not
    refined. On a GPU the planned step's times include its own stalls, if it had any, and its
    rebuilds (kernels on the compute stream, which the device clock times): their predicted
    time is cut out after each rebuilt record's unpack, as recomputation is.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import logging
import numbers
import os
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from offload import lifecycle
from offload._device import clock_and_probe
from offload._planning import load_arg_file
from offload.lifecycle import (
    EventKind,
    HardwareModel,
    Placement,
    Plan,
    Recorder,
    TensorRecord,
    Trace,
    Trigger,
)
from offload.lifecycle._calls import OUTSIDE
from offload.lifecycle._units import format_bytes

log = logging.getLogger("offload")

MAX_SIGNATURES = 8
# Signatures past MAX_SIGNATURES that mgr.plans names (the most recent; they share one plan).
MAX_SHARED_SIGNATURES = 64
KEEP = "keep"
REBUILD = "rebuild"
# A plan's placement as the action a pack takes (RECOMPUTE: its keys vanish, the checkpoint
# saves the call's inputs, kept).
_ACTION_OF = {Placement.CPU: "cpu", Placement.NVME: "nvme", Placement.REBUILD: REBUILD}


def signature_of(args: Any, kwargs: Mapping[str, Any] | None = None) -> str:
    """A module call's arguments as one string: the shapes and dtypes of its tensors, and the
    values of its plain settings (keyword arguments by name, in name order, after the
    positional ones; tuples, lists and dicts are looked into). See NOTE [ Signatures ].

    Example:
        >>> import torch
        >>> signature_of((torch.zeros(2, 3), 4, [torch.zeros(5, dtype=torch.int64)]))
        'float32[2,3];4;int64[5]'
        >>> signature_of((), {"labels": torch.zeros(2, dtype=torch.int64), "ids": torch.zeros(2, 7)})
        'ids=float32[2,7];labels=int64[2]'
        >>> signature_of((torch.zeros(2),), {"causal": True, "cfg": {"scale": 0.5, "mode": "a"}})
        "float32[2];causal=True;cfg=scale:float;cfg=mode:'a'"
    """
    parts = list(_parts(args))
    for name in sorted(kwargs or ()):
        parts.extend(f"{name}={p}" for p in _parts(kwargs[name]))  # type: ignore[index]
    sig = ";".join(parts)
    if len(sig) > _LONG_SIGNATURE:
        # A long list of settings (100k ints made a 589 KB string, kept per signature): its
        # head, to read, and a crc32 of the whole, to tell signatures apart.
        sig = f"{sig[: _LONG_SIGNATURE // 4]}...#{zlib.crc32(sig.encode('utf-8', 'surrogatepass')):08x}"
    return sig


# NOTE [ Signatures ]
#     docs/design.md "Keys and signatures": a step's signature is what its root call was given. A
#     tensor is its dtype and shape (its values never change the saved tensors' keys: varying
#     data is the normal case). A plain setting is its value: ``None``, a bool, an int, an enum
#     member (``Kind.NAME``), a ``torch.dtype``, a string (quoted; longer than
#     ``_LONG_STR`` characters: its crc32, stable across processes, unlike ``hash()``). These are
#     what picks a forward's structure (``model(x, depth)``, ``use_cache=False``, an attention
#     kind), and a plan profiled for one structure keyed by (module, call, ordinal) silently
#     misplaces another's records (depth 1 -> 3 under one signature leaves 8 records unplanned
#     and the saved peak 2.7x the plan's). An int that changes every step (a step counter) thus makes
#     each step a new signature: the 8 profiled ones, then the shared plan of their per-key
#     maxima (NOTE [ Budget mode ]), whose lookup tables every later one shares; ``mgr.plans``
#     keeps the ``MAX_SHARED_SIGNATURES`` most recent of those, so a counter grows nothing. A
#     float is only its type: its value is a schedule or a temperature more often than a switch,
#     and keying on it would spend 8 profiling steps on a float schedule for nothing. Not seen
#     here: a float that switches the structure (``if p > 0``), data-dependent branches,
#     attributes set between steps; a planned step they change leaves its plan's key sequence,
#     which the manager notices and profiles again (NOTE [ Structure ] in _structure.py). Pass
#     such a switch as a bool or an int. Other objects (a config instance, a callable) are left
#     out: their identity or repr may change every step.
_LONG_STR = 32


_LONG_SIGNATURE = 1024
# Containers nested deeper than this are not looked into (a dict holding itself recursed until
# RecursionError, raised inside the root's forward pre-hook).
_MAX_NESTING = 16


def _parts(obj: Any, key: str = "", depth: int = 0) -> Iterator[str]:
    if isinstance(obj, torch.Tensor):
        # No dict key: tensor parts read as before settings were counted (saved plans match).
        yield _shape_of(obj)
    elif isinstance(obj, (tuple, list)):
        if depth < _MAX_NESTING:
            for o in obj:
                yield from _parts(o, key, depth + 1)
    elif isinstance(obj, dict):
        if depth < _MAX_NESTING:
            for k, o in obj.items():
                yield from _parts(o, f"{k}:", depth + 1)
    else:
        value = _setting(obj)
        if value is not None:
            yield key + value


def _setting(v: Any) -> str | None:
    """A plain setting's part of a signature (NOTE [ Signatures ]); ``None``: not one."""
    if v is None or isinstance(v, bool):
        return repr(v)
    if type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"):
        # numpy's bool (no Integral): as a bool
        return repr(bool(v))
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, numbers.Integral):
        return str(int(v))
    if isinstance(v, numbers.Number):
        return "float" if isinstance(v, numbers.Real) else "complex"
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, str):
        if len(v) <= _LONG_STR:
            return repr(v)
        return f"str#{zlib.crc32(v.encode('utf-8', 'surrogatepass')):08x}"
    return None


def _shape_of(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(str(n) for n in t.shape)}]"


class ActivePlan:
    """A :class:`Plan` as lookup tables for the hooks: what to do with a key, where reloads
    start, which module calls to recompute."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        # key -> "keep" | "cpu" | "nvme" | "rebuild"; members of a family share its decision.
        self.action: dict[tuple[str, int, int], str] = {}
        # key -> the most bytes a record of it may have and keep its decision (its family's)
        self.limit: dict[tuple[str, int, int], int] = {}
        # key of a family's first member -> its reload trigger's key (or None)
        self.trigger: dict[tuple[str, int, int], tuple[str, str, int, int] | None] = {}
        # key -> (action, limit): the pack's one lookup (the hot path, offload/_pack.py)
        self.decision: dict[tuple[str, int, int], tuple[str, int]] = {}
        for e in plan.entries:
            action = _ACTION_OF.get(e.placement, KEEP)
            for k in e.keys:
                self.action[k] = action
                self.limit[k] = e.nbytes
                self.decision[k] = (action, e.nbytes)
            if e.placement.moves:
                self.trigger[e.keys[0]] = e.reload.key if e.reload is not None else None
        self.recompute_calls = frozenset(plan.recompute_calls)
        self.recompute_modules = frozenset(m for m, _ in plan.recompute_calls)
        self.recompute_bytes = sum(
            e.nbytes for e in plan.entries if e.placement is Placement.RECOMPUTE
        )
        self.backward_triggers = frozenset(
            (t[1], t[2]) for t in self.trigger.values() if t is not None and t[0] == "backward"
        )
        self.expected = frozenset(plan.expected_keys)
        # The keys in the order a forward of the plan's structure packs them (NOTE [ Structure ]).
        self.sequence = tuple(plan.expected_keys)
        # The plan rebuilds some family: packs the manager keeps are remembered (a rebuilt
        # record's input may be one of them, see ActivationOffloader._activation_recipe).
        self.rebuilds = any(e.placement is Placement.REBUILD for e in plan.entries)


class ComputeClock:
    """The host clock less the seconds offload itself held the compute thread.

    In a CPU-only profiling step every copy runs on the compute thread (min-memory mode copies
    everything): the manager adds each copy's time to ``held_s``, so the trace times compute
    alone and the planner adds back only the copies its plan makes.

    Example:
        >>> c = ComputeClock()
        >>> a = c.stamp(); c.held_s += 10.0; b = c.stamp()
        >>> c.seconds([a, b])[1] < 0
        True
    """

    def __init__(self) -> None:
        self.held_s = 0.0

    def stamp(self) -> float:
        return time.perf_counter() - self.held_s

    def seconds(self, stamps: Sequence[object]) -> list[float]:
        if not stamps:
            return []
        t0 = float(stamps[0])  # type: ignore[arg-type]
        return [float(s) - t0 for s in stamps]  # type: ignore[arg-type]


class Profiler:
    """One :class:`lifecycle.Recorder` on the model for the manager's profiling steps.

    Attached once (its module hooks come after the manager's, so the manager's root pre-hook can
    begin a step that the recorder's root pre-hook then sees) and fed through the manager's
    saved-tensor hooks; idle between profiling steps.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        device_bytes: Callable[[], int],
        kept_modules: Sequence[str] = (),
    ):
        # Modules whose saved tensors the manager never moves (keep=): the trace names them, so
        # that no plan places or recomputes them.
        self.kept_modules = sorted(kept_modules)
        clock, probe, self.label = clock_and_probe(device)
        self.cuda = probe is not None
        # CPU: time offload's own copies out of the trace (see ComputeClock). CUDA: copies run on
        # their own streams; the CUDA clock stamps the compute stream as it is.
        self.compute_clock = None if self.cuda else ComputeClock()
        clock = self.compute_clock or clock
        if probe is not None:
            allocated = probe

            def probe_without_offloaded() -> int:
                # The executor's own device bytes are taken out here and the trace's live saved
                # bytes put back in trace(), so the trace shows memory as if everything were
                # kept, which is what the planner reads (see NOTE [ Budget mode ]).
                return allocated() - device_bytes()

            probe = probe_without_offloaded
        self.recorder = Recorder(clock=clock, memory_probe=probe)
        self._attached: Any = self.recorder.attach(model)
        self._attached.__enter__()

    @property
    def recording(self) -> bool:
        return self.recorder.recording

    def begin(self, thread: int | None) -> None:
        """Record a step whose forward runs on ``thread`` (module calls of other threads outside a
        backward are not the step's; ``None``: every thread's are)."""
        self.recorder.begin_step(thread=thread)

    def end(self) -> int:
        """End the step being recorded; returns its index in :meth:`trace`."""
        self.recorder.end_step()
        return self.recorder.steps_recorded - 1

    def discard(self) -> None:
        self.recorder.discard_partial_step()

    def trace(self) -> Trace:
        """Every profiled step so far (call it between steps)."""
        meta: dict[str, Any] = {"device": self.label, "source": "offload.ActivationOffloader"}
        if self.kept_modules:
            meta["kept_modules"] = self.kept_modules
        trace = self.recorder.trace(meta)
        if self.cuda:
            live = dict(trace.live_saved_bytes())
            trace = dataclasses.replace(
                trace,
                events=tuple(
                    dataclasses.replace(e, memory_bytes=e.memory_bytes + live[e.index])
                    for e in trace.events
                ),
            )
        return trace

    def close(self) -> None:
        if self._attached is not None:
            self.recorder.discard_partial_step()
            self._attached.__exit__(None, None, None)
            self._attached = None


class RecomputeForward:
    """Installed as ``module.forward`` while a plan recomputes some of the module's calls: those
    calls run under non-reentrant ``torch.utils.checkpoint``; others run as they are."""

    def __init__(self, mgr: Any, name: str, forward: Callable[..., Any]) -> None:
        # The manager weakly: the module outlives a manager dropped without close().
        self.mgr, self.name, self.forward = weakref.ref(mgr), name, forward
        functools.update_wrapper(self, forward)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A copy of the module (an EMA or teacher copy) is not the manager's: it runs its own
        # forward, as it would without a plan.
        return copy.deepcopy(self.forward, memo)

    def __reduce__(self) -> tuple[Any, ...]:
        # ``torch.save(model)``: a weak reference cannot be pickled; the loaded module calls
        # its own forward (a bound method pickles as ``getattr(module, "forward")``).
        return (_same, (self.forward,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mgr = self.mgr()
        call = None if mgr is None else mgr._recompute_this(self.name)
        if mgr is None or call is None:
            return self.forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Traced into (a model compiled after the manager was made): checkpoint under
            # compile takes only TorchDispatchMode contexts; nothing to verify or mark there.
            return torch.utils.checkpoint.checkpoint(
                self.forward, *args, use_reentrant=False, **kwargs
            )
        # The forward context marks the checkpoint as the plan's (NOTE [ Model checkpoints ] in
        # lifecycle/_recorder.py) or verifies it (NOTE [ Verified recomputation ] in _verify.py).
        return torch.utils.checkpoint.checkpoint(
            self.forward,
            *args,
            use_reentrant=False,
            context_fn=mgr._checkpoint_context(self.name, getattr(self.forward, "__self__", None)),
            **kwargs,
        )


def _same(x: Any) -> Any:
    return x


def merged_trace(trace: Trace, steps: Sequence[int]) -> tuple[Trace, int, list[int]]:
    """One step standing for many input signatures: ``(trace', step, group)``.

    ``group``: the largest set of ``steps`` whose records have the same keys (module, call,
    ordinal); with varying sequence lengths or batch sizes every step's keys are the same.
    ``step``: the one of ``group`` with the most saved bytes, whose timeline (events, times,
    memory outside saved tensors) the merged step keeps; in ``trace'`` its records carry, per
    key, the most bytes any step of ``group`` saved under that key (a family's storage: the
    most of its members'), and its memory curve the bytes that adds. A plan of it holds for
    every step of the group, and for new signatures with the same keys and no larger records.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> rec = Recorder()
        >>> with rec.attach(model), rec.hooks():
        ...     for n in (2, 6, 3):
        ...         rec.begin_step()
        ...         model(torch.randn(n, 4)).sum().backward()
        ...         rec.end_step()
        >>> trace, step, group = merged_trace(rec.trace(), [0, 1, 2])
        >>> step, group
        (1, [0, 1, 2])
        >>> [r.nbytes for r in trace.records if r.step == 1 and not r.is_parameter]
        [96, 96]
    """
    records_of: dict[int, list[TensorRecord]] = {s: [] for s in steps}
    for r in trace.records:
        if r.step in records_of:
            records_of[r.step].append(r)
    groups: dict[frozenset[tuple[str, int, int]], list[int]] = {}
    for s in steps:
        groups.setdefault(frozenset(_key(r) for r in records_of[s]), []).append(s)
    group = max(groups.values(), key=len)

    def saved(s: int) -> int:
        return sum(r.nbytes for r in records_of[s] if not r.is_parameter)

    base = max(group, key=saved)
    most: dict[tuple[str, int, int], tuple[int, int]] = {}
    for s in group:
        for r in records_of[s]:
            n, st = most.get(_key(r), (0, 0))
            most[_key(r)] = (max(n, r.nbytes), max(st, r.storage_nbytes))
    storage: dict[int, int] = {}
    for r in records_of[base]:
        storage[r.family] = max(storage.get(r.family, 0), most[_key(r)][1])
    grown = {
        r.seq: dataclasses.replace(r, nbytes=most[_key(r)][0], storage_nbytes=storage[r.family])
        for r in records_of[base]
        if (r.nbytes, r.storage_nbytes) != (most[_key(r)][0], storage[r.family])
    }
    if not grown:
        return trace, base, group
    before = dict(trace.live_saved_bytes())
    out = dataclasses.replace(trace, records=tuple(grown.get(r.seq, r) for r in trace.records))
    after = dict(out.live_saved_bytes())
    events = tuple(
        dataclasses.replace(e, memory_bytes=e.memory_bytes + after[e.index] - before[e.index])
        if e.step == base
        else e
        for e in trace.events
    )
    return dataclasses.replace(out, events=events), base, group


_ANCHORS = frozenset(
    {
        EventKind.STEP_START,
        EventKind.STEP_END,
        EventKind.FORWARD_START,
        EventKind.FORWARD_END,
        EventKind.BACKWARD_START,
        EventKind.BACKWARD_END,
    }
)


def retimed(
    trace: Trace,
    step: int,
    timing: int,
    rebuild_s: Mapping[tuple[str, int, int], float] | None = None,
) -> Trace:
    """``trace`` with step ``step``'s times taken from step ``timing`` (see NOTE [ Refinement ]).

    Module boundaries (forward and backward starts and ends of a module call) that both steps
    have are anchors: each gets the time it had in ``timing``; the events between two anchors
    (packs, unpacks, calls the other step lacks) keep their relative place between them. Forward
    spans of ``timing`` that ``step`` lacks (a planned checkpoint's recomputation during the
    backward) are cut out of its clock first, since a plan adds recomputation time itself; so
    are ``rebuild_s[key]`` seconds after each unpack in ``timing`` of a record with that key (a
    planned rebuild, whose kernel a device clock times: the plan adds rebuild time itself).
    Records, memory and order are left as they are.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> rec = Recorder()
        >>> with rec.attach(model), rec.hooks():
        ...     for _ in range(2):
        ...         rec.begin_step()
        ...         model(torch.randn(2, 4)).sum().backward()
        ...         rec.end_step()
        >>> trace = rec.trace()
        >>> out = retimed(trace, 0, 1)
        >>> def span(s):
        ...     e = [x for x in s.events if x.step == 0]
        ...     return e[-1].time_s - e[0].time_s
        >>> ev = [x for x in trace.events if x.step == 1]
        >>> abs(span(out) - (ev[-1].time_s - ev[0].time_s)) < 1e-12
        True
    """
    mine = [e for e in trace.events if e.step == step]
    theirs = [e for e in trace.events if e.step == timing]
    if not mine or not theirs:
        raise ValueError(f"the trace has no step {step if not mine else timing}")
    calls = {(e.module, e.call_index) for e in mine if e.kind is EventKind.FORWARD_START}
    # Forward spans of `timing` that `step` lacks, outermost: cut out of its clock. One ends at
    # its own end, or (a checkpoint's recomputation stops early, so no end is recorded) at the
    # next event of the step's own timeline.
    cut: list[tuple[float, float]] = []
    open_: list[tuple[str, int]] = []
    start = 0.0
    for e in theirs:
        foreign = (e.module, e.call_index) not in calls
        if e.kind is EventKind.FORWARD_START and foreign:
            if not open_:
                start = e.time_s
            open_.append((e.module, e.call_index))
        elif e.kind is EventKind.FORWARD_END and foreign:
            if open_ and open_[-1] == (e.module, e.call_index):
                open_.pop()
                if not open_:
                    cut.append((start, e.time_s))
        elif open_:
            cut.append((start, e.time_s))
            open_.clear()
        if rebuild_s and e.kind is EventKind.UNPACK and e.record >= 0:
            took = rebuild_s.get(_key(trace.records[e.record]), 0.0)
            if took > 0.0 and not open_:
                cut.append((e.time_s, e.time_s + took))

    def clock(t: float) -> float:
        return t - sum(min(t, b) - a for a, b in cut if a < t)

    at: dict[tuple[EventKind, str, int], float] = {}
    for e in theirs:
        if e.kind in _ANCHORS:
            at.setdefault((e.kind, e.module, e.call_index), clock(e.time_s))
    pairs: list[tuple[float, float]] = []  # (time in `step`, time from `timing`), both rising
    for e in mine:
        t = at.get((e.kind, e.module, e.call_index)) if e.kind in _ANCHORS else None
        if t is not None and (not pairs or (e.time_s >= pairs[-1][0] and t >= pairs[-1][1])):
            pairs.append((e.time_s, t))
    if len(pairs) < 2:
        return trace
    shift = pairs[0][0] - pairs[0][1]  # the first anchor (the step's start) keeps its time
    new: dict[int, float] = {}
    j = 0
    for e in mine:
        while j + 2 < len(pairs) and pairs[j + 1][0] <= e.time_s:
            j += 1
        (p0, t0), (p1, t1) = pairs[j], pairs[j + 1]
        share = (e.time_s - p0) / (p1 - p0) if p1 > p0 else 0.0
        new[e.index] = t0 + share * (t1 - t0) + shift
    events = tuple(
        dataclasses.replace(e, time_s=new[e.index]) if e.index in new else e for e in trace.events
    )
    records = tuple(
        dataclasses.replace(
            r,
            pack_time_s=new[r.pack_event],
            unpack_times_s=tuple(new[i] for i in r.unpack_events),
        )
        if r.step == step
        else r
        for r in trace.records
    )
    return dataclasses.replace(
        trace, events=events, records=records, metadata={**dict(trace.metadata), "retimed": True}
    )


def _key(r: TensorRecord) -> tuple[str, int, int]:
    return (r.module, r.call_index, r.ordinal)


def load_plan(plan: Plan | str | os.PathLike[str] | None) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load_arg_file(Plan.load, plan, "plan")
    raise TypeError(
        f"plan must be a lifecycle.Plan, a path to one saved as JSON, or None; got {type(plan).__name__}"
    )


def rooted_plan(plan: Plan, model: nn.Module) -> Plan:
    """``plan`` with its module paths relative to ``model``, as the manager names them.

    A plan made from a trace of global module hooks (``offload profile``, which notes its roots
    in ``trace.metadata["root_modules"]``, carried into ``plan.metadata``) names each module from
    its root's class (``GPT.blocks.0``); a manager names them from its model (``blocks.0``, the
    model itself ``""``). Without renaming, none of the plan's keys matched a pack. Packs
    outside ``model`` (the recorder's ``<outside>`` ones and those of its other roots, such as
    an ``nn.CrossEntropyLoss``) are one sequence to the manager, ``<outside>`` numbered in pack
    order: the plan's keys of them are renumbered so (``plan.expected_keys`` is in pack order).

    Raises:
        ValueError: the plan's roots do not include ``model``'s class.
    """
    roots = plan.metadata.get("root_modules")
    if not roots:
        return plan
    root = type(model).__name__
    if root not in roots:
        raise ValueError(
            f"plan: made by `offload profile` from root modules {sorted(roots)!r}, none of "
            f"them a {root}, the model given: its keys name another model's modules; profile "
            "the script that trains this model, or let the manager profile (no plan=)"
        )
    prefix = root + "."

    def name(module: str) -> str:
        if module == root:
            return ""
        return module[len(prefix) :] if module.startswith(prefix) else module

    # The manager numbers every pack outside its model as one sequence; the recorder numbered
    # those of each other root per call, and its own <outside> ones apart.
    outside: dict[tuple[str, int, int], tuple[str, int, int]] = {}
    for k in plan.expected_keys:
        if k[0] != root and not k[0].startswith(prefix):
            outside[k] = (OUTSIDE, 0, len(outside))

    def key(k: tuple[str, int, int]) -> tuple[str, int, int]:
        got = outside.get(k)
        return got if got is not None else (name(k[0]), k[1], k[2])

    def trigger(t: Trigger) -> Trigger:
        if t.kind == "unpack":
            module, call_index, ordinal = key((t.module, t.call_index, t.ordinal))
            return dataclasses.replace(t, module=module, call_index=call_index, ordinal=ordinal)
        return dataclasses.replace(t, module=name(t.module))

    entries = tuple(
        dataclasses.replace(
            e,
            keys=tuple(key(k) for k in e.keys),
            module=OUTSIDE if e.keys and e.keys[0] in outside else name(e.module),
            reload=None if e.reload is None else trigger(e.reload),
            recompute_module=name(e.recompute_module) if e.recompute_module else "",
        )
        for e in plan.entries
    )
    metadata = {k: v for k, v in plan.metadata.items() if k != "root_modules"}
    if "kept_modules" in metadata:
        metadata["kept_modules"] = sorted(name(m) for m in metadata["kept_modules"])
    return dataclasses.replace(
        plan,
        entries=entries,
        recompute_calls=tuple((name(m), c) for m, c in plan.recompute_calls),
        expected_keys=tuple(key(k) for k in plan.expected_keys),
        metadata=metadata,
    )


def describe(plan: Plan) -> str:
    """One log line about a plan."""
    by = plan.bytes_by_placement()
    moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in by.items() if v)
    keep = plan.anchors.get("keep_all")
    ratio = (
        f" ({plan.predicted_step_s / keep.step_s:.3f}x keeping everything)"
        if keep and keep.step_s > 0
        else ""
    )
    return (
        f"offload: planned signature {plan.signature or '<any>'} for a budget of "
        f"{format_bytes(plan.gpu_budget_bytes)}: predicted peak {format_bytes(plan.predicted_peak_bytes)}, "
        f"step {plan.predicted_step_s * 1e3:.2f} ms{ratio}; {moved}"
    )


def make_plan(
    trace: Trace,
    *,
    step: int,
    budget: int,
    hardware: HardwareModel,
    tiers: tuple[str, ...],
    cpu_budget_bytes: int,
    min_offload_bytes: int,
    max_inflight_bytes: int,
    signature: str,
    recompute: bool = True,
) -> Plan:
    """:func:`lifecycle.plan` with the manager's settings."""
    return lifecycle.plan(
        trace,
        budget,
        hardware,
        tiers=tiers,
        cpu_budget=cpu_budget_bytes,
        min_offload_bytes=min_offload_bytes,
        max_inflight_bytes=max_inflight_bytes or None,
        step=step,
        signature=signature,
        recompute=recompute,
    )
