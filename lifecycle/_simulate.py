"""A discrete-event model of one training step under a placement: predicted device peak and time.
Here: :func:`simulate` and what it models (the NOTEs); the replay itself is in _sim_engine.py.

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

from collections.abc import Mapping

from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._nogc import gc_paused
from offload.lifecycle._placement import Decision, PlacementMap
from offload.lifecycle._sim_engine import Simulation, _Simulator
from offload.lifecycle._sim_step import _resolve, _step_index, _StepView
from offload.lifecycle._trace import Trace
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
