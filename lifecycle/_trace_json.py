"""The JSON form of a :class:`Trace`: records and events to JSON objects and back, checked.

A loaded file that is not a trace fails here, naming the record or event and the field.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from offload.lifecycle._jsonfile import check_header
from offload.lifecycle._nogc import gc_paused
from offload.lifecycle._trace import _FORMAT, SCHEMA_VERSION, Event, EventKind, TensorRecord, Trace

_T = TypeVar("_T")


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """See :meth:`Trace.to_dict`."""
    with gc_paused():
        return {
            "format": _FORMAT,
            "schema_version": SCHEMA_VERSION,
            "steps": trace.steps,
            "retained_steps": list(trace.retained_steps),
            "create_graph_steps": list(trace.create_graph_steps),
            "metadata": dict(trace.metadata),
            "records": [_record_to_json(r) for r in trace.records],
            "events": [_event_to_json(e) for e in trace.events],
        }


def trace_from_dict(cls: type[Trace], data: Mapping[str, Any]) -> Trace:
    """See :meth:`Trace.from_dict`."""
    check_header(data, fmt=_FORMAT, version=SCHEMA_VERSION, what="trace")
    missing = [k for k in ("steps", "records", "events") if k not in data]
    if missing:
        raise ValueError(f"trace is missing the field(s) {', '.join(map(repr, missing))}")
    steps, metadata = data["steps"], data.get("metadata", {})
    if type(steps) is not int or steps < 0:  # type(), not isinstance: a bool is no count
        raise ValueError(f"trace field 'steps' must be an int >= 0; got {steps!r}")
    # Absent from traces written before the fields existed: none.
    marked = {}
    for name in ("retained_steps", "create_graph_steps"):
        got = data.get(name, [])
        if not isinstance(got, list) or any(type(s) is not int for s in got):
            raise ValueError(f"trace field {name!r} must be a list of step indices; got {got!r}")
        marked[name] = tuple(got)
    if not isinstance(metadata, Mapping):
        raise ValueError(
            f"trace field 'metadata' must be a JSON object; got {type(metadata).__name__}"
        )
    device = metadata.get("device")
    if device is not None and not (isinstance(device, str) and _is_device(device)):
        raise ValueError(f"trace metadata 'device' {device!r} is not a torch device, e.g. 'cpu'")
    with gc_paused():
        records = _items_from_json(data, "records", _record_from_json)
        events = _items_from_json(data, "events", _event_from_json)
        try:
            trace = cls(
                records=records,
                events=events,
                steps=steps,
                metadata=dict(metadata),
                **marked,
            )
            _check_indices(trace)
        except TypeError as e:  # an index field that is not a number
            raise ValueError(f"trace has a malformed index field: {e}") from e
    return trace


def _check_indices(trace: Trace) -> None:
    """Raise ``ValueError`` when a record names an event, or an event a record, that is not in
    ``trace``: a bad file fails at load rather than deep inside the planner or the simulator.
    Only loaded traces are checked; traces built in memory come from the recorder and from
    transforms that keep their indices consistent."""
    n_events, n_records = len(trace.events), len(trace.records)
    for r in trace.records:
        if not 0 <= r.pack_event < n_events:
            raise ValueError(_not_an_event(r.seq, "pack_event", r.pack_event, n_events))
        for u in r.unpack_events:
            if not 0 <= u < n_events:
                raise ValueError(_not_an_event(r.seq, "unpack_events", u, n_events))
    ends = sum(e.kind is EventKind.STEP_END for e in trace.events)
    if ends != trace.steps:
        raise ValueError(f"'steps' is {trace.steps}, but the events end {ends} step(s)")
    step, t = 0, -math.inf
    for i, e in enumerate(trace.events):
        if not -1 <= e.record < n_records:
            raise ValueError(
                f"event {e.index}: record {e.record!r} is not a record's seq in [0, {n_records}) "
                "or -1"
            )
        if e.step < step:
            raise ValueError(f"event {i}: step {e.step} after step {step}; steps are in order")
        # One monotonic clock stamps the whole timeline (shuffled times planned as if a module's
        # backward ended before it began).
        if e.time_s < t:
            raise ValueError(f"event {i}: time_s {e.time_s} is before the event before it ({t})")
        step, t = e.step, e.time_s
    # What records and events say of each other (the recorder writes both): a record's pack
    # event packs it, each of its unpack events unpacks it, after that pack.
    events = trace.events
    for r in trace.records:
        pack = events[r.pack_event]
        if pack.kind is not EventKind.PACK or pack.record != r.seq:
            raise ValueError(
                f"record {r.seq}: pack_event {r.pack_event} is not its pack (it is the "
                f"{pack.kind.value} event of record {pack.record})"
            )
        for u in r.unpack_events:
            if events[u].kind is not EventKind.UNPACK or events[u].record != r.seq:
                raise ValueError(
                    f"record {r.seq}: unpack event {u} is not an unpack of it (it is the "
                    f"{events[u].kind.value} event of record {events[u].record})"
                )
            if u <= r.pack_event:
                raise ValueError(
                    f"record {r.seq}: unpack event {u} comes before its pack_event {r.pack_event}"
                )
        # A record's times are its events' times (the planner reads the one, the summary the other).
        if r.pack_time_s != pack.time_s or any(
            events[u].time_s != s for u, s in zip(r.unpack_events, r.unpack_times_s, strict=True)
        ):
            raise ValueError(
                f"record {r.seq}: pack_time_s or unpack_times_s differ from the times of its "
                "pack and unpack events"
            )


def _not_an_event(seq: int, name: str, index: Any, n_events: int) -> str:
    return f"record {seq}: {name} {index!r} is not an event index in [0, {n_events})"


_TUPLE_FIELDS = ("shape", "stride", "unpack_events", "unpack_times_s")
_EVENT_KINDS = {k.value: k for k in EventKind}


# The records' and events' own attribute dicts (their fields, in declaration order) are copied
# rather than ``dataclasses.asdict``-ed, which deep-copies field by field: a 10k-record trace's
# ``to_dict`` took 2.3 s with asdict and takes 0.4 s so.


def _record_to_json(r: TensorRecord) -> dict[str, Any]:
    d = dict(vars(r))
    for k in _TUPLE_FIELDS:
        d[k] = list(d[k])
    return d


def _items_from_json(
    data: Mapping[str, Any], name: str, convert: Callable[[Mapping[str, Any]], _T]
) -> tuple[_T, ...]:
    """``data[name]``, a list of JSON objects, converted; a ``ValueError`` naming the item and
    what is wrong with it when one does not convert."""
    items = data[name]
    if not isinstance(items, list):
        raise ValueError(f"trace field {name!r} must be a list; got {type(items).__name__}")
    try:
        return tuple(map(convert, items))
    except (KeyError, TypeError, ValueError) as e:
        # Only now find which item it was: a good trace (10k records, 50k events) loads without
        # paying for the bookkeeping.
        i, item = next((i, d) for i, d in enumerate(items) if not _converts(convert, d))
        if not isinstance(item, dict):
            why = f"expected a JSON object; got {type(item).__name__}"
        elif isinstance(e, KeyError):
            why = f"missing the field {e}"
        else:  # an unknown field, a list that is not one, an unknown event kind
            why = str(e)
        raise ValueError(f"trace {name}[{i}]: {why}") from e


def _converts(convert: Callable[[Mapping[str, Any]], Any], item: Any) -> bool:
    try:
        convert(item)
    except (KeyError, TypeError, ValueError):
        return False
    return True


# What each field of a loaded record or event must hold: a file that is not one fails at load,
# naming the item and the field, not deep inside the planner or the simulator (a NaN time made
# Plan.save fail, a null module the summary, 10**30 bytes numpy).
_INT64 = 2**63
_RECORD_INTS = ("seq", "step", "family", "call_index", "ordinal", "pack_event")
_RECORD_SIZES = ("nbytes", "storage_nbytes", "storage_offset")
_RECORD_STRS = ("module", "dtype", "device", "grad_fn")
_RECORD_BOOLS = ("is_parameter", "in_backward")  # and is_view, weight_cast, when present


def _check_fields(
    d: Mapping[str, Any],
    *,
    ints: Iterable[str] = (),
    sizes: Iterable[str] = (),
    strs: Iterable[str] = (),
    bools: Iterable[str] = (),
    times: Iterable[str] = (),
) -> None:
    """Raise ``ValueError`` naming the first field of ``d`` that is not what it must be (a
    missing one is a ``KeyError``). ``type(v) is int``, not isinstance: a bool is no index."""
    for k in ints:
        v = d[k]
        if type(v) is not int:
            raise ValueError(f"field {k!r} must be an int (not a bool or a float); got {v!r}")
    for k in sizes:
        v = d[k]
        if type(v) is not int or not 0 <= v < _INT64:
            raise ValueError(f"field {k!r} must be an int in [0, 2**63); got {v!r}")
    for k in strs:
        if type(d[k]) is not str:
            raise ValueError(f"field {k!r} must be a string; got {d[k]!r}")
    for k in bools:
        if type(d[k]) is not bool:
            raise ValueError(f"field {k!r} must be true or false; got {d[k]!r}")
    for k in times:
        v = d[k]
        if type(v) not in (float, int) or not math.isfinite(v):
            raise ValueError(f"field {k!r} must be a finite number of seconds; got {v!r}")


def _record_from_json(d: Mapping[str, Any]) -> TensorRecord:
    d = dict(d)
    for k in _TUPLE_FIELDS:
        try:
            d[k] = tuple(d[k])
        except TypeError:
            raise TypeError(f"field {k!r} must be a list; got {d[k]!r}") from None
    _check_fields(
        d,
        ints=_RECORD_INTS if "rebuild_from" not in d else (*_RECORD_INTS, "rebuild_from"),
        sizes=_RECORD_SIZES,
        strs=_RECORD_STRS,
        bools=(*_RECORD_BOOLS, *(k for k in ("is_view", "weight_cast") if k in d)),
        times=("pack_time_s",),
    )
    shape, stride = d["shape"], d["stride"]
    if any(type(n) is not int or not 0 <= n < _INT64 for n in shape):
        raise ValueError(f"field 'shape' must be a list of ints >= 0; got {list(shape)!r}")
    if len(stride) != len(shape) or any(type(n) is not int for n in stride):
        raise ValueError(
            f"field 'stride' must be a list of ints as long as 'shape' {list(shape)!r}; got "
            f"{list(stride)!r}"
        )
    if d["dtype"] not in _dtype_names():
        raise ValueError(f"field 'dtype' {d['dtype']!r} is not a torch dtype, e.g. 'torch.float32'")
    if not _is_device(d["device"]):
        raise ValueError(f"field 'device' {d['device']!r} is not a torch device, e.g. 'cuda:0'")
    unpacks, times = d["unpack_events"], d["unpack_times_s"]
    if any(type(u) is not int for u in unpacks):
        raise ValueError(f"field 'unpack_events' must be a list of ints; got {list(unpacks)!r}")
    if len(times) != len(unpacks) or any(
        type(t) not in (float, int) or not math.isfinite(t) for t in times
    ):
        raise ValueError(
            f"field 'unpack_times_s' must be a list of finite times, one per unpack event "
            f"({len(unpacks)}); got {list(times)!r}"
        )
    return TensorRecord(**d)


@functools.cache
def _is_device(name: str) -> bool:
    import torch

    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        return False
    return True


@functools.cache
def _dtype_names() -> frozenset[str]:
    import torch  # at the first load, not at import: lifecycle's data needs no torch

    return frozenset(str(v) for v in vars(torch).values() if isinstance(v, torch.dtype))


def _event_to_json(e: Event) -> dict[str, Any]:
    d = dict(vars(e))
    d["kind"] = e.kind.value
    return d


def _event_from_json(d: Mapping[str, Any]) -> Event:
    d = dict(d)
    kind = _EVENT_KINDS.get(d["kind"]) if isinstance(d["kind"], str) else None
    if kind is None:
        raise ValueError(f"{d['kind']!r} is not a valid EventKind")
    d["kind"] = kind
    t, m = d["time_s"], d["memory_bytes"]
    # One expression for the common case, as events are the most numerous items; the
    # field-by-field check runs only to say what is wrong.
    if not (
        type(d["index"]) is int
        and type(d["step"]) is int
        and type(d.get("call_index", 0)) is int
        and type(d.get("record", 0)) is int
        and type(d.get("module", "")) is str
        and type(m) is int
        and 0 <= m < _INT64
        and (type(t) is float or type(t) is int)
        and math.isfinite(t)
    ):
        _check_fields(
            d,
            # module, call_index and record have defaults in Event
            ints=("index", "step", *(k for k in ("call_index", "record") if k in d)),
            sizes=("memory_bytes",),
            strs=("module",) if "module" in d else (),
            times=("time_s",),
        )
    return Event(**d)
