"""The recorded life of one or more training steps: frozen records, JSON, derived facts.

A :class:`Trace` is plain data. It is produced by :class:`lifecycle.Recorder`, saved and loaded
as JSON with a schema version, and read by the planner, the exporters and the CLI. Nothing here
touches CUDA or autograd.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
import math
import os
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from offload.lifecycle._jsonfile import read_json, write_json
from offload.lifecycle._nogc import gc_paused

# NOTE [ Alias handling ] in offload's _family.py: a view spanning at least 1/WHOLE_STORAGE_FACTOR
# of its storage is copied as the whole storage (sibling views packed later, q, k and v of one qkv
# output, then find their bytes stored); a smaller slice, or a tensor that is no view, copies only
# its own span. offload's executor copies so and a trace counts a family's span so
# (``Trace.families``): one constant, so that a plan's bytes are the bytes the manager moves.
WHOLE_STORAGE_FACTOR = 4

SCHEMA_VERSION = 1
_T = TypeVar("_T")
_FORMAT = "offload.trace"


class EventKind(str, enum.Enum):
    """What happened at one point of the step timeline."""

    STEP_START = "step_start"
    STEP_END = "step_end"
    FORWARD_START = "forward_start"
    FORWARD_END = "forward_end"
    BACKWARD_START = "backward_start"
    BACKWARD_END = "backward_end"
    PACK = "pack"
    UNPACK = "unpack"


@dataclass(frozen=True, kw_only=True)
class Event:
    """One point of the timeline.

    Attributes:
        index: position in the trace's timeline (0, 1, 2, ... across all steps).
        kind: what happened.
        step: which recorded step (0-based) the event belongs to.
        time_s: seconds since the start of the first recorded step.
        memory_bytes: memory in use at this point (CUDA allocator on GPU, live saved bytes on CPU).
        module: qualified name of the module concerned ("" when none).
        call_index: call index of that module within the step (-1 when none).
        record: ``seq`` of the record concerned for PACK / UNPACK events, else -1.
    """

    index: int
    kind: EventKind
    step: int
    time_s: float
    memory_bytes: int
    module: str = ""
    call_index: int = -1
    record: int = -1


@dataclass(frozen=True, kw_only=True)
class TensorRecord:
    """One tensor that autograd saved for backward, and when it was used.

    Attributes:
        seq: pack order across the trace (0, 1, 2, ...).
        step: which recorded step (0-based).
        family: alias family id; records of one live storage (at one version) share it.
        module: qualified name of the innermost module running at pack ("" is the root module,
            "<outside>" no module: a functional loss, say).
        call_index: call index of that module within the step.
        ordinal: position of this pack within that module call.
        nbytes: bytes this view spans (``numel * itemsize``).
        storage_nbytes: bytes of the whole underlying storage.
        storage_offset: element offset of the view into its storage.
        shape: the view's shape.
        stride: the view's strides, in elements.
        dtype: ``str(torch.dtype)``, e.g. ``"torch.float32"``.
        device: ``str(torch.device)``, e.g. ``"cpu"`` or ``"cuda:0"``.
        is_parameter: the storage belongs to a parameter or buffer of the model (so ``weight.t()``
            counts).
        grad_fn: class name of the tensor's ``grad_fn`` (``""`` for leaves and non-grad tensors).
        in_backward: packed while a backward ran (checkpoint recomputation, double backward).
        pack_event: timeline index of the pack.
        pack_time_s: time of the pack.
        unpack_events: timeline indices of every unpack, in order.
        unpack_times_s: times of every unpack, in order.
        rebuild_from: ``seq`` of the record this one can be rebuilt from at unpack instead of
            stored (a GELU / SiLU / norm output, saved by the next op, from the input the
            function's own node saved: NOTE [ Activation recipes ] in ``offload``), or -1. The
            planner may choose to rebuild such a family (``Placement.REBUILD``).
        is_view: the tensor was a view (``t._base`` set) when packed. A family whose first
            record is a view spanning at least a quarter of its storage counts the whole storage,
            as the offloader copies it (:meth:`Trace.families`). False in traces written before
            this field existed.
        weight_cast: an autocast weight cast (NOTE [ Weight casts ] in ``offload``), recorded
            as a parameter (``is_parameter``): ``offload`` casts it again at unpack, so a plan
            need not place it. One smaller than ``min_offload_bytes`` the manager keeps as it
            is, though: :func:`lifecycle.plan` counts those as kept activations. False in traces
            written before this field existed.
    """

    seq: int
    step: int
    family: int
    module: str
    call_index: int
    ordinal: int
    nbytes: int
    storage_nbytes: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str
    is_parameter: bool
    grad_fn: str
    in_backward: bool
    pack_event: int
    pack_time_s: float
    unpack_events: tuple[int, ...] = ()
    unpack_times_s: tuple[float, ...] = ()
    rebuild_from: int = -1
    is_view: bool = False
    weight_cast: bool = False

    @property
    def key(self) -> tuple[str, int, int]:
        """(module path, call index, ordinal): stable across steps of one signature."""
        return (self.module, self.call_index, self.ordinal)

    @property
    def last_use_event(self) -> int:
        """Timeline index of the last unpack, or of the pack when never unpacked."""
        return self.unpack_events[-1] if self.unpack_events else self.pack_event

    @property
    def lifetime_s(self) -> float:
        """Seconds from pack to the last unpack (0.0 when never unpacked)."""
        return self.unpack_times_s[-1] - self.pack_time_s if self.unpack_times_s else 0.0

    @property
    def itemsize(self) -> int:
        return self.nbytes // max(1, math.prod(self.shape)) if self.nbytes else 0


@dataclass(frozen=True, kw_only=True)
class Family:
    """An alias family: the records that share one live storage, and the span they cover.

    Attributes:
        family: the family id.
        records: ``seq`` of each member, in pack order.
        span_bytes: bytes an offload copies once: the whole storage when the first member is a
            view spanning at least a quarter of it (NOTE [ Alias handling ] in ``offload``), else
            the span the members cover.
        storage_nbytes: bytes of the whole storage.
        is_parameter: the storage is a parameter's or buffer's.
        first_pack_event / last_use_event: the family's lifetime on the timeline.
    """

    family: int
    step: int
    records: tuple[int, ...]
    span_bytes: int
    storage_nbytes: int
    is_parameter: bool
    first_pack_event: int
    last_use_event: int


@dataclass(frozen=True, kw_only=True)
class ModuleSpan:
    """One forward or backward of one module call, from its start to its end event."""

    module: str
    call_index: int
    step: int
    phase: str  # "forward" | "backward"
    start_event: int
    end_event: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True)
class Trace:
    """The recorded life of every saved tensor over one or more steps.

    Build one with :func:`offload.profile` or the ``offload profile`` CLI; load one with
    :meth:`Trace.load`.

    Attributes:
        records: every saved tensor, in pack order.
        events: the timeline (module starts and ends, packs, unpacks), in order.
        steps: how many steps were recorded.
        metadata: free-form facts about the run (torch version, device, clock, memory probe).
        retained_steps: the steps whose saved tensors outlived a backward that used them
            (``retain_graph=True``; ``torch.autograd.grad(..., create_graph=True)``, a gradient
            penalty): the recorder saw one still held when that backward ended. Each saved
            tensor of such a step stays live until the step's end, not its last use, and a plan
            counts a tensor it keeps on the device so (one it moves, rebuilds or recomputes is
            freed after its use in each backward, as without). Ascending step indices; empty
            in traces written before this field existed.
        create_graph_steps: the steps with a backward run with ``create_graph=True`` (grad
            mode on at its unpacks): the graph it builds may save what it unpacks again, so a
            plan counts every saved tensor of such a step, brought back or kept, as live until
            the step's end. Same form as ``retained_steps``.

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> x = torch.randn(4, 8)
        >>> trace = offload.profile(lambda: model(x).sum().backward(), model)
        >>> trace.steps, len(trace.records) > 0
        (1, True)
    """

    records: tuple[TensorRecord, ...]
    events: tuple[Event, ...]
    steps: int = 1
    metadata: Mapping[str, Any] = field(default_factory=dict)
    retained_steps: tuple[int, ...] = ()
    create_graph_steps: tuple[int, ...] = ()

    # -- derived facts -----------------------------------------------------------------------

    def _derived(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """A fact derived from this trace, built at its first use and kept with the trace:
        records and events are immutable, and the simulator, the planner's replays and the
        reports ask for the same ones again and again. Not pickled (:meth:`__getstate__`)."""
        memo = self.__dict__.get("_memo")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_memo", memo)  # a cache, not a field: frozen still
        if key not in memo:
            memo[key] = build()
        return memo[key]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def __repr__(self) -> str:
        # Counts, not contents: the generated repr printed every record and event (tens of KB
        # for a small model, in a notebook cell or a log line). :meth:`summary` is the report.
        device = self.metadata.get("device", "?")
        return (
            f"Trace(steps={self.steps}, records={len(self.records)}, events={len(self.events)}, "
            f"saved_bytes={self.saved_bytes}, device={device!r})"
        )

    def families(self) -> tuple[Family, ...]:
        """Alias families in order of first pack."""
        return self._derived("families", self._families)

    def _families(self) -> tuple[Family, ...]:
        members: dict[int, list[TensorRecord]] = {}
        for r in self.records:
            members.setdefault(r.family, []).append(r)
        out = []
        for fam, rs in members.items():
            out.append(
                Family(
                    family=fam,
                    step=rs[0].step,
                    records=tuple(r.seq for r in rs),
                    span_bytes=_family_span_bytes(rs),
                    storage_nbytes=rs[0].storage_nbytes,
                    is_parameter=rs[0].is_parameter,
                    first_pack_event=min(r.pack_event for r in rs),
                    last_use_event=max(r.last_use_event for r in rs),
                )
            )
        return tuple(out)

    @property
    def activation_records(self) -> tuple[TensorRecord, ...]:
        """Records that are not parameters or buffers."""
        return tuple(r for r in self.records if not r.is_parameter)

    @property
    def saved_bytes(self) -> int:
        """Activation bytes saved over the trace, each alias family counted once (its span)."""
        return sum(f.span_bytes for f in self.families() if not f.is_parameter)

    def live_saved_bytes(self) -> list[tuple[int, int]]:
        """Live activation bytes after each event: ``[(event index, bytes), ...]``.

        A family is live from its first pack through its last use (the last unpack of any
        member, or of the node that unpacked it, NOTE [ Unpacks of one node ]; a family never
        unpacked, or one of a step in ``retained_steps`` or
        ``create_graph_steps``, stays live until the end of its step).
        """
        return list(self._derived("live_saved_bytes", self._live_saved_bytes))

    def _live_saved_bytes(self) -> tuple[tuple[int, int], ...]:
        step_end: dict[int, int] = {}
        for e in self.events:
            if e.kind is EventKind.STEP_END:
                step_end[e.step] = e.index
        last_index = self.events[-1].index if self.events else 0
        retained = frozenset(self.retained_steps) | frozenset(self.create_graph_steps)
        delta: dict[int, int] = {}
        for f in self.families():
            if f.is_parameter:
                continue
            unpacked = any(self.records[s].unpack_events for s in f.records)
            if unpacked and f.step not in retained:
                end = self.held_through(f.last_use_event)
            else:
                end = step_end.get(f.step, last_index)
            delta[f.first_pack_event] = delta.get(f.first_pack_event, 0) + f.span_bytes
            # Bytes leave right after their last use.
            delta[end + 1] = delta.get(end + 1, 0) - f.span_bytes
        out, live = [], 0
        for e in self.events:
            live += delta.get(e.index, 0)
            out.append((e.index, live))
        return tuple(out)

    def held_through(self, event: int) -> int:
        """The last event at which what was unpacked at ``event`` is still held: the last unpack
        of the same autograd node (NOTE [ Unpacks of one node ]); ``event`` itself otherwise."""
        return self._derived("node unpack ends", self._node_unpack_ends).get(event, event)

    def _node_unpack_ends(self) -> dict[int, int]:
        # NOTE [ Unpacks of one node ]
        #     An autograd node unpacks all its saved tensors before it computes, and holds them
        #     until it returns: a MulBackward0 holds both factors together, however each was
        #     brought back (a reload, a recomputation, a rebuild). The trace does not name the
        #     node, so two records count as one node's when the op packed them at adjacent
        #     events and backward unpacked them at adjacent events in the same order, pass by
        #     pass (the generated nodes unpack in pack order). Two nodes in a row, each with
        #     one saved tensor, unpack in the reverse of their pack order, so they are not
        #     joined; a node that unpacks out of pack order is missed (counted as before). What
        #     a node unpacked is freed after the node's last unpack, not its own.
        ends: dict[int, int] = {}
        for r, s in itertools.pairwise(self.records):
            if (
                s.pack_event == r.pack_event + 1
                and r.unpack_events
                and len(s.unpack_events) == len(r.unpack_events)
                and all(b == a + 1 for a, b in zip(r.unpack_events, s.unpack_events, strict=True))
            ):
                ends.update(zip(r.unpack_events, s.unpack_events, strict=True))
        for a in sorted(ends, reverse=True):  # a chain of three or more: to its last unpack
            ends[a] = ends.get(ends[a], ends[a])
        return ends

    @property
    def peak_saved_bytes(self) -> int:
        """Peak of :meth:`live_saved_bytes` (0 for an empty trace)."""
        live = self._derived("live_saved_bytes", self._live_saved_bytes)
        return max((b for _, b in live), default=0)

    @property
    def peak_memory_bytes(self) -> int:
        """Peak of the memory probe over the timeline (allocator bytes on GPU)."""
        return max((e.memory_bytes for e in self.events), default=0)

    def bytes_by_module(self) -> dict[str, int]:
        """Activation bytes per module path (each family counted once, at its first record)."""
        out: dict[str, int] = {}
        for f in self.families():
            if f.is_parameter:
                continue
            first = self.records[f.records[0]]
            out[first.module] = out.get(first.module, 0) + f.span_bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def lifetimes_s(self) -> list[float]:
        """Pack-to-last-use seconds of each activation record that was unpacked."""
        return [r.lifetime_s for r in self.activation_records if r.unpack_events]

    def alias_counts(self) -> dict[int, int]:
        """How many records share each activation family: ``{family: count}``."""
        counts: dict[int, int] = {}
        for r in self.activation_records:
            counts[r.family] = counts.get(r.family, 0) + 1
        return counts

    def module_spans(self) -> tuple[ModuleSpan, ...]:
        """Forward and backward spans of every module call, ordered by start."""
        return self._derived("module_spans", self._module_spans)

    def _module_spans(self) -> tuple[ModuleSpan, ...]:
        open_: dict[tuple[str, int, int, str], Event] = {}
        spans = []
        pairs = {
            EventKind.FORWARD_START: ("forward", True),
            EventKind.FORWARD_END: ("forward", False),
            EventKind.BACKWARD_START: ("backward", True),
            EventKind.BACKWARD_END: ("backward", False),
        }
        for e in self.events:
            if e.kind not in pairs:
                continue
            phase, is_start = pairs[e.kind]
            k = (e.module, e.call_index, e.step, phase)
            if is_start:
                open_.setdefault(k, e)
                continue
            start = open_.pop(k, None)
            if start is not None:
                spans.append(
                    ModuleSpan(
                        module=e.module,
                        call_index=e.call_index,
                        step=e.step,
                        phase=phase,
                        start_event=start.index,
                        end_event=e.index,
                        start_s=start.time_s,
                        end_s=e.time_s,
                    )
                )
        # A backward whose end was not seen (the module's inputs need no gradient: the first
        # layer, the root) ends with its step.
        step_end = {e.step: e for e in self.events if e.kind is EventKind.STEP_END}
        for (module, call_index, step, phase), start in open_.items():
            end = step_end.get(step)
            if phase == "backward" and end is not None:
                spans.append(
                    ModuleSpan(
                        module=module,
                        call_index=call_index,
                        step=step,
                        phase=phase,
                        start_event=start.index,
                        end_event=end.index,
                        start_s=start.time_s,
                        end_s=end.time_s,
                    )
                )
        return tuple(sorted(spans, key=lambda s: s.start_event))

    def summary(self, top: int = 10) -> str:
        """A plain-text report: totals, peak, the ``top`` modules by saved bytes (0: none),
        lifetimes, aliasing.

        Raises:
            TypeError / ValueError: ``top`` is not an int >= 0.
        """
        from offload.lifecycle._report import summarize

        return summarize(self, top=top)

    # -- persistence -------------------------------------------------------------------------

    # Converting builds a dict per record and per event: with the cyclic GC held off (see
    # lifecycle._nogc), a 100k-record trace's to_dict took 0.75 s instead of 4.9 s.

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (lists for tuples, strings for enums)."""
        from offload.lifecycle._trace_json import trace_to_dict

        return trace_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: another format or schema, or a body that is not a trace's: a missing or
                malformed field (indices are ints, not bools or floats; byte counts ints in
                [0, 2**63); times finite numbers, in order; ``dtype`` a torch dtype's name,
                ``device`` a torch device's; one unpack time per unpack event, each its event's),
                or an index to an event or record that is not there. The message names the
                record or event and the field.
        """
        from offload.lifecycle._trace_json import trace_from_dict

        return trace_from_dict(cls, data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as JSON to ``path`` (atomically: a temp file, then a rename)."""
        with gc_paused():
            write_json(path, self.to_dict(), separators=(",", ":"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save`.

        Raises:
            TypeError: ``path`` is not a str or ``os.PathLike``.
            FileNotFoundError: ``path`` does not exist.
            ValueError: the file is not an offload trace, has another schema version, or a
                field that is malformed (see :meth:`from_dict`).
        """
        with gc_paused():
            return cls.from_dict(read_json(path))

    def __post_init__(self) -> None:
        for name in ("retained_steps", "create_graph_steps"):
            got = tuple(getattr(self, name))
            if any(type(s) is not int for s in got) or list(got) != sorted(set(got)):
                raise ValueError(f"{name} must be ascending, distinct step indices; got {got!r}")
            if got and not 0 <= got[0] <= got[-1] < self.steps:
                raise ValueError(f"{name} must be step indices in [0, {self.steps}); got {got!r}")
            object.__setattr__(self, name, got)
        # Records are addressed by position everywhere (events carry ``record=seq``).
        for i, r in enumerate(self.records):
            if r.seq != i:
                raise ValueError(
                    f"records must be in seq order with seq == position; record {i} has seq {r.seq}"
                )
            if r.rebuild_from != -1 and not 0 <= r.rebuild_from < i:
                raise ValueError(
                    f"record {i}'s rebuild_from must be an earlier record's seq or -1; got "
                    f"{r.rebuild_from}"
                )
        for i, e in enumerate(self.events):
            if e.index != i:
                raise ValueError(
                    f"events must be in index order with index == position; event {i} has index {e.index}"
                )


# NOTE [ Backward passes ]
#     A step may run several backwards over one graph (``loss1.backward(retain_graph=True);
#     loss2.backward()``): every saved tensor is then unpacked once per backward, and the k-th
#     unpack of a record is taken as backward pass k. A moved family's reload buffer lives only
#     as long as autograd's use of it in one pass: offload's executor drops its reference once
#     every member has been unpacked, and the next pass reloads it. Its reload for pass k starts
#     where the trigger of its first reload fires again in pass k (a plan's trigger is a
#     pre-hook on a module output's ``grad_fn`` or an unpack, and both fire in every pass):
#     an unpack trigger at the same record's k-th unpack; a backward start (which the recorder
#     notes in the first pass only) right after the unpack before the k-th unpack of the record
#     first unpacked after it, no later than where the executor sees it (the events between are
#     no unpacks). A family is counted per pass only when each member is unpacked equally often
#     and each pass's unpacks of it all come before the next pass's; otherwise, as before, it
#     is held from its first reload to its last use. Each pass also gets the executor's
#     look-ahead window anew (NOTE [ Reload policy ] in _simulate.py).
class BackwardPasses:
    """The backward passes of one step: which unpack is which pass, per NOTE [ Backward passes ].

    Args:
        records: the step's records.
    """

    def __init__(self, records: Iterable[TensorRecord]) -> None:
        self._unpacks: dict[int, tuple[int, ...]] = {}
        self._at: dict[int, tuple[int, int]] = {}  # unpack event -> (seq, pass)
        for r in records:
            self._unpacks[r.seq] = r.unpack_events
            for j, u in enumerate(r.unpack_events):
                self._at[u] = (r.seq, j)
        self._order = sorted(self._at)
        self.count = max(map(len, self._unpacks.values()), default=0)

    def again(self, event: int, k: int) -> int:
        """Where a reload trigger at ``event`` (of pass 0) fires in pass ``k``; -1: it does not."""
        i = bisect.bisect_left(self._order, event)
        if i == len(self._order):
            return -1
        unpack = self._order[i]
        seq, j = self._at[unpack]
        uses = self._unpacks[seq]
        if j + k >= len(uses):
            return -1
        target = uses[j + k]
        if unpack == event:
            return target
        before = bisect.bisect_left(self._order, target) - 1
        return self._order[before] + 1 if before >= 0 else target

    def of_family(self, seqs: Iterable[int]) -> tuple[tuple[int, int], ...]:
        """(first unpack, last unpack) of each pass of the family of records ``seqs``; () when
        the family is not counted per pass (NOTE [ Backward passes ])."""
        uses = [self._unpacks[s] for s in seqs]
        n = len(uses[0]) if uses else 0
        if n < 2 or any(len(u) != n for u in uses):
            return ()
        out = tuple((min(u[k] for u in uses), max(u[k] for u in uses)) for k in range(n))
        if any(out[k][1] >= out[k + 1][0] for k in range(n - 1)):
            return ()
        return out


def with_small_casts_kept(trace: Trace, floor_bytes: int) -> Trace:
    """``trace`` as a manager with ``min_offload_bytes=floor_bytes`` would record it: each weight
    cast (``TensorRecord.weight_cast``) smaller than the floor an activation, not a parameter.

    The manager casts a weight again at unpack only from ``min_offload_bytes`` up (NOTE [ Weight
    casts ] in ``offload``); a smaller cast it keeps where it is, and its own profiling step
    records it as any tensor it keeps. A recorder without a manager marks every cast, since it
    cannot know the floor a plan will use: the planner calls this with its own (without it a
    plan's peak left those casts out). ``trace`` itself when no cast is that small.
    """

    def build() -> Trace:
        small = [
            i
            for i, r in enumerate(trace.records)
            if r.weight_cast and r.is_parameter and r.nbytes < floor_bytes
        ]
        if not small:
            return trace
        records = list(trace.records)
        for i in small:
            records[i] = dataclasses.replace(records[i], is_parameter=False)
        return dataclasses.replace(trace, records=tuple(records))

    return trace._derived(("small casts kept", floor_bytes), build)


def _family_span_bytes(records: list[TensorRecord]) -> int:
    """What the offloader copies for a family whose members are ``records``, in pack order: the
    whole storage when the first is a view spanning at least 1/WHOLE_STORAGE_FACTOR of it (its
    executor's rule, see ``lifecycle._tensors``), else the span the members cover. (The
    executor starts a new family for a later member outside the first one's copy; the trace keeps
    such members in one family, counted by their union.)"""
    first = records[0]
    if first.is_view and first.nbytes:
        own = _span_bytes(records[:1])
        if first.storage_nbytes <= WHOLE_STORAGE_FACTOR * own:
            return first.storage_nbytes
    return _span_bytes(records)


def _span_bytes(records: Iterable[TensorRecord]) -> int:
    """Bytes of the storage span covered by views (offset/shape/stride in elements)."""
    lo, hi = None, 0
    for r in records:
        item = r.itemsize
        if r.nbytes == 0:
            continue
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(r.shape, r.stride, strict=True))
        start = r.storage_offset * item
        end = start + extent * item
        lo = start if lo is None else min(lo, start)
        hi = max(hi, end)
    if lo is None:
        return 0
    return hi - lo
