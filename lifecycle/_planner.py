"""``lifecycle.plan()``: choose, per alias family, where it waits so the step fits a memory budget.

NOTE [ Planner ]
    The planner searches a small, structured space and scores points with a closed-form model of
    the step (below): 0.7-1.3 s for 100k records on a slow 2-core VM (its speed moves that much
    from one run to the next), most of it reading the trace's objects and building the plan's
    (benchmarks/bench_plan.py). When the trace is small enough (``simulate_records``) the chosen
    plan is then replayed by the discrete-event simulator (:func:`lifecycle.simulate`), whose
    peak the plan reports.

    The space. Following "The physics" in DESIGN.md, a point is (m, lead, k):
      * ``m``: how many blocks (a transformer's layers: NOTE [ Blocks ] in _blocks.py) run under
        checkpoint, latest in forward first (their activations are the shortest-lived, so
        offloading them buys the least); ``m`` takes the values of a fixed ladder. A
        recomputed block's first family (its input, which checkpoint saves again and the
        executor keeps) is kept: neither offloaded nor rebuilt;
      * ``lead``: reloads start as late as the link allows (1.0: each ends right before its first
        unpack, on a FIFO H2D link in the order backward needs them) or at the first unpack (0.0:
        the least memory, every reload a stall);
      * ``k``: how many families are offloaded, a prefix of a fixed order: first those the D2H
        link takes without falling behind the packs by more than the in-flight bound, then the
        rest, each group earliest packed (longest-lived, in one step's LIFO backward) first;
        where lifetimes do not fall along pack order (a pipeline round, where each
        microbatch's backward follows a few forwards, not all of them), the rest longest-lived
        first is a further order variant (each microbatch's early layers before any late
        ones). ``k`` runs from 0 to ``top``, the most the host and disk room allow. Past
        ``cpu_budget`` the earliest-packed offloaded families go to NVMe (the larger, slower
        tier).
      * whether the outputs the trace links to their inputs (``rebuild_from``: a GELU / SiLU /
        norm output saved by the next op) are rebuilt instead of stored (NOTE [ Rebuilt
        outputs ]): a further order variant of every column.
    A column is one (m, lead). In each column the smallest ``k`` whose predicted peak fits is
    found by bisection over ``[0, top]`` (to within 1/256 of the column); the plan is the column
    result with the smallest predicted step time (then the fewest moved bytes).

    The search is best-first: columns wait in a heap under a lower bound on their result, refined
    in stages that cost more each (the trace plus the recompute time of ``m``; then the
    back-pressure of the least ``k`` that could fit, since moving ``k`` families lowers the peak by
    at most their bytes live across it; then the whole step time at that ``k``), and are bisected
    only when their bound is the lowest; a bisection stops as soon as its bound exceeds the best
    step found. The bounds only skip work: the result is the one the full search gives, which (3)
    below needs. In a transformer the result is mostly the smallest ``m`` whose column fits at
    all, so ``m``'s ladder is fine (24 geometric steps): a coarser one costs recompute time.
    Beside the ladder, the boundary columns (the smallest ``m`` whose column's top fits, by a
    bisection over ``m``: see _boundary) join the search; that bisection runs one probe per pop
    of its heap entry, whose bound rises as the probes rule small ``m`` out.

    A larger budget never predicts a slower step, by construction:
      (1) a bisection with a fixed bracket and a fixed probe rule returns a ``k`` that never
          grows with the target, whatever shape peak(k) has: two targets take the same probes
          up to the first probe only the larger target fits; from there the larger one searches
          below that probe and the smaller one above it;
      (2) in the model, a column's step time never decreases as ``k`` grows (see below);
      (3) the columns do not depend on the budget, and one that fits keeps fitting.
    So every column's result gets no slower as the budget grows, and neither does their minimum.
    The simulator does not re-rank: it checks the chosen plan's peak (which the model bounds, see
    below) and supplies it; step times are the model's, so the guarantee holds for both sources.

    The model. Compute is the trace's timeline. Copies out form one FIFO on the D2H link in pack
    order (an NVMe record then waits for the disk FIFO); a family's device bytes are freed at the
    first event after its copy completes. Reloads are FIFO on the H2D link in the order backward
    needs them; each starts at a backward event (a module's backward start or an unpack: the only
    points the executor sees) at or before its ideal start, and never before the first such event
    after its copy out (or disk write) is done; with ``lead`` 0.0 at its first unpack.
      Time: step = trace + recompute (each checkpointed block's forward once) + back-pressure (how
      far the copies out lag behind the packs beyond ``max_inflight_bytes`` of link time; by
      default twice the family's own bytes, at least 256 MiB: the executor's bound, twice the
      largest family stored so far, is never smaller)
      + backward stall: the larger of (a) how far the reload FIFO, each reload started no earlier
      than its copy allows, finishes after a first unpack, and (b) the summed durations of the
      reloads that cannot start before their first unpack. Where copies do not overlap compute
      (CPU-only runs) every copied byte adds its time instead. Adding a family to the prefix
      only adds copies to FIFOs, delays the others' copies out, and moves no family from NVMe
      back to the host, so each term only grows: (2) above. (Every unpacked offloaded family is
      counted as reloaded, even one unpacked before its copy out completed, which in fact reuses
      its source: moving such a family buys no memory, and the model charges it its reload.)
      Memory: the trace's memory outside saved tensors, kept families from first pack to last
      use (to the step's end where the graph outlived its backward: ``Trace.retained_steps``),
      recomputed ones from the first unpack of their block, offloaded ones until their copy
      out completes and from their reload's start (to their last use, retained or not; in a step
      of several backwards, to their last use in each: NOTE [ Backward passes ] in _trace.py).
      To bound the simulator's peak from above, the D2H rate after backward begins is the shared-duplex rate, and memory is tracked over at
      most ``_MAX_FRAMES`` frames of consecutive events, an item held in part of a frame counting
      in all of it. Not modelled: what the simulator also leaves out (see NOTE [ Simulation
      model ]), duplex sharing in time, and the time shift a stall causes (which only makes
      copies out complete earlier in the step's events).

NOTE [ Rebuilt outputs ]
    A family every record of which the trace links to one other family (``TensorRecord.
    rebuild_from``: an activation's or a norm's output saved by the next Linear, linked to
    the input the function's own node saved) can be rebuilt at its first unpack instead of
    stored: one elementwise kernel on the compute stream, (input + output bytes) /
    ``pointwise_bytes_per_s`` (against two link crossings of the output's bytes, or keeping
    them). Rebuild variants of the order variants (of the first slack's) rebuild all such
    families of a column (those whose input or own block is not recomputed, and neither of them
    a recomputed block's input, which the executor holds for the recomputation; an input is
    never rebuilt itself), which then are no offload candidates. All or none: where the GELU outputs
    alone would do, the LayerNorm outputs are rebuilt too (on the synthetic GPTs at most 0.003x
    of the step slower than with GELU links only; a variant per output size would cost columns).
    Model: a rebuilt family is absent from the event after its pack until its first unpack,
    then held to its last use as before; the step gains the rebuild times (a constant
    of the column, so (2) holds); its input is needed at the earlier of its own first unpack
    and the output's, so a moved input's reload is placed and timed for that (for every column
    of the variant, also where the output is recomputed instead: its reload then starts
    earlier than it needs to). Where memory is plentiful the rebuild variant loses by its
    rebuild time and the plan stores the outputs. The extra columns cost planning time: 100,800
    records took 1.5-1.8 s at budgets of 25% and 50% against 0.9-1.2 s without them when they
    came (benchmarks/bench_plan.py, the same run); 1.06 and 0.95 s since the trace's events are
    read column by column, the link's free pass is vectorised where it takes everything, and
    the boundary search yields to the heap between probes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from offload.lifecycle._anchors import predict_anchors
from offload.lifecycle._blocks import find_blocks, within
from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._nogc import gc_paused
from offload.lifecycle._placement import Decision, Placement
from offload.lifecycle._plan import (
    BudgetInfeasibleError,
    Key,
    Plan,
    PlanEntry,
    Prediction,
    Trigger,
    _bulk,
)
from offload.lifecycle._sim_step import _step_index
from offload.lifecycle._simulate import _DEFAULT_MIN_INFLIGHT_BYTES, simulate
from offload.lifecycle._trace import (
    WHOLE_STORAGE_FACTOR,
    BackwardPasses,
    Event,
    EventKind,
    TensorRecord,
    Trace,
    with_small_casts_kept,
)
from offload.lifecycle._units import check_count, format_bytes, parse_bytes

_MIN_MARGIN_BYTES = 256 << 20  # DESIGN.md "Budget": max(5% of the budget, 256 MiB) on a GPU
_MARGIN_SHARE = 0.05
_MAX_FRAMES = 8192
_LEADS = (1.0, 0.0)
_BISECTION_STEPS = 256  # a column's k is found to within 1/256 of its candidates
_LADDER_STEPS = 12  # values of m searched, geometric above this many blocks
_LEAVES = 9  # heap stage of the boundary columns (see _Model.search)
_BOUNDARY_STEPS = 128  # the boundary m is found to within 1/128 of the blocks


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
    recompute: bool = True,
) -> Plan:
    """Plan where each activation family of one traced step waits, to fit ``gpu_budget``.

    A pure function: the same trace, budget and hardware give the same plan, and a larger budget
    never predicts a slower step. See NOTE [ Planner ] in this module for the search and the
    model.

    Args:
        trace: a recorded step (from :func:`offload.profile`, the CLI, or the manager).
        gpu_budget: device bytes the step may use, base (weights, optimizer state) included: an
            int or a size string like ``"8GiB"``.
        hardware: link and disk bandwidths (:func:`offload.probe_hardware`, or a preset).
        tiers: allowed tiers, ``"cpu"`` and/or ``"nvme"``.
        cpu_budget: host bytes the plan may hold at once (``None``: no limit).
        nvme_bytes: NVMe bytes the plan may hold at once (``None``: no limit); only with
            ``"nvme"`` in ``tiers``.
        min_offload_bytes: families smaller than this are kept (the manager's setting).
        margin: room left under the budget for what a trace cannot show. ``None``: on a CUDA
            trace, max(5% of the budget, 256 MiB) plus ``trace.metadata["reserved_excess_bytes"]``
            (DESIGN.md "Budget"); on a CPU trace 5% of the budget.
        max_inflight_bytes: the executor's bound on copies out in flight (``None``: twice the
            largest offloaded family, at least 256 MiB).
        step: which recorded step to plan for (``-1``: the last).
        simulate_records: replay the chosen plan with :func:`lifecycle.simulate` when the step
            has at most this many records (0: never); the plan then reports the simulator's peak,
            and the anchors as :func:`lifecycle.predict_anchors` simulates them (NOTE [ Anchors ]
            in ``_anchors.py``; without, the model's keep_all and checkpoint_blocks only).
        signature: a label for the plan (the manager passes the input signature).
        recompute: allow recomputing blocks (``False`` under tensor parallelism, where a
            block's forward issues collectives that recomputation would issue again).

    Returns:
        A :class:`Plan`.

    Raises:
        BudgetInfeasibleError: no plan fits ``gpu_budget - margin``; ``.min_feasible_bytes``
            says what would (with the same ``margin`` setting).
        TypeError / ValueError: a bad argument (the message names it).

    Example:
        >>> import torch, offload
        >>> from offload.lifecycle import HardwareModel, plan
        >>> nn = torch.nn
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
        >>> trace = offload.profile(lambda: model(torch.randn(512, 256)).sum().backward(), model)
        >>> budget = trace.peak_memory_bytes * 3 // 4
        >>> p = plan(trace, budget, HardwareModel.h200(), min_offload_bytes=0, margin=0)
        >>> p.predicted_peak_bytes <= budget < p.anchors["keep_all"].peak_bytes
        True
    """
    args = dict(locals())
    with gc_paused():
        return _plan(**args)


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
    recompute: bool,
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
    if nvme_bytes is not None and "nvme" not in tiers:
        # As `offload plan --nvme-bytes` refuses it: a cap on a tier the plan may not use.
        raise ValueError(
            f"nvme_bytes={nvme_bytes!r} applies only with 'nvme' in tiers, and tiers={tiers!r}: "
            "nothing goes to NVMe; add 'nvme' to tiers or leave nvme_bytes out"
        )
    floor_bytes = parse_bytes(min_offload_bytes, name="min_offload_bytes")
    check_count(simulate_records, name="simulate_records")  # 0: never simulate
    if not isinstance(signature, str):
        raise TypeError(f"signature must be a str; got {type(signature).__name__}")
    fixed_margin = None if margin is None else parse_bytes(margin, name="margin")
    inflight = (
        None
        if max_inflight_bytes is None
        else parse_bytes(max_inflight_bytes, name="max_inflight_bytes")
    )
    # A weight cast under the floor stays on the device, as the manager leaves it (NOTE
    # [ Weight casts ] in offload): counted as a kept activation, by the simulator too.
    trace = with_small_casts_kept(trace, floor_bytes)
    view = _Step(trace, _step_index(trace, step), floor_bytes)
    on_cuda = str(trace.metadata.get("device", view.device)).startswith("cuda")
    excess = int(trace.metadata.get("reserved_excess_bytes", 0) or 0) if on_cuda else 0

    def margin_for(b: int) -> int:
        if fixed_margin is not None:
            return fixed_margin
        share = int(_MARGIN_SHARE * b)
        return max(share, _MIN_MARGIN_BYTES) + excess if on_cuda else share

    margin_bytes = margin_for(budget)
    target = budget - margin_bytes
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be a bool; got {type(recompute).__name__}")
    model = _Model(view, hardware, tiers, host_cap, disk_cap, inflight, recompute=recompute)

    def infeasible(floor: int, what: str) -> BudgetInfeasibleError:
        need = _min_budget(floor, margin_for)
        return BudgetInfeasibleError(
            f"gpu_budget {format_bytes(budget)} cannot be met: with margin "
            f"{format_bytes(margin_bytes)} the step must peak at {format_bytes(target)} or less, "
            f"and {what} peaks at {format_bytes(floor)}; the smallest feasible budget is about "
            f"{format_bytes(need)}",
            budget_bytes=budget,
            min_feasible_bytes=need,
        )

    keep_all = model.evaluate(model.column(0, 1.0), 0)
    chosen = keep_all if keep_all.peak <= target else model.search(target)
    if chosen is None:
        raise infeasible(
            math.ceil(model.lowest().peak),
            f"the lowest plan the allowed tiers ({', '.join(tiers)}) and host/NVMe room permit",
        )
    source = "planner model"
    predicted = Prediction(peak_bytes=math.ceil(chosen.peak), step_s=chosen.step_s)
    simulated: dict[str, float] = {}
    simulations = 0
    if 0 < len(view.records) <= simulate_records:
        # See NOTE [ Planner ]: the model's peak bounds the simulator's, so this only confirms;
        # should it not (a model defect), the lowest plan is the fallback.
        source = "simulator"
        sim = simulate(
            trace, hardware, model.decisions(chosen), step=view.step, max_inflight_bytes=inflight
        )
        simulations += 1
        if sim.peak_bytes > target:
            chosen = model.lowest()
            sim = simulate(
                trace,
                hardware,
                model.decisions(chosen),
                step=view.step,
                max_inflight_bytes=inflight,
            )
            simulations += 1
            if sim.peak_bytes > target:
                raise infeasible(sim.peak_bytes, "the lowest plan, in simulation,")
        predicted = Prediction(peak_bytes=sim.peak_bytes, step_s=chosen.step_s)
        simulated = {"simulated_step_s": sim.step_s}
        anchors = {
            name: Prediction(peak_bytes=s.peak_bytes, step_s=s.step_s)
            for name, s in predict_anchors(
                trace,
                hardware,
                step=view.step,
                max_inflight_bytes=inflight,
                min_offload_bytes=floor_bytes,
            ).items()
        }
        simulations += len(anchors)
    else:
        anchors = model.anchors(keep_all)
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
            "simulations": simulations,
            "records": len(view.records),
            "recomputed_blocks": chosen.m,
            "rebuilt_families": len(chosen.rebuilt),
            "offloaded_families": chosen.k,
            "reload_lead": chosen.lead,
            "model_peak_bytes": math.ceil(chosen.peak),
            # The modules planned as fixed (the manager's keep=): a plan given to a manager with
            # other ones did not count their tensors where they stay.
            "kept_modules": sorted(trace.metadata.get("kept_modules") or ()),
            # A trace of global hooks (`offload profile`) names modules from root classes
            # (``GPT.blocks.0``): a manager given the plan reads them relative to its model.
            **(
                {"root_modules": list(trace.metadata["root_modules"])}
                if trace.metadata.get("root_modules")
                else {}
            ),
            **simulated,
        },
    )


def _min_budget(floor: int, margin_for: Callable[[int], int]) -> int:
    """The smallest budget ``b`` with ``b - margin_for(b) >= floor`` (the margin grows with ``b``
    no faster than ``b``)."""
    lo, hi = floor, max(floor, 1)
    while hi - margin_for(hi) < floor:
        lo, hi = hi, 2 * hi
    while lo < hi:  # invariant: hi meets the floor
        mid = (lo + hi) // 2
        if mid - margin_for(mid) >= floor:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _tiers_arg(tiers: Iterable[str]) -> tuple[str, ...]:
    if isinstance(tiers, str):
        tiers = (tiers,)
    try:
        out = tuple(tiers)
    except TypeError:
        raise TypeError(
            f"tiers must be a sequence naming 'cpu' and/or 'nvme'; got {type(tiers).__name__}"
        ) from None
    if not out or any(t not in ("cpu", "nvme") for t in out) or len(set(out)) != len(out):
        raise ValueError(f"tiers must name 'cpu' and/or 'nvme', each once; got {out!r}")
    return out


# -- the step as arrays -------------------------------------------------------------------------

_get = operator.attrgetter
_KINDS = tuple(EventKind)
_CODE = {k: i for i, k in enumerate(_KINDS)}
_BWD_START, _UNPACK = _CODE[EventKind.BACKWARD_START], _CODE[EventKind.UNPACK]


# Enum members carry their definition order as ``_sort_order_`` (CPython 3.11+): reading it costs
# about two thirds of a dict lookup per event (which hashes each str-Enum member in Python). Used
# only where it is the code below. Each column is read in its own pass: one structured
# ``fromiter`` of (time, memory, kind) tuples took 2.4x as long over the 504k events of
# bench_plan's 100k-record trace (448 ms against 187 ms, best of 7).
_SORT_ORDER = all(getattr(k, "_sort_order_", None) == i for i, k in enumerate(_KINDS))
_RECORD_FIELDS = np.dtype(
    [
        ("family", np.int64),
        ("nbytes", np.int64),
        ("storage", np.int64),
        ("pack", np.int64),
        ("param", np.bool_),
        ("backward", np.bool_),
        ("rebuild", np.int64),
        ("view", np.bool_),
    ]
)


def _event_arrays(events: Sequence[Event]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each event's time, memory probe and kind (as its index in ``EventKind``)."""
    n = len(events)
    t = np.fromiter(map(_get("time_s"), events), np.float64, n)
    memory = np.fromiter(map(_get("memory_bytes"), events), np.int64, n)
    if _SORT_ORDER:
        kinds = np.fromiter(map(_get("kind._sort_order_"), events), np.int8, n)
    else:
        kinds = np.fromiter(map(_CODE.__getitem__, map(_get("kind"), events)), np.int8, n)
    return t, memory, kinds


def _step_range(items: tuple, step: int) -> tuple[int, int]:
    """``[lo, hi)`` of the items (events or records, in step order) belonging to ``step``."""
    key = _get("step")
    return bisect.bisect_left(items, step, key=key), bisect.bisect_right(items, step, key=key)


def _diff(n: int, starts: np.ndarray, stops: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Sum of ``weights`` over positions ``0..n-1``, each item from ``starts`` to ``stops - 1``."""
    w = weights.astype(np.float64, copy=False)
    d = np.bincount(starts, w, minlength=n + 1)[: n + 1]
    d -= np.bincount(stops, w, minlength=n + 1)[: n + 1]
    return np.cumsum(d[:n])


class _Step:
    """One step of a trace as numpy arrays over its events and its alias families."""

    def __init__(self, trace: Trace, step: int, floor_bytes: int) -> None:
        self.step = step
        lo, hi = _step_range(trace.events, step)
        events = trace.events[lo:hi]
        if not events or events[0].kind is not EventKind.STEP_START:
            raise ValueError(f"step {step} of the trace has no STEP_START event")
        self.first_event = events[0].index
        # See NOTE [ Retained graphs ] in the recorder: the step's graph outlived its backward,
        # or a backward built a graph, which may hold what it unpacked, to the step's end.
        self.create_graph = step in trace.create_graph_steps
        self.retained = self.create_graph or step in trace.retained_steps
        n = len(events)
        self.n_events = n
        self.events = events
        self.t, mem, codes = _event_arrays(events)
        self.t -= self.t[0]
        self.base = int(mem[0])
        self.step_s = float(self.t[-1])
        self.codes = codes
        self.trig = np.flatnonzero((codes == _BWD_START) | (codes == _UNPACK))
        self.trig_t = self.t[self.trig]
        rlo, rhi = _step_range(trace.records, step)
        self.records = trace.records[rlo:rhi]
        self.first_seq = self.records[0].seq if self.records else 0
        self.device = self.records[0].device if self.records else "cpu"
        self._families(floor_bytes, trace.held_through)
        self._passes(trace.held_through)
        act = ~self.param
        live = _diff(n, self.fp[act], self.keep_end[act] + 1, self.nbytes[act])
        rest = np.maximum(0.0, mem - self.base - live)
        # A block holding a module whose forward updates running statistics (BatchNorm in
        # training) is never recomputed: running its forward again would update them twice.
        # Nor is one overlapping a module the manager keeps (keep=), whose saved tensors never
        # move: they are no candidates either.
        stateful = trace.metadata.get("stateful_modules") or ()
        # Nor one the model runs under a checkpoint of its own, nor one whose recomputation a
        # manager found to differ from its forward (NOTE [ Model checkpoints ] in
        # _recorder.py, NOTE [ Verified recomputation ] in offload/_verify.py), nor one that
        # writes its own input in place (checkpoint saves that input; the block inside is not
        # named and stays a candidate: the input it writes is its own, made in the block).
        unsafe = [
            *(trace.metadata.get("checkpointed_modules") or ()),
            *(trace.metadata.get("recompute_mismatch_modules") or ()),
        ]
        writes_input = trace.metadata.get("input_writing_modules") or ()
        kept = tuple(trace.metadata.get("kept_modules") or ())
        if kept:
            inside = np.fromiter((within(k[0], kept) for k in self.keys), bool, len(self.keys))
            held = np.zeros(len(self.fid), bool)
            np.logical_or.at(held, self.record_pos, inside)
            self.movable &= ~held
            self.candidate &= ~held
        blocks = find_blocks(events, codes, self.t)
        self.all_blocks = len(blocks)
        self.blocks = blocks.without([*stateful, *kept, *unsafe]).without(
            writes_input, exactly=True
        )
        # See NOTE [ Planner ]: memory is tracked over frames of consecutive events.
        nf = min(n, _MAX_FRAMES)
        self.n_frames = nf
        frame_of = (np.arange(n + 1, dtype=np.int64) * nf) // n  # frame_of[n] == nf
        self.frame_of = frame_of
        first = np.searchsorted(frame_of[:n], np.arange(nf), side="left")
        self.frame_first = first
        self.frame_first_t = self.t[first]
        # Items held over events [a, b): "touch" frames [touch_lo[a], touch_hi[b]) (any event of
        # the frame), "inner" frames [inner_lo[a], inner_hi[b]) (every event of the frame).
        self.touch_lo = frame_of
        self.touch_hi = np.concatenate([[0], frame_of[:n] + 1])
        self.inner_lo = np.concatenate([[0], frame_of[:n] + 1])
        self.inner_hi = frame_of
        self.device_base = np.maximum.reduceat(self.base + rest, first)

    def held(self, starts: np.ndarray, stops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Bytes held per frame by items held from event ``starts`` through ``stops - 1``: an
        item counts in every frame it touches (an upper bound when frames span several events)."""
        lo = self.touch_lo[starts]
        hi = np.maximum(self.touch_hi[stops], lo)
        return _diff(self.n_frames, lo, hi, nbytes)

    def freed(self, starts: np.ndarray, stops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Bytes per frame that items absent over events ``[starts, stops)`` give back: only the
        frames they are absent from throughout (a lower bound when frames span several events)."""
        lo = self.inner_lo[starts]
        hi = np.maximum(self.inner_hi[stops], lo)
        return _diff(self.n_frames, lo, hi, nbytes)

    def _families(self, floor_bytes: int, held: Callable[[int], int]) -> None:
        recs = self.records
        r = len(recs)
        first = self.first_event
        fields = np.fromiter(
            map(
                _get(
                    "family",
                    "nbytes",
                    "storage_nbytes",
                    "pack_event",
                    "is_parameter",
                    "in_backward",
                    "rebuild_from",
                    "is_view",
                ),
                recs,
            ),
            _RECORD_FIELDS,
            r,
        )
        fam, nbytes, storage = fields["family"], fields["nbytes"], fields["storage"]
        pack = fields["pack"] - first
        is_param, in_bwd = fields["param"], fields["backward"]
        unpacks = list(map(_get("unpack_events"), recs))
        counts = np.fromiter(map(len, unpacks), np.int64, r)
        flat = np.fromiter(itertools.chain.from_iterable(unpacks), np.int64, int(counts.sum()))
        flat -= first
        stops = np.cumsum(counts)
        has = counts > 0
        u_first = np.full(r, -1, np.int64)
        u_last = np.full(r, -1, np.int64)
        u_first[has] = flat[(stops - counts)[has]]
        u_last[has] = flat[stops[has] - 1]
        # Held until the node that unpacked it returns (NOTE [ Unpacks of one node ]).
        u_last[has] = [held(int(u) + first) - first for u in u_last[has]]
        self.unpacked_record = np.full(self.n_events, -1, np.int64)  # per event, for unpacks
        self.unpacked_record[flat] = np.repeat(np.arange(r), counts)
        # The storage span each record covers: the whole storage (the usual activation), nothing
        # (empty), or a view's extent from its shape and strides (the same for many views).
        start = np.zeros(r, np.int64)
        extent = np.where(nbytes == storage, nbytes, 0)
        views = np.flatnonzero((nbytes != storage) & (nbytes > 0))
        if len(views):
            start[views], extent[views] = _view_spans(
                list(map(recs.__getitem__, views.tolist())), nbytes[views]
            )
        # Families in order of first record (records are in pack order).
        _, first_rec, inverse = np.unique(fam, return_index=True, return_inverse=True)
        order = np.argsort(first_rec, kind="stable")
        position = np.empty(len(order), np.int64)
        position[order] = np.arange(len(order))
        pos = position[inverse.reshape(-1)]
        first_rec = first_rec[order]
        n_fam = len(first_rec)
        spans = extent > 0
        big = np.iinfo(np.int64).max
        lo = np.full(n_fam, big, np.int64)
        hi = np.zeros(n_fam, np.int64)
        np.minimum.at(lo, pos[spans], start[spans])
        np.maximum.at(hi, pos[spans], (start + extent)[spans])
        fu = np.full(n_fam, big, np.int64)
        fl = np.full(n_fam, -1, np.int64)
        np.minimum.at(fu, pos[has], u_first[has])
        np.maximum.at(fl, pos[has], u_last[has])
        backward = np.zeros(n_fam, bool)
        np.logical_or.at(backward, pos, in_bwd)
        self.fid = fam[first_rec]
        self.nbytes = np.where(lo < big, hi - lo, 0)
        # A first member that is a view spanning at least a quarter of its storage: the executor
        # copies the whole storage (see WHOLE_STORAGE_FACTOR), and so does Trace.families.
        whole = fields["view"][first_rec] & (
            storage[first_rec] <= WHOLE_STORAGE_FACTOR * extent[first_rec]
        )
        whole &= extent[first_rec] > 0
        self.nbytes = np.where(whole, storage[first_rec], self.nbytes)
        self.fp = pack[first_rec]
        self.fu = np.where(fu < big, fu, -1)
        self.end = np.where(fl >= 0, fl, self.n_events - 1)
        if self.create_graph:
            self.end[:] = self.n_events - 1  # brought back, held by the graph built from it
        # Where a family kept on the device is freed: after its last use, or, in a step whose
        # graph outlived its backward, at the step's end. One moved, rebuilt or recomputed is
        # freed after its last use either way (its reload buffer, rebuilt output or recomputed
        # tensor dies with autograd's use of it; a second backward makes it again).
        self.keep_end = np.full_like(self.end, self.n_events - 1) if self.retained else self.end
        self.param = is_param[first_rec]
        self.movable = ~self.param & ~backward
        self.candidate = self.movable & (self.nbytes >= max(1, floor_bytes))
        self.record_pos = pos  # family position of each record
        self.first_rec = first_rec
        self.record_pack = pack
        self.record_backward = in_bwd
        self.keys: list[Key] = list(map(_get("module", "call_index", "ordinal"), recs))
        # The family each family can be rebuilt from (every record of it rebuilt from a record
        # of that one family), or -1.
        self.rebuild_parent = np.full(n_fam, -1, np.int64)
        link = fields["rebuild"] - self.first_seq
        linked = (fields["rebuild"] >= 0) & (link >= 0) & (link < r)
        if linked.any():
            via = np.where(linked, pos[np.where(linked, link, 0)], -2)
            lo_p = np.full(n_fam, big, np.int64)
            hi_p = np.full(n_fam, -2, np.int64)
            np.minimum.at(lo_p, pos, via)
            np.maximum.at(hi_p, pos, via)
            one = (lo_p == hi_p) & (lo_p >= 0) & (lo_p != np.arange(n_fam))
            self.rebuild_parent[one] = lo_p[one]

    def _passes(self, held: Callable[[int], int]) -> None:
        """Per family, its first and last unpack in each backward pass (local events, -1: not
        counted per pass), and where each backward event's reload trigger fires again in each
        later pass (NOTE [ Backward passes ] in _trace.py). Nothing to do in a step of one
        backward, nor where a backward built a graph (it may hold what it unpacked)."""
        self.n_passes = 1
        if self.create_graph or all(len(r.unpack_events) < 2 for r in self.records):
            return  # (the common case, without building the per-unpack maps)
        passes = BackwardPasses(self.records)  # so passes.count >= 2
        n, first = passes.count, self.first_event
        n_fam = len(self.fid)
        self.n_passes = n
        self.pass_first = np.full((n, n_fam), -1, np.int64)
        self.pass_last = np.full((n, n_fam), -1, np.int64)
        members: list[list[int]] = [[] for _ in range(n_fam)]
        for r, p in zip(self.records, self.record_pos.tolist(), strict=True):
            members[p].append(r.seq)
        for p, seqs in enumerate(members):
            for k, (lo, hi) in enumerate(passes.of_family(seqs)):
                self.pass_first[k, p], self.pass_last[k, p] = lo - first, held(hi) - first
        self.again = np.full((n, len(self.trig)), -1, np.int64)
        for k in range(1, n):
            at = [passes.again(e + first, k) for e in self.trig.tolist()]
            self.again[k] = np.where(np.asarray(at) >= 0, np.asarray(at) - first, -1)

    def between_passes(
        self, fams: np.ndarray, trigger: np.ndarray, nbytes: np.ndarray
    ) -> np.ndarray:
        """Bytes per frame that families ``fams``, reloaded at local events ``trigger`` for
        their first backward pass, give back between their passes: from after their last unpack
        of a pass until their trigger fires again (else their first unpack) in the next."""
        out = np.zeros(self.n_frames)
        if self.n_passes < 2 or not len(fams):
            return out
        col = np.searchsorted(self.trig, trigger)  # a trigger is a backward event
        for k in range(1, self.n_passes):
            first = self.pass_first[k, fams]
            has = first >= 0
            start = self.pass_last[k - 1, fams] + 1
            at = self.again[k, col]
            stop = np.minimum(np.maximum(np.where(at >= 0, at, first), start), first)
            out += self.freed(start[has], stop[has], nbytes[has])
        return out


def _view_spans(views: list[TensorRecord], nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte offset and extent of the storage span each view covers (from its shape, strides
    and storage offset, in elements), over all views at once."""
    k = len(views)
    shapes = list(map(_get("shape"), views))
    dims = np.fromiter(map(len, shapes), np.int64, k)
    total = int(dims.sum())
    size = np.fromiter(itertools.chain.from_iterable(shapes), np.int64, total)
    stride = np.fromiter(itertools.chain.from_iterable(map(_get("stride"), views)), np.int64, total)
    offset = np.fromiter(map(_get("storage_offset"), views), np.int64, k)
    numel = np.ones(k, np.int64)
    reach = np.ones(k, np.int64)  # elements from the first to the last one the view touches
    some = dims > 0
    if some.any():
        first = (np.cumsum(dims) - dims)[some]
        numel[some] = np.multiply.reduceat(size, first)
        reach[some] += np.add.reduceat((size - 1) * np.abs(stride), first)
    item = nbytes // np.maximum(numel, 1)
    return offset * item, reach * item


# -- the model and the search -------------------------------------------------------------------


@dataclass
class _Candidate:
    m: int  # recomputed blocks (latest first)
    lead: float  # 1.0: reloads as late as the link allows; 0.0: at the first unpack
    k: int  # offloaded families (a prefix of the column's order)
    peak: float
    step_s: float
    moved: np.ndarray  # family positions offloaded, in pack order
    nvme: np.ndarray  # bool per moved: goes to NVMe
    trigger: np.ndarray  # local event index of each moved family's reload start (-1: none)
    rebuilt: np.ndarray  # family positions rebuilt at their first unpack


class _Column:
    """The candidates of one ``m``, as arrays in pack order, and the order they are offloaded in."""

    def __init__(self, model: _Model, m: int, variant: int) -> None:
        v = model.v
        self.m = m
        self.variant = variant
        slack, by_life, rebuild = model.variants[variant]
        self.rebuild = rebuild
        rec, unit_of = model.recomputed(m)
        self.recomputed, self.unit_of = rec, unit_of
        self.recompute_s = model.recompute_s[m]
        self.rebuilt = np.zeros(0, np.int64)
        if rebuild:
            self.rebuilt, rebuild_s = model.rebuilt(m)
            self.recompute_s += rebuild_s
        fams = model.views[rebuild][3]
        gone = model.recomputed_inputs(m)
        if len(rec) or len(gone):
            keep = np.ones(len(v.fid), bool)
            keep[rec] = False
            keep[gone] = False  # kept by checkpoint: see recomputed_inputs
            fams = fams[keep[fams]]
        self.fams = fams  # family positions, pack order
        n = len(fams)
        self.n = n
        # Offload order (see NOTE [ Planner ]): rank of each family in it.
        free = model.free_mask(fams, m, slack, rebuild)
        ahead = np.cumsum(free) - 1
        n_free = int(free.sum())
        self.rank = np.where(free, ahead, n_free + np.arange(n) - ahead - 1)
        if by_life:
            # The rest longest-lived first (a pipeline stage: each microbatch's early layers).
            rest = np.flatnonzero(~free)
            order = rest[np.argsort(-model.life[fams[rest]], kind="stable")]
            self.rank[order] = n_free + np.arange(len(order))
        self.fp = v.fp[fams]
        # Kept, a family would live to here: what moving it relieves, and how long its copy
        # stays on the host (until the graph dies: see _Step.keep_end).
        self.end = v.keep_end[fams]
        self.b = model.b[fams]
        self.base = model.base_memory(m)  # per frame, nothing offloaded
        r = self.rebuilt
        if len(r):
            # Absent from the event after its pack until it is rebuilt at its first unpack.
            stop = np.where(v.fu[r] >= 0, v.fu[r], v.end[r] + 1)
            self.base = self.base - v.freed(v.fp[r] + 1, stop, v.nbytes[r])
            if v.retained:  # and after its last use (see _Step.keep_end)
                self.base = self.base - v.freed(v.end[r] + 1, v.keep_end[r] + 1, v.nbytes[r])
        self.peak0 = float(self.base.max()) if len(self.base) else 0.0
        # Bytes of the first k (in offload order) held throughout the frame where
        # nothing-offloaded memory peaks: what offloading them can take off that peak, at most.
        f = int(np.argmax(self.base)) if len(self.base) else 0
        lo_ev = int(v.frame_first[f]) if len(self.base) else 0
        hi_ev = int(v.frame_first[f + 1]) - 1 if f + 1 < v.n_frames else v.n_events - 1
        relief = np.zeros(n, np.float64)
        across = (self.fp <= lo_ev) & (self.end >= hi_ev)
        relief[self.rank[across]] = self.b[across]
        self.cum_relief = np.cumsum(relief)
        self.top = model.room(self)

    def least_k(self, target: float) -> int:
        """A k below which no candidate of this column fits ``target``; ``n + 1``: none does."""
        need = self.peak0 - target
        if need <= 0:
            return 0
        k = int(np.searchsorted(self.cum_relief, need, side="left")) + 1
        return k if k <= self.n else self.n + 1


class _Model:
    def __init__(
        self,
        view: _Step,
        hw: HardwareModel,
        tiers: tuple[str, ...],
        host_cap: float,
        disk_cap: float,
        inflight: int | None,
        *,
        recompute: bool = True,
    ) -> None:
        v = view
        self.recompute = recompute
        self.v, self.hw, self.tiers = view, hw, tiers
        self.host_cap, self.disk_cap, self.inflight = host_cap, disk_cap, inflight
        self.blocks = view.blocks
        self.scored = 0
        self.overlap = hw.copies_overlap_compute
        b = v.nbytes.astype(np.float64)
        self.b = b
        self.d2h_s = b / hw.d2h_bytes_per_s
        self.h2d_s = b / hw.h2d_bytes_per_s
        self.read_s = b / hw.disk_read_bytes_per_s
        self.write_s = b / hw.disk_write_bytes_per_s
        # The in-flight bound each family's copy out meets, fixed per family whatever else is
        # offloaded (NOTE [ Planner ], (2)): the executor's default, twice the family, at least
        # 256 MiB (the executor's grows with the largest family stored so far: this is the
        # cautious end of it).
        order = np.argsort(v.fp, kind="stable")
        if inflight is not None:
            bound = np.maximum(float(inflight), b)
            grown = bound
        else:
            bound = np.maximum(float(_DEFAULT_MIN_INFLIGHT_BYTES), 2 * b)
            largest = np.zeros(len(b))
            picked = order[v.candidate[order]]
            if len(picked):
                largest[picked] = np.maximum.accumulate(b[picked])
            grown = np.maximum(bound, 2 * largest)
        self.slack_s = bound / hw.d2h_bytes_per_s
        # Which families the link takes without falling behind decides the offload order; two
        # orders are searched where they differ: by the bound above, and by the executor's as it
        # grows with the largest family stored so far (neither wins on every trace).
        self.order_slacks = [self.slack_s]
        if np.any(grown != bound):
            self.order_slacks.append(grown / hw.d2h_bytes_per_s)
        # Order variants: (slack, by lifetime). Past the families the link takes freely, the
        # rest go earliest packed first, which in one step's LIFO backward is longest-lived
        # first; where the two differ (a pipeline round: every microbatch's forward precedes its
        # own backward, not all backwards), longest-lived first is searched too.
        self.life = np.where(v.end >= v.fp, v.t[v.end] - v.t[v.fp], 0.0)
        self.variants = [(i, False, False) for i in range(len(self.order_slacks))]
        cand = order[v.candidate[order]]
        if len(cand) and np.any(np.diff(self.life[cand]) > 0):
            by_life = cand[np.argsort(-self.life[cand], kind="stable")]
            if not np.array_equal(by_life, cand):
                self.variants.append((0, True, False))
        self.u = np.where(v.fu >= 0, v.t[np.maximum(v.fu, 0)], np.inf)
        both = hw.h2d_bytes_per_s + hw.d2h_bytes_per_s
        self.duplex = 1.0 if hw.duplex_bytes_per_s >= both else hw.duplex_bytes_per_s / both
        self.t0 = float(v.trig_t[0]) if len(v.trig) else math.inf  # backward's first event
        # What an evaluation gathers per offloaded family: pack time, bytes, D2H / H2D / disk
        # read / disk write seconds, back-pressure slack, first-unpack time; first-unpack event,
        # the first backward event after the pack, the first frame after it.
        self.floats = np.stack(
            [v.t[v.fp], b, self.d2h_s, self.h2d_s, self.read_s, self.write_s, self.slack_s, self.u]
        )
        self.ints = np.stack(
            [v.fu, np.searchsorted(v.trig, v.fp + 1, side="left"), v.inner_lo[v.fp + 1]]
        )
        # Recompute units, latest block first: the movable families first packed inside a
        # block, except its first (the block's input, which checkpoint keeps).
        movable = order[v.movable[order]]
        first_pack = v.fp[movable]
        lo = np.searchsorted(first_pack, self.blocks.start, side="left") + 1
        hi = np.maximum(np.searchsorted(first_pack, self.blocks.end, side="right"), lo)
        self._movable_by_pack = movable
        self._unit_lo, self._unit_hi = lo, hi  # ranges of movable_by_pack, per block
        # Each block's first family (-1: none packed inside it). Under checkpoint it is saved
        # again as the call's input, which the executor keeps on the device: with its block
        # recomputed it is neither moved nor rebuilt (see recomputed_inputs).
        inside = lo - 1 < np.searchsorted(first_pack, self.blocks.end, side="right")
        self._unit_input = np.where(inside, movable[np.minimum(lo - 1, len(movable) - 1)], -1)
        self.recompute_s = [0.0, *itertools.accumulate(reversed(self.blocks.duration_s))]
        self.pack_order = order[v.candidate[order]]
        unpacked = np.flatnonzero(v.fu >= 0)
        use_order = unpacked[np.argsort(v.fu[unpacked], kind="stable")]
        # Per rebuild flag: gathered facts, use order, offload candidates (see NOTE [ Rebuilt
        # outputs ]).
        self.views = {False: (self.floats, self.ints, use_order, self.pack_order)}
        self._rebuild_times: dict[int, float] = {}
        self._rebuildable(hw)
        self._index = np.zeros(len(v.fid), np.int64)  # scratch: family position -> index
        # Nothing offloaded, nothing recomputed: the trace's memory, per frame.
        act = ~v.param
        self._base0 = v.device_base + v.held(v.fp[act], v.keep_end[act] + 1, v.nbytes[act])
        self._unit_start: np.ndarray | None = None
        self._columns: dict[tuple[int, int], _Column] = {}
        self._recomputed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._tops: dict[tuple[int, float, int], _Candidate] = {}
        self._free_prefix: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}
        # Without recompute the search stays on m = 0 (the anchors still use every block).
        self.ladder = _ladder(len(self.blocks)) if recompute else [0]

    def _rebuildable(self, hw: HardwareModel) -> None:
        """The families a plan may rebuild instead of storing (NOTE [ Rebuilt outputs ]), the
        ones each is rebuilt from, the rebuild times, and the facts rebuild variants score with."""
        v = self.v
        parent = v.rebuild_parent
        outputs = np.flatnonzero(parent >= 0)
        outputs = outputs[v.candidate[outputs] & v.movable[parent[outputs]]]
        is_output = np.zeros(len(v.fid), bool)
        is_output[outputs] = True
        outputs = outputs[~is_output[parent[outputs]]]  # an input is not rebuilt itself
        self.outputs, self.inputs = outputs, parent[outputs]
        self.rebuild_s = (self.b[outputs] + self.b[self.inputs]) / hw.pointwise_bytes_per_s
        if not len(outputs):
            return
        is_output[:] = False
        is_output[outputs] = True
        # With the first slack's order only: with the grown bound's order as well, the synthetic
        # GPTs that have both orders (h=4096 x 8 layers, h=8192 x 6) got the same step at every
        # budget tried (20-75% of their saved bytes), with more columns to score.
        self.variants += [(0, by_life, True) for slack, by_life, _ in self.variants if slack == 0]
        # An input is needed at its own first unpack or at its output's, whichever is first.
        big = np.iinfo(np.int64).max
        fu = np.where(v.fu >= 0, v.fu, big)
        np.minimum.at(fu, self.inputs, fu[outputs])
        fu = np.where(fu < big, fu, -1)
        floats, ints = self.floats.copy(), self.ints.copy()
        floats[7] = np.where(fu >= 0, v.t[np.maximum(fu, 0)], np.inf)
        ints[0] = fu
        unpacked = np.flatnonzero(fu >= 0)
        use_order = unpacked[np.argsort(fu[unpacked], kind="stable")]
        self.views[True] = (floats, ints, use_order, self.pack_order[~is_output[self.pack_order]])

    def rebuild_time(self, m: int, variant: int) -> float:
        """Seconds the rebuilds of column ``(m, variant)`` add to the step (0.0 without)."""
        if not self.variants[variant][2]:
            return 0.0
        got = self._rebuild_times.get(m)
        if got is None:
            got = self._rebuild_times[m] = self.rebuilt(m)[1]
        return got

    def rebuilt(self, m: int) -> tuple[np.ndarray, float]:
        """The families rebuilt with the last ``m`` blocks recomputed (neither they nor their
        inputs recomputed, nor either a recomputed block's input: the executor holds that one
        for the recomputation, and its pack returns no kept tensor to rebuild from), and the
        seconds their rebuilds take."""
        gone = np.zeros(len(self.v.fid), bool)
        gone[self.recomputed(m)[0]] = True
        ok = ~gone[self.outputs] & ~gone[self.inputs]
        gone[:] = False
        gone[self.recomputed_inputs(m)] = True
        ok &= ~gone[self.outputs] & ~gone[self.inputs]
        return self.outputs[ok], float(self.rebuild_s[ok].sum())

    # -- columns ---------------------------------------------------------------------------

    def column(self, m: int, lead: float, variant: int = 0) -> tuple[_Column, float]:
        col = self._columns.get((m, variant))
        if col is None:
            col = self._columns[(m, variant)] = _Column(self, m, variant)
        return col, lead

    def recomputed(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Families recomputed with the last ``m`` blocks checkpointed, and each one's block
        (0: the last block)."""
        got = self._recomputed.get(m)
        if got is not None:
            return got
        nb = len(self.blocks)
        if m == 0:
            got = np.zeros(0, np.int64), np.zeros(0, np.int64)
        else:
            lo, hi = self._unit_lo[nb - m :][::-1], self._unit_hi[nb - m :][::-1]
            sizes = hi - lo
            offsets = np.repeat(lo - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
            index = np.arange(int(sizes.sum()), dtype=np.int64) + offsets
            got = self._movable_by_pack[index], np.repeat(np.arange(m, dtype=np.int64), sizes)
        self._recomputed[m] = got
        return got

    def recomputed_inputs(self, m: int) -> np.ndarray:
        """The first family of each of the last ``m`` blocks: the block's input, which
        non-reentrant checkpoint saves again as the call's input and the executor keeps (its
        packs under the recomputed call's key). Kept in the plan too: moved or rebuilt there, a
        plan held that many bytes fewer than its step (a recomputed block whose input the plan
        sent to the host: 16 KiB over the predicted peak)."""
        if m == 0:
            return np.zeros(0, np.int64)
        inputs = self._unit_input[len(self.blocks) - m :]
        return inputs[inputs >= 0]

    def base_memory(self, m: int) -> np.ndarray:
        """Device bytes per frame with ``m`` blocks checkpointed and nothing offloaded."""
        if m == 0:
            return self._base0
        v = self.v
        rec, unit = self.recomputed(m)
        if self._unit_start is None:
            # Each block's recomputation starts at the first unpack of one of its families.
            nb = len(self.blocks)
            all_rec, all_unit = self.recomputed(nb)
            fu = v.fu[all_rec]
            first = np.full(nb, v.n_events, np.int64)
            ok = fu >= 0
            np.minimum.at(first, all_unit[ok], fu[ok])
            self._unit_start = first
        start = self._unit_start[unit]  # unit 0 is the last block for every m
        start = np.minimum(np.where(v.fu[rec] >= 0, start, v.n_events), v.end[rec] + 1)
        # A recomputed family is absent from its first pack until its block runs again (and,
        # see _Step.keep_end, after its last use).
        base = self._base0 - v.freed(v.fp[rec], start, v.nbytes[rec])
        if v.retained:
            base = base - v.freed(v.end[rec] + 1, v.keep_end[rec] + 1, v.nbytes[rec])
        return base

    def free_mask(self, fams: np.ndarray, m: int, slack: int, rebuild: bool) -> np.ndarray:
        """Per family of ``fams`` (pack order): whether the D2H link takes it without falling
        behind the packs by more than the in-flight bound, given the ones taken before it. Those
        are offloaded first (see NOTE [ Planner ])."""
        hw = self.hw
        if not (self.overlap and len(fams) and math.isfinite(hw.d2h_bytes_per_s)):
            return np.ones(len(fams), bool)
        # The pass over the families before the first recomputed one is the same for every m:
        # run it once over all candidates and resume from there.
        order = self.views[rebuild][3]
        if (slack, rebuild) not in self._free_prefix:
            self._free_prefix[(slack, rebuild)] = self._free_pass(order, 0.0, slack)
        free0, done0 = self._free_prefix[(slack, rebuild)]
        if m == 0:
            return free0
        rec = np.concatenate([self.recomputed(m)[0], self.recomputed_inputs(m)])
        cut = len(fams)
        if len(rec):
            cut = int(np.searchsorted(self.v.fp[order], self.v.fp[rec].min()))
        cut = min(cut, len(fams))  # fams[:cut] == order[:cut]
        done = float(done0[cut - 1]) if cut else 0.0
        tail, _ = self._free_pass(fams[cut:], done, slack)
        return np.concatenate([free0[:cut], tail])

    def _free_pass(
        self, fams: np.ndarray, done: float, slack: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per family (pack order): taken by the link within its slack, given the link is busy
        until ``done`` with the families taken before; and the busy-until time after each."""
        dur = self.d2h_s[fams]
        packed = self.v.t[self.v.fp[fams]]
        # Taken iff the link is free by pack + slack - duration (the slack is at least the
        # duration, so an idle link never refuses).
        latest_s = packed + self.order_slacks[slack][fams] - dur
        # Where the link takes every one (the blocks' inputs past the first recomputed family,
        # say) one vectorised FIFO says so; else one pass in order, as each depends on the last.
        cum = np.cumsum(dur)
        finish = np.maximum(np.maximum.accumulate(packed - (cum - dur)), done) + cum
        if len(fams) and done <= latest_s[0] and np.all(finish[:-1] <= latest_s[1:]):
            return np.ones(len(fams), bool), finish
        latest = latest_s.tolist()
        free = [False] * len(latest)
        busy_from = done
        for i, (last, tp, d) in enumerate(zip(latest, packed.tolist(), dur.tolist(), strict=True)):
            if done <= last:
                free[i] = True
                done = (done if done > tp else tp) + d
        taken = np.asarray(free, bool)
        # Busy-until after each family: the FIFO of the ones taken, from ``done`` on.
        d = np.where(taken, dur, 0.0)
        cum = np.cumsum(d)
        start = np.where(taken, packed, -math.inf)
        return taken, np.maximum(np.maximum.accumulate(start - (cum - d)), busy_from) + cum

    # -- room on the host and the disk -----------------------------------------------------

    def room(self, col: _Column) -> int:
        """The largest k whose families the host and disk room can hold (more never fits less)."""
        if not (math.isfinite(self.host_cap) or math.isfinite(self.disk_cap)):
            return col.n
        if self._fits(col, col.n):
            return col.n
        lo, hi = 0, col.n  # invariant: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits(col, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _fits(self, col: _Column, k: int) -> bool:
        return self._tiers_for(col, np.flatnonzero(col.rank < k))[1]

    def _tiers_for(self, col: _Column, moved: np.ndarray) -> tuple[np.ndarray, bool]:
        """Per moved family (positions in ``col``, pack order): NVMe or not; and whether host and
        disk room suffice. The host first; past ``cpu_budget``, the earliest packed go to NVMe
        (a time threshold, so a larger k never sends a family back to the host)."""
        nvme = np.zeros(len(moved), bool)
        if "cpu" not in self.tiers:
            nvme[:] = True
        ok = True
        if (
            "cpu" in self.tiers
            and len(moved)
            and math.isfinite(self.host_cap)
            and self._resident_peak(col, moved) > self.host_cap
        ):
            if "nvme" not in self.tiers:
                return nvme, False
            lo, hi = 0, len(moved)
            while lo < hi:  # the fewest earliest-packed families sent to NVMe
                mid = (lo + hi) // 2
                if self._resident_peak(col, moved[mid:]) <= self.host_cap:
                    hi = mid
                else:
                    lo = mid + 1
            nvme[:lo] = True
        if nvme.any() and math.isfinite(self.disk_cap):
            ok = self._resident_peak(col, moved[nvme]) <= self.disk_cap
        return nvme, ok

    def _resident_peak(self, col: _Column, moved: np.ndarray) -> float:
        """Peak bytes held off the device by ``moved`` (from pack to last use; per frame, so at
        most what a finer count would give)."""
        if not len(moved):
            return 0.0
        return float(np.max(self.v.held(col.fp[moved], col.end[moved] + 1, col.b[moved])))

    # -- scoring ---------------------------------------------------------------------------

    def evaluate(self, column: tuple[_Column, float], k: int, *, memory: bool = True) -> _Candidate:
        """Predicted step time (and, with ``memory``, peak) offloading the first ``k``
        families of ``column``'s offload order. See NOTE [ Planner ]."""
        self.scored += 1
        col, lead = column
        v = self.v
        step_s = v.step_s + col.recompute_s
        none = np.zeros(0, np.int64)
        if k == 0:
            return _Candidate(
                col.m, lead, 0, col.peak0, step_s, none, none.astype(bool), none, col.rebuilt
            )
        sel = np.flatnonzero(col.rank < k)  # moved families (positions in col), pack order
        fam = col.fams[sel]
        nvme, _ = self._tiers_for(col, sel)
        floats, ints, use_order, _ = self.views[col.rebuild]
        tp, b, d2h, h2d, read, write, slack, u_all = np.take(floats, fam, axis=1)
        fu_all, trig_after_pack, frame_after_pack = np.take(ints, fam, axis=1)
        if self.overlap:
            cum = np.cumsum(d2h)
            c = np.maximum.accumulate(tp - (cum - d2h)) + cum  # copy-out completions, FIFO
            step_s += max(0.0, float(np.max(c - tp - slack)))
        else:
            c = tp
        # For memory only (an upper bound on when a copy out completes): once reloads may run,
        # D2H may get only its share of the duplex rate. Reloads are placed by the full rate:
        # one asked for before its copy completes simply waits for it (NOTE [ Reload policy ]).
        c_memory = c
        if self.overlap and self.duplex < 1.0:
            late = c > self.t0
            c_memory = c.copy()
            c_memory[late] = self.t0 + (c[late] - self.t0) / self.duplex
        # c does not decrease along pack order: only the copies completing in backward need a
        # search for the first backward event after them.
        trig, n_trig = v.trig, len(v.trig)
        nxt = np.zeros(len(sel), np.int64)
        late_from = int(np.searchsorted(c, self.t0, side="right"))
        nxt[late_from:] = np.searchsorted(v.trig_t, c[late_from:], side="left")
        nxt = np.maximum(nxt, trig_after_pack)  # and not before the pack
        avail = c
        rd = h2d
        if nvme.any():
            avail = c.copy()
            w_cum = np.cumsum(write[nvme])
            avail[nvme] = np.maximum.accumulate(c[nvme] - (w_cum - write[nvme])) + w_cum
            rd = h2d + np.where(nvme, read, 0.0)
        # Reloads: every unpacked moved family, in the order backward needs them.
        member = np.zeros(len(v.fid), bool)
        member[fam] = True
        index = self._index
        index[fam] = np.arange(len(fam))
        at = index[use_order[member[use_order]]]  # into sel, use order
        u = u_all[at]
        do = rd[at]
        if self.overlap:
            if len(at):
                after = np.where(nxt < n_trig, v.trig_t[np.minimum(nxt, n_trig - 1)], math.inf)
                # When each reload can start at the earliest (lead 0.0: at its first unpack).
                ready = u if lead == 0.0 else np.minimum(np.maximum(avail, after)[at], u)
                cum = np.cumsum(do)
                fin = np.maximum.accumulate(ready - (cum - do)) + cum
                late = max(0.0, float(np.max(fin - u)))
                step_s += max(late, float(do[ready >= u].sum()))
        else:
            step_s += float(d2h.sum()) + float(do.sum())
            if v.n_passes > 1:  # each later backward pass reloads again
                again = (v.pass_first[1:, fam] >= 0).sum(axis=0)
                step_s += float((rd * again).sum())
        if not memory:
            return _Candidate(
                col.m, lead, k, math.nan, step_s, none, none.astype(bool), none, col.rebuilt
            )
        # Memory: each moved family is absent from its copy's completion to its reload's start.
        trigger = np.full(len(sel), -1, np.int64)
        away = (fu_all < 0) | (c < u_all)
        if len(at):
            if self.overlap and lead != 0.0:
                # As late as the link allows, counting only the reloads that happen (a family
                # unpacked before its copy out completes uses its source). The step time above
                # counts them all, which keeps it monotone in k; the start times only place
                # reloads, and so only change memory.
                busy = np.where(away[at], do, 0.0)
                rc = np.cumsum(busy[::-1])[::-1]  # durations from each reload to the last
                following = np.append(rc[1:], 0.0)
                start = np.minimum.accumulate((u + following)[::-1])[::-1] - rc
            else:
                start = u
            fu = fu_all[at]
            pos = np.searchsorted(v.trig_t, start, side="right") - 1
            ev = np.minimum(trig[np.maximum(pos, 0)], fu)
            first_after = np.where(nxt < n_trig, trig[np.minimum(nxt, n_trig - 1)], v.n_events)
            ev = np.maximum(ev, first_after[at])
            back = away[at] & (ev <= fu)
            trigger[at[back]] = ev[back]
            away[at[~back]] = False
        # In frames: absent from the first frame after the copy out through the frame before the
        # reload (see _Step.freed).
        first_frame = np.searchsorted(v.frame_first_t, c_memory, side="left")
        lo = np.maximum(first_frame, frame_after_pack)[away]
        hi = v.inner_hi[np.where(trigger >= 0, trigger, v.n_events)][away]
        freed = _diff(v.n_frames, lo, np.maximum(hi, lo), b[away])
        if v.retained:
            # A reloaded family is freed after its last use, not kept to the step's end.
            back = trigger >= 0
            freed += v.freed(v.end[fam[back]] + 1, v.keep_end[fam[back]] + 1, b[back])
            # And after its last use in each backward pass (NOTE [ Backward passes ]).
            freed += v.between_passes(fam[back], trigger[back], b[back])
        peak = float(np.max(col.base - freed))
        return _Candidate(col.m, lead, k, peak, step_s, fam, nvme, trigger, col.rebuilt)

    # -- the search ------------------------------------------------------------------------

    def search(self, target: float) -> _Candidate | None:
        """The fastest column result that fits ``target`` (see NOTE [ Planner ])."""
        best: _Candidate | None = None
        bound = math.inf  # the step time of a feasible candidate seen: the result is no slower
        # Heap entries: (lower bound, stage, tie-break, m, lead, order variant). Columns' bounds
        # are refined in stages, each costlier than the last: 0, the trace plus the recompute
        # time; 1, plus the copies out of the least k that could fit (the same for both leads);
        # 2, lead 1.0's step at that k (lead 0.0's steps are no shorter); 3, the column's own
        # step at that k; then the column is bisected. Stage _LEAVES: the search for the
        # boundary columns above m (see _next_leaf), one probe per pop, its bound raised as
        # the probes rule out small m.
        heap: list[tuple[float, int, int, int, float, int]] = []
        queued: set[tuple[int, float, int]] = set()
        tie = itertools.count()
        variants = range(len(self.variants))
        nb = len(self.blocks)
        leaf_work: dict[int, Generator[int, None, int | None]] = {}  # by tie-break

        def leaves_above(m: int, lead: float, low: float) -> None:
            order = next(tie)
            leaf_work[order] = self._next_leaf(target, m, lead)
            heapq.heappush(heap, (low, _LEAVES, order, m, lead, 0))

        def queue(m: int, lead: float) -> None:
            for variant in variants:
                if (m, lead, variant) not in queued:
                    queued.add((m, lead, variant))
                    low = self.v.step_s + self.recompute_s[m] + self.rebuild_time(m, variant)
                    heapq.heappush(heap, (low, 0, next(tie), m, lead, variant))

        for m in self.ladder:
            for lead in _LEADS:
                queue(m, lead)
        # m = 0 is on the ladder: the boundary columns worth adding start above it.
        if self.recompute:
            leaves_above(0, _LEADS[0], self.v.step_s + self.recompute_s[min(1, nb)])
        copies_out: dict[tuple[int, int], float] = {}  # (m, variant) -> stage 1's bound
        first_lead: dict[tuple[int, int], float] = {}  # (m, variant) -> lead 1.0's stage 3
        while heap:
            low, stage, order, m, lead, variant = heapq.heappop(heap)
            if low > bound:
                break
            if stage == _LEAVES:
                work = leaf_work.pop(order)
                try:
                    least = next(work)  # one probe; the least m the leaf can still be
                except StopIteration as done:
                    leaf = done.value
                    if leaf is not None:
                        queue(leaf, lead)
                        if leaf < nb:
                            leaves_above(leaf, lead, self.v.step_s + self.recompute_s[leaf + 1])
                    continue
                order = next(tie)
                leaf_work[order] = work
                low = max(low, self.v.step_s + self.recompute_s[min(least, nb)])
                heapq.heappush(heap, (low, _LEAVES, order, m, lead, 0))
                continue
            column = self.column(m, lead, variant)
            col = column[0]
            least = col.least_k(target)
            if least > col.top:
                continue  # not even every family the room allows fits
            key = (m, variant)
            if stage == 0:
                if key not in copies_out:
                    copies_out[key] = self._copies_out_bound(col, least)
                stage, low = 1, max(low, copies_out[key])
            elif stage == 1:
                if lead != _LEADS[0] and key in first_lead:
                    stage, low = 2, max(low, first_lead[key])
                else:
                    stage = 3
                    if least > 0:
                        low = max(low, self.evaluate(column, least, memory=False).step_s)
                    if lead == _LEADS[0]:
                        first_lead[key] = low
            elif stage == 2:
                stage = 3
                if least > 0:
                    low = max(low, self.evaluate(column, least, memory=False).step_s)
            else:
                found = self._bisect(column, target, least, low, bound)
                if found is not None:
                    bound = min(bound, found.step_s)
                    if best is None or _better(found, best, self.v):
                        best = found
                continue
            heapq.heappush(heap, (low, stage, next(tie), m, lead, variant))
        return best

    def _next_leaf(
        self, target: float, after: int, lead: float
    ) -> Generator[int, None, int | None]:
        """Returns the smallest ``m`` above ``after`` that a boundary bisection returns for some
        target at most ``target`` (see _boundary); ``None``: there is none. A generator, run one
        probe at a time: before each it yields the least ``m`` the result can still be (above
        ``after``; at least the bisection's lower bracket, as later bisections, for smaller
        targets, return no smaller ``m``), a bound the search weighs this work by."""
        t = target
        while True:
            leaf, flips = yield from self._boundary(t, lead, after + 1)
            if leaf is None:
                return None
            if leaf > after:
                return leaf
            # Below the largest fitting peak on its path, the bisection turns right there.
            t = max(flips) - 0.5

    def _boundary(
        self, target: float, lead: float, least: int
    ) -> Generator[int, None, tuple[int | None, list[float]]]:
        """Returns the smallest ``m`` whose column's top fits ``target``, by bisection over all
        ``m`` with a fixed bracket and probe rule (to within 1/_BOUNDARY_STEPS of the blocks),
        and the peaks that fitted on the way; yields before each probe (see _next_leaf). The
        result never grows with the target; the set of results for all targets up to a budget
        only grows with it, so its columns may join the search."""
        nb = len(self.blocks)
        yield least
        peak = self._top(nb, lead).peak
        if peak > target:
            return None, []
        fitted = [peak]
        lo, hi = 0, nb  # invariant: hi fits
        tolerance = max(1, nb // _BOUNDARY_STEPS)
        while hi - lo >= tolerance and lo < hi:
            yield max(least, lo)  # the result is at least lo
            mid = (lo + hi) // 2
            col = self.column(mid, lead)[0]
            # Known not to fit without scoring it when even all its room cannot relieve the peak.
            fits = col.least_k(target) <= col.top and self._top(mid, lead).peak <= target
            if fits:
                hi = mid
                fitted.append(self._top(mid, lead).peak)
            else:
                lo = mid + 1
        return hi, fitted

    def _top(self, m: int, lead: float, variant: int = 0) -> _Candidate:
        """Column ``(m, lead)`` with every family the room allows offloaded (kept for reuse)."""
        got = self._tops.get((m, lead, variant))
        if got is None:
            column = self.column(m, lead, variant)
            got = self._tops[(m, lead, variant)] = self.evaluate(column, column[0].top)
        return got

    def _copies_out_bound(self, col: _Column, k: int) -> float:
        """A lower bound on the step time of ``col``'s first ``k`` families offloaded: the trace,
        the recompute time, and the copies out (their back-pressure, or their time where copies
        do not overlap compute)."""
        step_s = self.v.step_s + col.recompute_s
        if k == 0:
            return step_s
        fam = col.fams[col.rank < k]
        d2h = self.d2h_s[fam]
        if not self.overlap:
            return step_s + float(d2h.sum())
        tp = self.floats[0][fam]
        cum = np.cumsum(d2h)
        c = np.maximum.accumulate(tp - (cum - d2h)) + cum
        return step_s + max(0.0, float(np.max(c - tp - self.slack_s[fam])))

    def _bisect(
        self,
        column: tuple[_Column, float],
        target: float,
        least: int,
        low: float,
        bound: float,
    ) -> _Candidate | None:
        """The column's smallest k that fits, by bisection over ``[0, top]``; ``None`` when the
        top does not fit, or when the result cannot beat ``bound`` (``low`` bounds it below)."""
        col = column[0]
        top = self._top(col.m, column[1], col.variant)
        if top.peak > target:
            return None
        best = top
        bound = min(bound, top.step_s)
        lo, hi = 0, col.top  # invariant: hi fits
        tolerance = max(1, col.top // _BISECTION_STEPS)
        while hi - lo >= tolerance and lo < hi:
            mid = (lo + hi) // 2
            if mid < least:
                lo = mid + 1  # known not to fit: see _Column.least_k
                continue
            c = self.evaluate(column, mid)
            if c.peak <= target:
                hi, best = mid, c
                bound = min(bound, c.step_s)
            else:
                lo = mid + 1
                low = max(low, c.step_s)  # the result has more families: it is no faster
                if low > bound:
                    return None
        return best

    def lowest(self) -> _Candidate:
        """The least-memory candidate: every family the room allows offloaded, reloads at first
        use, on the ``m`` that peaks lowest."""
        best = None
        for m in self.ladder:
            for variant in range(len(self.variants)):
                c = self._top(m, 0.0, variant)
                if best is None or c.peak < best.peak:
                    best = c
        assert best is not None
        return best

    def anchors(self, keep_all: _Candidate) -> dict[str, Prediction]:
        """The anchors this model predicts as :func:`lifecycle.predict_anchors` defines them
        (NOTE [ Anchors ]): keeping everything, and checkpointing every block when the planner
        may recompute every one. Offloading everything is min-memory mode, whose reloads follow
        the executor's look-ahead window, which this model does not have: left out."""
        out = {"keep_all": Prediction(peak_bytes=math.ceil(keep_all.peak), step_s=keep_all.step_s)}
        if len(self.blocks) == self.v.all_blocks:
            c = self.evaluate(self.column(len(self.blocks), 1.0), 0)
            out["checkpoint_blocks"] = Prediction(peak_bytes=math.ceil(c.peak), step_s=c.step_s)
        return out

    # -- the plan out of a candidate ---------------------------------------------------------

    def decisions(self, c: _Candidate) -> dict[int, Decision]:
        return {
            e.family: e.decision() for e in self.entries(c) if e.placement is not Placement.KEEP
        }

    def entries(self, c: _Candidate) -> tuple[PlanEntry, ...]:
        v = self.v
        n_fam = len(v.fid)
        # Per family: 0 keep, 1 cpu, 2 nvme, 3 recompute, 4 rebuild; reload event; recompute
        # block.
        kind = np.zeros(n_fam, np.int8)
        kind[c.rebuilt] = 4
        kind[c.moved] = np.where(c.nvme, 2, 1)
        event = np.full(n_fam, -1, np.int64)
        event[c.moved] = c.trigger
        unit = np.full(n_fam, -1, np.int64)
        if c.m:
            recomputed, unit_of = self.recomputed(c.m)
            kind[recomputed] = 3
            unit[recomputed] = unit_of
        names = [*reversed(self.blocks.module), ""]  # unit -1: ""
        placements = (
            Placement.KEEP,
            Placement.CPU,
            Placement.NVME,
            Placement.RECOMPUTE,
            Placement.REBUILD,
        )
        positions = np.flatnonzero(v.movable)
        event = event[positions]
        triggers: dict[int, Trigger | None] = {-1: None}
        triggers.update(self._triggers(np.unique(event[event >= 0])))
        keys = self._family_keys(positions)
        first = operator.itemgetter(0)
        # Valid by construction (see _bulk): every field below is of its declared type.
        entries = _bulk(
            PlanEntry,
            len(positions),
            {
                "family": v.fid[positions].tolist(),
                "keys": keys,
                "nbytes": v.nbytes[positions].tolist(),
                "module": map(first, map(first, keys)),
                "placement": map(placements.__getitem__, kind[positions].tolist()),
                "reload": map(triggers.__getitem__, event.tolist()),
                "reload_event": np.where(event >= 0, event + v.first_event, -1).tolist(),
                "recompute_module": map(names.__getitem__, unit[positions].tolist()),
            },
        )
        return tuple(entries)

    def _family_keys(self, positions: np.ndarray) -> list[tuple[Key, ...]]:
        """Record keys of the families at ``positions``, in pack order."""
        v = self.v
        keys = v.keys
        out: list[tuple[Key, ...]] = list(zip(map(keys.__getitem__, v.first_rec.tolist())))
        # Families of several records (views of one storage): their records, grouped.
        members = np.bincount(v.record_pos, minlength=len(out))
        shared = np.flatnonzero(members[v.record_pos] > 1)
        if len(shared):
            grouped = shared[np.argsort(v.record_pos[shared], kind="stable")]
            owners = v.record_pos[grouped]
            starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
            stops = np.r_[starts[1:], len(grouped)]
            ordered = list(map(keys.__getitem__, grouped.tolist()))
            for pos, lo, hi in zip(
                owners[starts].tolist(), starts.tolist(), stops.tolist(), strict=True
            ):
                out[pos] = tuple(ordered[lo:hi])
        return list(map(out.__getitem__, positions.tolist()))

    def _triggers(self, local_events: np.ndarray) -> dict[int, Trigger]:
        """The executor's name for each of ``local_events`` (backward starts and unpacks)."""
        v = self.v
        unpack = v.codes[local_events] == _UNPACK
        # An unpack is named by its record's key, a backward start by its module call.
        at_unpack = local_events[unpack]
        keys = list(map(v.keys.__getitem__, v.unpacked_record[at_unpack].tolist()))
        at_call = local_events[~unpack]
        calls = list(map(_get("module", "call_index"), map(v.events.__getitem__, at_call.tolist())))
        # Valid by construction: kinds are "backward" (ordinal -1) or "unpack".
        made = _bulk(
            Trigger,
            len(keys),
            {
                "kind": itertools.repeat("unpack"),
                "module": map(operator.itemgetter(0), keys),
                "call_index": map(operator.itemgetter(1), keys),
                "ordinal": map(operator.itemgetter(2), keys),
            },
        ) + _bulk(
            Trigger,
            len(calls),
            {
                "kind": itertools.repeat("backward"),
                "module": map(operator.itemgetter(0), calls),
                "call_index": map(operator.itemgetter(1), calls),
                "ordinal": itertools.repeat(-1),
            },
        )
        return dict(zip([*at_unpack.tolist(), *at_call.tolist()], made, strict=True))

    def recompute_calls(self, c: _Candidate) -> tuple[tuple[str, int], ...]:
        first = len(self.blocks) - c.m
        blocks = self.blocks
        return tuple(zip(blocks.module[first:], blocks.call_index[first:], strict=True))

    def expected_keys(self, c: _Candidate) -> tuple[Key, ...]:
        v = self.v
        packs = v.record_pack
        # Blocks are disjoint and sorted: the one starting last at or before a pack is the only
        # one that can hold it.
        show = ~v.record_backward
        if c.m:
            first = len(self.blocks) - c.m
            starts, ends = self.blocks.start[first:], self.blocks.end[first:]
            i = np.searchsorted(starts, packs, side="right") - 1
            show &= ~((i >= 0) & (packs <= ends[np.maximum(i, 0)]))
        return tuple(itertools.compress(v.keys, show.tolist()))


def _better(a: _Candidate, b: _Candidate, v: _Step) -> bool:
    """Faster; then fewer bytes moved; then fewer blocks recomputed."""
    if a.step_s != b.step_s:
        return a.step_s < b.step_s
    moved_a, moved_b = int(v.nbytes[a.moved].sum()), int(v.nbytes[b.moved].sum())
    if moved_a != moved_b:
        return moved_a < moved_b
    return (a.m, -a.lead) < (b.m, -b.lead)


def _ladder(n: int) -> list[int]:
    """The ``m`` values searched: every one up to ``_LADDER_STEPS``, else 0 and about that many
    geometric steps from 1 up to n (n itself included)."""
    if n <= _LADDER_STEPS:
        return list(range(n + 1))
    ratio = n ** (1 / _LADDER_STEPS)
    out, m = [0], 1.0
    while m < n:
        if int(m) != out[-1]:
            out.append(int(m))
        m *= ratio
    out.append(n)
    return out
