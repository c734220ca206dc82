"""``lifecycle.plan()``: choose, per alias family, where it waits so the step fits a memory budget.

NOTE [ Planner ]
    The planner searches a small, structured space and scores every point with a closed-form
    model of the step (below), fast enough for 100k records in well under a second; when the
    trace is small enough (``simulate_records``) the best candidates are then checked with the
    discrete-event simulator (:func:`lifecycle.simulate`), whose figures the plan reports.

    The space. Two knobs, following "The physics" in DESIGN.md:
      * ``m``: how many blocks (a transformer's layers: see :func:`_blocks`) run under
        checkpoint, latest in forward first (their activations are the shortest-lived, so
        offloading them buys the least);
      * ``k``: how many of the remaining movable families are offloaded, earliest packed first
        (the longest-lived: their copies have the most compute to hide behind).
    For each ``m`` on a ladder, the smallest ``k`` whose predicted peak fits is found by
    bisection (more offloaded bytes never raise the peak in the model); the plan is the point
    with the smallest predicted step time. Offloaded families go to the host tier until
    ``cpu_budget`` is used up; the longest-lived ones then go to NVMe (the larger, slower tier).

    The model. Compute is the trace's timeline. Copies out form one FIFO on the D2H link in pack
    order (an NVMe record then waits for the disk FIFO); a family's device bytes are freed when
    its copy completes. Reloads are scheduled as late as possible on the H2D link, in the order
    backward needs them, so that each ends right before its first unpack; each starts at the
    latest backward event (a module's backward start or an unpack: the only points the executor
    sees) before that time. Stall = how far the reload FIFO, started at those triggers (and not
    before the copy out or the disk write is done), finishes after a first unpack; back-pressure
    = how far the copies out lag behind the packs beyond ``max_inflight_bytes`` of link time.
    Where copies do not overlap compute (CPU-only runs) every copied byte adds its time instead.
    A recomputed block costs its forward time once, and its families occupy the device from the
    first unpack of the block in backward to their last use. Not modelled: what the simulator
    also leaves out (see NOTE [ Simulation model ]), duplex sharing, and the time shift a stall
    causes to later events' memory.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import math
import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from lifecycle._hardware import HardwareModel
from lifecycle._plan import (
    BudgetInfeasibleError,
    Key,
    Plan,
    PlanEntry,
    Prediction,
    Trigger,
)
from lifecycle._simulate import Decision, Placement, Simulation, simulate
from lifecycle._trace import Event, EventKind, Trace
from lifecycle._units import format_bytes, parse_bytes

_MIN_MARGIN_BYTES = 256 << 20  # DESIGN.md "Budget": max(5% of the budget, 256 MiB) on a GPU
_MARGIN_SHARE = 0.05
_DEFAULT_MIN_INFLIGHT_BYTES = 256 << 20
_MAX_SIMULATIONS = 6
_MAX_FRAMES = 8192


def plan(
    trace: Trace,
    gpu_budget: int | str,
    hardware: HardwareModel,
    *,
    tiers: Iterable[str] = ("cpu",),
    cpu_budget: int | str | None = None,
    nvme_bytes: int | str | None = None,
    min_offload_bytes: int | str = 1 << 20,
    margin: int | str | None = None,
    max_inflight_bytes: int | str | None = None,
    step: int = -1,
    simulate_records: int = 20_000,
    signature: str = "",
) -> Plan:
    """Plan where each activation family of one traced step waits, to fit ``gpu_budget``.

    A pure function: the same trace, budget and hardware give the same plan. See NOTE
    [ Planner ] in this module for the search and the model.

    Args:
        trace: a recorded step (from :func:`offload.profile`, the CLI, or the manager).
        gpu_budget: device bytes the step may use, base (weights, optimizer state) included: an
            int or a size string like ``"8GiB"``.
        hardware: link and disk bandwidths (:func:`offload.probe_hardware`, or a preset).
        tiers: allowed tiers, ``"cpu"`` and/or ``"nvme"``.
        cpu_budget: host bytes the plan may hold at once (``None``: no limit).
        nvme_bytes: NVMe bytes the plan may hold at once (``None``: no limit).
        min_offload_bytes: families smaller than this are kept (the manager's setting).
        margin: room left under the budget for what a trace cannot show. ``None``: on a CUDA
            trace, max(5% of the budget, 256 MiB) plus ``trace.metadata["reserved_excess_bytes"]``
            (DESIGN.md "Budget"); on a CPU trace 5% of the budget.
        max_inflight_bytes: the executor's bound on copies out in flight (``None``: twice the
            largest offloaded family, at least 256 MiB).
        step: which recorded step to plan for (``-1``: the last).
        simulate_records: check the best candidates with :func:`lifecycle.simulate` when the step
            has at most this many records (0: never); the plan then reports the simulator's
            figures.
        signature: a label for the plan (the manager passes the input signature).

    Returns:
        A :class:`Plan`.

    Raises:
        BudgetInfeasibleError: no plan fits ``gpu_budget - margin``; ``.min_feasible_bytes``
            says what would.
        TypeError / ValueError: a bad argument (the message names it).

    Example:
        >>> import torch, offload
        >>> from lifecycle import HardwareModel, plan
        >>> nn = torch.nn
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
        >>> trace = offload.profile(lambda: model(torch.randn(512, 256)).sum().backward(), model)
        >>> budget = trace.peak_memory_bytes * 3 // 4
        >>> p = plan(trace, budget, HardwareModel.h200(), min_offload_bytes=0, margin=0)
        >>> p.predicted_peak_bytes <= budget < p.anchors["keep_all"].peak_bytes
        True
    """
    # A pure computation over many small objects: the cyclic GC would scan the whole trace again
    # and again (it doubled planning time at 100k records) and there is nothing cyclic to free.
    args = dict(locals())
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(**args)
    finally:
        if gc_was_enabled:
            gc.enable()


def _plan(
    *,
    trace: Trace,
    gpu_budget: int | str,
    hardware: HardwareModel,
    tiers: Iterable[str],
    cpu_budget: int | str | None,
    nvme_bytes: int | str | None,
    min_offload_bytes: int | str,
    margin: int | str | None,
    max_inflight_bytes: int | str | None,
    step: int,
    simulate_records: int,
    signature: str,
) -> Plan:
    started = time.perf_counter()
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a lifecycle.Trace; got {type(trace).__name__}")
    if not isinstance(hardware, HardwareModel):
        raise TypeError(
            f"hardware must be a lifecycle.HardwareModel; got {type(hardware).__name__}"
        )
    budget = parse_bytes(gpu_budget, name="gpu_budget")
    tiers = _tiers_arg(tiers)
    host_cap = math.inf if cpu_budget is None else parse_bytes(cpu_budget, name="cpu_budget")
    disk_cap = math.inf if nvme_bytes is None else parse_bytes(nvme_bytes, name="nvme_bytes")
    floor_bytes = parse_bytes(min_offload_bytes, name="min_offload_bytes")
    if isinstance(simulate_records, bool) or not isinstance(simulate_records, int):
        raise TypeError(f"simulate_records must be an int; got {simulate_records!r}")
    view = _Step(trace, _step_arg(trace, step), floor_bytes)
    on_cuda = str(trace.metadata.get("device", view.device)).startswith("cuda")
    if margin is None:
        margin_bytes = int(_MARGIN_SHARE * budget)
        if on_cuda:
            excess = int(trace.metadata.get("reserved_excess_bytes", 0) or 0)
            margin_bytes = max(margin_bytes, _MIN_MARGIN_BYTES) + excess
    else:
        margin_bytes = parse_bytes(margin, name="margin")
    inflight = (
        None
        if max_inflight_bytes is None
        else parse_bytes(max_inflight_bytes, name="max_inflight_bytes")
    )
    target = budget - margin_bytes
    model = _Model(view, hardware, tiers, host_cap, disk_cap, inflight)

    keep_all = model.evaluate(0, 0)
    best = [keep_all] if keep_all.peak <= target else model.search(target)
    if not best:
        floor = int(model.min_peak())
        raise BudgetInfeasibleError(
            f"gpu_budget {format_bytes(budget)} cannot be met: with margin "
            f"{format_bytes(margin_bytes)} the step must peak at {format_bytes(target)} or less, "
            f"and the lowest plan the allowed tiers ({', '.join(tiers)}) and host/NVMe room permit "
            f"peaks at {format_bytes(floor)}; the smallest feasible budget is about "
            f"{format_bytes(floor + margin_bytes)}",
            budget_bytes=budget,
            min_feasible_bytes=floor + margin_bytes,
        )

    source = "planner model"
    chosen = best[0]
    predicted = Prediction(peak_bytes=int(chosen.peak), step_s=chosen.step_s)
    anchors = {
        "keep_all": Prediction(peak_bytes=int(keep_all.peak), step_s=keep_all.step_s),
        "offload_all": _as_prediction(model.offload_all()),
        "checkpoint_blocks": _as_prediction(model.evaluate(len(model.blocks), 0)),
    }
    simulated = 0
    if 0 < len(view.records) <= simulate_records:
        source = "simulator"
        found = None
        for cand in best[:_MAX_SIMULATIONS]:
            sim = simulate(
                trace, hardware, model.decisions(cand), step=view.step, max_inflight_bytes=inflight
            )
            simulated += 1
            if sim.peak_bytes <= target:
                found = (cand, sim)
                break
        if found is None:
            # The model was optimistic for every candidate: fall back to the lowest plan.
            cand = model.lowest()
            sim = simulate(
                trace, hardware, model.decisions(cand), step=view.step, max_inflight_bytes=inflight
            )
            simulated += 1
            if sim.peak_bytes > target:
                raise BudgetInfeasibleError(
                    f"gpu_budget {format_bytes(budget)} cannot be met: the lowest plan peaks at "
                    f"{format_bytes(sim.peak_bytes)} in simulation, above the "
                    f"{format_bytes(target)} the budget less its margin allows; the smallest "
                    f"feasible budget is about {format_bytes(sim.peak_bytes + margin_bytes)}",
                    budget_bytes=budget,
                    min_feasible_bytes=sim.peak_bytes + margin_bytes,
                )
            found = (cand, sim)
        chosen, sim = found
        predicted = Prediction(peak_bytes=sim.peak_bytes, step_s=sim.step_s)
        anchors = {
            name: Prediction(peak_bytes=s.peak_bytes, step_s=s.step_s)
            for name, s in _simulated_anchors(trace, hardware, model, view.step, inflight).items()
        }
    return Plan(
        gpu_budget_bytes=budget,
        margin_bytes=margin_bytes,
        tiers=tiers,
        entries=model.entries(chosen),
        recompute_calls=model.recompute_calls(chosen),
        expected_keys=model.expected_keys(chosen),
        predicted=predicted,
        anchors=anchors,
        trace_step_s=view.step_s,
        base_bytes=view.base,
        prediction_source=source,
        hardware=hardware,
        signature=signature,
        metadata={
            "planning_s": round(time.perf_counter() - started, 6),
            "candidates_scored": model.scored,
            "simulations": simulated,
            "records": len(view.records),
            "recomputed_blocks": chosen.m,
            "offloaded_families": chosen.k,
        },
    )


def _as_prediction(c: _Candidate) -> Prediction:
    return Prediction(peak_bytes=int(c.peak), step_s=c.step_s)


def _simulated_anchors(
    trace: Trace, hw: HardwareModel, model: _Model, step: int, inflight: int | None
) -> dict[str, Simulation]:
    return {
        "keep_all": simulate(trace, hw, None, step=step, max_inflight_bytes=inflight),
        "offload_all": simulate(
            trace, hw, model.decisions(model.offload_all()), step=step, max_inflight_bytes=inflight
        ),
        "checkpoint_blocks": simulate(
            trace,
            hw,
            model.decisions(model.evaluate(len(model.blocks), 0)),
            step=step,
            max_inflight_bytes=inflight,
        ),
    }


def _tiers_arg(tiers: Iterable[str]) -> tuple[str, ...]:
    if isinstance(tiers, str):
        tiers = (tiers,)
    out = tuple(tiers)
    if not out or any(t not in ("cpu", "nvme") for t in out) or len(set(out)) != len(out):
        raise ValueError(f"tiers must name 'cpu' and/or 'nvme', each once; got {out!r}")
    return out


def _step_arg(trace: Trace, step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be an int; got {step!r}")
    if trace.steps < 1:
        raise ValueError("the trace has no recorded step")
    if not -trace.steps <= step < trace.steps:
        raise ValueError(
            f"step must be in [{-trace.steps}, {trace.steps - 1}] for a trace of {trace.steps} "
            f"step(s); got {step}"
        )
    return step % trace.steps


# -- the step as arrays -------------------------------------------------------------------------


def _step_range(items: tuple, step: int) -> tuple[int, int]:
    """``[lo, hi)`` of the items (events or records, in step order) belonging to ``step``."""
    key = operator.attrgetter("step")
    return bisect.bisect_left(items, step, key=key), bisect.bisect_right(items, step, key=key)


def _diff(n: int, starts: np.ndarray, stops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Bytes held over events ``0..n-1``, each item from ``starts`` through ``stops - 1``."""
    w = nbytes.astype(np.float64)
    d = (
        np.bincount(starts, w, minlength=n + 2)[: n + 2]
        - np.bincount(stops, w, minlength=n + 2)[: n + 2]
    )
    return np.cumsum(d)[:n]


class _Step:
    """One step of a trace as numpy arrays over its events and its alias families."""

    def __init__(self, trace: Trace, step: int, floor_bytes: int) -> None:
        self.step = step
        lo, hi = _step_range(trace.events, step)
        events = trace.events[lo:hi]
        if not events or events[0].kind is not EventKind.STEP_START:
            raise ValueError(f"step {step} of the trace has no STEP_START event")
        self.first_event = events[0].index
        n = len(events)
        self.t = np.fromiter(map(operator.attrgetter("time_s"), events), float, n)
        self.t -= self.t[0]
        mem = np.fromiter(map(operator.attrgetter("memory_bytes"), events), np.int64, n)
        self.base = int(mem[0])
        self.step_s = float(self.t[-1])
        self.n_events = n
        self.events = events
        codes = {EventKind.BACKWARD_START: 1, EventKind.UNPACK: 1}
        kinds = np.fromiter(
            (codes.get(k, 0) for k in map(operator.attrgetter("kind"), events)), np.int8, n
        )
        self.trig = np.nonzero(kinds)[0].astype(np.int64)
        self.trig_t = self.t[self.trig]
        rlo, rhi = _step_range(trace.records, step)
        self.records = trace.records[rlo:rhi]
        self.first_seq = self.records[0].seq if self.records else 0
        self.device = self.records[0].device if self.records else "cpu"
        self._families(floor_bytes)
        act = ~self.param
        live = _diff(n, self.fp[act], self.end[act] + 1, self.nbytes[act])
        self.rest = np.maximum(0.0, mem - self.base - live)
        self.blocks = _blocks(events)
        # See NOTE [ Planner ]: memory is tracked over frames of consecutive events.
        self.n_frames = min(n, _MAX_FRAMES)
        self.frame_of = (np.arange(n + 1, dtype=np.int64) * self.n_frames) // n
        first = np.searchsorted(self.frame_of[:n], np.arange(self.n_frames), side="left")
        self.device_base = np.maximum.reduceat(self.base + self.rest, first)

    def held(self, starts: np.ndarray, stops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Bytes held per frame by items held from event ``starts`` through ``stops - 1``: an
        item counts in every frame it touches (an upper bound when frames span several events)."""
        f = self.frame_of
        return _diff(self.n_frames, f[starts], f[np.maximum(stops - 1, starts)] + 1, nbytes)

    def _families(self, floor_bytes: int) -> None:
        first = self.first_event
        pos: dict[int, int] = {}
        fid: list[int] = []
        lo: list[int] = []
        hi: list[int] = []
        fp: list[int] = []
        fu: list[int] = []
        fl: list[int] = []
        param: list[bool] = []
        backward: list[bool] = []
        keys: list[list[Key]] = []
        modules: list[str] = []
        for r in self.records:
            nbytes = r.nbytes
            if nbytes == 0:
                start = extent = 0
            elif nbytes == r.storage_nbytes:
                start, extent = 0, nbytes  # the whole storage: the usual activation
            else:
                item = r.itemsize
                start = r.storage_offset * item
                extent = (
                    1 + sum((s - 1) * abs(d) for s, d in zip(r.shape, r.stride, strict=True))
                ) * item
            u = r.unpack_events
            i = pos.get(r.family)
            if i is None:
                pos[r.family] = len(fid)
                fid.append(r.family)
                lo.append(start if extent else -1)
                hi.append(start + extent)
                fp.append(r.pack_event - first)
                if u:
                    fu.append(u[0] - first)
                    fl.append(u[-1] - first)
                else:
                    fu.append(-1)
                    fl.append(-1)
                param.append(r.is_parameter)
                backward.append(r.in_backward)
                keys.append([(r.module, r.call_index, r.ordinal)])
                modules.append(r.module)
                continue
            keys[i].append((r.module, r.call_index, r.ordinal))
            if extent:
                lo[i] = start if lo[i] < 0 else min(lo[i], start)
                hi[i] = max(hi[i], start + extent)
            if u:
                a, b = u[0] - first, u[-1] - first
                fu[i] = a if fu[i] < 0 else min(fu[i], a)
                fl[i] = max(fl[i], b)
            if r.in_backward:
                backward[i] = True
        self.fid = np.asarray(fid, np.int64)
        lo_a, hi_a = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        self.nbytes = np.where(lo_a >= 0, hi_a - lo_a, 0)
        self.fp = np.asarray(fp, np.int64)
        self.fu = np.asarray(fu, np.int64)
        fl_a = np.asarray(fl, np.int64)
        self.end = np.where(fl_a >= 0, fl_a, self.n_events - 1)
        self.param = np.asarray(param, bool)
        self.movable = ~self.param & ~np.asarray(backward, bool)
        self.candidate = self.movable & (self.nbytes >= max(1, floor_bytes))
        self.keys = keys
        self.modules = modules


@dataclass(frozen=True)
class _Block:
    module: str
    call_index: int
    start: int  # local event indices
    end: int
    duration_s: float


def _blocks(events: Sequence[Event]) -> list[_Block]:
    """The step's blocks: forward spans at the first nesting level holding two or more spans
    that call modules themselves (a transformer's layers; a lone wrapper is looked through)."""
    open_: list[list] = []  # [module, call, start, depth, has_children]
    spans: list[tuple[int, _Block, bool]] = []
    t0 = events[0].time_s
    for i, e in enumerate(events):
        if e.kind is EventKind.FORWARD_START:
            if open_:
                open_[-1][4] = True
            open_.append([e.module, e.call_index, i, len(open_), False])
        elif e.kind is EventKind.FORWARD_END and open_:
            module, call, start, depth, children = open_.pop()
            dur = (e.time_s - t0) - (events[start].time_s - t0)
            spans.append((depth, _Block(module, call, start, i, dur), children))
    by_depth: dict[int, list[_Block]] = {}
    for depth, b, children in spans:
        if children and depth >= 1:
            by_depth.setdefault(depth, []).append(b)
    for depth in sorted(by_depth):
        if len(by_depth[depth]) >= 2:
            return sorted(by_depth[depth], key=lambda b: b.start)
    return sorted(by_depth.get(1, []), key=lambda b: b.start)


# -- the model and the search -------------------------------------------------------------------


@dataclass
class _Candidate:
    m: int  # recomputed blocks (latest first)
    k: int  # offloaded families (earliest packed first)
    lead: float  # 1.0: reloads as late as possible; 0.0: at the first unpack (least memory)
    peak: float
    step_s: float
    host_ok: bool
    moved: np.ndarray  # family positions offloaded
    nvme: np.ndarray  # bool per moved: goes to NVMe
    trigger: np.ndarray  # local event index of each moved family's reload start (-1: none)
    recomputed: np.ndarray  # family positions recomputed
    unit_of: np.ndarray  # block index per recomputed family


class _Model:
    def __init__(
        self,
        view: _Step,
        hw: HardwareModel,
        tiers: tuple[str, ...],
        host_cap: float,
        disk_cap: float,
        inflight: int | None,
    ) -> None:
        self.v, self.hw, self.tiers = view, hw, tiers
        self.host_cap, self.disk_cap, self.inflight = host_cap, disk_cap, inflight
        self.blocks = view.blocks
        self.scored = 0
        # Recompute units, latest block first: families first packed inside a block, except its
        # first (the block's input, which checkpoint keeps).
        order = np.argsort(view.fp, kind="stable")
        self.unit_families: list[np.ndarray] = []
        movable = order[view.movable[order]]
        first_pack = view.fp[movable]  # sorted
        for b in reversed(self.blocks):
            lo = np.searchsorted(first_pack, b.start, side="left")
            hi = np.searchsorted(first_pack, b.end, side="right")
            self.unit_families.append(movable[lo + 1 : hi])
        self.pack_order = order[view.candidate[order]]
        self._order_cache: dict[int, np.ndarray] = {}
        self._unit_cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        durations = [b.duration_s for b in reversed(self.blocks)]
        self._recompute_s = [0.0, *itertools.accumulate(durations)]

    # -- search ----------------------------------------------------------------------------

    def search(self, target: float) -> list[_Candidate]:
        """Feasible candidates, best (fastest, then fewest moved bytes) first."""
        found: list[_Candidate] = []
        for m in _ladder(len(self.blocks)):
            for lead in (1.0, 0.5, 0.0):
                c = self._smallest_k(m, target, lead)
                if c is not None:
                    found.append(c)
                    break
        if found:
            best_m = min(found, key=lambda c: c.step_s).m
            # Refine between the ladder's neighbours of the best m.
            ladder = _ladder(len(self.blocks))
            i = ladder.index(best_m)
            lo = ladder[i - 1] if i > 0 else 0
            hi = ladder[i + 1] if i + 1 < len(ladder) else len(self.blocks)
            for m in sorted({(lo + best_m) // 2, (best_m + hi) // 2} - set(ladder)):
                c = self._smallest_k(m, target, 1.0)
                if c is not None:
                    found.append(c)
        found.sort(key=lambda c: (c.step_s, self._moved_bytes(c)))
        return found

    def _moved_bytes(self, c: _Candidate) -> int:
        return int(self.v.nbytes[c.moved].sum())

    def _smallest_k(self, m: int, target: float, lead: float) -> _Candidate | None:
        n = len(self._candidates(m))
        top = self.evaluate(m, n, lead)
        if not (top.host_ok and top.peak <= target):
            return None
        lo, hi = 0, n  # invariant: hi fits
        best = top
        # To within 1/256 of the candidates: a few more offloaded families cost little, and the
        # bisection is most of the planning time on large traces.
        tolerance = max(1, n // 256)
        while hi - lo >= tolerance and lo < hi:
            mid = (lo + hi) // 2
            c = self.evaluate(m, mid, lead)
            if c.host_ok and c.peak <= target:
                hi, best = mid, c
            else:
                lo = mid + 1
        return best

    def min_peak(self) -> float:
        return self.lowest().peak

    def lowest(self) -> _Candidate:
        """The least-memory candidate the host and disk room allow."""
        best = None
        for m in _ladder(len(self.blocks)):
            c = self.evaluate(m, len(self._candidates(m)), 0.0)
            if c.host_ok and (best is None or c.peak < best.peak):
                best = c
        assert best is not None
        return best

    def offload_all(self) -> _Candidate:
        return self.evaluate(0, len(self.pack_order), 1.0)

    def _candidates(self, m: int) -> np.ndarray:
        """Offload order with ``m`` blocks recomputed: first the families the D2H link can take
        without falling behind the packs by more than the in-flight bound (in pack order), then
        the rest (in pack order)."""
        cached = self._order_cache.get(m)
        if cached is not None:
            return cached
        fams = self.pack_order
        if m:
            fams = fams[~np.isin(fams, np.concatenate(self.unit_families[:m]))]
        v, hw = self.v, self.hw
        if hw.copies_overlap_compute and len(fams) and math.isfinite(hw.d2h_bytes_per_s):
            dur = (v.nbytes[fams] / hw.d2h_bytes_per_s).tolist()
            packed = v.t[v.fp[fams]].tolist()
            largest = int(v.nbytes[fams].max())
            cap = self.inflight or max(_DEFAULT_MIN_INFLIGHT_BYTES, 2 * largest)
            slack = cap / hw.d2h_bytes_per_s
            free = []
            done = 0.0  # when the link finishes the families taken so far
            for d, tp in zip(dur, packed, strict=True):
                end = (done if done > tp else tp) + d
                ok = end - tp <= slack
                free.append(ok)
                if ok:
                    done = end
            mask = np.asarray(free, bool)
            fams = np.concatenate([fams[mask], fams[~mask]])
        self._order_cache[m] = fams
        return fams

    # -- the model ---------------------------------------------------------------------------

    def _units(self, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Recomputed families with ``m`` blocks checkpointed, their unit, and the device bytes
        over the events of everything not offloadable (kept families and recomputed units)."""
        cached = self._unit_cache.get(m)
        if cached is not None:
            return cached
        v = self.v
        n = v.n_events
        units = self.unit_families[:m]
        recomputed = np.concatenate(units) if units else np.zeros(0, np.int64)
        sizes = [len(u) for u in units]
        unit_of = np.repeat(np.arange(m, dtype=np.int64), sizes) if units else recomputed
        keep = ~v.param
        keep[self.pack_order] = False
        keep[recomputed] = False
        fixed = v.held(v.fp[keep], v.end[keep] + 1, v.nbytes[keep])
        if len(recomputed):
            fu_r = v.fu[recomputed]
            has = fu_r >= 0
            first = np.full(m, n, np.int64)
            np.minimum.at(first, unit_of[has], fu_r[has])
            start_r = first[unit_of]
            live = has & (start_r < n)
            fixed = fixed + v.held(
                start_r[live], v.end[recomputed][live] + 1, v.nbytes[recomputed][live]
            )
        # Candidates of this m that the search leaves on the device are added per evaluation.
        out = (recomputed, unit_of, v.device_base + fixed)
        self._unit_cache[m] = out
        return out

    def evaluate(self, m: int, k: int, lead: float = 1.0) -> _Candidate:
        self.scored += 1
        v, hw = self.v, self.hw
        t = v.t
        order = self._candidates(m)
        moved, kept = order[:k], order[k:]
        recomputed, unit_of, fixed = self._units(m)
        b = v.nbytes[moved].astype(float)
        overlap = hw.copies_overlap_compute
        nvme, host_ok = self._tiers_for(moved)
        tp = t[v.fp[moved]]
        # Copies out: one FIFO in pack order.
        if overlap and len(moved):
            dur = b / hw.d2h_bytes_per_s
            cum = np.cumsum(dur)
            c = np.maximum.accumulate(tp - (cum - dur)) + cum
        else:
            c = tp.copy()
        avail = c.copy()
        if nvme.any():
            w_dur = b[nvme] / hw.disk_write_bytes_per_s
            w_cum = np.cumsum(w_dur)
            avail[nvme] = np.maximum.accumulate(c[nvme] - (w_cum - w_dur)) + w_cum
        fu = v.fu[moved]
        unpacked = fu >= 0
        u = np.where(unpacked, t[np.maximum(fu, 0)], np.inf)
        # A family unpacked before its copy out completed keeps its source: it never left.
        away = unpacked & (c < u)
        gone_until = np.maximum(np.searchsorted(t, c, side="left"), v.fp[moved] + 1)
        trigger = np.full(len(moved), -1, np.int64)
        stall_bwd = 0.0
        sync_s = 0.0
        rdur = b / hw.h2d_bytes_per_s
        if nvme.any():
            rdur = rdur + np.where(nvme, b / hw.disk_read_bytes_per_s, 0.0)
        idx = np.nonzero(away)[0]
        if len(idx) and len(v.trig):
            by_use = idx[np.argsort(u[idx], kind="stable")]
            uo, do = u[by_use], rdur[by_use]
            if overlap:
                rc = np.cumsum(do[::-1])[::-1]  # durations from i to the end
                nxt = np.append(rc[1:], 0.0)
                alap = np.minimum.accumulate((uo + nxt)[::-1])[::-1] - rc
                start = uo - lead * (uo - alap)
            else:
                start = uo
            pos = np.searchsorted(v.trig_t, start, side="right") - 1
            ev = v.trig[np.maximum(pos, 0)]
            ev = np.minimum(ev, fu[by_use])
            ev = np.maximum(ev, gone_until[by_use])  # never before the copy out is done
            trigger[by_use] = ev
            if overlap:
                st = np.maximum(avail[by_use], t[ev])
                cum = np.cumsum(do)
                fin = np.maximum.accumulate(st - (cum - do)) + cum
                stall_bwd = max(0.0, float(np.max(fin - uo)))
            else:
                sync_s += float(do.sum())
        stall_fwd = 0.0
        if len(moved):
            if overlap:
                cap = self.inflight or max(_DEFAULT_MIN_INFLIGHT_BYTES, 2 * int(b.max()))
                lag = (c - tp) - cap / hw.d2h_bytes_per_s
                stall_fwd = max(0.0, float(lag.max()))
            else:
                sync_s += float((b / hw.d2h_bytes_per_s).sum())
        recompute_s = self._recompute_s[m]
        # Device memory over the events: fixed part, candidates left on the device, moved ones
        # until their copy out completes and from their reload to their last use.
        mb = v.nbytes[moved]
        back = away & (trigger >= 0)
        starts = np.concatenate([v.fp[kept], v.fp[moved], trigger[back]])
        stops = np.concatenate(
            [v.end[kept] + 1, np.where(away, gone_until, v.end[moved] + 1), v.end[moved][back] + 1]
        )
        sizes = np.concatenate([v.nbytes[kept], mb, mb[back]])
        peak = float(np.max(fixed + v.held(starts, stops, sizes)))
        return _Candidate(
            m=m,
            k=k,
            lead=lead,
            peak=peak,
            step_s=v.step_s + stall_fwd + stall_bwd + sync_s + recompute_s,
            host_ok=host_ok,
            moved=moved,
            nvme=nvme,
            trigger=trigger,
            recomputed=recomputed,
            unit_of=unit_of,
        )

    def _tiers_for(self, moved: np.ndarray) -> tuple[np.ndarray, bool]:
        """Per moved family: NVMe or not; and whether host and disk room suffice. The host
        first; past ``cpu_budget``, the longest-lived (earliest packed) go to NVMe."""
        nvme = np.zeros(len(moved), bool)
        if "cpu" not in self.tiers:
            nvme[:] = True
        host_ok = True
        if (
            "cpu" in self.tiers
            and len(moved)
            and math.isfinite(self.host_cap)
            and self._resident_peak(moved) > self.host_cap
        ):
            if "nvme" not in self.tiers:
                return nvme, False
            by_pack = np.argsort(self.v.fp[moved], kind="stable")
            lo, hi = 0, len(moved)
            while lo < hi:  # the fewest earliest-packed families sent to NVMe
                mid = (lo + hi) // 2
                on_host = np.ones(len(moved), bool)
                on_host[by_pack[:mid]] = False
                if self._resident_peak(moved[on_host]) <= self.host_cap:
                    hi = mid
                else:
                    lo = mid + 1
            nvme[by_pack[:lo]] = True
            host_ok = self._resident_peak(moved[~nvme]) <= self.host_cap
        if nvme.any() and math.isfinite(self.disk_cap):
            host_ok = host_ok and self._resident_peak(moved[nvme]) <= self.disk_cap
        return nvme, host_ok

    def _resident_peak(self, fams: np.ndarray) -> float:
        """Peak bytes held off the device by ``fams`` (from pack to last use)."""
        if not len(fams):
            return 0.0
        v = self.v
        return float(np.max(v.held(v.fp[fams], v.end[fams] + 1, v.nbytes[fams])))

    # -- the plan out of a candidate ---------------------------------------------------------

    def decisions(self, c: _Candidate) -> dict[int, Decision]:
        return {
            e.family: e.decision() for e in self.entries(c) if e.placement is not Placement.KEEP
        }

    def entries(self, c: _Candidate) -> tuple[PlanEntry, ...]:
        v = self.v
        keep = (Placement.KEEP, None, -1, "")
        chosen: dict[int, tuple[Placement, Trigger | None, int, str]] = {}
        triggers: dict[int, Trigger] = {}
        for pos, nvme, ev in zip(
            c.moved.tolist(), c.nvme.tolist(), c.trigger.tolist(), strict=True
        ):
            trigger = None
            if ev >= 0:
                trigger = triggers.get(ev)
                if trigger is None:
                    trigger = triggers[ev] = self._trigger(ev)
            placement = Placement.NVME if nvme else Placement.CPU
            chosen[pos] = (placement, trigger, v.first_event + ev if ev >= 0 else -1, "")
        names = [b.module for b in reversed(self.blocks)]
        for pos, unit in zip(c.recomputed.tolist(), c.unit_of.tolist(), strict=True):
            chosen[pos] = (Placement.RECOMPUTE, None, -1, names[unit])
        out = []
        fids, sizes = v.fid.tolist(), v.nbytes.tolist()
        for pos in np.nonzero(v.movable)[0].tolist():
            placement, trigger, event, module = chosen.get(pos, keep)
            out.append(
                PlanEntry(
                    family=fids[pos],
                    keys=tuple(v.keys[pos]),
                    nbytes=sizes[pos],
                    module=v.modules[pos],
                    placement=placement,
                    reload=trigger,
                    reload_event=event,
                    recompute_module=module,
                )
            )
        return tuple(out)

    def _trigger(self, local_event: int) -> Trigger:
        e = self.v.events[local_event]
        if e.kind is EventKind.UNPACK:
            r = self.v.records[e.record - self.v.first_seq]
            return Trigger(
                kind="unpack", module=r.module, call_index=r.call_index, ordinal=r.ordinal
            )
        return Trigger(kind="backward", module=e.module, call_index=e.call_index)

    def recompute_calls(self, c: _Candidate) -> tuple[tuple[str, int], ...]:
        blocks = self.blocks[len(self.blocks) - c.m :] if c.m else []
        return tuple((b.module, b.call_index) for b in blocks)

    def expected_keys(self, c: _Candidate) -> tuple[Key, ...]:
        v = self.v
        blocks = self.blocks[len(self.blocks) - c.m :] if c.m else []
        starts = np.asarray([b.start for b in blocks], np.int64)
        ends = np.asarray([b.end for b in blocks], np.int64)
        packs = np.fromiter((r.pack_event for r in v.records), np.int64, len(v.records))
        packs -= v.first_event
        # Blocks are disjoint and sorted: the one starting last at or before a pack is the only
        # one that can hold it.
        inside = np.zeros(len(packs), bool)
        if len(blocks):
            i = np.searchsorted(starts, packs, side="right") - 1
            inside = (i >= 0) & (packs <= ends[np.maximum(i, 0)])
        return tuple(
            r.key
            for r, gone in zip(v.records, inside.tolist(), strict=True)
            if not gone and not r.in_backward
        )


def _ladder(n: int) -> list[int]:
    """0, then about a dozen geometric steps from 1 up to n (n itself included)."""
    ratio = max(2.0, n ** (1 / 12)) if n > 1 else 2.0
    out, m = [0], 1.0
    while m < n:
        if int(m) != out[-1]:
            out.append(int(m))
        m *= ratio
    if n > 0:
        out.append(n)
    return out
