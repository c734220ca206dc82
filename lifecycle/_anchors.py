"""The anchors a plan is shown against: keep all, offload all, checkpoint every block
(NOTE [ Anchors ]), as decisions and as :func:`predict_anchors` simulates them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from offload.lifecycle._blocks import find_blocks
from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._placement import Decision, Placement
from offload.lifecycle._sim_engine import Simulation
from offload.lifecycle._sim_step import _step_index, _StepView
from offload.lifecycle._simulate import simulate
from offload.lifecycle._trace import Trace, with_small_casts_kept
from offload.lifecycle._units import parse_bytes

# NOTE [ Anchors ]
#     An anchor predicts what a user gets by running that alternative instead of a plan, so a
#     plan can be shown next to them (Plan.summary, `offload plan`, `offload profile
#     --gpu-budget`, the plan PNG) and benchmarks/bench_budget.py can measure them:
#       keep_all           a step without offload;
#       offload_all        the manager without a gpu_budget (min-memory mode): every movable
#                          family to the host, rebuildable outputs rebuilt, reloads through the
#                          executor's look-ahead window (not a planned move-everything, whose
#                          planned reloads hold a quarter of what min-memory mode holds);
#       checkpoint_blocks  non-reentrant torch.utils.checkpoint around every block, the blocks
#                          the planner recomputes (NOTE [ Blocks ] in _blocks.py).
#     lifecycle.plan reports these, simulated, when it simulates its plan; above
#     ``simulate_records`` its model predicts keep_all and checkpoint_blocks (when it may
#     recompute every block) and leaves offload_all out (it has no look-ahead window). Measured
#     equal to the predicted peaks on CPU: tests/test_offload_window.py
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
    default policy (NOTE [ Reload policy ] in _simulate.py). A family whose records the trace
    links to one moved family (``TensorRecord.rebuild_from``: a GELU / SiLU / norm output) is
    rebuilt from it at unpack instead (``Placement.REBUILD``), as min-memory mode does
    (NOTE [ Activation recipes ] in offload); not one linked to a rebuilt family (the outer
    output of a chain), nor one whose parent is kept.

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
