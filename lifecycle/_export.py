"""Exports of a trace: a Perfetto / Chrome trace JSON and a memory-timeline PNG; of a plan: its
planned device-memory timeline as a PNG."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from offload.lifecycle._jsonfile import replacing
from offload.lifecycle._units import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from offload.lifecycle._plan import Plan
    from offload.lifecycle._trace import Trace

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
    spans = trace.module_spans()
    # A track shows only spans that nest (Perfetto draws partly overlapping slices wrongly, and
    # backward spans do overlap: a module's backward starts with its outputs' gradient and ends
    # with its input's, and the root's may start after its last child's). Spans that would
    # overlap partly go to another track of their phase.
    tids: dict[int, int] = {}
    for phase, base in _TIDS.items():
        ours = [i for i, sp in enumerate(spans) if sp.phase == phase]
        lanes = _nesting_lanes([(spans[i].start_s, spans[i].end_s) for i in ours])
        for i, lane in zip(ours, lanes, strict=True):
            tids[i] = base if lane == 0 else 10 * lane + base
        for lane in range(1, max(lanes, default=0) + 1):
            out.append(
                {
                    "ph": "M",
                    "pid": _PID,
                    "tid": 10 * lane + base,
                    "name": "thread_name",
                    "args": {"name": f"{phase} ({lane + 1})"},
                }
            )
    for i, s in enumerate(spans):
        out.append(
            {
                "ph": "X",
                "pid": _PID,
                "tid": tids[i],
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


def _nesting_lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane for each ``(start, end)``: within a lane every two spans are disjoint or one holds
    the other. Greedy, in start order (longer first): the first lane the span nests in."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    open_ends: list[list[float]] = []  # per lane, the ends of the spans still open, innermost last
    lane_of = [0] * len(spans)
    for i in order:
        start, end = spans[i]
        chosen = len(open_ends)
        for k, ends in enumerate(open_ends):
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends or end <= ends[-1]:
                chosen = k
                break
        if chosen == len(open_ends):
            open_ends.append([])
        open_ends[chosen].append(end)
        lane_of[i] = chosen
    return lane_of


def write_perfetto(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write a Chrome/Perfetto trace (open it at https://ui.perfetto.dev or chrome://tracing).

    Args:
        trace: the trace to export.
        path: the JSON file to write (atomically: a temp file, then a rename).
    """
    events = perfetto_events(trace)
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def write_memory_png(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Plot live saved bytes (and memory in use) over the step timeline into a PNG (written
    atomically: a temp file, then a rename).

    Raises:
        ImportError: matplotlib is missing; the message names the ``plot`` extra.
    """
    figure_cls = _figure_class("the memory-timeline PNG")
    live_b = [b for _, b in trace.live_saved_bytes()]
    mem_b = [e.memory_bytes for e in trace.events]
    unit, scale = _unit(max([*live_b, *mem_b, 1]))
    times = [e.time_s * 1e3 for e in trace.events]
    on_cpu = trace.metadata.get("memory_probe") == "live_saved_bytes"
    fig = figure_cls(figsize=(10, 4), dpi=100)
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
    with replacing(path) as tmp:  # a failed write leaves no half a picture
        fig.savefig(tmp, format="png")  # a PNG whatever the name ends in


def write_plan_png(
    trace: Trace, plan: Plan, path: str | os.PathLike[str], *, step: int = -1
) -> None:
    """Plot the device memory a plan predicts for one step against keeping everything, and the
    budget, into a PNG.

    Both curves are the ``memory_timeline`` of a :func:`lifecycle.simulate` run on ``trace`` with
    ``plan.hardware``: one with ``plan.decisions()``, one with nothing moved.
    Each runs on its own time axis (the plan's step may take longer). A horizontal line marks
    ``plan.gpu_budget_bytes``, a dotted one the budget less the margin when there is one.

    Args:
        trace: the trace the plan was made from.
        plan: a plan of ``trace``'s step ``step``.
        path: the PNG file to write (atomically: a temp file, then a rename).
        step: the recorded step the plan is for (``-1``: the last, as :func:`lifecycle.plan`).

    Raises:
        ImportError: matplotlib is missing; the message names the ``plot`` extra.
        ValueError: the plan does not fit the trace (a family or an event it names is not in
            ``step``).

    Example:
        >>> import os, tempfile, torch, offload
        >>> from offload.lifecycle import HardwareModel, plan
        >>> nn = torch.nn
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
        >>> trace = offload.profile(lambda: model(torch.randn(128, 64)).sum().backward(), model)
        >>> p = plan(trace, trace.peak_memory_bytes // 2, HardwareModel.h200(),
        ...          min_offload_bytes=0, margin=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.png")
        >>> write_plan_png(trace, p, path)
        >>> open(path, "rb").read(4) == b"\\x89PNG"
        True
    """
    figure_cls = _figure_class("the planned-memory PNG")
    from offload.lifecycle._simulate import simulate

    planned = simulate(trace, plan.hardware, plan.decisions(), step=step)
    keep = simulate(trace, plan.hardware, None, step=step)
    budget = plan.gpu_budget_bytes
    unit, scale = _unit(max(planned.peak_bytes, keep.peak_bytes, budget, 1))
    fig = figure_cls(figsize=(13, 4), dpi=100)
    ax = fig.subplots()
    for sim, label, alpha in (
        (keep, "keep everything", 0.6),
        (planned, "this plan", 1.0),
    ):
        ax.step(
            [t * 1e3 for t, _ in sim.memory_timeline],
            [b / scale for _, b in sim.memory_timeline],
            where="post",
            alpha=alpha,
            label=f"{label}: peak {format_bytes(sim.peak_bytes)}, step {sim.step_s * 1e3:.2f} ms",
        )
    ax.axhline(
        budget / scale, color="tab:red", linestyle="--", label=f"budget {format_bytes(budget)}"
    )
    if plan.margin_bytes > 0:
        ax.axhline(
            plan.target_bytes / scale,
            color="tab:red",
            linestyle=":",
            alpha=0.7,
            label=f"budget less margin {format_bytes(plan.target_bytes)}",
        )
    ax.set_xlabel("time since step start (ms)")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    hardware = plan.hardware.device_name or "unnamed"
    ax.set_title(f"device memory of one step, simulated ({hardware} hardware model)")
    # Outside the axes: the curves peak mid-step, where any inside corner may be.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    with replacing(path) as tmp:  # a failed write leaves no half a picture
        fig.savefig(tmp, format="png")  # a PNG whatever the name ends in


def _figure_class(what: str) -> type[Figure]:
    try:
        # A bare Figure renders with Agg and leaves pyplot's global state (and backend) alone.
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"{what} needs matplotlib: pip install 'offload[plot]'") from e
    return Figure


def _unit(top: float) -> tuple[str, int]:
    """The largest binary unit not above ``top``, and its size."""
    return next(
        (u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= s
    )
