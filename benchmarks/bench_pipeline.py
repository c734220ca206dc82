"""Stage 0 of a 1F1B pipeline on one device: kept vs offloaded, against the simulator, in one run.

Run (CPU, the default without CUDA; under a minute on 2 cores):
    python benchmarks/bench_pipeline.py [--config cpu-tiny] [--stages 4] [--microbatches 8]
        [--warmup 2] [--reps 5] [--quick] [--out benchmarks/results/cpu]
Run (GPU, bf16 autocast; see benchmarks/gpu_check.sh):
    python benchmarks/bench_pipeline.py --config h4096 --out DIR

One process plays stage 0 of a ``stages``-stage pipeline: a stage model of a few GPT blocks
(``examples/gpt.py``, no embedding or head), fed ``[batch, seq, d_model]`` inputs with
``requires_grad=True`` as if received from a previous stage, running stage 0's action order
from ``lifecycle.schedule_1f1b(stages, microbatches)[0]``: F(i) runs microbatch i's forward and
holds its input and output; B(i) runs ``out_i.backward(grad_i)`` with a fixed random
gradient, as if received from stage 1. The other stages are not run, so nothing waits for them:
the actions run back to back, and the stash pattern (up to ``stages`` microbatches' activations
waiting for their backward) is stage 0's. Variants, round robin in one process (the first one
rotates each round, to cancel drift), every one on the same weights, inputs and gradients:
``1f1b`` (no offload, the reference), ``1f1b_offload`` (``offload.ActivationOffloader`` on a copy
of the stage, each F inside ``with mgr:``), ``1f1b_budget`` (a copy attached with
``mgr.attach`` to a manager with ``gpu_budget``: the kept schedule's peak less half its stash; its
first schedule is profiled and planned as one round) and ``gpipe`` (all F, then all B, no
offload: the stash depth of ``microbatches`` instead of ``stages``).

Per variant: schedule time (median, min, max of --reps timed schedules after --warmup; on GPU
between ``torch.cuda.synchronize`` calls), ratio to ``1f1b``, peak memory, the saved-activation
stash and the offloader's counters per schedule (``mgr.stats.total`` deltas). Peak memory: on
CUDA the allocator's peak above the allocation at the schedule's start (read before every F as
well: the manager resets the peak counters when a step begins); on CPU the peak bytes of tensors
allocated during one extra, untimed schedule and alive at once (bench_step's ``LiveBytes``). The
stash: the peak of live saved bytes in ``offload.profile`` of one whole schedule (no offload).
Exactness: after each warm-up schedule, every parameter's gradient and every microbatch's input
gradient are compared with ``torch.equal`` to the first ``1f1b`` schedule's (PASS / FAIL;
``1f1b`` itself in the second round, as a determinism control).

Prediction: ``offload.profile`` of one microbatch's F+B (one per timed round, between the
variants' schedules; the one of median duration is used), ``offload.probe_hardware()`` of this
device (on CPU a ``cpu_only`` model: copies do not overlap compute), then
``predict_1f1b(trace, hardware, stages=, microbatches=)[0]``: stage 0 keeping and offloading
everything. Its timeline includes stage 0's waits for the other stages, which this run does not
have, so it is also simulated with those waits removed (the same composed timeline, every
action moved back to back): the like-for-like prediction whose error is reported. As a third
figure the simulator replays the profiled whole schedule, which separates the error of composing
one microbatch's trace from the simulator's own.

Writes ``<stem>.json`` and ``<stem>.md`` into --out (default ``benchmarks/results/cpu`` or
``benchmarks/results/<gpu name>``, named as bench_step names them; stem ``pipeline`` for
cpu-tiny, else ``pipeline-<config>``, then ``-custom`` when a shape flag changed it and
``-quick`` with --quick). Exits 1 when the offloaded gradients are not bitwise equal (unless the
reference itself did not repeat bitwise: non-deterministic kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import offload
from offload._live import SavedBytes
from offload.lifecycle import (
    EventKind,
    Simulation,
    offload_all,
    pipeline_trace,
    predict_1f1b,
    schedule_1f1b,
    simulate,
)
from offload.lifecycle._pipeline import (  # the dependency timing predict_1f1b uses
    Action,
    _start_times,
)
from offload.lifecycle._simulate import _automatic_window_bytes  # the window predict_1f1b takes
from offload.lifecycle._units import parse_bytes

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# bench_step puts examples/ on the path; its hardware naming, CPU peak counter and helpers are
# shared so that both benchmarks report alike.
from bench_step import (  # noqa: E402
    LiveBytes,
    _mib,
    _ms,
    _row,
    default_results_dir,
    machine,
    resolve_device_and_shape,
    runtime_version,
)
from gpt import GPT, GPTConfig  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30

# cpu-tiny keeps a quiet 2-core run under a minute, with saved activations of 1 MiB and more (the
# default min_offload_bytes applies). h2048 / h4096 are sized for one H200 under bf16; by estimate
# h4096 saves about 7 GB per microbatch (autocast's bf16 weight copies included): a 1F1B stash of
# about 27 GB (GPipe's twice that), about 54 GB moved each way per offloaded schedule (seconds).
CONFIGS: dict[str, dict[str, int]] = {
    "cpu-tiny": dict(layers=2, heads=2, d_model=64, seq=256, batch=16),
    "h2048": dict(layers=8, heads=16, d_model=2048, seq=2048, batch=2),
    "h4096": dict(layers=4, heads=32, d_model=4096, seq=2048, batch=4),
}
LABELS = {"1f1b": "1F1B, no offload", "1f1b_offload": "1F1B, offload everything (cpu)",
    "1f1b_budget": "1F1B, gpu_budget (planned round, mgr.attach)",
    "gpipe": "GPipe order (all F, then all B), no offload"}  # fmt: skip
BUDGET_SHARE = 0.5  # of the kept stash that the budgeted variant must do without
VARIANTS = tuple(LABELS)
DEFAULT_MIN_OFFLOAD = (
    inspect.signature(offload.ActivationOffloader).parameters["min_offload_bytes"].default
)
STAT_KEYS = ("bytes_offloaded_cpu", "records_offloaded_cpu", "records", "records_kept",
    "records_deduplicated", "reloads", "stalls", "stall_s", "backpressure_waits", "fallbacks",
    "host_allocations")  # fmt: skip

# ---------------------------------------------------------------------------------------------
# The stage and its schedule


class Stage(nn.Module):
    """One pipeline stage: GPT blocks without embedding or head (the input comes from the
    previous stage, the output goes to the next)."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def gpipe_order(microbatches: int) -> list[Action]:
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


@dataclass
class Data:
    inputs: list[torch.Tensor]  # what the previous stage would send, per microbatch
    grads: list[torch.Tensor]  # what stage 1 would send back


@dataclass
class Variant:
    name: str
    order: list[Action]
    model: Stage
    mgr: offload.ActivationOffloader | None = None
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)  # CUDA: above the schedule's start
    stats: list[dict[str, float]] = field(default_factory=list)  # per timed schedule
    exact: list[dict[str, Any]] = field(default_factory=list)
    live_peak: int | None = None  # CPU: LiveBytes over one untimed schedule
    saved_peak: int | None = None  # CPU: offload._live.SavedBytes over the same schedule
    stash: int | None = None  # peak live saved bytes of a profiled schedule (no offload)
    stage: BenchStage | None = None  # run through mgr.attach(stage) (budget mode)


class BenchStage:
    """Stage 0's chunks under the names ``mgr.attach`` wraps (as ``torch.distributed.pipelining``
    calls them): F(i) clones microbatch i's input (a received buffer) and holds it and its output
    until B(i), as a pipeline stage does. ``step``: a manager each F runs inside (the
    offload-everything variant); the budgeted variant is attached instead, so that the manager
    plans a whole schedule round."""

    stage_index = 0

    def __init__(self, args: argparse.Namespace, model: Stage, data: Data, chunks: int,
                 step: offload.ActivationOffloader | None = None) -> None:  # fmt: skip
        self.args, self.submod, self.data, self.chunks, self.step = args, model, data, chunks, step
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.input_grads: dict[int, torch.Tensor | None] | None = None

    def forward_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> None:
        x = self.data.inputs[i].clone().requires_grad_()
        with self.step if self.step is not None else contextlib.nullcontext(), autocast(self.args):
            self.held[i] = (x, self.submod(x))

    def backward_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> None:
        x, out = self.held.pop(i)
        out.backward(self.data.grads[i])
        if self.input_grads is not None:
            self.input_grads[i] = x.grad

    def backward_weight_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> None:
        pass  # 1F1B: B computes the weight gradients too


def autocast(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    if args.autocast == "bf16":
        return torch.autocast(args.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_schedule(
    args: argparse.Namespace,
    v: Variant,
    data: Data,
    input_grads: dict[int, torch.Tensor | None] | None = None,
) -> tuple[float, int]:
    """One schedule of ``v.order`` through ``v``'s :class:`BenchStage`: (seconds, CUDA peak above
    the schedule's start). ``input_grads`` receives each microbatch's input gradient (what would
    be sent back to the previous stage).
    """
    dev = args.device
    cuda = dev.type == "cuda"
    stage = v.stage
    if stage is None:
        stage = BenchStage(args, v.model, data, len(data.inputs), step=v.mgr)
    stage.held, stage.input_grads = {}, input_grads
    peak = base = 0
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    for kind, i in v.order:
        if kind == "F":
            if cuda:
                # The manager's __enter__ resets the allocator's peak counters (for its own
                # per-step figure): read the peak so far before every step begins.
                peak = max(peak, torch.cuda.max_memory_allocated(dev))
            stage.forward_one_chunk(i)
        else:
            stage.backward_one_chunk(i)
    if cuda:
        torch.cuda.synchronize(dev)
        peak = max(peak, torch.cuda.max_memory_allocated(dev))
    t1 = time.perf_counter()
    return t1 - t0, max(0, peak - base)


def gradients(model: nn.Module, input_grads: dict[int, torch.Tensor | None], m: int) -> list[Any]:
    return [p.grad for p in model.parameters()] + [input_grads.get(i) for i in range(m)]


def compare(ref: list[Any], got: list[Any], names: list[str]) -> dict[str, Any]:
    """Bitwise comparison, tensor by tensor (as bench_step's compare_grads, any tensor list)."""
    diffs: dict[str, float] = {}  # name -> max |difference|
    for name, r, g in zip(names, ref, got, strict=True):
        if r is None or g is None:
            if (r is None) != (g is None):
                diffs[name] = math.inf
        elif not torch.equal(r, g):
            diffs[name] = (r.double() - g.double()).abs().max().item()
    return dict(
        bitwise_equal=not diffs, mismatched_tensors=len(diffs), first_mismatched=list(diffs)[:3],
        max_abs_diff=max(diffs.values(), default=0.0),
    )  # fmt: skip


def stats_delta(before: offload.StepStats, after: offload.StepStats) -> dict[str, float]:
    return {k: getattr(after, k) - getattr(before, k) for k in STAT_KEYS}


# ---------------------------------------------------------------------------------------------
# Prediction


def close_waits(composed: offload.Trace, one: offload.Trace, stages: int, microbatches: int
                ) -> offload.Trace:  # fmt: skip
    """Stage 0's composed 1F1B timeline with its waits for the other stages removed.

    ``pipeline_trace`` places each action where the schedule's dependencies allow; here every
    action starts when the one before it ends, as in this single-process run. Times inside an
    action keep their offsets; event order, records and memory stay as they are.
    """
    # The split into a forward and a backward part, as pipeline_trace makes it.
    events = [e for e in one.events if e.step == one.steps - 1]
    split = next(
        (i for i, e in enumerate(events) if e.kind in (EventKind.BACKWARD_START, EventKind.UNPACK)),
        len(events) - 1,
    )
    forward_s = events[split].time_s - events[0].time_s
    backward_s = events[-1].time_s - events[split].time_s
    order = schedule_1f1b(stages, microbatches)[0]
    starts = _start_times(schedule_1f1b(stages, microbatches), forward_s, backward_s)[0]
    placed, packed, at = [], [], 0.0  # (pipeline start, back-to-back start) of each action
    for a in order:
        placed.append(starts[a])
        packed.append(at)
        at += forward_s if a[0] == "F" else backward_s
    new_time: dict[int, float] = {}
    k = 0
    for e in composed.events:  # in time order: the action is the last one started by then
        while k + 1 < len(placed) and placed[k + 1] <= e.time_s:
            k += 1
        new_time[e.index] = e.time_s - placed[k] + packed[k]
    times = [new_time[e.index] for e in composed.events]
    if any(b < a - 1e-12 for a, b in itertools.pairwise(times)):
        raise RuntimeError("close_waits: the timeline went backwards (pipeline_trace changed?)")
    return dataclasses.replace(
        composed,
        events=tuple(dataclasses.replace(e, time_s=new_time[e.index]) for e in composed.events),
        records=tuple(
            dataclasses.replace(
                r,
                pack_time_s=new_time[r.pack_event],
                unpack_times_s=tuple(new_time[i] for i in r.unpack_events),
            )
            for r in composed.records
        ),
        metadata={**dict(composed.metadata), "waits": "removed (actions back to back)"},
    )


def sim_pair(trace: offload.Trace, hw: offload.HardwareModel, min_offload: int, window: int
             ) -> tuple[Simulation, Simulation]:  # fmt: skip
    """(keep everything, offload everything) of one trace, as predict_1f1b simulates a stage:
    reloads look ``window`` bytes ahead, the window the executor gives one microbatch's step."""
    keep = simulate(trace, hw)
    moved = simulate(
        trace, hw, offload_all(trace, min_offload_bytes=min_offload), prefetch_bytes=window
    )
    return keep, moved


def sim_dict(s: Simulation) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d.pop("memory_timeline")
    d["peak_above_base_bytes"] = s.peak_bytes - s.base_bytes
    return d


def step_s(trace: offload.Trace) -> float:
    """The recorded step's duration (a one-step trace: STEP_START to STEP_END)."""
    return trace.events[-1].time_s - trace.events[0].time_s


def median_trace(traces: list[offload.Trace]) -> offload.Trace:
    """The trace of median duration (profiled once per timed round, like the timed schedules:
    one disturbed round does not set the prediction's timeline)."""
    return sorted(traces, key=step_s)[len(traces) // 2]


def predict(args: argparse.Namespace, ones: list[offload.Trace],
            schedules: list[offload.Trace], hw: offload.HardwareModel) -> dict[str, Any]:  # fmt: skip
    p, m, floor = args.stages, args.microbatches, args.min_offload_bytes
    one, schedule = median_trace(ones), median_trace(schedules)
    stage0 = predict_1f1b(one, hw, stages=p, microbatches=m, min_offload_bytes=floor)[0]
    composed = pipeline_trace(one, stage=0, stages=p, microbatches=m)
    # One microbatch's window, as predict_1f1b takes it (each F is a step with its own window).
    window = _automatic_window_bytes(one, offload_all(one, min_offload_bytes=floor))
    closed = sim_pair(close_waits(composed, one, p, m), hw, floor, window)
    replayed = sim_pair(schedule, hw, floor, window)
    out: dict[str, Any] = {
        "stashed_microbatches": stage0.stashed_microbatches,
        "one_microbatch_profiles_s": [step_s(t) for t in ones],
        "schedule_profiles_s": [step_s(t) for t in schedules],
    }
    for key, (keep, moved) in (
        ("predict_1f1b", (stage0.keep, stage0.offload)),
        ("waits_removed", closed),
        ("profiled_schedule", replayed),
    ):
        out[key] = dict(
            keep=sim_dict(keep), offload=sim_dict(moved),
            overhead=moved.step_s / keep.step_s if keep.step_s > 0 else 1.0,
            # A composed timeline's memory is its base plus live saved bytes; a profiled CUDA
            # schedule's also holds its transients, so its peak is no stash figure.
            stash_bytes=None if key == "profiled_schedule" else keep.peak_bytes - keep.base_bytes,
        )  # fmt: skip
    out["waits_s"] = stage0.keep.step_s - closed[0].step_s
    out["stage_plans"] = stage_plans(one, hw, p, m, floor, stage0)
    return out


def stage_plans(one: offload.Trace, hw: offload.HardwareModel, p: int, m: int, floor: int,
                stage0: Any) -> dict[str, Any]:  # fmt: skip
    """Every stage of the pipeline planned by the simulator under one budget, stage 0's base
    plus ``BUDGET_SHARE`` of its stash: where the stash is deep, the plan moves bytes; where a
    microbatch hardly waits, it keeps them."""
    stash0 = stage0.keep.peak_bytes - stage0.keep.base_bytes
    budget = stage0.keep.base_bytes + int(BUDGET_SHARE * stash0)
    try:
        stages = predict_1f1b(one, hw, stages=p, microbatches=m, min_offload_bytes=floor,
                              gpu_budget=budget)  # fmt: skip
    except offload.BudgetInfeasibleError as e:
        return dict(budget_bytes=budget, infeasible=str(e))
    rows = []
    for s in stages:
        plan = s.planned
        assert plan is not None
        by = plan.bytes_by_placement()
        rows.append(dict(
            stage=s.stage, stashed_microbatches=s.stashed_microbatches,
            kept_stash_bytes=s.keep.peak_bytes - s.keep.base_bytes,
            offload_all_overhead=s.overhead, planned_peak_bytes=plan.predicted_peak_bytes,
            planned_overhead=plan.predicted_step_s / s.keep.step_s if s.keep.step_s else 1.0,
            moved_bytes=sum(v for k, v in by.items() if k not in ("keep", "recompute")),
            recomputed_bytes=by.get("recompute", 0),
        ))  # fmt: skip
    return dict(budget_bytes=budget, stages=rows)


# ---------------------------------------------------------------------------------------------
# Driver


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--config", choices=sorted(CONFIGS), default=None, help="default: h4096 on CUDA")
    add("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    for name in ("layers", "heads", "d-model", "seq", "batch"):
        add(f"--{name}", type=int, default=None, help="override the config's value")
    add("--stages", type=int, default=4, help="pipeline stages p (stage 0 stashes p microbatches)")
    add("--microbatches", type=int, default=8, help="microbatches m per schedule")
    add("--autocast", choices=("bf16", "off"), default=None, help="default: bf16 on CUDA")
    add("--warmup", type=int, default=None, help="untimed schedules per variant (2; 1 --quick)")
    add("--reps", type=int, default=None, help="timed schedules per variant (5; 3 --quick)")
    add("--quick", action="store_true", help="fewer schedules, for CI-like runs")
    add("--min-offload-bytes", type=parse_bytes, default=DEFAULT_MIN_OFFLOAD, help="e.g. 1MiB")
    add("--out", default=None)
    args = ap.parse_args(argv)

    cuda, overridden = resolve_device_and_shape(ap, args, CONFIGS, "h4096")
    overridden |= args.stages != 4 or args.microbatches != 8
    if min(args.stages, args.microbatches, *args.shape.values()) < 1:
        ap.error("--stages, --microbatches and the shape must be >= 1")
    args.stem = "pipeline" if args.config == "cpu-tiny" else f"pipeline-{args.config}"
    args.stem += ("-custom" if overridden else "") + ("-quick" if args.quick else "")
    args.autocast = args.autocast or ("bf16" if cuda else "off")
    args.warmup = (1 if args.quick else 2) if args.warmup is None else args.warmup
    args.reps = (3 if args.quick else 5) if args.reps is None else args.reps
    if min(args.warmup, args.reps) < 1:
        ap.error("--warmup and --reps must be >= 1")
    if args.out is None:
        args.out = default_results_dir(args.device)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    args.nvme_base = tempfile.gettempdir()  # machine() names this disk; no tier writes to it
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    result = run(args)
    md = markdown(result)
    os.makedirs(args.out, exist_ok=True)
    for ext, text in (("json", json.dumps(result, indent=2)), ("md", md)):
        Path(args.out, f"{args.stem}.{ext}").write_text(text)
    print(md)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = args.t_start = time.perf_counter()
    device, s, p, m = args.device, args.shape, args.stages, args.microbatches
    cfg = GPTConfig(
        vocab_size=8, n_layer=s["layers"], n_head=s["heads"], d_model=s["d_model"],
        seq_len=s["seq"], dropout=0.0, bias=True,
    )  # fmt: skip
    plain = Stage(GPT(cfg, seed=0).blocks).to(device)  # the embeddings are dropped here
    offloaded = copy.deepcopy(plain)  # identical weights; the manager's hooks stay off `plain`
    mgr = offload.ActivationOffloader(offloaded, min_offload_bytes=args.min_offload_bytes)
    gen = torch.Generator().manual_seed(1)
    shape = (s["batch"], s["seq"], s["d_model"])
    draw: Callable[[], torch.Tensor] = functools.partial(torch.randn, shape, generator=gen)
    data = Data([draw().to(device) for _ in range(m)], [draw().to(device) for _ in range(m)])
    one_f1b = schedule_1f1b(p, m)[0]
    variants = [
        Variant("1f1b", one_f1b, plain),
        Variant("1f1b_offload", one_f1b, offloaded, mgr),
        Variant("gpipe", gpipe_order(m), plain),
    ]
    names = [n for n, _ in plain.named_parameters()] + [f"input_grad[{i}]" for i in range(m)]
    print(f"bench_pipeline: {args.config} {s}, stage 0 of {p}, {m} microbatches on {device}, "
          f"autocast={args.autocast}, {args.warmup} warm-up + {args.reps} timed schedules per "
          f"variant; 1F1B order {' '.join(f'{k}{i}' for k, i in one_f1b)}", flush=True)  # fmt: skip
    # Measured first, before the runtime's host pool exists; no disk: the tier is host memory.
    hw = offload.probe_hardware(device=device, cache=False)
    budgeted, budget = budget_variant(args, variants[0], data, hw)
    variants.insert(2, budgeted)

    def one_microbatch() -> None:
        x = data.inputs[0].clone().requires_grad_()
        with autocast(args):
            out = plain(x)
        out.backward(data.grads[0])

    # Round robin; `1f1b` runs first in round 0 and gives the reference gradients. Each timed
    # round also profiles one microbatch and one 1F1B schedule (no offload), for the prediction.
    ref: list[Any] | None = None
    ones: list[offload.Trace] = []
    schedules: list[offload.Trace] = []
    rounds = args.warmup + args.reps
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        timed, check = r >= args.warmup, r < min(2, args.warmup)
        for v in order:
            before = v.mgr.stats.total if v.mgr is not None else None
            input_grads: dict[int, torch.Tensor | None] | None = {} if check else None
            sched_s, peak = run_schedule(args, v, data, input_grads)
            if check:
                assert input_grads is not None
                got = gradients(v.model, input_grads, m)
                if r == 0 and v.name == "1f1b":
                    ref = [None if g is None else g.clone() for g in got]
                else:  # the second `1f1b` is the determinism control
                    assert ref is not None
                    v.exact.append(compare(ref, got, names))
                del got, input_grads
            if timed:
                v.times.append(sched_s)
                v.peaks.append(peak)
                if before is not None and v.mgr is not None:
                    v.stats.append(stats_delta(before, v.mgr.stats.total))
            # Kept allocated (zeroed) so later peaks do not count the gradients' allocation.
            v.model.zero_grad(set_to_none=False)
        ref = ref if r < 1 else None
        if timed:
            ones.append(offload.profile(one_microbatch, plain, warmup_steps=0))
            run_1f1b = functools.partial(run_schedule, args, variants[0], data)
            schedules.append(offload.profile(run_1f1b, plain, warmup_steps=0))
            plain.zero_grad(set_to_none=False)
        phase = "timed" if timed else "warm-up"
        print(
            f"  round {r + 1}/{rounds} ({phase}) {time.perf_counter() - t_start:.1f} s", flush=True
        )

    # The stash of each order (the offloaded one cannot be profiled: the profiler's hooks would
    # stand in for the manager's).
    variants[0].stash = median_trace(schedules).peak_saved_bytes
    run_gpipe = functools.partial(run_schedule, args, variants[3], data)
    variants[3].stash = offload.profile(run_gpipe, plain, warmup_steps=0).peak_saved_bytes
    plain.zero_grad(set_to_none=False)
    if device.type == "cpu":  # one more, untimed schedule per variant under the live-bytes counter
        for v in variants:
            meter = SavedBytes.on(v.mgr) if v.mgr is not None else contextlib.nullcontext()
            with LiveBytes() as counter, meter as saved:
                run_schedule(args, v, data)
            v.model.zero_grad(set_to_none=False)
            v.live_peak = counter.peak
            v.saved_peak = None if saved is None else saved.peak
    print(f"  stashes{' and live peaks' if device.type == 'cpu' else ''} "
          f"{time.perf_counter() - t_start:.1f} s", flush=True)  # fmt: skip
    prediction = predict(args, ones, schedules, hw)
    print(f"  prediction {time.perf_counter() - t_start:.1f} s", flush=True)
    total = mgr.stats.total.as_dict()
    mgr.close()
    assert budgeted.mgr is not None
    plan = budgeted.mgr.plan
    budget["plan"] = None if plan is None else plan_figures(plan)
    budgeted.mgr.close()
    return assemble(args, variants, median_trace(ones), prediction, hw, total, t_start, budget)


def budget_variant(args: argparse.Namespace, kept: Variant, data: Data,
                   hw: offload.HardwareModel) -> tuple[Variant, dict[str, Any]]:  # fmt: skip
    """The budgeted variant: a copy of the stage attached through :class:`BenchStage` to a
    manager whose budget is the kept schedule's peak less ``BUDGET_SHARE`` of its stash (on CPU,
    where the planner counts saved bytes only, that share of the stash)."""
    dev = args.device
    run_kept = functools.partial(run_schedule, args, kept, data)
    stash = offload.profile(run_kept, kept.model, warmup_steps=0).peak_saved_bytes
    kept.model.zero_grad(set_to_none=False)
    kept_peak = stash
    if dev.type == "cuda":
        start = torch.cuda.memory_allocated(dev)
        _, above = run_kept()
        kept.model.zero_grad(set_to_none=False)
        kept_peak = start + above
    gpu_budget = int(kept_peak - BUDGET_SHARE * stash)
    model = copy.deepcopy(kept.model)
    mgr = offload.ActivationOffloader(
        model, min_offload_bytes=args.min_offload_bytes, gpu_budget=gpu_budget, hardware=hw
    )
    stage = BenchStage(args, model, data, args.microbatches)
    mgr.attach(stage)
    variant = Variant("1f1b_budget", kept.order, model, mgr, stage=stage)
    return variant, dict(gpu_budget_bytes=gpu_budget, kept_peak_bytes=kept_peak,
                         stash_saved_bytes=stash, share=BUDGET_SHARE)  # fmt: skip


def plan_figures(plan: offload.Plan) -> dict[str, Any]:
    keep = plan.anchors["keep_all"]
    return dict(
        signature=plan.signature, predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_step_s=plan.predicted_step_s, keep_all_peak_bytes=keep.peak_bytes,
        keep_all_step_s=keep.step_s, bytes_by_placement=plan.bytes_by_placement(),
        recompute_calls=len(plan.recompute_calls),
        refined=bool(plan.metadata.get("refined")),
        first_plan_step_s=plan.metadata.get("first_plan_step_s"),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Results


def assemble(args: argparse.Namespace, variants: list[Variant], one: offload.Trace,
             prediction: dict[str, Any], hw: offload.HardwareModel, total: dict[str, Any],
             t_start: float, budget: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    med = statistics.median
    ref_med = med(variants[0].times)
    cuda = args.device.type == "cuda"
    rows: dict[str, Any] = {}
    for v in variants:
        row = rows[v.name] = dict(
            label=LABELS[v.name], order=" ".join(f"{k}{i}" for k, i in v.order),
            schedule_s_median=med(v.times), schedule_s_min=min(v.times),
            schedule_s_max=max(v.times), schedule_s_all=v.times,
            ratio_to_1f1b=med(v.times) / ref_med,
            peak_bytes=med(v.peaks) if cuda else v.live_peak,
            peak_kind="cuda_above_start" if cuda else "cpu_live_bytes",
            stash_saved_bytes=v.stash, exactness=v.exact, saved_peak_bytes=v.saved_peak,
        )  # fmt: skip
        if v.stats:
            row["offload"] = {k: med(st[k] for st in v.stats) for k in STAT_KEYS}
    # The measured side of the prediction table, with each figure the simulator predicts.
    kept, moved = rows["1f1b"], rows["1f1b_offload"]
    measured = dict(
        stash_saved_bytes=kept["stash_saved_bytes"], peak_kept_bytes=kept["peak_bytes"],
        peak_offload_bytes=moved["peak_bytes"], saved_offload_bytes=moved["saved_peak_bytes"],
        schedule_kept_s=kept["schedule_s_median"],
        schedule_offload_s=moved["schedule_s_median"],
        overhead=moved["schedule_s_median"] / kept["schedule_s_median"],
        bytes_offloaded=moved["offload"]["bytes_offloaded_cpu"],
    )  # fmt: skip
    errors = {}
    for key in ("waits_removed", "profiled_schedule"):
        pred = predicted_figures(prediction[key])
        errors[key] = {k: rel_error(pred[k], measured[k]) for k in measured}
    s = args.shape
    held = s["batch"] * s["seq"] * s["d_model"] * 4  # one microbatch's fp32 input, or output
    exact_off = [e["bitwise_equal"] for e in moved["exactness"]]
    exact_gpipe = [e["bitwise_equal"] for e in rows["gpipe"]["exactness"]]
    exact_budget = [e["bitwise_equal"] for e in rows["1f1b_budget"]["exactness"]]
    control = [e["bitwise_equal"] for e in kept["exactness"]]
    params = list(variants[0].model.parameters())
    return {
        "benchmark": "bench_pipeline",
        "version": runtime_version(),
        "command": "python " + " ".join([os.path.relpath(__file__, _ROOT), *sys.argv[1:]]),
        "machine": machine(args),
        "config": {
            "name": args.config,
            **s,
            "stages": args.stages,
            "microbatches": args.microbatches,
            "parameters": sum(q.numel() for q in params),
            "param_dtype": str(params[0].dtype),
            "autocast": args.autocast,
            "warmup": args.warmup,
            "reps": args.reps,
            "quick": args.quick,
            "min_offload_bytes": args.min_offload_bytes,
        },
        "one_microbatch_trace": dict(
            saved_bytes=one.saved_bytes,
            peak_saved_bytes=one.peak_saved_bytes,
            records=len(one.activation_records),
            step_s=step_s(one),
            profiles=len(prediction["one_microbatch_profiles_s"]),
        ),
        "hardware_model": hw.to_dict(),
        "variants": rows,
        "offload_stats_total": total,
        "prediction": prediction,
        "measured": measured,
        "prediction_error": errors,
        "budget": budget,
        "held_input_or_output_bytes": held,
        "exactness": dict(
            offload_equals_1f1b=all(exact_off) and bool(exact_off),
            gpipe_equals_1f1b=all(exact_gpipe) and bool(exact_gpipe),
            budget_equals_1f1b=all(exact_budget) and bool(exact_budget),
            control_1f1b_repeat=(all(control) if control else None),
        ),
        "wall_s": time.perf_counter() - t_start,
    }


def predicted_figures(pred: dict[str, Any]) -> dict[str, float]:
    keep, moved = pred["keep"], pred["offload"]
    return dict(
        stash_saved_bytes=pred["stash_bytes"],
        peak_kept_bytes=keep["peak_above_base_bytes"],
        peak_offload_bytes=moved["peak_above_base_bytes"],
        saved_offload_bytes=moved["peak_above_base_bytes"], schedule_kept_s=keep["step_s"],
        schedule_offload_s=moved["step_s"], overhead=pred["overhead"],
        bytes_offloaded=moved["bytes_offloaded_cpu"],
    )  # fmt: skip


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1 (None when either is missing or the measurement is 0)."""
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _verdict(flags: list[bool]) -> str:
    return "n/a" if not flags else ("PASS" if all(flags) else "FAIL")


def markdown(res: dict[str, Any]) -> str:
    m, c, ver, pred = res["machine"], res["config"], res["version"], res["prediction"]
    cuda, hw, rows = m["gpu"] is not None, res["hardware_model"], res["variants"]
    runtime = f"commit {ver['commit']}" if "commit" in ver else f"offload {ver.get('offload')}"
    runtime += " + local changes" if ver.get("runtime_modified") else ""
    load = [f"{a[0]:.2f}" if a else "-" for a in (m["load_average_start"], m["load_average_end"])]
    gpu = "GPU: none (no CUDA)."
    if cuda:
        g, link = m["gpu"], m["gpu"].get("pcie") or {}
        gpu = (
            f"GPU: {g['name']} ({g['total_memory_bytes'] / GiB:.0f} GiB, sm {g['capability']}, "
            f"CUDA {g['cuda']}, driver {g.get('driver')}; PCIe max Gen{link.get('max_generation')}"
            f" x{link.get('max_width')}, {link.get('max_theoretical_gb_per_s') or 0:.1f} GB/s)."
        )
    p, mb, one = c["stages"], c["microbatches"], res["one_microbatch_trace"]
    rate = f"H2D {hw['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H {hw['d2h_bytes_per_s'] / 1e9:.1f} GB/s"
    out = [
        f"# Pipeline stage 0 under 1F1B: kept vs offloaded ({c['name']}, "
        "benchmarks/bench_pipeline.py)",
        "",
        f"Command: `{res['command']}` (runtime at {runtime})",
        "",
        f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['torch_threads']} torch "
        f"threads, {m['ram_bytes'] / GiB:.0f} GiB RAM, torch {m['torch']}; load average (1 min) "
        f"{load[0]} at start, {load[1]} at end. {gpu} Disk: not used (the tier is host memory"
        f"{', pinned' if cuda else ''}).",
        "",
        f"Stage: {c['layers']} GPT blocks (examples/gpt.py, no embedding or head), d_model "
        f"{c['d_model']}, {c['heads']} heads, microbatch [{c['batch']}, {c['seq']}, "
        f"{c['d_model']}] fp32 in and out, {c['parameters'] / 1e6:.1f} M parameters "
        f"({c['param_dtype']}), autocast {c['autocast']}. Stage 0 of {p} stages, {mb} "
        f"microbatches; 1F1B order: {rows['1f1b']['order']}. {c['warmup']} warm-up + {c['reps']} "
        f"timed schedules per variant, round robin. Offload: ActivationOffloader(min_offload_bytes="
        f"{c['min_offload_bytes']}), defaults otherwise. One microbatch's F+B (offload.profile, median of "
        f"{one['profiles']}, one per timed round): "
        f"{_ms(one['step_s'])} ms, {_mib(one['saved_bytes'])} MiB saved in {one['records']} "
        "records.",
        "",
        f"| variant | schedule median (ms) | min-max (ms) | x 1F1B | "
        f"{'peak above start' if cuda else 'live peak in schedule'} (MiB) | saved stash, profiled "
        "(MiB) | offloaded/schedule (MiB) | records moved | reloads | stalls (stall ms) | grads "
        "bitwise = 1F1B |",
        "|---" * 11 + "|",
    ]
    for name, r in rows.items():
        o = r.get("offload")
        flags = [e["bitwise_equal"] for e in r["exactness"]]
        exact = _verdict(flags) + (f" ({len(flags)} schedules)" if len(flags) > 1 else "")
        if name == "1f1b":
            exact = f"reference; repeat: {_verdict(flags)}"
        moved = "- | - | - | -"
        if o:
            moved = (
                f"{_mib(o['bytes_offloaded_cpu'])} | {o['records_offloaded_cpu']:.0f} | "
                f"{o['reloads']:.0f} | {o['stalls']:.0f} ({o['stall_s'] * 1e3:.1f})"
            )
        spread = f"{_ms(r['schedule_s_min'])}-{_ms(r['schedule_s_max'])}"
        out.append(_row(r["label"], _ms(r["schedule_s_median"]), spread,
                        f"{r['ratio_to_1f1b']:.2f}", _mib(r["peak_bytes"]),
                        _mib(r["stash_saved_bytes"]), moved, exact))  # fmt: skip

    meas, err = res["measured"], res["prediction_error"]
    figures = {k: predicted_figures(pred[k]) for k in ("predict_1f1b", "waits_removed",
                                                        "profiled_schedule")}  # fmt: skip
    peak_label = "peak above start" if cuda else "live peak"
    table = [
        ("saved stash, kept (MiB)", "stash_saved_bytes", _mib),
        (f"{peak_label}, kept (MiB)", "peak_kept_bytes", _mib),
        (f"{peak_label}, offloaded (MiB)", "peak_offload_bytes", _mib),
        ("saved bytes held, offloaded (MiB)", "saved_offload_bytes", _mib),
        ("schedule, kept (ms)", "schedule_kept_s", _ms),
        ("schedule, offloaded (ms)", "schedule_offload_s", _ms),
        ("offloaded / kept time", "overhead", lambda x: f"{x:.2f}"),
        ("offloaded per schedule (MiB)", "bytes_offloaded", _mib),
    ]
    out += [
        "",
        f"Prediction for stage 0 (lifecycle simulator, hardware from offload.probe_hardware(): "
        f"{hw['device_name']}, {hw['link']}, {rate}, copies overlap compute: "
        f"{'yes' if hw['copies_overlap_compute'] else 'no'}). Error = predicted / measured - 1.",
        "",
        "| stage 0 | measured | predict_1f1b (waits for stages 1.. included) | same, waits "
        "removed | error | simulator on the profiled schedule | error |",
        "|---" * 7 + "|",
    ]
    for label, key, fmt in table:
        cells = [fmt(meas[key]) if meas[key] is not None else "-"]
        cells.append(fmt(figures["predict_1f1b"][key]))
        for k in ("waits_removed", "profiled_schedule"):
            cells += [fmt(figures[k][key]), _pct(err[k][key])]
        out.append(_row(label, *cells))

    ex = res["exactness"]
    held = _mib(res["held_input_or_output_bytes"])
    notes = [
        f"Exactness (every parameter's gradient and every microbatch's input gradient, "
        f"torch.equal, after a whole schedule from the same weights and inputs): offloaded 1F1B = "
        f"1F1B: {'PASS' if ex['offload_equals_1f1b'] else 'FAIL'}; 1F1B under gpu_budget = "
        f"1F1B: {'PASS' if ex['budget_equals_1f1b'] else 'FAIL'}; GPipe order = 1F1B: "
        f"{'PASS' if ex['gpipe_equals_1f1b'] else 'FAIL'}; 1F1B repeated = itself: "
        f"{'n/a' if ex['control_1f1b_repeat'] is None else _verdict([ex['control_1f1b_repeat']])}.",
        f"predict_1f1b places stage 0's actions where it waits for stages 1..{p - 1} "
        f"({_ms(pred['waits_s'])} ms of waits in the kept timeline); this run has none, so the "
        "errors are taken against the same timeline with the waits removed, and against the "
        "simulator replaying the profiled whole schedule (composition error vs simulator error).",
        f"Not predicted: the schedule holds each waiting microbatch's output ({held} MiB, not a "
        f"saved tensor) and input ({held} MiB, saved by the first LayerNorm: in the stash, but "
        f"offloading it copies it and frees nothing), x{pred['stashed_microbatches']} at stage "
        "0's depth; autograd and allocator transients; the gradients flowing between blocks.",
    ]
    notes.append(
        "The simulator replays stage 0's timeline as one step, with the look-ahead window the "
        "runtime gives one microbatch's step (each F is a step: a quarter of the bytes it stores, "
        "at least 2 x its largest family, at most max_inflight_bytes' default); its walk from "
        "B0 on may take later microbatches' families too, where the runtime's walks one step at "
        "a time. The saved bytes held (offload._live.SavedBytes over the live-peak schedule, "
        "CPU only) are what the simulator predicts; the live peak adds what is listed as not "
        "predicted above."
    )
    notes.append(budget_note(res, rows, cuda))
    notes.append(stage_plans_note(pred["stage_plans"]))
    o = rows["1f1b_offload"]["offload"]
    notes.append(
        f"Offloader per schedule (median): {o['records']:.0f} saved tensors seen, "
        f"{o['records_kept']:.0f} kept (parameters, under min_offload_bytes), "
        f"{o['records_deduplicated']:.0f} deduplicated views, {o['backpressure_waits']:.0f} "
        f"back-pressure waits, {o['fallbacks']:.0f} fallbacks (kept for want of host room), "
        f"{o['host_allocations']:.0f} new host slabs."
    )
    if ex["control_1f1b_repeat"] is False:
        notes.append(
            "1F1B is not bitwise repeatable on this device (non-deterministic kernels): a FAIL "
            "above is no evidence against the offloader."
        )
    if not cuda:
        notes.append(
            "On CPU the 'device' is host memory: the offload variant copies into the runtime's "
            "host pool and back, so its time shows the runtime's overhead and the memcpys, and "
            "its live peak what it would keep on a device, not a RAM saving. Peak above start is "
            "a CUDA figure (n/a here); the live peak is bench_step's LiveBytes counter over one "
            "extra, untimed schedule (host-pool regions excluded)."
        )
    peak = (
        " between torch.cuda.synchronize calls. Peak: max_memory_allocated (read before every F "
        "too, as the manager resets it when a step begins) minus memory_allocated at the "
        "schedule's start, median of timed schedules; parameter gradients stay allocated."
        if cuda
        else ". Live peak: see above."
    )
    columns = (
        f"Columns: schedule times are wall seconds of all F and B{peak} Saved stash: peak of live "
        "saved-activation bytes in offload.profile of one whole schedule without offload. "
        "Offloaded, records, reloads, stalls: mgr.stats.total deltas per schedule, median of "
        "timed schedules."
    )
    return "\n".join([*out, "", *(f"- {n}" for n in notes), "", columns, ""])


def stage_plans_note(sp: dict[str, Any]) -> str:
    """The simulator's per-stage plans under one budget (prediction only)."""
    head = (
        f"Every stage planned by the simulator (lifecycle.predict_1f1b(..., gpu_budget=)) under "
        f"one budget, stage 0's base plus {BUDGET_SHARE:.0%} of its stash "
        f"({_mib(sp['budget_bytes'])} MiB), from the one-microbatch trace; predictions only"
    )
    if "infeasible" in sp:
        return f"{head}: infeasible ({sp['infeasible']})."
    parts = [
        f"stage {r['stage']} (stash {r['stashed_microbatches']}, kept {_mib(r['kept_stash_bytes'])}"
        f" MiB): peak {_mib(r['planned_peak_bytes'])} MiB, {r['planned_overhead']:.2f}x kept "
        f"(offload everything {r['offload_all_overhead']:.2f}x), moved {_mib(r['moved_bytes'])} "
        f"MiB, recomputed {_mib(r['recomputed_bytes'])} MiB"
        for r in sp["stages"]
    ]
    return f"{head}: " + "; ".join(parts) + "."


def budget_note(res: dict[str, Any], rows: dict[str, Any], cuda: bool) -> str:
    """What the budgeted variant planned and did."""
    b, row, kept = res["budget"], rows["1f1b_budget"], rows["1f1b"]
    plan = b["plan"]
    head = (
        f"1F1B under gpu_budget: the stage attached to a manager (mgr.attach) with a budget of "
        f"{_mib(b['gpu_budget_bytes'])} MiB, the kept schedule's "
        f"{'peak (allocated at start + peak above start)' if cuda else 'stash'} "
        f"{_mib(b['kept_peak_bytes'])} MiB less {b['share']:.0%} of its stash "
        f"({_mib(b['stash_saved_bytes'])} MiB); its first (warm-up) schedule was profiled in "
        "min-memory mode and planned as one round, the others ran the plan. The stage's inputs "
        "stay (the stage holds them), unlike the offload-everything variant, which copies them."
    )
    if plan is None:
        return head + " No plan was made (see the log)."
    by = plan["bytes_by_placement"]
    placed = ", ".join(f"{k} {_mib(v)} MiB" for k, v in by.items() if v)
    measured = ""
    if not cuda and row.get("saved_peak_bytes") is not None:
        measured = (
            f" Saved bytes the manager held on the device, counted over one schedule "
            f"(offload._live.SavedBytes, reload buffers whole): {_mib(row['saved_peak_bytes'])} "
            f"MiB, {'within' if row['saved_peak_bytes'] <= b['gpu_budget_bytes'] else 'OVER'} "
            "the budget."
        )
    if not cuda and row["peak_bytes"] is not None and kept["peak_bytes"] is not None:
        # The plan's keep-all peak is the stash less the stage's inputs (held by the stage, not
        # the plan's to move); on CPU the budget bounds those planned bytes only.
        transients = kept["peak_bytes"] - plan["keep_all_peak_bytes"]
        measured += (
            f" Live peak of all tensors {_mib(row['peak_bytes'])} MiB; less the kept schedule's bytes "
            f"besides the plan's keep-all peak ({_mib(transients)} MiB): "
            f"{_mib(row['peak_bytes'] - transients)} MiB against the budget (an estimate: on CPU "
            "the budget bounds saved bytes only, and the backward's own temporaries, such as "
            "attention-score gradients, peak at other moments than the kept stash does)."
        )
    elif cuda:
        measured = f" Measured peak above start: {_mib(row['peak_bytes'])} MiB."
    refined = (
        f"refined from its first planned round (first plan {_ms(plan['first_plan_step_s'])} ms)"
        if plan.get("refined")
        else "not refined"
    )
    return (
        f"{head} Plan: predicted peak {_mib(plan['predicted_peak_bytes'])} MiB (keeping all "
        f"{_mib(plan['keep_all_peak_bytes'])}), predicted round {_ms(plan['predicted_step_s'])} "
        f"ms (keeping all {_ms(plan['keep_all_step_s'])}; {refined}); {placed}; "
        f"{plan['recompute_calls']} recomputed calls.{measured} Schedule time "
        f"{row['ratio_to_1f1b']:.2f}x 1F1B."
    )


if __name__ == "__main__":
    result = main()
    exact = result["exactness"]
    # A non-repeatable reference (non-deterministic kernels) proves nothing either way.
    failed = (
        not (exact["offload_equals_1f1b"] and exact["budget_equals_1f1b"])
        and exact["control_1f1b_repeat"] is not False
    )
    sys.exit(1 if failed else 0)
