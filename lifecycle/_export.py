"""Exports of a trace: a Perfetto / Chrome trace JSON and a memory-timeline PNG."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from lifecycle._units import format_bytes

if TYPE_CHECKING:
    from lifecycle._trace import Trace

_PID = 1
_TIDS = {"forward": 1, "backward": 2}


def perfetto_events(trace: Trace) -> list[dict[str, Any]]:
    """Chrome trace events: module spans ("X") on a forward and a backward track, and counter
    tracks ("C") of live saved bytes and memory in use. Times are microseconds."""
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": "offload trace"}},
        {
            "ph": "M",
            "pid": _PID,
            "tid": _TIDS["forward"],
            "name": "thread_name",
            "args": {"name": "forward"},
        },
        {
            "ph": "M",
            "pid": _PID,
            "tid": _TIDS["backward"],
            "name": "thread_name",
            "args": {"name": "backward"},
        },
    ]
    for s in trace.module_spans():
        out.append(
            {
                "ph": "X",
                "pid": _PID,
                "tid": _TIDS[s.phase],
                "name": s.module or "<root>",
                "cat": s.phase,
                "ts": s.start_s * 1e6,
                "dur": max(0.0, s.duration_s) * 1e6,
                "args": {"call_index": s.call_index, "step": s.step},
            }
        )
    live = dict(trace.live_saved_bytes())
    for e in trace.events:
        ts = e.time_s * 1e6
        out.append(
            {
                "ph": "C",
                "pid": _PID,
                "name": "live saved bytes",
                "ts": ts,
                "args": {"bytes": live.get(e.index, 0)},
            }
        )
        out.append(
            {
                "ph": "C",
                "pid": _PID,
                "name": "memory in use",
                "ts": ts,
                "args": {"bytes": e.memory_bytes},
            }
        )
    return out


def write_perfetto(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write a Chrome/Perfetto trace (open it at https://ui.perfetto.dev or chrome://tracing).

    Args:
        trace: the trace to export.
        path: the JSON file to write.
    """
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        json.dump({"traceEvents": perfetto_events(trace), "displayTimeUnit": "ms"}, f)


def write_memory_png(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Plot live saved bytes (and memory in use) over the step timeline into a PNG.

    Raises:
        ImportError: matplotlib is missing; the message names the ``plot`` extra.
    """
    try:
        # A bare Figure renders with Agg and leaves pyplot's global state (and backend) alone.
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "the memory-timeline PNG needs matplotlib: pip install 'offload[plot]'"
        ) from e
    live_b = [b for _, b in trace.live_saved_bytes()]
    mem_b = [e.memory_bytes for e in trace.events]
    top = max([*live_b, *mem_b, 1])
    unit, scale = next(
        (u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= s
    )
    times = [e.time_s * 1e3 for e in trace.events]
    on_cpu = trace.metadata.get("memory_probe") == "live_saved_bytes"
    fig = Figure(figsize=(10, 4), dpi=100)
    ax = fig.subplots()
    ax.step(
        times,
        [b / scale for b in live_b],
        where="post",
        label="live saved activations (pack to last use)",
    )
    if not on_cpu:  # on CPU the memory probe is the live saved curve itself
        ax.step(
            times,
            [b / scale for b in mem_b],
            where="post",
            alpha=0.7,
            label="allocated device memory",
        )
    for s in trace.module_spans():
        if s.phase == "backward" and s.module.count(".") == 0:
            ax.axvspan(s.start_s * 1e3, s.end_s * 1e3, color="0.92", zorder=0)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel(unit)
    ax.set_title(
        f"saved-tensor memory over {trace.steps} step(s) (backward shaded); "
        f"peak live {format_bytes(trace.peak_saved_bytes)}"
    )
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
