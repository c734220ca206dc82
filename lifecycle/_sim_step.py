"""The step as the simulator reads it: per-family facts of one traced step (:class:`_StepView`),
and the placements asked for, checked against them and resolved to decisions and recompute units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from offload.lifecycle._placement import Decision, Placement, PlacementMap, _as_placement
from offload.lifecycle._trace import BackwardPasses, Event, EventKind, ModuleSpan, Trace

# -- the step, as the simulator reads it --------------------------------------------------------


@dataclass(frozen=True)
class _FamilyFacts:
    family: int
    span_bytes: int
    module: str  # of the first record
    calls: tuple[tuple[str, int], ...]  # (module, call index) of every member's pack
    first_pack: int  # event indices
    last_pack: int
    first_unpack: int  # -1: never unpacked
    last_use: int  # -1: never unpacked (lives to the end of the step)
    movable: bool  # an activation not packed during backward
    records: tuple[int, ...]  # seq of each member
    rebuild_from: tuple[int, ...]  # each member's TensorRecord.rebuild_from (-1: none)
    # (first unpack, last unpack) per backward pass, or (): see NOTE [ Backward passes ]
    passes: tuple[tuple[int, int], ...] = ()
    # How many backward passes unpack every member (a rebuilt child's records included): a
    # later pass that misses one leaves its reload held to the step's end (NOTE [ Later
    # backward passes ] in offload/_executor.py).
    whole_passes: int = 0


class _StepView:
    """One step of a trace, with the facts the simulator looks up by event or family. Read
    only: one view serves every simulation of the step (:meth:`of`)."""

    @staticmethod
    def of(trace: Trace, step: int) -> _StepView:
        """The view of ``step`` (an index from ``_step_index``), built once per trace."""
        return trace._derived(("simulator step", step), lambda: _StepView(trace, step))

    def __init__(self, trace: Trace, step: int) -> None:
        self.step = step
        self.events: tuple[Event, ...] = tuple(e for e in trace.events if e.step == step)
        if not self.events or self.events[0].kind is not EventKind.STEP_START:
            raise ValueError(f"step {step} of the trace has no STEP_START event")
        self.base_bytes = self.events[0].memory_bytes
        # The step's graph outlived its backward (NOTE [ Retained graphs ] in the recorder): a
        # family kept on the device stays to the step's end.
        self.retained = step in trace.retained_steps
        # A backward built a graph: what it unpacked (a reload too) may be held to the end.
        self.create_graph = step in trace.create_graph_steps
        live = dict(trace.live_saved_bytes())
        # See NOTE [ Simulation model ] in _simulate.py: what the plan does not control, taken
        # as fixed.
        self.rest = {
            e.index: max(0, e.memory_bytes - self.base_bytes - live.get(e.index, 0))
            for e in self.events
        }
        # See NOTE [ Backward passes ] in _trace.py. A graph built by a backward may hold what
        # it unpacked to the step's end: no family of such a step is counted per pass.
        self.passes = BackwardPasses(r for r in trace.records if r.step == step)
        self.facts = {
            f.family: f
            for f in _family_facts(trace, step, None if self.create_graph else self.passes)
        }
        spans = [s for s in trace.module_spans() if s.step == step]
        self.forward_spans = [s for s in spans if s.phase == "forward"]
        self.forward_spans_of: dict[str, list[ModuleSpan]] = {}
        for s in self.forward_spans:
            self.forward_spans_of.setdefault(s.module, []).append(s)
        self.backward_start = {
            (e.module, e.call_index): e.index
            for e in reversed(self.events)
            if e.kind is EventKind.BACKWARD_START
        }
        self.backward_begins = next(
            (
                e.index
                for e in self.events
                if e.kind in (EventKind.BACKWARD_START, EventKind.UNPACK)
            ),
            self.events[-1].index + 1,
        )
        self.family_of_record = {r.seq: r.family for r in trace.records if r.step == step}


def _family_facts(trace: Trace, step: int, passes: BackwardPasses | None) -> Iterable[_FamilyFacts]:
    for fam in trace.families():
        if fam.step != step or fam.is_parameter:
            continue
        members = [trace.records[s] for s in fam.records]
        unpacks = [u for r in members for u in r.unpack_events]
        held = trace.held_through  # NOTE [ Unpacks of one node ] in _trace.py
        per_pass = passes.of_family(fam.records) if passes is not None else ()
        yield _FamilyFacts(
            family=fam.family,
            span_bytes=fam.span_bytes,
            module=members[0].module,
            calls=tuple(dict.fromkeys((r.module, r.call_index) for r in members)),
            first_pack=fam.first_pack_event,
            last_pack=max(r.pack_event for r in members),
            first_unpack=min(unpacks) if unpacks else -1,
            last_use=held(fam.last_use_event) if unpacks else -1,
            movable=not any(r.in_backward for r in members),
            records=fam.records,
            rebuild_from=tuple(r.rebuild_from for r in members),
            passes=tuple((first, held(last)) for first, last in per_pass),
            whole_passes=min(len(r.unpack_events) for r in members),
        )


def _step_index(trace: Trace, step: int) -> int:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a lifecycle.Trace; got {type(trace).__name__}")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (a step index); got {type(step).__name__} {step!r}")
    if trace.steps < 1:
        raise ValueError("the trace has no recorded step")
    if not -trace.steps <= step < trace.steps:
        raise ValueError(
            f"step must be in [{-trace.steps}, {trace.steps - 1}] for a trace of {trace.steps} "
            f"step(s); got {step}"
        )
    return step % trace.steps


def _encloses(span: ModuleSpan, event: int) -> bool:
    return span.start_event <= event <= span.end_event


# -- placements -------------------------------------------------------------------------------


@dataclass
class _Unit:
    """A module call recomputed in backward: its forward runs again at its first unpack."""

    span: ModuleSpan
    families: list[int] = field(default_factory=list)
    done: bool = False


def _resolve(view: _StepView, placements: PlacementMap | None) -> dict[int, Decision]:
    """Checked decisions for the step's families (kept families left out)."""
    if placements is None:
        return {}
    if not isinstance(placements, Mapping):
        raise TypeError(
            f"placements must be a mapping {{family id: Placement | Decision}}; got "
            f"{type(placements).__name__}"
        )
    out = {}
    for fid, value in placements.items():
        try:
            decision = (
                value if isinstance(value, Decision) else Decision(placement=_as_placement(value))
            )
        except ValueError as e:
            raise ValueError(f"placements[{fid!r}]: {e}") from None
        if decision.placement is Placement.KEEP:
            continue
        facts = view.facts.get(fid)
        if facts is None:
            raise ValueError(
                f"placements names family {fid!r}, which is not an activation family of step "
                f"{view.step} (parameters and other steps' families cannot be placed)"
            )
        if not facts.movable:
            raise ValueError(
                f"placements: family {fid} was packed while a backward ran (recomputation, double "
                "backward); it can only be kept"
            )
        _check_reload_event(view, facts, decision)
        out[fid] = decision
    return out


def _check_reload_event(view: _StepView, facts: _FamilyFacts, decision: Decision) -> None:
    event = decision.reload_event
    if event == -1:
        return
    last = facts.first_unpack if facts.first_unpack >= 0 else view.events[-1].index
    if not facts.first_pack <= event <= last:
        raise ValueError(
            f"placements: family {facts.family} has reload_event={event}, outside its life on "
            f"the timeline [first pack {facts.first_pack}, first unpack {last}]"
        )


def _units(view: _StepView, decisions: Mapping[int, Decision]) -> dict[int, _Unit]:
    """The recompute unit of each RECOMPUTE family (families of one module call share one)."""
    units: dict[tuple[str, int], _Unit] = {}
    out = {}
    for fid, d in decisions.items():
        if d.placement is not Placement.RECOMPUTE:
            continue
        facts = view.facts[fid]
        module = d.recompute_module or facts.module
        around = [
            s for s in view.forward_spans_of.get(module, ()) if _encloses(s, facts.first_pack)
        ]
        if not around:
            raise ValueError(
                f"placements: family {fid} is to be recomputed with module {module!r}, but no "
                f"forward of {module!r} encloses its pack (event {facts.first_pack})"
            )
        span = max(around, key=lambda s: s.start_event)
        unit = units.setdefault((module, span.start_event), _Unit(span))
        unit.families.append(fid)
        out[fid] = unit
    return out


def _rebuild_parents(view: _StepView, decisions: Mapping[int, Decision]) -> dict[int, int]:
    """The parent family of each REBUILD family, checked. See NOTE [ Simulation model ] in
    _simulate.py."""
    out = {}
    for fid, d in decisions.items():
        if d.placement is not Placement.REBUILD:
            continue
        facts = view.facts[fid]
        why = f"placements: family {fid} cannot be rebuilt"
        parents = set()
        for seq, link in zip(facts.records, facts.rebuild_from, strict=True):
            if link < 0:
                raise ValueError(
                    f"{why}: its record {seq} has no rebuild_from link in the trace (only an "
                    "activation's output, saved by the next op, is rebuilt from the input the "
                    "activation saved)"
                )
            parent = view.family_of_record.get(link)
            if parent is None or parent not in view.facts:
                raise ValueError(
                    f"{why}: its record {seq} links to record {link}, which is not an activation "
                    f"record of step {view.step}"
                )
            parents.add(parent)
        if len(parents) > 1:
            raise ValueError(
                f"{why}: its records link to several families {sorted(parents)}; a rebuild reads "
                "one parent family"
            )
        # Not the family itself: its first record links to an earlier one (Trace checks it).
        (parent,) = parents
        placement = decisions[parent].placement if parent in decisions else Placement.KEEP
        if placement in (Placement.RECOMPUTE, Placement.REBUILD):
            raise ValueError(
                f"{why}: its parent family {parent} is placed {placement.value!r}; a rebuild "
                "reads its parent, which must be 'keep', 'cpu' or 'nvme'"
            )
        out[fid] = parent
    return out


def _with_rebuild_uses(
    facts: Mapping[int, _FamilyFacts], parents: Mapping[int, int]
) -> dict[int, _FamilyFacts]:
    """``facts`` with each rebuild counted as a use of its parent: the parent's first unpack,
    last use, backward passes and reload-triggering calls include its children's rebuilds (their
    first unpack in each pass) and calls.

    See NOTE [ Reload policy ] in _simulate.py.
    """
    out = dict(facts)
    for child, parent in parents.items():
        c, p = facts[child], out[parent]
        if c.first_unpack < 0:
            continue  # never unpacked: never rebuilt
        passes = p.passes
        for rebuilt in [first for first, _ in c.passes] or [c.first_unpack]:
            passes = _with_use(passes, rebuilt)
        out[parent] = dataclasses.replace(
            p,
            passes=passes,
            whole_passes=min(p.whole_passes, c.whole_passes),
            calls=tuple(dict.fromkeys((*p.calls, *c.calls))),
            first_unpack=(
                c.first_unpack if p.first_unpack < 0 else min(p.first_unpack, c.first_unpack)
            ),
            # -1 (never unpacked: lives to the end of the step) stays: the end is later still.
            last_use=p.last_use if p.last_use < 0 else max(p.last_use, c.first_unpack),
        )
    return out


def _with_use(passes: tuple[tuple[int, int], ...], event: int) -> tuple[tuple[int, int], ...]:
    """``passes`` (NOTE [ Backward passes ]) with a use at ``event`` added to the pass it falls
    in or comes before (a rebuild precedes its parent's own unpacks in a pass), or after the
    last pass, to that one."""
    for k, (first, last) in enumerate(passes):
        if event <= last:
            return (*passes[:k], (min(first, event), last), *passes[k + 1 :])
    if not passes:
        return passes
    return (*passes[:-1], (passes[-1][0], event))
