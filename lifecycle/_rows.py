"""The recorder's rows (NOTE [ Recorder allocations ]): the columns of a record row, the codes of
event kinds, and the freezing of the rows into a trace's :class:`Event` and :class:`TensorRecord`.
"""

from __future__ import annotations

from typing import Any

from offload.lifecycle._trace import Event, EventKind, TensorRecord

_RECORD_FIELDS = (  # the columns of a record row (Recorder._records)
    "seq",
    "step",
    "family",
    "module",
    "call_index",
    "ordinal",
    "nbytes",
    "storage_nbytes",
    "storage_offset",
    "dims",  # where the record's shape and then its stride start in Recorder._dims
    "ndim",
    "dtype",
    "device",
    "is_parameter",
    "grad_fn",
    "in_backward",
    "rebuild_from",
    "is_view",
    "weight_cast",
)


_NF = len(_RECORD_FIELDS)
_R_STEP, _R_NBYTES, _R_STORAGE_NBYTES, _R_OFFSET, _R_DIMS, _R_NDIM, _R_DTYPE = 1, 6, 7, 8, 9, 10, 11


# NOTE [ Recorder allocations ]
#     Every object a pack leaves alive that Python's cyclic GC tracks makes the next collection
#     longer; with torch imported (~170k objects) one full collection took 0.2 s on the project's
#     2-core CI machine, which added several microseconds per pack when each pack kept an enum or
#     a small object alive. Even a tuple of ints is tracked until the first collection that sees
#     it: the one that ran after each recorded step (the GC is paused during it) took 3-7 ms for
#     the ~9 such objects each of bench_hooks' 2000 packs left. So records and events are rows of
#     flat lists (each added by one ``extend`` of a tuple that dies at once), of ints, floats,
#     strings, dtypes and devices, which the GC never tracks; shapes and strides go, as ints, into
#     a third flat list; a family's key is an int (a tuple only for the rare ``unsafe_chunk``
#     piece). What stays tracked per pack: the handle and its detached tensor (until backward
#     frees them), and per alias family, a weak reference and a pair of ints.
_KINDS = tuple(EventKind)
_CODE = {k: i for i, k in enumerate(_KINDS)}


def frozen_rows(
    flat: list[Any], rows: list[tuple[Any, ...]], dims: list[int], seconds: list[float]
) -> tuple[list[Event], list[TensorRecord]]:
    """The events and records of the flat ``flat`` event rows and record ``rows`` (tuples in
    _RECORD_FIELDS order), their shapes and strides in ``dims``, each event at ``seconds``."""
    events = []
    step = 0
    pack_event: dict[int, int] = {}
    for i, (ev, mem, t) in enumerate(zip(flat[0::3], flat[2::3], seconds, strict=True)):
        if isinstance(ev, int):
            seq = ev if ev >= 0 else ~ev
            kind = EventKind.PACK if ev >= 0 else EventKind.UNPACK
            module, call_index = rows[seq][3], rows[seq][4]
            if ev >= 0:
                pack_event[seq] = i
        else:
            seq = -1
            kind, module, call_index = _KINDS[ev[0]], ev[1], ev[2]
        events.append(
            Event(
                index=i,
                kind=kind,
                step=step,
                time_s=t,
                memory_bytes=mem,
                module=module,
                call_index=call_index,
                record=seq,
            )
        )
        if kind is EventKind.STEP_END:
            step += 1
    unpacks: dict[int, list[int]] = {}
    for e in events:
        if e.kind is EventKind.UNPACK:
            unpacks.setdefault(e.record, []).append(e.index)
    records = []
    for row in rows:
        f = dict(zip(_RECORD_FIELDS, row, strict=True))
        at, ndim = f.pop("dims"), f.pop("ndim")
        f["shape"] = tuple(dims[at : at + ndim])
        f["stride"] = tuple(dims[at + ndim : at + 2 * ndim])
        f["dtype"], f["device"] = str(f["dtype"]), str(f["device"])
        f["pack_event"] = pack_event[f["seq"]]
        used = unpacks.get(f["seq"], ())
        records.append(
            TensorRecord(
                **f,
                pack_time_s=seconds[f["pack_event"]],
                unpack_events=tuple(used),
                unpack_times_s=tuple(seconds[e] for e in used),
            )
        )
    return events, records
