"""Planning speed: ``lifecycle.plan()`` on synthetic transformer traces of 1k, 10k and 100k records.

Run (CPU; about 3 minutes on 2 cores, most of it simulating at 10k records and, with
--baseline-rev, running the old planner):
    python benchmarks/bench_plan.py [--records 1008 10080 100800] [--budgets 0.25 0.5 0.75]
        [--repeats 5] [--baseline-rev REV] [--out benchmarks/results/cpu]

Each trace is ``lifecycle.transformer_trace(layers=records // 12, hidden=4096, tokens=1024,
base_bytes=10 GiB)`` (12 records, 9 alias families and 60 events per layer), planned for
``base + share x peak saved bytes`` with ``min_offload_bytes=0`` on ``HardwareModel.h200()``.
Trace construction is not timed. Per size and budget share:

* ``plan (model)``: ``plan(..., simulate_records=0)``, the planner alone (search, closed-form
  model, entries); median and min of ``--repeats`` runs in one process, after one warm-up run;
* ``plan (default)``: ``plan(...)`` as users call it: up to 20k records it also replays the plan
  and the three anchors with ``lifecycle.simulate`` (median of fewer runs where that is slow);
* ``simulate()``: one replay of the chosen plan's decisions (at 1k and 10k records only): why
  the planner has its own model;
* ``simulate() again``: the same on a trace that already holds the simulator's view of the step
  (``Trace._derived``). The two before it run on a new copy of the trace each time, so they are
  first calls, which build that view.

``--baseline-rev REV`` also times the planner and the simulator (``lifecycle/_planner.py``,
``lifecycle/_simulate.py`` and the modules they were split into, as ``REV`` has them) as
committed at git revision ``REV`` (read with ``git show``, nothing checked out) on the same
traces, in the same process, each alternating run by run (ABBA) with its current version, for
before/after figures measured side by side (the simulator's on first calls, at 1k and 10k). The
machine is named from /proc/cpuinfo; the load average before and after is recorded, since a
shared machine's timings move with it.
Writes ``plan.json`` and ``plan.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from offload import lifecycle
from offload.lifecycle import HardwareModel, Trace, simulate, transformer_trace

_BASE_BYTES = 10 << 30
_SIMULATE_MAX_RECORDS = 20_000  # plan()'s default simulate_records: the simulator's range


def _cpu() -> dict[str, Any]:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
    }


def _times(fn: Callable[..., Any], repeats: int, trace: Trace | None = None) -> list[float]:
    """Times of ``repeats`` calls of ``fn``; with ``trace``, each call gets a new copy of it,
    made untimed: a trace keeps facts it derived for the simulator (``Trace._derived``), so a
    first call on a trace pays for them and later ones do not. Those are first calls."""
    out = []
    for _ in range(repeats):
        args = () if trace is None else (dataclasses.replace(trace),)
        t = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t)
    return out


def _alternating(
    a: Callable[..., Any], b: Callable[..., Any], repeats: int, trace: Trace | None = None
) -> tuple[list[float], list[float]]:
    """Times of ``a`` and ``b`` (as :func:`_times`), ``repeats`` each, alternating in ABBA
    order."""
    out: dict[Callable[..., Any], list[float]] = {a: [], b: []}
    for i in range(repeats):
        for fn in (a, b) if i % 2 == 0 else (b, a):
            out[fn].extend(_times(fn, 1, trace))
    return out[a], out[b]


def _summary(times: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "runs_s": [round(t, 6) for t in times],
    }


# The planner's and the simulator's modules, dependencies first (a revision before their split
# has _simulate.py and _planner.py alone).
_BASELINE_MODULES = (
    "_placement",
    "_sim_step",
    "_sim_engine",
    "_simulate",
    "_anchors",
    "_plan_model",
    "_plan_cost",
    "_plan_search",
    "_planner",
)


def _baseline(rev: str) -> dict[str, ModuleType]:
    """The modules of ``_BASELINE_MODULES`` that git revision ``rev`` has, as it has them, each
    imported beside the current one as ``<name>_baseline``: they import each other's baseline
    copies, and the rest of ``lifecycle`` as it is now."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out: dict[str, ModuleType] = {}
    for module in _BASELINE_MODULES:
        path = f"lifecycle/{module}.py"
        shown = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True
        )
        if shown.returncode != 0:
            continue  # not at that revision
        source = shown.stdout
        for other in out:
            source = re.sub(
                rf"\boffload\.lifecycle\.{other}\b", f"offload.lifecycle.{other}_baseline", source
            )
        name = f"offload.lifecycle.{module}_baseline"
        spec = importlib.util.spec_from_loader(name, loader=None)
        assert spec is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # dataclasses look their module up while the class is built
        exec(compile(source, f"{rev}:{path}", "exec"), loaded.__dict__)
        out[module] = loaded
    if "_planner" not in out or "_simulate" not in out:
        raise SystemExit(f"--baseline-rev {rev}: no lifecycle/_planner.py or _simulate.py there")
    return out


def _old_decisions(vocabulary: ModuleType, decisions: dict[int, Any]) -> dict[int, Any]:
    """``decisions`` as the baseline simulator's own Decision objects (``vocabulary``: the
    baseline module that defines Decision and Placement)."""
    return {
        fam: vocabulary.Decision(
            placement=vocabulary.Placement(d.placement.value),
            reload_event=d.reload_event,
            recompute_module=d.recompute_module,
        )
        for fam, d in decisions.items()
    }


def _one_size(
    records: int,
    shares: list[float],
    repeats: int,
    hw: HardwareModel,
    baseline: ModuleType | None,
    sim_baseline: ModuleType | None,
) -> dict[str, Any]:
    layers = max(1, records // 12)
    t = time.perf_counter()
    trace = transformer_trace(layers=layers, hidden=4096, tokens=1024, base_bytes=_BASE_BYTES)
    built_s = time.perf_counter() - t
    saved = trace.peak_saved_bytes
    out: dict[str, Any] = {
        "layers": layers,
        "records": len(trace.records),
        "events": len(trace.events),
        "families": len({r.family for r in trace.records}),
        "peak_saved_bytes": saved,
        "trace_build_s": built_s,
        "budgets": [],
    }
    for share in shares:
        budget = _BASE_BYTES + int(share * saved)
        row = _one_budget(trace, budget, share, repeats, hw, baseline, sim_baseline)
        out["budgets"].append(row)
        print(
            f"{len(trace.records):>7} records, budget base + {share:.0%}: plan (model) "
            f"{row['plan_model']['median_s'] * 1e3:.0f} ms median"
            + (
                f", baseline {row['baseline_plan']['median_s'] * 1e3:.0f} ms"
                if "baseline_plan" in row
                else ""
            ),
            flush=True,
        )
    return out


def _one_budget(
    trace: Trace,
    budget: int,
    share: float,
    repeats: int,
    hw: HardwareModel,
    baseline: ModuleType | None,
    sim_baseline: ModuleType | None,
) -> dict[str, Any]:
    kw: dict[str, Any] = {"min_offload_bytes": 0}

    def model_only() -> lifecycle.Plan:
        return lifecycle.plan(trace, budget, hw, simulate_records=0, **kw)

    def baseline_only() -> Any:
        assert baseline is not None
        return baseline.plan(trace, budget, hw, simulate_records=0, **kw)

    chosen = model_only()  # warm-up, and the plan the other figures describe
    old = baseline_only() if baseline is not None else None
    if old is None:
        model_times = _times(model_only, repeats)
    else:  # run by run, in ABBA order: drift and order effects hit both alike
        model_times, old_times = _alternating(model_only, baseline_only, repeats)
    row: dict[str, Any] = {
        "share": share,
        "gpu_budget_bytes": budget,
        "plan_model": _summary(model_times),
        "predicted_step_s": chosen.predicted_step_s,
        "predicted_peak_bytes": chosen.predicted_peak_bytes,
        "keep_all_step_s": chosen.anchors["keep_all"].step_s,
        "recomputed_blocks": chosen.metadata["recomputed_blocks"],
        "offloaded_families": chosen.metadata["offloaded_families"],
        "candidates_scored": chosen.metadata["candidates_scored"],
        "bytes_by_placement": chosen.bytes_by_placement(),
    }
    n = len(trace.records)
    if n <= _SIMULATE_MAX_RECORDS:
        slow = max(1, min(repeats, 3 if n > 2000 else repeats))
        default = lifecycle.plan(trace, budget, hw, **kw)
        row["plan_default"] = _summary(
            _times(lambda t: lifecycle.plan(t, budget, hw, **kw), slow, trace)
        )
        row["plan_default_source"] = default.prediction_source
        row["plan_default_simulations"] = default.metadata["simulations"]
        decisions = chosen.decisions()
        sim = simulate(trace, hw, decisions)
        if sim_baseline is None:
            row["simulate"] = _summary(_times(lambda t: simulate(t, hw, decisions), slow, trace))
        else:  # the simulator at the baseline revision, run by run in ABBA order, first calls
            # Decision and Placement: in _placement.py since the split, in _simulate.py before.
            vocabulary = sys.modules.get("offload.lifecycle._placement_baseline", sim_baseline)
            old_decisions = _old_decisions(vocabulary, decisions)
            new_sim, old_sim = _alternating(
                lambda t: simulate(t, hw, decisions),
                lambda t: sim_baseline.simulate(t, hw, old_decisions),
                slow,
                trace,
            )
            row["simulate"], row["baseline_simulate"] = _summary(new_sim), _summary(old_sim)
            before = sim_baseline.simulate(dataclasses.replace(trace), hw, old_decisions)
            row["baseline_simulate_agrees"] = (before.peak_bytes, before.step_s) == (
                sim.peak_bytes,
                sim.step_s,
            )
        row["simulate_again"] = _summary(_times(lambda: simulate(trace, hw, decisions), slow))
        row["simulated_step_s"] = sim.step_s
        row["simulated_peak_bytes"] = sim.peak_bytes
    if old is not None:
        row["baseline_plan"] = _summary(old_times)
        row["baseline_predicted_step_s"] = old.predicted_step_s
        row["baseline_predicted_peak_bytes"] = old.predicted_peak_bytes
    return row


def _markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    base = result.get("baseline_rev")
    lines = [
        "# Planning speed (benchmarks/bench_plan.py)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, numpy {m['numpy']}; "
        f"load average {result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} "
        "after (a shared machine: timings move with it).",
        "Traces: `transformer_trace(layers=records // 12, hidden=4096, tokens=1024, "
        "base_bytes=10 GiB)`; budget = base + share x peak saved bytes; "
        "`min_offload_bytes=0`; `HardwareModel.h200()`. Median (min) of "
        f"{result['repeats']} warm runs; trace construction not timed.",
        "",
        "| records | events | budget | plan (model) ms | "
        + (f"plan at {base} ms | " if base else "")
        + "plan (default) ms | simulate() ms | "
        + (f"simulate() at {base} ms | " if base else "")
        + "simulate() again ms | predicted step / keep-all | recomputed blocks | "
        "offloaded families |",
        "|---|---|---|---|" + ("---|---|" if base else "") + "---|---|---|---|---|---|",
    ]

    def ms(d: dict[str, Any] | None) -> str:
        if d is None:
            return "-"
        return f"{d['median_s'] * 1e3:.0f} ({d['min_s'] * 1e3:.0f})"

    for size in result["sizes"]:
        for row in size["budgets"]:
            lines.append(
                f"| {size['records']} | {size['events']} | +{row['share']:.0%} | "
                f"{ms(row['plan_model'])} | "
                + (f"{ms(row.get('baseline_plan'))} | " if base else "")
                + f"{ms(row.get('plan_default'))} | {ms(row.get('simulate'))} | "
                + (f"{ms(row.get('baseline_simulate'))} | " if base else "")
                + f"{ms(row.get('simulate_again'))} | "
                f"{row['predicted_step_s'] / row['keep_all_step_s']:.4f} | "
                f"{row['recomputed_blocks']} | {row['offloaded_families']} |"
            )
    lines += [
        "",
        "plan (model): `simulate_records=0`, the planner's own search and model. plan (default): "
        "as called with its defaults; up to 20k records it replays the plan and the three "
        "anchors with `lifecycle.simulate` (the simulated peak is the one reported), which "
        "share one view of the step. simulate(): one replay of the chosen plan. Both on a new "
        "copy of the trace each run: first calls, which build the simulator's view of the step "
        "(a trace keeps it). simulate() again: on a trace that has it.",
    ]
    if base:
        lines.append(
            f"plan at {base}: the planner as committed at `{base}`, `simulate_records=0`, same "
            "traces and process, its runs alternating with plan (model)'s (ABBA order). "
            f"simulate() at {base}: the simulator as committed there, first calls on new copies "
            "of the trace, alternating with simulate()'s (ABBA; it reads the trace through "
            "today's Trace, which keeps what it derives, so the family list that simulator built "
            "twice per call it now builds once: the figure flatters it slightly); "
            + (
                "its predictions equal this one's at every size and budget."
                if all(
                    row.get("baseline_simulate_agrees", True)
                    for size in result["sizes"]
                    for row in size["budgets"]
                )
                else "its predictions DIFFER from this one's (see plan.json)."
            )
        )
    target = [
        row["plan_model"]["median_s"]
        for size in result["sizes"]
        if size["records"] >= 99_000
        for row in size["budgets"]
    ]
    if target:
        lines.append(
            f"Target: 100k records planned in under 1 s; measured median "
            f"{max(target) * 1e3:.0f} ms at the slowest budget."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, nargs="+", default=[1008, 10_080, 100_800])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-rev", default=None, help="git revision to time beside this one")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu"))
    args = ap.parse_args(argv)
    hw = HardwareModel.h200()
    old = _baseline(args.baseline_rev) if args.baseline_rev else {}
    baseline, sim_baseline = old.get("_planner"), old.get("_simulate")
    load_before = os.getloadavg()
    sizes = [
        _one_size(n, args.budgets, args.repeats, hw, baseline, sim_baseline) for n in args.records
    ]
    result = {
        "benchmark": "bench_plan",
        "machine": _cpu(),
        "hardware_model": "HardwareModel.h200()",
        "repeats": args.repeats,
        "baseline_rev": args.baseline_rev,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "sizes": sizes,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        json.dump(result, f, indent=2)
    md = _markdown(result)
    with open(os.path.join(args.out, "plan.md"), "w") as f:
        f.write(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
