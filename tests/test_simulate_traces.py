"""The simulator on real traces of the test models: bounds, monotonicity and accounting,
one step view per trace, and the garbage collector paused and restored."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from models import ALL_MODELS
from simulate_util import CPU, IDEAL, NVME, REBUILD, _check_accounting, _hw, _pointwise
from torch import nn

import offload
from offload.lifecycle import (
    Decision,
    HardwareModel,
    Trace,
    checkpoint_blocks,
    offload_all,
    simulate,
    transformer_trace,
)


def _links(trace: Trace) -> dict[int, int]:
    """``{family: parent family}`` for every family whose records the trace links to a parent
    that is not linked itself (a LayerNorm of a GELU output: only the LayerNorm's output, as
    the planner chooses; a rebuild reads a stored parent)."""
    links = {
        r.family: trace.records[r.rebuild_from].family for r in trace.records if r.rebuild_from >= 0
    }
    return {c: p for c, p in links.items() if p not in links}


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_keep_all_predicts_the_traced_peak(traces: dict[str, Trace], name: str) -> None:
    trace = traces[name]
    sim = simulate(trace, HardwareModel.h200())
    assert sim.peak_bytes == sim.base_bytes + trace.peak_saved_bytes
    assert sim.stall_s == 0.0 and sim.stalls == 0
    assert sim.step_s == sim.trace_step_s
    _check_accounting(sim)


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_ideal_link_offload_all_costs_nothing(traces: dict[str, Trace], name: str) -> None:
    trace = traces[name]
    keep = simulate(trace, IDEAL)
    for window in (0, None):
        sim = simulate(trace, IDEAL, offload_all(trace, rebuild=False), prefetch_bytes=window)
        assert sim.step_s == pytest.approx(keep.step_s, rel=1e-12)
        assert sim.stall_s == 0.0
        assert sim.peak_bytes <= keep.peak_bytes
        _check_accounting(sim)
    jit = simulate(trace, IDEAL, offload_all(trace, rebuild=False), prefetch_bytes=0)
    if len(offload_all(trace, rebuild=False)) > 1:
        assert jit.peak_bytes < keep.peak_bytes


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_no_placement_predicts_more_than_keeping_everything(
    traces: dict[str, Trace], name: str
) -> None:
    # A moved, recomputed or rebuilt family holds device bytes over a part of its kept life, never
    # more; a rebuild's parent, kept or moved, is needed no longer than it is used itself.
    trace = traces[name]
    keep = simulate(trace, IDEAL).peak_bytes
    for hw in (HardwareModel.h200(), _hw(1e8), _hw(1e6, duplex=1e6)):
        for placements in (
            offload_all(trace),
            offload_all(trace, tier=NVME),
            checkpoint_blocks(trace),
            {**offload_all(trace), **dict.fromkeys(_links(trace), REBUILD)},
        ):
            for inflight in (0, None):
                sim = simulate(trace, hw, placements, max_inflight_bytes=inflight)
                assert sim.peak_bytes <= keep
                _check_accounting(sim)


LADDER = (1e11, 1e10, 1e9, 1e8, 1e7, 1e6)


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_step_time_grows_as_the_reload_link_slows(traces: dict[str, Trace], name: str) -> None:
    # Copies out are instant here, so every family is reloaded, and only the reload link varies.
    trace = traces[name]
    sims = [
        simulate(trace, _hw(math.inf, h2d=bw, duplex=math.inf), offload_all(trace)) for bw in LADDER
    ]
    steps = [s.step_s for s in sims]
    assert steps == sorted(steps)
    assert sims[-1].stall_s > 0 and sims[-1].step_s > sims[-1].trace_step_s


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_step_time_grows_as_the_link_slows(traces: dict[str, Trace], name: str) -> None:
    # Both directions slow. A family whose copy out has not completed when backward needs it
    # takes its source back and is not reloaded (docs/design.md, stream ordering rule 3): on a slower link
    # that can save a reload, so monotonicity holds between rungs that reloaded the same bytes.
    trace = traces[name]
    sims = [simulate(trace, _hw(bw), offload_all(trace), max_inflight_bytes=0) for bw in LADDER]
    for fast, slow in itertools.pairwise(sims):
        if fast.bytes_reloaded == slow.bytes_reloaded:
            assert slow.step_s >= fast.step_s
    assert sims[-1].step_s > sims[-1].trace_step_s
    assert sims[-1].stall_s > 0 or sims[-1].backpressure_s > 0


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_more_room_never_predicts_a_slower_step(traces: dict[str, Trace], name: str) -> None:
    trace = traces[name]
    moved = offload_all(trace)
    for bw in (1e9, 1e7):
        # A larger look-ahead window. Copies out are instant: with a family still going out when
        # backward begins, a larger window can queue later families ahead of its reload (NOTE
        # [ Reload policy ]; test_window_can_queue_ahead_of_a_family_still_going_out), and so
        # can a walk last packed first where backward needs families in another order (the LSTM
        # op's saved tensors).
        hw = _hw(math.inf, h2d=bw, duplex=math.inf)
        by_window = [
            simulate(trace, hw, moved, prefetch_bytes=w).step_s
            for w in (0, 4 << 10, 64 << 10, 1 << 20, 1 << 30)
        ]
        if _needed_last_packed_first(trace, moved):
            assert by_window == sorted(by_window, reverse=True)
        # A larger in-flight bound, both directions slow.
        by_inflight = [
            simulate(trace, _hw(bw), moved, max_inflight_bytes=n, prefetch_bytes=0).step_s
            for n in (0, 16 << 10, 256 << 10, 1 << 30)
        ]
        assert by_inflight == sorted(by_inflight, reverse=True)


def _needed_last_packed_first(trace: Trace, placements: dict[int, Decision]) -> bool:
    """Whether backward first needs the moved families of ``placements`` (a rebuilt one's
    parent at the rebuild) in the order the window walks them: last packed first."""
    need = {}
    for r in trace.records:
        d = placements.get(r.family)
        if d is None or not r.unpack_events:
            continue
        fam = r.family
        if d.placement is REBUILD:
            fam = trace.records[r.rebuild_from].family
        need[fam] = min(need.get(fam, r.unpack_events[0]), r.unpack_events[0])
    first_pack = {f.family: f.first_pack_event for f in trace.families()}
    walk = sorted(need, key=first_pack.__getitem__, reverse=True)
    return walk == sorted(need, key=need.__getitem__)


def test_rebuilding_a_gelu_output_lowers_the_peak_where_it_was_gone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 64),
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 64),
    )
    x = torch.randn(32, 64)
    trace = offload.profile(lambda: model(x).sum().backward(), model)
    links = _links(trace)
    assert len(links) == 2  # each GELU's output, from the input that GELU saved
    families = {f.family: f for f in trace.families()}
    first, last = sorted(links, key=lambda f: families[f].first_pack_event)
    span = {f: families[f].span_bytes for f in families}
    hw = HardwareModel.h200()
    keep = simulate(trace, hw)
    # The peak is the second block's forward end, where the first GELU output is no longer needed
    # until backward; the second is saved right there (its pack event), so it stays at the peak.
    assert simulate(trace, hw, {first: REBUILD}).peak_bytes == keep.peak_bytes - span[first]
    assert simulate(trace, hw, {last: REBUILD}).peak_bytes == keep.peak_bytes
    both = simulate(trace, hw, dict.fromkeys(links, REBUILD))
    assert both.peak_bytes == keep.peak_bytes - span[first]
    # Parents kept: the step is the trace plus one elementwise kernel per rebuilt family.
    cost = sum(span[c] + span[p] for c, p in links.items()) / hw.pointwise_bytes_per_s
    assert both.rebuild_s == pytest.approx(cost, rel=1e-12)
    assert both.step_s == pytest.approx(keep.step_s + cost, rel=1e-12)
    assert both.bytes_rebuilt == span[first] + span[last]
    assert both.stall_s == 0.0 and both.bytes_reloaded == 0
    _check_accounting(both)


def _linked_transformer(layers: int) -> Trace:
    """transformer_trace with only each layer's GELU output (saved by mlp.fc2) linked to its
    input (saved by mlp.act): its LayerNorm outputs' links dropped."""
    trace = transformer_trace(layers=layers, hidden=256, tokens=512)
    act = {
        r.module.removesuffix(".mlp.act"): r.seq
        for r in trace.records
        if r.module.endswith(".mlp.act")
    }
    records = tuple(
        dataclasses.replace(
            r,
            rebuild_from=act[r.module.removesuffix(".mlp.fc2")]
            if r.module.endswith(".mlp.fc2")
            else -1,
        )
        for r in trace.records
    )
    return dataclasses.replace(trace, records=records)


def test_rebuild_on_a_transformer_trace() -> None:
    layers = 3
    trace = _linked_transformer(layers)
    links = _links(trace)
    assert len(links) == layers
    gelu_out = 4 * 512 * 256 * 2  # bytes of one [tokens, 4h] bf16 activation
    hw = _pointwise(IDEAL, 4.0e12)
    keep = simulate(trace, hw)
    rebuilt = dict.fromkeys(links, REBUILD)
    sim = simulate(trace, hw, rebuilt)
    # At forward's end (the keep-all peak) every GELU output is gone; backward rebuilds the last
    # layer's first, while the others are still gone.
    assert sim.peak_bytes == keep.peak_bytes - (layers - 1) * gelu_out
    assert sim.rebuild_s == pytest.approx(layers * 2 * gelu_out / 4.0e12, rel=1e-12)
    assert sim.step_s == pytest.approx(keep.step_s + sim.rebuild_s, rel=1e-12)
    # Parents on the host, reloaded by the default policy on an instant link: nothing waits.
    moved = simulate(trace, hw, {**rebuilt, **dict.fromkeys(links.values(), CPU)}, prefetch_bytes=0)
    assert moved.stalls == 0 and moved.step_s == pytest.approx(sim.step_s, rel=1e-12)
    assert moved.bytes_reloaded == layers * gelu_out
    # Reloads planned only for the parents' own unpacks: each rebuild starts one, a counted stall.
    parents = [trace.records[r.rebuild_from] for r in trace.records if r.rebuild_from >= 0]
    late = {p.family: Decision(placement=CPU, reload_event=p.unpack_events[0]) for p in parents}
    assert simulate(trace, hw, {**rebuilt, **late}).stalls == layers
    for s in (sim, moved):
        _check_accounting(s)


def test_simulations_of_one_trace_share_its_step_view_and_leave_no_cycles() -> None:
    """Every simulation of a step reads one view of it, built once per trace; a finished
    simulation's state is freed by reference counting (its copy jobs call back into it: the
    cycles are broken at the end), so no full collection has to walk the trace for it."""
    import gc

    from offload.lifecycle._sim_step import _StepView

    trace = _linked_transformer(3)
    hw = _pointwise(HardwareModel.h200(), 4.0e12)
    links = _links(trace)
    mixed = {
        **offload_all(trace),
        **dict.fromkeys(links, REBUILD),
        **dict.fromkeys(links.values(), NVME),
    }
    assert _StepView.of(trace, 0) is _StepView.of(trace, 0)
    first = [simulate(trace, hw, d) for d in (None, mixed, offload_all(trace, tier="nvme"))]
    # Until nothing is left: a collection can run callbacks that free more (an earlier test's
    # closed offload manager was found on a second one), which this test must not count.
    while gc.collect():
        pass
    gc.disable()
    try:
        again = [simulate(trace, hw, d) for d in (None, mixed, offload_all(trace, tier="nvme"))]
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert again == first
    assert unreachable == 0
    assert first[1].bytes_reloaded > 0 and first[1].rebuild_s > 0  # copies and rebuilds ran


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_restores_the_collector(enabled: bool) -> None:
    import gc

    from offload.lifecycle._nogc import gc_paused

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError), gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
