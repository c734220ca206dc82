"""Exports of a trace: a Perfetto / Chrome trace JSON and a memory-timeline PNG."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lifecycle._trace import Trace

_PID = 1
_TIDS = {"forward": 1, "backward": 2}


def perfetto_events(trace: Trace) -> list[dict[str, Any]]:
    """Chrome trace events: module spans ("X") on a forward and a backward track, and counter
    tracks ("C") of live saved bytes and memory in use. Times are microseconds."""
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": "offload trace"}},
        {"ph": "M", "pid": _PID, "tid": _TIDS["forward"], "name": "thread_name", "args": {"name": "forward"}},
        {"ph": "M", "pid": _PID, "tid": _TIDS["backward"], "name": "thread_name", "args": {"name": "backward"}},
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
        out.append({"ph": "C", "pid": _PID, "name": "live saved bytes", "ts": ts, "args": {"bytes": live.get(e.index, 0)}})
        out.append({"ph": "C", "pid": _PID, "name": "memory in use", "ts": ts, "args": {"bytes": e.memory_bytes}})
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
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "the memory-timeline PNG needs matplotlib: pip install 'offload[plot]'"
        ) from e
    times = [e.time_s * 1e3 for e in trace.events]
    live = [b / 2**20 for _, b in trace.live_saved_bytes()]
    mem = [e.memory_bytes / 2**20 for e in trace.events]
    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    try:
        ax.step(times, live, where="post", label="live saved activation bytes")
        if trace.metadata.get("memory_probe") != "live_saved_storage_bytes":
            ax.step(times, mem, where="post", label="memory in use", alpha=0.7)
        for s in trace.module_spans():
            if s.phase == "backward" and s.module.count(".") == 0:
                ax.axvspan(s.start_s * 1e3, s.end_s * 1e3, color="0.9", zorder=0)
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("MiB")
        ax.set_title(f"saved-tensor memory over {trace.steps} step(s); peak {max(live, default=0):.1f} MiB")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(os.fspath(path))
    finally:
        plt.close(fig)
