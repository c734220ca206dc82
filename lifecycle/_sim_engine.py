"""The simulator's event engine: one step's events replayed under checked decisions, through
FIFO copy channels and device memory over time, to a :class:`Simulation` (see _simulate.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._placement import Decision, Placement
from offload.lifecycle._sim_step import (
    _FamilyFacts,
    _rebuild_parents,
    _StepView,
    _Unit,
    _units,
    _with_rebuild_uses,
)
from offload.lifecycle._trace import Event, EventKind


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """The predicted course of one step under a placement.

    ``step_s == trace_step_s + stall_s + backpressure_s + recompute_s + rebuild_s + sync_copy_s``.

    Attributes:
        peak_bytes: predicted device memory peak (base included).
        base_bytes: the memory probe at the step's start.
        step_s: predicted step time.
        trace_step_s: the step's time in the trace (what keeping everything costs).
        stall_s: time unpacks waited for reloads.
        stalls: unpacks (or rebuilds, for their parent) that found no reload started.
        backpressure_s: time packs waited for copies out (``max_inflight_bytes``).
        recompute_s: time spent running forwards again.
        rebuild_s: time spent rebuilding REBUILD families from their parents.
        sync_copy_s: time the compute thread ran copies itself (``copies_overlap_compute=False``).
        d2h_busy_s / h2d_busy_s / disk_write_busy_s / disk_read_busy_s: seconds each channel was
            copying.
        bytes_offloaded_cpu / bytes_offloaded_nvme: bytes copied out to each tier.
        bytes_recomputed: bytes of the families recomputed instead of kept.
        bytes_rebuilt: bytes of the families rebuilt from their parents instead of kept.
        bytes_reloaded: bytes copied back (less than those offloaded when a family was never
            unpacked, or was unpacked before its copy out completed and used its source).
        memory_timeline: ``(seconds since step start, device bytes)`` at each change, in time order
            (several points may share a time: frees come before allocations).

    Example:
        >>> import torch, offload
        >>> from offload.lifecycle import HardwareModel, simulate
        >>> model = torch.nn.Linear(8, 8)
        >>> trace = offload.profile(lambda: model(torch.randn(4, 8)).sum().backward(), model)
        >>> sim = simulate(trace, HardwareModel.h200())
        >>> sim.slowdown, sim.stalls, sim.peak_bytes == max(b for _, b in sim.memory_timeline)
        (1.0, 0, True)
    """

    peak_bytes: int
    base_bytes: int
    step_s: float
    trace_step_s: float
    stall_s: float
    stalls: int
    backpressure_s: float
    recompute_s: float
    rebuild_s: float
    sync_copy_s: float
    d2h_busy_s: float
    h2d_busy_s: float
    disk_write_busy_s: float
    disk_read_busy_s: float
    bytes_offloaded_cpu: int
    bytes_offloaded_nvme: int
    bytes_recomputed: int
    bytes_rebuilt: int
    bytes_reloaded: int
    memory_timeline: tuple[tuple[float, int], ...] = field(repr=False)

    @property
    def slowdown(self) -> float:
        """``step_s / trace_step_s`` (1.0 for an empty step)."""
        return self.step_s / self.trace_step_s if self.trace_step_s > 0 else 1.0


# -- copy channels ----------------------------------------------------------------------------

D2H, H2D, DISK_WRITE, DISK_READ = "d2h", "h2d", "disk_write", "disk_read"
_CHANNELS = (D2H, H2D, DISK_WRITE, DISK_READ)


@dataclass(eq=False)
class _Stage:
    channel: str
    remaining: float  # bytes
    on_done: Callable[[float], None] | None = None


@dataclass(eq=False)
class _Job:
    """Stages run one after another, each on its channel; starts after ``after`` completes."""

    stages: list[_Stage]
    after: _Job | None = None
    next: int = 0
    done: bool = False
    waiters: list[_Job] = field(default_factory=list)


class _Channels:
    """FIFO copy channels sharing the duplex cap; time advances only when the simulator asks."""

    def __init__(self, hw: HardwareModel) -> None:
        self.now = 0.0
        self._alone = {
            D2H: float(hw.d2h_bytes_per_s),
            H2D: float(hw.h2d_bytes_per_s),
            DISK_WRITE: float(hw.disk_write_bytes_per_s),
            DISK_READ: float(hw.disk_read_bytes_per_s),
        }
        both = self._alone[D2H] + self._alone[H2D]
        duplex = float(hw.duplex_bytes_per_s)
        self._duplex_factor = 1.0 if duplex >= both else duplex / both
        self._queues: dict[str, deque[_Job]] = {c: deque() for c in _CHANNELS}
        self._active: dict[str, _Job | None] = dict.fromkeys(_CHANNELS)
        self._busy = 0  # channels with an active job
        self.busy_s = dict.fromkeys(_CHANNELS, 0.0)

    def submit(self, job: _Job) -> None:
        if job.after is not None and not job.after.done:
            job.after.waiters.append(job)
        else:
            self._enqueue(job)

    def advance(self, until: float, stop: Callable[[], bool] | None = None) -> float:
        """Run the channels up to ``until``, or until ``stop()`` holds; returns the time reached."""
        until = max(until, self.now)
        while stop is None or not stop():
            if not self._busy:
                if math.isinf(until):
                    raise RuntimeError("simulator waits for a copy that never starts")
                self.now = until
                return until
            if self._busy == 1:
                if self._advance_one(until):
                    return self.now
                continue
            active = {c: j for c, j in self._active.items() if j is not None}
            rates = self._rates(active)
            finish = {c: j.stages[j.next].remaining / rates[c] for c, j in active.items()}
            first = min(finish, key=finish.__getitem__)
            if self.now + finish[first] > until:
                self._progress(active, rates, until - self.now)
                self.now = until
                return self.now
            dt = finish[first]
            self._progress(active, rates, dt)
            self.now += dt
            active[first].stages[active[first].next].remaining = 0.0
            for c, j in active.items():
                if j.stages[j.next].remaining <= 0.0:
                    self._complete(c, j)
        return self.now

    def _advance_one(self, until: float) -> bool:
        """One iteration of :meth:`advance` with one channel busy (most of them), the same
        arithmetic without the per-channel dicts: at its own rate (the duplex cap needs both
        directions busy), it completes its stage or runs until ``until`` (then True)."""
        channel, job = next((c, j) for c, j in self._active.items() if j is not None)
        stage = job.stages[job.next]
        rate = self._alone[channel]
        dt = stage.remaining / rate
        reached = self.now + dt > until
        if reached:
            dt = until - self.now
        if dt > 0.0:
            stage.remaining = max(0.0, stage.remaining - rate * dt)
            self.busy_s[channel] += dt
        if reached:
            self.now = until
            return True
        self.now += dt
        stage.remaining = 0.0
        self._complete(channel, job)
        return False

    def _rates(self, active: Mapping[str, _Job]) -> dict[str, float]:
        factor = self._duplex_factor if D2H in active and H2D in active else 1.0
        return {c: self._alone[c] * (factor if c in (D2H, H2D) else 1.0) for c in active}

    def _progress(self, active: Mapping[str, _Job], rates: Mapping[str, float], dt: float) -> None:
        if dt <= 0.0:
            return
        for c, j in active.items():
            stage = j.stages[j.next]
            stage.remaining = max(0.0, stage.remaining - rates[c] * dt)
            self.busy_s[c] += dt

    def _enqueue(self, job: _Job) -> None:
        self._queues[job.stages[job.next].channel].append(job)
        self._start_idle()

    def _start_idle(self) -> None:
        for c in _CHANNELS:
            if self._active[c] is None and self._queues[c]:
                self._active[c] = self._queues[c].popleft()
                self._busy += 1

    def _complete(self, channel: str, job: _Job) -> None:
        self._active[channel] = None
        self._busy -= 1
        stage = job.stages[job.next]
        job.next += 1
        if job.next < len(job.stages):
            self._enqueue(job)
        else:
            job.done = True
            for waiter in job.waiters:
                self._enqueue(waiter)
        if stage.on_done is not None:
            stage.on_done(self.now)
        self._start_idle()


# -- device memory ----------------------------------------------------------------------------


class _Memory:
    """Device bytes over time: base + the fixed rest + saved bytes the placement holds."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.rest = 0
        self.saved = 0
        self.timeline: list[tuple[float, int]] = [(0.0, base)]

    def set_rest(self, t: float, rest: int) -> None:
        self.rest = rest
        self._mark(t)

    def add(self, t: float, nbytes: int) -> None:
        self.saved += nbytes
        self._mark(t)

    def _mark(self, t: float) -> None:
        # One point per change, even at one instant: two events of a CUDA-clock trace often share
        # a time, and coalescing them would hide a peak. Within one event frees come first and
        # allocations after, so no point is above a state the step really passes through.
        value = self.base + self.rest + self.saved
        if self.timeline[-1][1] != value:
            self.timeline.append((t, value))


# -- the step ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _FamilyState:
    facts: _FamilyFacts
    placement: Placement
    device_bytes: int = 0  # what the family holds on the device now
    packed: bool = False
    offload: _Job | None = None
    copied_out: bool = False  # its D2H completed
    requested: bool = False  # reload asked for (started, or waiting for the copy out)
    reload: _Job | None = None
    unpacked: bool = False  # its first unpack (or, for a parent, its first rebuild) happened
    source_used: bool = False  # unpacked before its D2H completed: the source stays in use
    parent: _FamilyState | None = None  # REBUILD: the family it is rebuilt from
    backward_pass: int = 0  # NOTE [ Backward passes ]: the pass its next unpacks belong to


class _Simulator:
    """Replays one step's events, adding the waits a placement causes.

    See NOTE [ Simulation model ] in _simulate.py.
    """

    def __init__(
        self,
        view: _StepView,
        hw: HardwareModel,
        decisions: Mapping[int, Decision],
        *,
        max_inflight_bytes: int,
        prefetch_bytes: int,
    ) -> None:
        self.view, self.hw = view, hw
        self.max_inflight_bytes, self.prefetch_bytes = max_inflight_bytes, prefetch_bytes
        self.channels = _Channels(hw)
        self.memory = _Memory(view.base_bytes)
        self.units = _units(view, decisions)
        parents = _rebuild_parents(view, decisions)
        self.fams = {
            fid: _FamilyState(
                facts, decisions[fid].placement if fid in decisions else Placement.KEEP
            )
            for fid, facts in _with_rebuild_uses(view.facts, parents).items()
        }
        for child, parent in parents.items():
            self.fams[child].parent = self.fams[parent]
        self.now = 0.0
        self.delay_s = 0.0  # waits added so far: now = trace time since step start + delay_s
        self.waits = dict.fromkeys(
            ("stall", "backpressure", "recompute", "rebuild", "sync_copy"), 0.0
        )
        self.stalls = 0
        self.inflight_bytes = 0  # D2H bytes not yet copied out
        self.ahead_bytes = 0  # requested, not yet unpacked
        self.free_at: dict[int, list[_FamilyState]] = {}
        self.pass_end_at: dict[int, list[_FamilyState]] = {}  # see NOTE [ Backward passes ]
        self._plan_reloads(decisions)

    def _plan_reloads(self, decisions: Mapping[int, Decision]) -> None:
        """Where each moved family's reload may start. See NOTE [ Reload policy ] in
        _simulate.py."""
        self.explicit_at: dict[int, list[_FamilyState]] = {}
        self.trigger_at: dict[int, list[_FamilyState]] = {}
        # Event -> (family, pass, whether a module trigger fires it: see _start_reloads).
        self.again_at: dict[int, list[tuple[_FamilyState, int, bool]]] = {}
        window = []
        for fid, d in decisions.items():
            if not d.placement.moves:
                continue
            fam = self.fams[fid]
            if d.reload_event >= 0:
                self.explicit_at.setdefault(d.reload_event, []).append(fam)
                self._plan_later_passes(fam, d.reload_event)
                continue
            facts = fam.facts
            if facts.first_unpack < 0:
                continue  # never needed again: never reloaded
            triggers = [
                t
                for t in (self.view.backward_start.get(call, -1) for call in facts.calls)
                if facts.first_pack < t <= facts.first_unpack
            ]
            if triggers:
                self.trigger_at.setdefault(min(triggers), []).append(fam)
                self._plan_later_passes(fam, min(triggers), by_trigger=True)
            window.append(fam)
        self.window = sorted(window, key=lambda f: f.facts.first_pack, reverse=True)
        self.window_next = 0
        self.wanted: list[_FamilyState] = []  # named by a trigger, waiting for the window
        self.window_restart_at = self._later_pass_starts()

    def _later_pass_starts(self) -> dict[int, int]:
        """Event -> position in ``window`` where the look-ahead starts over in a later backward
        pass: its first trigger or unpack of a windowed family, at the family packed last of
        those it names (NOTE [ Later backward passes ] in offload/_executor.py)."""
        position = {id(f): i for i, f in enumerate(self.window)}
        named = [
            (at, k, fam)
            for at, firing in self.again_at.items()
            for fam, k, _ in firing
            if id(fam) in position
        ]
        named += [(first, k, f) for f in self.window for k, (first, _) in enumerate(f.facts.passes)]
        start: dict[int, tuple[int, int]] = {}  # pass -> (event, position)
        for at, k, fam in named:
            here = (at, position[id(fam)])
            if k > 0 and (k not in start or here < start[k]):
                start[k] = here
        return dict(start.values())

    def _plan_later_passes(
        self, fam: _FamilyState, trigger: int, *, by_trigger: bool = False
    ) -> None:
        """Where the reload trigger at event ``trigger`` fires again in each later backward pass
        of ``fam`` (NOTE [ Backward passes ]); one that does not fire leaves the unpack to
        reload (a stall)."""
        passes = fam.facts.passes
        for k in range(1, len(passes)):
            at = self.view.passes.again(trigger, k)
            if at >= 0:
                at = min(max(at, passes[k - 1][1] + 1), passes[k][0])
                self.again_at.setdefault(at, []).append((fam, k, by_trigger))

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> Simulation:
        events, rest = self.view.events, self.view.rest
        advance, set_rest, free_at = self.channels.advance, self.memory.set_rest, self.free_at
        pack, unpack = EventKind.PACK, EventKind.UNPACK
        # Before backward begins, only the planned reload points start reloads.
        reload_at = self.explicit_at.keys() | self.trigger_at.keys() | self.again_at.keys()
        backward_begins = self.view.backward_begins
        t0 = events[0].time_s
        for e in events:
            self.now = max(self.now, e.time_s - t0 + self.delay_s)
            advance(self.now)
            if free_at:
                for fam in free_at.pop(e.index, ()):
                    self._hold(fam, -fam.device_bytes)
            for fam in self.pass_end_at.pop(e.index, ()):
                self._end_pass(fam)
            set_rest(self.now, rest[e.index])
            kind = e.kind
            if kind is pack:
                self._on_pack(e)
            elif kind is unpack:
                self._on_unpack(e)
            if e.index >= backward_begins or e.index in reload_at:
                self._start_reloads(e.index)
        result = self._result(events[-1].time_s - t0)
        self._unlink()
        return result

    def _unlink(self) -> None:
        """Break the run's reference cycles (a copy-out calls back into this simulator; an
        offload and the reload waiting on it point at each other), so that its state goes with
        the caller's last reference instead of waiting for a full collection, which walks the
        whole trace as well (a third of a 10k-record simulation, measured)."""
        for fam in self.fams.values():
            for job in (fam.offload, fam.reload):
                if job is not None:
                    job.after = None
                    job.waiters.clear()
                    for stage in job.stages:
                        stage.on_done = None

    def _wait(self, kind: str, done: Callable[[], bool]) -> None:
        """Let the channels run until ``done()``; compute waits that long."""
        start = self.now
        self.now = self.channels.advance(math.inf, done)
        self.waits[kind] += self.now - start
        self.delay_s += self.now - start

    def _hold(self, fam: _FamilyState, nbytes: int) -> None:
        fam.device_bytes += nbytes
        self.memory.add(self.channels.now, nbytes)

    # -- pack ------------------------------------------------------------------------------

    def _on_pack(self, e: Event) -> None:
        fam = self._family(e)
        if fam is None or fam.packed:
            return  # a parameter, or another member of a family already packed
        fam.packed = True
        span = fam.facts.span_bytes
        if fam.placement is Placement.KEEP:
            self._hold(fam, span)
        elif fam.placement.moves:
            self._wait("backpressure", lambda: self._room_for(span))
            self._hold(fam, span)
            self._offload(fam)
        elif fam.placement is Placement.REBUILD:
            # The op saving it still uses it; it goes after its last pack, or at its first unpack
            # (which rebuilds it at once) if backward reaches it sooner.
            self._hold(fam, span)
            gone = fam.facts.last_pack + 1
            if fam.facts.first_unpack >= 0:
                gone = min(gone, fam.facts.first_unpack)
            self.free_at.setdefault(gone, []).append(fam)
        # RECOMPUTE: the tensor dies after its consumer in forward; nothing is saved.
        view = self.view
        if fam.facts.last_use >= 0 and not (
            view.create_graph or (view.retained and fam.placement is Placement.KEEP)
        ):
            # What the step brings back (a reload, a rebuild, a recomputation) dies after its
            # last use even when the graph lives on; a kept tensor lives with the graph. A
            # reload a later backward pass held for a member it did not unpack stays (_end_pass).
            if not (fam.placement.moves and fam.facts.whole_passes < len(fam.facts.passes)):
                self.free_at.setdefault(fam.facts.last_use + 1, []).append(fam)
            if fam.placement.moves or fam.placement is Placement.REBUILD:
                # A reload or a rebuild dies after its last use in each backward pass (NOTE
                # [ Backward passes ] in _trace.py).
                for _, last in fam.facts.passes[:-1]:
                    self.pass_end_at.setdefault(last + 1, []).append(fam)

    def _room_for(self, nbytes: int) -> bool:
        # NOTE [ Stream ordering ] rule 2 (docs/design.md): one copy larger than the bound still goes.
        return self.inflight_bytes == 0 or self.inflight_bytes + nbytes <= self.max_inflight_bytes

    def _offload(self, fam: _FamilyState) -> None:
        span = fam.facts.span_bytes
        stages = [_Stage(D2H, span, lambda t: self._copied_out(fam))]
        if fam.placement is Placement.NVME:
            stages.append(_Stage(DISK_WRITE, span))
        fam.offload = _Job(stages)
        self.inflight_bytes += span
        self.channels.submit(fam.offload)
        if not self.hw.copies_overlap_compute:
            self._wait("sync_copy", lambda: fam.copied_out)

    def _copied_out(self, fam: _FamilyState) -> None:
        # Runs inside the channels, at the copy's completion time.
        fam.copied_out = True
        self.inflight_bytes -= fam.facts.span_bytes
        if not fam.source_used:
            self._hold(fam, -fam.device_bytes)
            if fam.requested:
                self._reload(fam, from_compute=False)

    def _end_pass(self, fam: _FamilyState) -> None:
        """``fam``'s last unpack of a backward pass is done: its reload buffer (or rebuilt
        output) goes, and the next pass brings it back again. One whose source was used stays
        (cautious: the executor drops the source once its copy out completes)."""
        fam.backward_pass += 1
        if fam.source_used or not fam.unpacked or fam.backward_pass > fam.facts.whole_passes:
            return  # (the last: a member this pass did not unpack holds it to the step's end)
        self._hold(fam, -fam.device_bytes)
        fam.unpacked = fam.requested = False

    # -- unpack ----------------------------------------------------------------------------

    def _on_unpack(self, e: Event) -> None:
        fam = self._family(e)
        if fam is not None:
            self._use(fam)

    def _use(self, fam: _FamilyState) -> None:
        """The family's first use in backward brings it to the device; later ones find it."""
        if fam.unpacked:
            return
        if fam.placement is Placement.RECOMPUTE:
            self._recompute(self.units[fam.facts.family])
        elif fam.placement.moves:
            self._bring_back(fam)
        elif fam.placement is Placement.REBUILD:
            assert fam.parent is not None  # _rebuild_parents found one
            # See NOTE [ Reload policy ] in _simulate.py: the rebuild is its parent's first use
            # when it comes first.
            self._use(fam.parent)
            self._rebuild(fam)
        fam.unpacked = True

    def _recompute(self, unit: _Unit) -> None:
        if unit.done:
            return
        unit.done = True
        cost = unit.span.duration_s
        self.now += cost
        self.delay_s += cost
        self.waits["recompute"] += cost
        self.channels.advance(self.now)
        for fid in unit.families:
            fam = self.fams[fid]
            if fam.facts.first_unpack >= 0:
                self._hold(fam, fam.facts.span_bytes)

    def _rebuild(self, fam: _FamilyState) -> None:
        assert fam.parent is not None
        span = fam.facts.span_bytes
        cost = (fam.parent.facts.span_bytes + span) / self.hw.pointwise_bytes_per_s
        self._hold(fam, span)  # the kernel's output, allocated as it starts
        self.now += cost
        self.delay_s += cost
        self.waits["rebuild"] += cost
        self.channels.advance(self.now)

    def _bring_back(self, fam: _FamilyState) -> None:
        if fam.requested:
            self.ahead_bytes -= fam.facts.span_bytes
        if not fam.copied_out:
            # NOTE [ Stream ordering ] rule 3: the source is still held, so unpack uses it.
            fam.source_used = True
            fam.requested = False
            return
        if not fam.requested:
            self.stalls += 1
            self._request(fam)
            self.ahead_bytes -= fam.facts.span_bytes
        reload = fam.reload
        assert reload is not None
        self._wait("stall", lambda: reload.done)

    # -- reloads ---------------------------------------------------------------------------

    def _start_reloads(self, index: int) -> None:
        """See NOTE [ Reload policy ] in _simulate.py."""
        for fam in self.explicit_at.get(index, ()):
            self._request(fam)
        triggered = list(self.trigger_at.get(index, ()))
        for fam, k, by_trigger in self.again_at.get(index, ()):
            if fam.backward_pass == k:
                if by_trigger:
                    triggered.append(fam)  # the module trigger fires again in a later pass
                else:
                    self._request(fam)
        if triggered and self.prefetch_bytes:
            # Under the window, last packed first, the call's last packed one at once (NOTE
            # [ Module triggers under the window ] in offload/_executor.py); a window of 0
            # brings each call's families back at once.
            self._request(max(triggered, key=lambda f: f.facts.first_pack))
            self.wanted = sorted(
                {id(f): f for f in (*self.wanted, *triggered)}.values(),
                key=lambda f: f.facts.first_pack,
            )
        else:
            for fam in triggered:
                self._request(fam)
        if index < self.view.backward_begins:
            return
        restart = self.window_restart_at.get(index)
        if restart is not None:
            self.window_next = restart
        wanted = self.wanted
        while wanted:
            fam = wanted[-1]
            if not (fam.requested or fam.unpacked or not fam.packed):
                span = fam.facts.span_bytes
                if self.ahead_bytes and self.ahead_bytes + span > self.prefetch_bytes:
                    break
                self._request(fam)
            wanted.pop()
        while self.window_next < len(self.window):
            fam = self.window[self.window_next]
            if not fam.packed:
                break
            if not (fam.requested or fam.unpacked):
                if self.ahead_bytes + fam.facts.span_bytes > self.prefetch_bytes:
                    break
                self._request(fam)
            self.window_next += 1

    def _request(self, fam: _FamilyState) -> None:
        if fam.requested or fam.unpacked or not fam.packed:
            return
        fam.requested = True
        self.ahead_bytes += fam.facts.span_bytes
        if fam.copied_out:
            self._reload(fam, from_compute=True)
        # else: the reload starts when the copy out completes (_copied_out).

    def _reload(self, fam: _FamilyState, *, from_compute: bool) -> None:
        # NOTE [ Stream ordering ] rule 3: the destination is allocated when the reload starts.
        span = fam.facts.span_bytes
        self._hold(fam, span)
        stages = [_Stage(H2D, span)]
        if fam.placement is Placement.NVME:
            stages.insert(0, _Stage(DISK_READ, span))
        fam.reload = reload = _Job(stages, after=fam.offload)
        self.channels.submit(reload)
        if from_compute and not self.hw.copies_overlap_compute:
            self._wait("sync_copy", lambda: reload.done)

    # -- helpers ---------------------------------------------------------------------------

    def _family(self, e: Event) -> _FamilyState | None:
        fid = self.view.family_of_record.get(e.record)
        return self.fams.get(fid) if fid is not None else None

    def _result(self, trace_step_s: float) -> Simulation:
        busy = self.channels.busy_s
        placed = [f for f in self.fams.values() if f.packed]

        def total(p: Placement) -> int:
            return sum(f.facts.span_bytes for f in placed if f.placement is p)

        return Simulation(
            peak_bytes=max(v for _, v in self.memory.timeline),
            base_bytes=self.view.base_bytes,
            step_s=self.now,
            trace_step_s=trace_step_s,
            stall_s=self.waits["stall"],
            stalls=self.stalls,
            backpressure_s=self.waits["backpressure"],
            recompute_s=self.waits["recompute"],
            rebuild_s=self.waits["rebuild"],
            sync_copy_s=self.waits["sync_copy"],
            d2h_busy_s=busy[D2H],
            h2d_busy_s=busy[H2D],
            disk_write_busy_s=busy[DISK_WRITE],
            disk_read_busy_s=busy[DISK_READ],
            bytes_offloaded_cpu=total(Placement.CPU),
            bytes_offloaded_nvme=total(Placement.NVME),
            bytes_recomputed=total(Placement.RECOMPUTE),
            bytes_rebuilt=total(Placement.REBUILD),
            bytes_reloaded=sum(f.facts.span_bytes for f in placed if f.reload is not None),
            memory_timeline=tuple(self.memory.timeline),
        )
