"""``lifecycle.plan()``: choose, per alias family, where it waits so the step fits a memory budget.
Here: its arguments and the Plan built from the chosen candidate (model, cost, search: _plan_*.py).

NOTE [ Planner ]
    The planner searches a small, structured space and scores points with a closed-form model of
    the step (below): 0.7-1.3 s for 100k records on a slow 2-core VM (its speed moves that much
    from one run to the next), most of it reading the trace's objects and building the plan's
    (benchmarks/bench_plan.py). When the trace is small enough (``simulate_records``) the chosen
    plan is then replayed by the discrete-event simulator (:func:`lifecycle.simulate`), whose
    peak the plan reports.

    The space. Following "The physics" in docs/design.md, a point is (m, lead, k):
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
    rebuild time and the plan stores the outputs. The extra columns cost planning time, kept
    near a second for 100,800 records (benchmarks/bench_plan.py) by reading the trace's events
    column by column, vectorising the link's free pass where it takes everything, and letting
    the boundary search yield to the heap between probes.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections.abc import Callable, Iterable

import numpy as np

from offload.lifecycle._anchors import predict_anchors
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
from offload.lifecycle._plan_cost import evaluate, model_anchors
from offload.lifecycle._plan_model import _UNPACK, _Candidate, _get, _Model, _Step
from offload.lifecycle._plan_search import _Search
from offload.lifecycle._sim_step import _step_index
from offload.lifecycle._simulate import simulate
from offload.lifecycle._trace import Trace, with_small_casts_kept
from offload.lifecycle._units import check_count, format_bytes, parse_bytes

_MIN_MARGIN_BYTES = 256 << 20  # docs/design.md "Budget": max(5% of the budget, 256 MiB) on a GPU
_MARGIN_SHARE = 0.05


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
            (docs/design.md "Budget"); on a CPU trace 5% of the budget.
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
    search = _Search(model)

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

    keep_all = evaluate(model, model.column(0, 1.0), 0)
    chosen = keep_all if keep_all.peak <= target else search.search(target)
    if chosen is None:
        raise infeasible(
            math.ceil(search.lowest().peak),
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
            trace, hardware, _decisions(model, chosen), step=view.step, max_inflight_bytes=inflight
        )
        simulations += 1
        if sim.peak_bytes > target:
            chosen = search.lowest()
            sim = simulate(
                trace,
                hardware,
                _decisions(model, chosen),
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
        anchors = model_anchors(model, keep_all)
    return Plan(
        gpu_budget_bytes=budget,
        margin_bytes=margin_bytes,
        tiers=tiers,
        entries=_entries(model, chosen),
        recompute_calls=_recompute_calls(model, chosen),
        expected_keys=_expected_keys(model, chosen),
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


# -- the plan out of a candidate ----------------------------------------------------------------


def _decisions(model: _Model, c: _Candidate) -> dict[int, Decision]:
    return {e.family: e.decision() for e in _entries(model, c) if e.placement is not Placement.KEEP}


def _entries(model: _Model, c: _Candidate) -> tuple[PlanEntry, ...]:
    v = model.v
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
        recomputed, unit_of = model.recomputed(c.m)
        kind[recomputed] = 3
        unit[recomputed] = unit_of
    names = [*reversed(model.blocks.module), ""]  # unit -1: ""
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
    triggers.update(_triggers(model, np.unique(event[event >= 0])))
    keys = _family_keys(model, positions)
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


def _family_keys(model: _Model, positions: np.ndarray) -> list[tuple[Key, ...]]:
    """Record keys of the families at ``positions``, in pack order."""
    v = model.v
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


def _triggers(model: _Model, local_events: np.ndarray) -> dict[int, Trigger]:
    """The executor's name for each of ``local_events`` (backward starts and unpacks)."""
    v = model.v
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


def _recompute_calls(model: _Model, c: _Candidate) -> tuple[tuple[str, int], ...]:
    first = len(model.blocks) - c.m
    blocks = model.blocks
    return tuple(zip(blocks.module[first:], blocks.call_index[first:], strict=True))


def _expected_keys(model: _Model, c: _Candidate) -> tuple[Key, ...]:
    v = model.v
    packs = v.record_pack
    # Blocks are disjoint and sorted: the one starting last at or before a pack is the only
    # one that can hold it.
    show = ~v.record_backward
    if c.m:
        first = len(model.blocks) - c.m
        starts, ends = model.blocks.start[first:], model.blocks.end[first:]
        i = np.searchsorted(starts, packs, side="right") - 1
        show &= ~((i >= 0) & (packs <= ends[np.maximum(i, 0)]))
    return tuple(itertools.compress(v.keys, show.tolist()))
