"""The step as the planner searches it: the trace's events and alias families as arrays
(:class:`_Step`), each family's copy times and offload orders, and the columns of candidates.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from offload.lifecycle._blocks import find_blocks, within
from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._plan import Key
from offload.lifecycle._simulate import _DEFAULT_MIN_INFLIGHT_BYTES
from offload.lifecycle._trace import (
    WHOLE_STORAGE_FACTOR,
    BackwardPasses,
    Event,
    EventKind,
    TensorRecord,
    Trace,
)

_MAX_FRAMES = 8192


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
        # See NOTE [ Planner ] in _planner.py: memory is tracked over frames of consecutive events.
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
        # Held until the node that unpacked it returns (NOTE [ Unpacks of one node ] in _trace.py).
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


# -- the columns and their families -------------------------------------------------------------


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
        # Offload order (see NOTE [ Planner ] in _planner.py): rank of each family in it.
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
    """What the cost and the search read of one step: each family's bytes and copy times, the
    offload orders and rebuildable outputs, and the columns of candidates, built on demand."""

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
        # offloaded (NOTE [ Planner ] in _planner.py, (2)): the executor's default, twice the
        # family, at least 256 MiB (the executor's grows with the largest family stored so far:
        # this is the cautious end of it).
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
        # outputs ] in _planner.py).
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
        self._free_prefix: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}

    def _rebuildable(self, hw: HardwareModel) -> None:
        """The families a plan may rebuild instead of storing (NOTE [ Rebuilt outputs ] in
        _planner.py), the ones each is rebuilt from, the rebuild times, and the facts rebuild
        variants score with."""
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
        are offloaded first (see NOTE [ Planner ] in _planner.py)."""
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
        return self.tiers_for(col, np.flatnonzero(col.rank < k))[1]

    def tiers_for(self, col: _Column, moved: np.ndarray) -> tuple[np.ndarray, bool]:
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
