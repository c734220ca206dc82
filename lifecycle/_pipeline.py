"""1F1B pipeline scenarios for the simulator: each stage's peak and overhead, offloaded or not.

Under a 1F1B schedule with ``p`` stages, stage ``s`` runs ``p - s`` forwards before its first
backward, so it holds up to ``p - s`` microbatches' activations at once, each waiting for its
backward while the stages after it work: stage 0 waits longest, which is where offloading pays.
:func:`pipeline_trace` builds that stage's timeline from a trace of one microbatch's step on one
stage (stages taken as equal), placing every forward and backward where the schedule's
dependencies allow (forward of microbatch m on stage s after stage s-1's; backward after stage
s+1's); :func:`predict_1f1b` simulates it for every stage, keeping everything and offloading
everything, and, given a per-stage ``gpu_budget``, plans each stage with :func:`lifecycle.plan`
on that stage's composed timeline: the planner sees how long each microbatch's activations wait
on that stage (longest on stage 0) and fits that stage's budget.

Not modelled: point-to-point transfer time between stages, stages of unequal cost, the loss on
the last stage, the allocator's transients (memory is the base plus live saved bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from offload.lifecycle._anchors import offload_all
from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._placement import Placement
from offload.lifecycle._plan import BudgetInfeasibleError, Plan
from offload.lifecycle._planner import plan
from offload.lifecycle._sim_engine import Simulation
from offload.lifecycle._sim_step import _step_index
from offload.lifecycle._simulate import _automatic_window_bytes, simulate
from offload.lifecycle._trace import Event, EventKind, Trace
from offload.lifecycle._units import check_count, parse_bytes

Action = tuple[str, int]  # ("F" | "B", microbatch)


def schedule_1f1b(stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's actions in order under 1F1B (as ``torch.distributed.pipelining`` runs it):
    ``stages - s`` warm-up forwards on stage ``s``, then one backward and one forward in turn,
    then the remaining backwards.

    Example:
        >>> [" ".join(f"{k}{m}" for k, m in a) for a in schedule_1f1b(2, 4)]
        ['F0 F1 B0 F2 B1 F3 B2 B3', 'F0 B0 F1 B1 F2 B2 F3 B3']
    """
    check_count(stages, name="stages", minimum=1)
    check_count(microbatches, name="microbatches", minimum=1)
    out = []
    for s in range(stages):
        warmup = min(stages - s, microbatches)
        actions: list[Action] = [("F", m) for m in range(warmup)]
        f, b = warmup, 0
        while b < microbatches:
            actions.append(("B", b))
            b += 1
            if f < microbatches:
                actions.append(("F", f))
                f += 1
        out.append(actions)
    return out


def _start_times(
    actions: list[list[Action]], forward_s: float, backward_s: float
) -> list[dict[Action, float]]:
    """When each action starts, each stage running its list in order and waiting for its
    dependencies (F after the previous stage's F, B after the next stage's B)."""
    p = len(actions)
    end: list[dict[Action, float]] = [{} for _ in range(p)]
    start: list[dict[Action, float]] = [{} for _ in range(p)]
    nxt = [0] * p
    free = [0.0] * p
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for s in range(p):
            if nxt[s] >= len(actions[s]):
                continue
            kind, m = actions[s][nxt[s]]
            dep = (s - 1, ("F", m)) if kind == "F" else (s + 1, ("B", m))
            if 0 <= dep[0] < p:
                ready = end[dep[0]].get(dep[1])
                if ready is None:
                    continue
            else:
                ready = 0.0
            t = max(free[s], ready)
            start[s][(kind, m)] = t
            end[s][(kind, m)] = free[s] = t + (forward_s if kind == "F" else backward_s)
            nxt[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked (a bug)")
    return start


def pipeline_trace(
    trace: Trace, *, stage: int, stages: int, microbatches: int, step: int = -1
) -> Trace:
    """Stage ``stage``'s 1F1B timeline, every microbatch replaying one step of ``trace``.

    ``trace``'s step ``step`` (``-1``: the last; a step in ``[-steps, steps - 1]`` as
    :func:`lifecycle.plan` takes it, else ``ValueError``) is split at its first backward event
    into a forward part and a backward part; each microbatch's records get their own families
    and call indices.

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        >>> one = offload.profile(lambda: model(torch.randn(4, 8)).sum().backward(), model)
        >>> t = pipeline_trace(one, stage=0, stages=2, microbatches=4)
        >>> len(t.records) == 4 * len(one.records)
        True
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a lifecycle.Trace; got {type(trace).__name__}")
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(
            f"stage must be an int (a stage index); got {type(stage).__name__} {stage!r}"
        )
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be an int in [0, {stages - 1}]; got {stage!r}")
    actions = schedule_1f1b(stages, microbatches)
    index = _step_index(trace, step)  # in [-steps, steps - 1], as lifecycle.plan takes it
    events = [e for e in trace.events if e.step == index]
    if not events:
        raise ValueError(f"the trace has no step {step}")
    split = next(
        (i for i, e in enumerate(events) if e.kind in (EventKind.BACKWARD_START, EventKind.UNPACK)),
        len(events) - 1,
    )
    body = [e for e in events if e.kind not in (EventKind.STEP_START, EventKind.STEP_END)]
    fwd = [e for e in body if e.index < events[split].index]
    bwd = [e for e in body if e.index >= events[split].index]
    t0 = events[0].time_s
    forward_s = events[split].time_s - t0
    backward_s = events[-1].time_s - events[split].time_s
    starts = _start_times(actions, forward_s, backward_s)[stage]
    records = [r for r in trace.records if r.step == index]
    first_seq = records[0].seq if records else 0
    n_rec = len(records)
    fam_span = 1 + max((r.family for r in records), default=0)
    call_span = 1 + max([r.call_index for r in records] + [e.call_index for e in body] + [0])
    base = events[0].memory_bytes - 0  # the step's base memory; saved bytes are added below

    out_events: list[Event] = []
    pack_at: dict[int, tuple[int, float]] = {}
    unpacks: dict[int, list[tuple[int, float]]] = {}

    def emit(e: Event, m: int, t: float) -> None:
        seq = -1
        if e.record >= 0:
            seq = m * n_rec + (e.record - first_seq)
        idx = len(out_events)
        out_events.append(
            Event(
                index=idx,
                kind=e.kind,
                step=0,
                time_s=t,
                memory_bytes=0,
                module=e.module,
                call_index=e.call_index + m * call_span if e.call_index >= 0 else -1,
                record=seq,
            )
        )
        if e.kind is EventKind.PACK:
            pack_at[seq] = (idx, t)
        elif e.kind is EventKind.UNPACK:
            unpacks.setdefault(seq, []).append((idx, t))

    out_events.append(
        Event(index=0, kind=EventKind.STEP_START, step=0, time_s=0.0, memory_bytes=base)
    )
    for kind, m in actions[stage]:
        start = starts[(kind, m)]
        part, origin = (fwd, t0) if kind == "F" else (bwd, events[split].time_s)
        for e in part:
            emit(e, m, start + (e.time_s - origin))
    end_t = max(out_events[-1].time_s, 0.0)
    out_events.append(
        Event(index=len(out_events), kind=EventKind.STEP_END, step=0, time_s=end_t, memory_bytes=0)
    )
    out_records = []
    for m in range(microbatches):
        for r in records:
            seq = m * n_rec + (r.seq - first_seq)
            if seq not in pack_at:
                continue
            ev, t = pack_at[seq]
            used = unpacks.get(seq, [])
            out_records.append(
                dataclasses.replace(
                    r,
                    seq=seq,
                    step=0,
                    family=r.family if r.is_parameter else r.family + (m + 1) * fam_span,
                    call_index=r.call_index + m * call_span,
                    pack_event=ev,
                    pack_time_s=t,
                    unpack_events=tuple(i for i, _ in used),
                    unpack_times_s=tuple(x for _, x in used),
                    rebuild_from=m * n_rec + (r.rebuild_from - first_seq)
                    if r.rebuild_from >= 0
                    else -1,
                )
            )
    # Records are addressed by position: renumber densely (a record whose pack fell outside
    # both parts, which a well-formed step does not have, is dropped above).
    renumber = {r.seq: i for i, r in enumerate(sorted(out_records, key=lambda r: r.seq))}
    out_records = [
        dataclasses.replace(r, seq=renumber[r.seq], rebuild_from=renumber.get(r.rebuild_from, -1))
        for r in sorted(out_records, key=lambda r: r.seq)
    ]
    out_events = [
        dataclasses.replace(e, record=renumber.get(e.record, -1)) if e.record >= 0 else e
        for e in out_events
    ]
    composed = Trace(
        records=tuple(out_records),
        events=tuple(out_events),
        metadata={**dict(trace.metadata), "pipeline": f"1F1B stage {stage} of {stages}"},
        # Every microbatch is the traced step again: its graph, kept or built on, is too.
        retained_steps=(0,) if index in trace.retained_steps else (),
        create_graph_steps=(0,) if index in trace.create_graph_steps else (),
    )
    live = dict(composed.live_saved_bytes())
    return dataclasses.replace(
        composed,
        events=tuple(
            dataclasses.replace(e, memory_bytes=base + live[e.index]) for e in composed.events
        ),
    )


@dataclass(frozen=True, kw_only=True)
class StagePrediction:
    """One stage of a 1F1B pipeline, simulated keeping everything and offloading everything.

    Attributes:
        stage: the stage index.
        stashed_microbatches: how many microbatches' activations the stage holds at most.
        keep / offload: the two simulations (``offload``: every movable family to ``tier``).
        planned: the stage's :class:`lifecycle.Plan` against its ``gpu_budget`` (planned on the
            stage's whole 1F1B timeline, so each microbatch's wait on this stage is seen), or
            ``None`` when :func:`predict_1f1b` was given no budget.
    """

    stage: int
    stashed_microbatches: int
    keep: Simulation
    offload: Simulation
    planned: Plan | None = None

    @property
    def overhead(self) -> float:
        """Step time offloaded over step time kept (1.0: offloading is free)."""
        return self.offload.step_s / self.keep.step_s if self.keep.step_s > 0 else 1.0

    @property
    def peak_saved_fraction(self) -> float:
        """Offloaded peak over kept peak, above the base memory."""
        kept = self.keep.peak_bytes - self.keep.base_bytes
        return (self.offload.peak_bytes - self.offload.base_bytes) / kept if kept > 0 else 1.0


def _stage_budgets(gpu_budget: int | str | Sequence[int | str], stages: int) -> list[int]:
    """``gpu_budget`` as one byte count per stage (one value applies to every stage)."""
    if isinstance(gpu_budget, (int, str)) and not isinstance(gpu_budget, bool):
        return [parse_bytes(gpu_budget, name="gpu_budget")] * stages
    if not isinstance(gpu_budget, Sequence):
        raise TypeError(
            "gpu_budget must be None, one budget for every stage (an int of bytes or a string "
            f"like '8GiB') or a sequence of {stages} such budgets, one per stage; "
            f"got {type(gpu_budget).__name__}"
        )
    if len(gpu_budget) != stages:
        raise ValueError(
            f"gpu_budget must have one budget per stage ({stages}), or be a single budget for "
            f"every stage; got {len(gpu_budget)} budgets"
        )
    return [parse_bytes(b, name=f"gpu_budget[{s}]") for s, b in enumerate(gpu_budget)]


def predict_1f1b(
    trace: Trace,
    hardware: HardwareModel,
    *,
    stages: int,
    microbatches: int,
    tier: Placement | str = Placement.CPU,
    min_offload_bytes: int | str = 0,
    max_inflight_bytes: int | str | None = None,
    prefetch_bytes: int | str | None = None,
    step: int = -1,
    gpu_budget: int | str | Sequence[int | str] | None = None,
) -> list[StagePrediction]:
    """Each stage's peak and time under 1F1B, keeping everything and offloading everything.

    ``trace`` is one microbatch's step on one stage (stages taken as equal). ``prefetch_bytes``
    is the reload look-ahead; ``None``: the window the executor gives one microbatch (each
    microbatch's forward is a step of its own, and its backward walks that step's window: a
    quarter of the bytes the microbatch moves, at least twice its largest moved family, at
    most ``max_inflight_bytes``; see :func:`lifecycle.simulate`). The simulator's own default,
    taken over the whole timeline, would be the stash's window, and one microbatch's saved
    bytes overstated min-memory mode's peak once the executor's window shrank (cpu-tiny stage
    0 of 4: 40.4 MiB predicted above the base against 14.8 MiB of saved bytes measured).

    With ``gpu_budget``, each stage is also planned: :func:`lifecycle.plan` runs on the stage's
    composed timeline (:func:`pipeline_trace`), so the planner sees how long each microbatch's
    activations wait on that stage (stage 0 waits longest and stashes the most), and fits that
    stage's budget; ``tier`` is its only tier, ``min_offload_bytes`` and ``max_inflight_bytes``
    pass through, the margin is the planner's default. The plan is ``StagePrediction.planned``.

    Args:
        trace: one microbatch's step on one stage.
        hardware: link and disk bandwidths.
        stages / microbatches: the pipeline's shape.
        tier: where offloaded families wait, ``"cpu"`` or ``"nvme"``.
        min_offload_bytes: families smaller than this stay on the device.
        max_inflight_bytes: the executor's bound on copies out in flight (``None``: its default).
        prefetch_bytes: the reload look-ahead (see above; ``None``: one microbatch's).
        step: which step of ``trace`` is the microbatch (``-1``: the last), in
            ``[-steps, steps - 1]``.
        gpu_budget: ``None`` (no plans), one budget for every stage, or a sequence of one per
            stage; each an int of bytes or a size string like ``"8GiB"``, base memory included.

    Returns:
        One :class:`StagePrediction` per stage, stage 0 first.

    Raises:
        BudgetInfeasibleError: a stage's budget cannot be met; the message starts with
            ``"stage N: "`` and ``.min_feasible_bytes`` is that stage's.
        TypeError / ValueError: a bad argument (the message names it), e.g. a ``gpu_budget``
            sequence whose length is not ``stages``.

    Example:
        >>> import torch, offload
        >>> from offload.lifecycle import HardwareModel
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        >>> one = offload.profile(lambda: model(torch.randn(128, 64)).sum().backward(), model)
        >>> stages = predict_1f1b(one, HardwareModel.h200(), stages=4, microbatches=8)
        >>> [s.stashed_microbatches for s in stages]
        [4, 3, 2, 1]
        >>> stages[0].keep.peak_bytes > stages[3].keep.peak_bytes
        True
        >>> budget = stages[0].keep.peak_bytes * 3 // 4  # every stage's, below stage 0's peak
        >>> planned = predict_1f1b(
        ...     one, HardwareModel.h200(), stages=4, microbatches=8, gpu_budget=budget
        ... )
        >>> [s.planned.bytes_by_placement()["cpu"] > 0 for s in planned]  # the deep stashes move
        [True, True, False, False]
        >>> all(s.planned.predicted_peak_bytes <= budget for s in planned)
        True
    """
    schedule_1f1b(stages, microbatches)  # validates both before a budget is matched to a stage
    _step_index(trace, step)  # the trace and the step, before any of the trace is read
    budgets = None if gpu_budget is None else _stage_budgets(gpu_budget, stages)
    out = []
    window = prefetch_bytes
    if window is None:  # one microbatch's step, as the executor sizes each step's window
        everything = offload_all(trace, step=step, tier=tier, min_offload_bytes=min_offload_bytes)
        window = _automatic_window_bytes(
            trace, everything, step=step, max_inflight_bytes=max_inflight_bytes
        )
    for s in range(stages):
        composed = pipeline_trace(
            trace, stage=s, stages=stages, microbatches=microbatches, step=step
        )
        keep = simulate(composed, hardware)
        moved = simulate(
            composed,
            hardware,
            offload_all(composed, tier=tier, min_offload_bytes=min_offload_bytes),
            max_inflight_bytes=max_inflight_bytes,
            prefetch_bytes=window,
        )
        planned = None
        if budgets is not None:
            try:
                planned = plan(
                    composed,
                    budgets[s],
                    hardware,
                    tiers=(Placement(tier).value,),  # offload_all above has checked tier
                    min_offload_bytes=min_offload_bytes,
                    max_inflight_bytes=max_inflight_bytes,
                )
            except BudgetInfeasibleError as e:
                raise BudgetInfeasibleError(
                    f"stage {s}: {e}",
                    budget_bytes=e.budget_bytes,
                    min_feasible_bytes=e.min_feasible_bytes,
                ) from e
        out.append(
            StagePrediction(
                stage=s,
                stashed_microbatches=min(stages - s, microbatches),
                keep=keep,
                offload=moved,
                planned=planned,
            )
        )
    return out
