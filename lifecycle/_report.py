"""Plain-text summary of a trace (what ``offload profile`` prints)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload.lifecycle._units import format_bytes

if TYPE_CHECKING:
    from offload.lifecycle._trace import Trace


def _quantiles(values: list[float], qs: tuple[float, ...]) -> list[float]:
    if not values:
        return [0.0 for _ in qs]
    v = sorted(values)
    return [v[min(len(v) - 1, round(q * (len(v) - 1)))] for q in qs]


def check_top(top: object) -> None:
    """The ``top`` of a summary: how many modules it lists, 0 for none."""
    if isinstance(top, bool) or not isinstance(top, int):
        raise TypeError(f"top must be an int (modules to list, 0 for none); got {top!r}")
    if top < 0:
        raise ValueError(f"top must be >= 0 (modules to list, 0 for none); got {top}")


def summarize(trace: Trace, top: int = 10) -> str:
    """Totals, peak live saved bytes, top modules by bytes (``top`` of them, 0 for none),
    lifetime distribution, aliasing."""
    check_top(top)
    acts = trace.activation_records
    params = [r for r in trace.records if r.is_parameter]
    fams = [f for f in trace.families() if not f.is_parameter]
    steps = max(1, trace.steps)
    lines = [
        f"offload trace: {trace.steps} step(s), {len(trace.records)} saved tensors "
        f"({len(acts)} activations, {len(params)} parameter/buffer views), {len(trace.events)} events",
        f"  activation bytes saved per step : {format_bytes(trace.saved_bytes / steps)}"
        f"  ({len(fams) / steps:g} storages; {format_bytes(sum(r.nbytes for r in acts) / steps)} "
        "before alias dedupe)",
        f"  peak live saved bytes           : {format_bytes(trace.peak_saved_bytes)}",
    ]
    if trace.metadata.get("memory_probe") not in (None, "live_saved_bytes"):
        lines.append(f"  peak memory in use              : {format_bytes(trace.peak_memory_bytes)}")
    by_mod = trace.bytes_by_module()
    if by_mod and top:
        total = sum(by_mod.values()) or 1
        lines.append(f"  top modules by saved bytes (of {len(by_mod)}):")
        width = min(48, max(len(m or "<root>") for m in list(by_mod)[:top]))
        for mod, b in list(by_mod.items())[:top]:
            lines.append(
                f"    {(mod or '<root>'):<{width}}  {format_bytes(b / steps):>11}  {100 * b / total:5.1f}%"
            )
    life = trace.lifetimes_s()
    if life:
        p = _quantiles(life, (0.0, 0.5, 0.9, 1.0))
        lines.append(
            "  lifetime pack -> last use (s)   : "
            f"min {p[0]:.4g}  p50 {p[1]:.4g}  p90 {p[2]:.4g}  max {p[3]:.4g}"
        )
    never = sum(1 for r in acts if not r.unpack_events)
    if never:
        lines.append(f"  never unpacked                  : {never} records")
    counts = trace.alias_counts()
    shared = [c for c in counts.values() if c > 1]
    if counts:
        # Per step, as the lines above (a trace of several steps counts each storage once a step).
        lines.append(
            f"  aliasing (per step)             : {len(shared) / steps:g} of {len(counts) / steps:g} "
            f"storages saved more than once ({(sum(shared) - len(shared)) / steps:g} duplicate "
            f"records, max {max(counts.values())} per storage)"
        )
    in_bwd = sum(1 for r in trace.records if r.in_backward)
    if in_bwd:
        lines.append(
            f"  packed during backward          : {in_bwd} records (recomputation / double backward)"
        )
    return "\n".join(lines)
