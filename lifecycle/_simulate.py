"""A discrete-event model of one training step under a placement: predicted device peak and time.

The planner asks "what if": given a :class:`~offload.lifecycle.Trace` of one step, a
:class:`~offload.lifecycle.HardwareModel` and a :class:`Placement` for each alias family, :func:`simulate`
predicts the step's device memory peak and its time. Pure: no clock, no device, no torch.

NOTE [ Simulation model ]
    Compute is the trace's own timeline: the time between two events of the chosen step is
    replayed as recorded (forward and backward alike), and only waits are added to it:
      * back-pressure: a pack whose copy out would push in-flight D2H bytes past
        ``max_inflight_bytes`` waits for the oldest copies to finish;
      * stalls: an unpack whose reload has not arrived waits for it (an unpack with no reload
        started starts one: a counted stall);
      * recomputation: the first unpack of a RECOMPUTE unit re-runs the unit's forward, for as
        long as that forward took in the trace;
      * rebuilds: the first unpack of a REBUILD family (an activation's output, which the trace
        links to the input the activation saved: ``TensorRecord.rebuild_from``) first needs its
        parent family (the one that input belongs to) on the device: a kept parent is there; a
        moved one is waited for as the parent's own first unpack would wait for it (counted as a
        stall, see NOTE [ Reload policy ]). Then one elementwise kernel reads the parent and
        writes the family: (parent + family bytes) / ``pointwise_bytes_per_s``;
      * synchronous copies: with ``copies_overlap_compute=False`` (CPU-only runs) the compute
        thread runs each copy itself.
    Copies go through four FIFO channels, one copy at a time each: D2H, H2D, disk write, disk
    read. A CPU offload is a D2H copy; an NVMe offload is a D2H copy into pinned staging, then a
    disk write. Reloads run the other way, after the offload finished (an NVMe reload waits for its
    write). While D2H and H2D are both busy each runs at its alone rate times
    ``min(1, duplex / (h2d + d2h))``; alone, at its alone rate.
    Device memory = base (the memory probe at step start) + the rest (the trace's memory minus its
    live saved bytes at each event: transients, gradients, workspaces, taken as fixed) + the saved
    bytes the placement leaves on the device: kept families from first pack to last use (to the
    step's end in a step of ``Trace.retained_steps``, whose graph outlived its backward, and every
    family to the step's end in one of ``Trace.create_graph_steps``), moved
    families from their pack until their D2H completes and from their reload's start until their
    last use, recomputed families from their recomputation until their last use, rebuilt families
    from their first through their last pack event (the op saving one still uses it) and from
    their rebuild until their last use; moved and rebuilt families in each backward pass of a step
    with several (NOTE [ Backward passes ] in _trace.py: the executor drops a rebuilt output
    after its pass's unpacks as it drops a reload, and rebuilds it in the next pass from its
    parent, brought back again). Bytes are freed at the event after their last use, as in
    :meth:`Trace.live_saved_bytes`; a rebuild is a use of its parent, so a parent stays at least
    until its children's first unpack. A REBUILD family's records must all link into one parent
    family of the step, which is itself kept or moved (a rebuild reads it; it cannot be
    recomputed or rebuilt in turn).
    Not modelled: a per-copy latency, kernels slowed by concurrent copies, host (pinned) memory and
    disk capacity, the allocator's rounding and fragmentation, saved tensors that Python still
    references (offloading those frees nothing in reality), the inputs a checkpointed module keeps
    (:func:`checkpoint_blocks` keeps each block's first family for them), disk reads contending
    with writes, transients of a recomputation, a rebuilt output that Python still references in
    forward (between its pack and the next event it is taken as gone), and steps overlapping each
    other (pipelining).

NOTE [ Reload policy ]
    A moved family's reload starts at the event its :class:`Decision` names (``reload_event``);
    otherwise as the executor starts it: when backward reaches the module call that packed the
    family (that call's BACKWARD_START event), or earlier through the look-ahead window: from the
    step's first backward event (its first BACKWARD_START or UNPACK) on, families are requested
    last packed first (the executor's walk down its step's families) while the bytes requested
    and not yet unpacked stay within ``prefetch_bytes``; the walk stops at the first family that
    does not fit. That is the order backward first needs them in, save where a rebuild needs its
    parent earlier (below) or an op unpacks its saved tensors in pack order (a LayerNorm's input
    before its mean and rstd), which the walk reaches in the other order. An unpack that finds
    nothing requested starts the reload itself (a stall). A family requested while its copy out
    still runs starts its reload when that copy completes; a family unpacked before its copy out
    completes uses its source, and nothing is copied back.
    A call's BACKWARD_START requests the family it packed last at once; with a window above 0
    its other families wait for the window too, last packed first, taken before the walk's at
    every later event (one whenever nothing requested is ahead), as the executor does (NOTE
    [ Module triggers under the window ] in offload/_executor.py); with a window of 0 all of
    them are requested at once.
    Like the executor's ``revisit`` list, the window walks past a family still copying out, so its
    reload joins the H2D queue behind families needed after it. A larger window can then predict
    a slower step: when the first families backward needs are still going out, the window has
    already queued later ones ahead of them (so, less often, can a family packed after one
    needed before it).
    A later backward pass over the same graph walks again (NOTE [ Later backward passes ] in
    offload/_executor.py): from its first event that names a windowed family (a trigger firing
    again, or a first unpack of the pass), starting at the one packed last of those it names,
    past families already used in the pass. A family whose records (its rebuilt children's
    included) are not all unpacked in a later pass is held from that pass's reload to the
    step's end, as the executor holds it for the member that never comes. Not modelled: the
    walk of a later pass bringing back a family below its start that the pass does not use.
    A rebuild reads its parent (NOTE [ Simulation model ]), and backward reaches a rebuilt family
    before its parent (fc2's backward unpacks the GELU output, then GELU's unpacks its input).
    So for a moved parent, "first needs" is the earlier of its own first unpack and its rebuilt
    children's (in each backward pass), and the module calls that trigger its reload include its
    children's (the executor starts the input's reload from the backward of the module that
    saved the rebuilt output). A rebuild whose parent's reload was never requested requests it: a
    stall, as for an unpack.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from offload.lifecycle._blocks import find_blocks
from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._nogc import gc_paused
from offload.lifecycle._trace import (
    BackwardPasses,
    Event,
    EventKind,
    ModuleSpan,
    Trace,
    with_small_casts_kept,
)
from offload.lifecycle._units import parse_bytes

_DEFAULT_MIN_INFLIGHT_BYTES = 256 << 20  # docs/design.md: max_inflight_bytes defaults to >= 256 MiB
# The automatic reload look-ahead: a quarter of the bytes the step moves (see automatic_bounds).
_AUTO_WINDOW_SHARE = 4


def automatic_bounds(largest: int, stored: int) -> tuple[int, int]:
    """``(max_inflight_bytes, look-ahead window)`` when neither is given, for a step whose
    largest moved family is ``largest`` bytes and that moved ``stored`` bytes: twice the largest,
    at least 256 MiB (docs/design.md); and a quarter of the bytes moved, at least twice the largest,
    at most that in-flight bound. offload's executor sets its bounds with this, and the
    simulator replays them.

    Example:
        >>> automatic_bounds(1 << 20, 64 << 20)
        (268435456, 16777216)
    """
    twice = 2 * largest
    inflight = max(twice, _DEFAULT_MIN_INFLIGHT_BYTES)
    return inflight, min(inflight, max(twice, stored // _AUTO_WINDOW_SHARE))


class Placement(str, enum.Enum):
    """Where an alias family waits between its pack and its last use.

    Example:
        >>> Placement("cpu").moves, Placement.RECOMPUTE.moves
        (True, False)
    """

    KEEP = "keep"  # on the device
    CPU = "cpu"  # pinned host memory
    NVME = "nvme"  # a file, through pinned staging
    RECOMPUTE = "recompute"  # dropped; its module's forward runs again in backward
    REBUILD = "rebuild"  # dropped; rebuilt at its first unpack from its parent (rebuild_from)

    @property
    def moves(self) -> bool:
        """True for the placements whose bytes leave the device (CPU, NVME)."""
        return self in (Placement.CPU, Placement.NVME)


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What a plan does with one alias family.

    Attributes:
        placement: where the family waits.
        reload_event: CPU / NVME only: the trace's event index (``Event.index``) at which the
            reload starts; ``-1`` leaves it to the default policy (see NOTE [ Reload policy ]).
        recompute_module: RECOMPUTE only: the module whose forward call (the one running when the
            family was first packed) is run again; ``""`` means the family's own module. Families
            naming the same call form one unit, recomputed once.

    Raises:
        ValueError: a field that does not apply to ``placement`` is set, or has a wrong value.

    Example:
        >>> Decision(placement=Placement.CPU, reload_event=42).reload_event
        42
        >>> Decision(placement=Placement.RECOMPUTE, recompute_module="blocks.0").placement.value
        'recompute'
    """

    placement: Placement
    reload_event: int = -1
    recompute_module: str = ""

    def __post_init__(self) -> None:
        # A str ("cpu") is accepted too: plans read from JSON carry them.
        object.__setattr__(self, "placement", _as_placement(self.placement))
        event = self.reload_event
        if isinstance(event, bool) or not isinstance(event, int) or event < -1:
            raise ValueError(f"reload_event must be an event index >= 0, or -1; got {event!r}")
        if event != -1 and not self.placement.moves:
            raise ValueError(
                f"reload_event applies to placements 'cpu' and 'nvme' only; got placement "
                f"{self.placement.value!r} with reload_event={event}"
            )
        if not isinstance(self.recompute_module, str):
            raise ValueError(
                f"recompute_module must be a module path (str); got {self.recompute_module!r}"
            )
        if self.recompute_module and self.placement is not Placement.RECOMPUTE:
            raise ValueError(
                f"recompute_module applies to placement 'recompute' only; got placement "
                f"{self.placement.value!r} with recompute_module={self.recompute_module!r}"
            )


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


PlacementMap = Mapping[int, Placement | Decision | str]


def _as_placement(value: object) -> Placement:
    try:
        return Placement(value)
    except ValueError:
        raise ValueError(
            f"placement must be one of {[p.value for p in Placement]}; got {value!r}"
        ) from None


def simulate(
    trace: Trace,
    hardware: HardwareModel,
    placements: PlacementMap | None = None,
    *,
    step: int = -1,
    max_inflight_bytes: int | str | None = None,
    prefetch_bytes: int | str | None = None,
) -> Simulation:
    """Predict one step's device peak and time with alias families placed as ``placements`` say.

    See NOTE [ Simulation model ] and NOTE [ Reload policy ] in this module for what is modelled.
    The facts of the step the replay reads are derived from the trace at its first simulation
    and kept with it, so later simulations of the same trace (other placements, the anchors)
    cost the replay alone.

    Args:
        trace: the recorded step(s).
        hardware: link and disk bandwidths.
        placements: ``{family id: Placement | Decision | "cpu" ...}`` for families of ``step``;
            families left out are kept. ``None`` keeps everything.
        step: which recorded step to replay (Python indexing: ``-1`` is the last).
        max_inflight_bytes: back-pressure bound on D2H bytes in flight (int bytes or a size string
            like ``"512MiB"``); ``None``: twice the largest moved family, at least 256 MiB.
        prefetch_bytes: the look-ahead window, bytes reloaded (or being reloaded) and not yet
            unpacked; ``0`` reloads each family only when backward reaches the module that packed
            it; ``None``: as the executor does, ``max_inflight_bytes`` when that is given, else a
            quarter of the bytes the step moves, at least twice its largest moved family and at
            most the automatic ``max_inflight_bytes``.

    Returns:
        A :class:`Simulation`.

    Raises:
        TypeError: ``trace`` is not a :class:`Trace`, ``hardware`` not a :class:`HardwareModel`,
            or ``step`` not an int.
        ValueError: ``step`` is out of range; a placement names a family not in the step, moves or
            recomputes a parameter or a family packed in backward, has a ``reload_event`` outside
            the family's life, recomputes a family that no module's forward encloses, or rebuilds
            a family that the trace does not link to one parent family of the step, or whose
            parent is itself recomputed or rebuilt; a byte argument is negative or unparsable.

    Example:
        >>> import math, torch, offload
        >>> from offload.lifecycle import HardwareModel, Placement, simulate
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        >>> x = torch.randn(256, 64)
        >>> trace = offload.profile(lambda: model(x).sum().backward(), model)
        >>> keep = simulate(trace, HardwareModel.h200())
        >>> keep.peak_bytes == trace.peak_saved_bytes and keep.stall_s == 0.0
        True
        >>> moved = {f.family: Placement.CPU for f in trace.families() if not f.is_parameter}
        >>> ideal = HardwareModel(h2d_bytes_per_s=math.inf, d2h_bytes_per_s=math.inf,
        ...     duplex_bytes_per_s=math.inf, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9)
        >>> # prefetch_bytes=0: each reload starts as the backward of the module that packed it does
        >>> free = simulate(trace, ideal, moved, prefetch_bytes=0)
        >>> free.step_s == keep.step_s, free.peak_bytes < keep.peak_bytes
        (True, True)
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a lifecycle.Trace; got {type(trace).__name__}")
    if not isinstance(hardware, HardwareModel):
        raise TypeError(
            f"hardware must be a lifecycle.HardwareModel; got {type(hardware).__name__}"
        )
    with gc_paused():
        view = _StepView.of(trace, _step_index(trace, step))
        decisions = _resolve(view, placements)
        inflight, auto_window = _automatic_bounds(view, decisions, max_inflight_bytes)
        window = (
            auto_window
            if prefetch_bytes is None
            else parse_bytes(prefetch_bytes, name="prefetch_bytes")
        )
        return _Simulator(
            view, hardware, decisions, max_inflight_bytes=inflight, prefetch_bytes=window
        ).run()


def _automatic_bounds(
    view: _StepView, decisions: Mapping[int, Decision], max_inflight_bytes: int | str | None
) -> tuple[int, int]:
    """(max_inflight_bytes, look-ahead window) as the executor sets them for a step that stores
    the families ``decisions`` move: given ``max_inflight_bytes``, both are it; else twice the
    largest moved family, at least 256 MiB, and a quarter of the moved bytes, at least twice the
    largest and at most that in-flight bound."""
    if max_inflight_bytes is not None:
        given = parse_bytes(max_inflight_bytes, name="max_inflight_bytes")
        return given, given
    sizes = [view.facts[f].span_bytes for f, d in decisions.items() if d.placement.moves]
    return automatic_bounds(max(sizes, default=0), sum(sizes))


def _automatic_window_bytes(
    trace: Trace,
    placements: PlacementMap | None,
    *,
    step: int = -1,
    max_inflight_bytes: int | str | None = None,
) -> int:
    """The look-ahead window the executor gives ``trace``'s step ``step`` under ``placements``
    (what :func:`simulate` takes for ``prefetch_bytes=None``): for a pipeline, where each
    microbatch's forward is a step of its own with its own window, the window of one
    microbatch's trace (see :func:`lifecycle.predict_1f1b`)."""
    view = _StepView.of(trace, _step_index(trace, step))
    return _automatic_bounds(view, _resolve(view, placements), max_inflight_bytes)[1]


# -- anchors ------------------------------------------------------------------------------------

# NOTE [ Anchors ]
#     An anchor predicts what a user gets by running that alternative instead of a plan, so a
#     plan can be shown next to them (Plan.summary, `offload plan`, `offload profile
#     --gpu-budget`, the plan PNG) and benchmarks/bench_budget.py can measure them:
#       keep_all           a step without offload;
#       offload_all        the manager without a gpu_budget (min-memory mode): every movable
#                          family to the host, rebuildable outputs rebuilt, reloads through the
#                          executor's look-ahead window (not a planned move-everything, whose
#                          planned reloads held a quarter of what min-memory mode holds);
#       checkpoint_blocks  non-reentrant torch.utils.checkpoint around every block, the blocks
#                          the planner recomputes (NOTE [ Blocks ] in _blocks.py).
#     lifecycle.plan reports these, simulated, when it simulates its plan; above
#     ``simulate_records`` its model predicts keep_all and checkpoint_blocks (when it may
#     recompute every block) and leaves offload_all out (it has no look-ahead window). Measured
#     equal to the predicted peaks on CPU: tests/test_offload_budget.py
#     test_anchors_predict_what_running_each_alternative_holds.


def offload_all(
    trace: Trace,
    *,
    step: int = -1,
    tier: Placement | str = Placement.CPU,
    min_offload_bytes: int | str = 0,
    rebuild: bool = True,
) -> dict[int, Decision]:
    """The "offload everything" anchor: every movable activation family to ``tier``, as the
    manager's min-memory mode (no ``gpu_budget``) places them.

    Movable: not a parameter or buffer, and not packed while a backward ran. Reloads follow the
    default policy (NOTE [ Reload policy ]). A family whose records the trace links to one moved
    family (``TensorRecord.rebuild_from``: a GELU / SiLU / norm output) is rebuilt from it at
    unpack instead (``Placement.REBUILD``), as min-memory mode does (NOTE [ Activation recipes ]
    in offload); not one linked to a rebuilt family (the outer output of a chain), nor one
    whose parent is kept.

    Args:
        trace: the recorded step(s).
        step: which recorded step (``-1``: the last).
        tier: ``Placement.CPU`` or ``Placement.NVME``.
        min_offload_bytes: families smaller than this stay (the manager's ``min_offload_bytes``).
        rebuild: False moves the linked families too (every family to ``tier``).

    Raises:
        ValueError: ``tier`` is not a tier, or ``step`` / ``min_offload_bytes`` is out of range.

    Example:
        >>> import torch, offload
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> trace = offload.profile(lambda: model(torch.randn(4, 8)).sum().backward(), model)
        >>> sorted({d.placement.value for d in offload_all(trace).values()})
        ['cpu']
    """
    if tier not in (Placement.CPU, Placement.NVME):  # a str Enum: "cpu" matches too
        raise ValueError(f"tier must be 'cpu' or 'nvme'; got {tier!r}")
    placement = Placement(tier)
    floor = parse_bytes(min_offload_bytes, name="min_offload_bytes")
    view = _StepView.of(trace, _step_index(trace, step))
    out: dict[int, Decision] = {}
    rebuilt = Decision(placement=Placement.REBUILD)
    for f in sorted(view.facts.values(), key=lambda f: f.first_pack):  # parents first
        if not f.movable or f.span_bytes < floor:
            continue
        parents = {view.family_of_record.get(link) for link in f.rebuild_from}
        (parent,) = parents if len(parents) == 1 else (None,)
        moved = parent is not None and parent in out and out[parent].placement.moves
        out[f.family] = rebuilt if rebuild and moved else Decision(placement=placement)
    return out


def checkpoint_blocks(trace: Trace, *, step: int = -1) -> dict[int, Decision]:
    """The "checkpoint every block" anchor: recompute each block in backward, as non-reentrant
    ``torch.utils.checkpoint`` around every block does.

    A block is what the planner recomputes (NOTE [ Blocks ] in ``_blocks.py``): a module call at
    the first nesting level holding two or more calls that call modules themselves, a
    transformer's layers (a lone wrapper around them is looked through). Every movable family
    first packed inside a block is recomputed with the whole block (``recompute_module``),
    except the block's first family, which is kept: it is the block's input in the usual layer
    (a norm or a Linear saves it first), and checkpointing keeps its inputs. Families outside
    every block are kept.

    Example:
        >>> import torch, offload
        >>> nn = torch.nn
        >>> block = lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        >>> model = nn.Sequential(nn.Sequential(block(), block()))  # a wrapper around the blocks
        >>> trace = offload.profile(lambda: model(torch.randn(4, 8)).sum().backward(), model)
        >>> sorted({d.recompute_module for d in checkpoint_blocks(trace).values()})
        ['', '0.0', '0.1']
    """
    view = _StepView.of(trace, _step_index(trace, step))
    blocks = find_blocks(view.events)
    # Sorted once and cut per block: a scan of every family for each block (a transformer's
    # blocks grow with its families) took 25 of predict_anchors' 37 s at 40k records, profiled.
    movable = sorted((f for f in view.facts.values() if f.movable), key=lambda f: f.first_pack)
    first_packs = [f.first_pack for f in movable]
    out: dict[int, Decision] = {}
    for module, start, end in zip(
        blocks.module, blocks.start.tolist(), blocks.end.tolist(), strict=True
    ):
        lo, hi = view.events[start].index, view.events[end].index
        inside = movable[bisect_left(first_packs, lo) : bisect_right(first_packs, hi)]
        for i, f in enumerate(inside):
            out[f.family] = (
                Decision(placement=Placement.KEEP)
                if i == 0
                else Decision(placement=Placement.RECOMPUTE, recompute_module=module)
            )
    return out


def predict_anchors(
    trace: Trace,
    hardware: HardwareModel,
    *,
    step: int = -1,
    max_inflight_bytes: int | str | None = None,
    prefetch_bytes: int | str | None = None,
    min_offload_bytes: int | str = 0,
) -> dict[str, Simulation]:
    """Simulate docs/design.md's three anchors: keep all, offload all (to CPU), checkpoint every block.

    ``min_offload_bytes``: the manager's setting; families smaller than it stay, and so do
    weight casts smaller than it (``TensorRecord.weight_cast``: the manager keeps those as they
    are, and casts larger ones again at unpack).

    Returns:
        ``{"keep_all": ..., "offload_all": ..., "checkpoint_blocks": ...}``.

    Example:
        >>> import torch, offload
        >>> from offload.lifecycle import HardwareModel
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> trace = offload.profile(lambda: model(torch.randn(4, 8)).sum().backward(), model)
        >>> list(predict_anchors(trace, HardwareModel.h200()))
        ['keep_all', 'offload_all', 'checkpoint_blocks']
    """
    trace = with_small_casts_kept(trace, parse_bytes(min_offload_bytes, name="min_offload_bytes"))
    anchors = {
        "keep_all": None,
        "offload_all": offload_all(trace, step=step, min_offload_bytes=min_offload_bytes),
        "checkpoint_blocks": checkpoint_blocks(trace, step=step),
    }
    return {
        name: simulate(
            trace,
            hardware,
            placements,
            step=step,
            max_inflight_bytes=max_inflight_bytes,
            prefetch_bytes=prefetch_bytes,
        )
        for name, placements in anchors.items()
    }


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
        # See NOTE [ Simulation model ]: what the plan does not control, taken as fixed.
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
    """The parent family of each REBUILD family, checked. See NOTE [ Simulation model ]."""
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

    See NOTE [ Reload policy ].
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

    See NOTE [ Simulation model ].
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
        """Where each moved family's reload may start. See NOTE [ Reload policy ]."""
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
            # See NOTE [ Reload policy ]: the rebuild is its parent's first use when it comes first.
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
        """See NOTE [ Reload policy ]."""
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
