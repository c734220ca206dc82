"""The anchors: checkpoint_blocks (by hand and on a transformer block, its work linear in
the step), and the anchors and the step choice."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType, ModuleType

import pytest
from models import gpt_block
from simulate_util import IDEAL, KEEP, RECOMPUTE, _check_accounting, _with_block

import offload
from offload.lifecycle import (
    Decision,
    HardwareModel,
    Trace,
    checkpoint_blocks,
    offload_all,
    predict_anchors,
    simulate,
    transformer_trace,
)


def test_checkpoint_blocks_keeps_each_block_input() -> None:
    decisions = checkpoint_blocks(_with_block())
    assert decisions == {
        0: Decision(placement=KEEP),
        1: Decision(placement=RECOMPUTE, recompute_module="blk"),
    }


def test_checkpoint_blocks_on_a_transformer_block(traces: dict[str, Trace]) -> None:
    trace = traces["gpt_block"]
    decisions = checkpoint_blocks(trace)
    assert {d.recompute_module for d in decisions.values()} == {"", "attn", "mlp"}
    sim = simulate(trace, IDEAL, decisions)
    spans = {s.module: s for s in trace.module_spans() if s.phase == "forward"}
    assert sim.recompute_s == pytest.approx(spans["attn"].duration_s + spans["mlp"].duration_s)
    assert sim.step_s == pytest.approx(sim.trace_step_s + sim.recompute_s)
    assert sim.bytes_recomputed > 0
    assert sim.peak_bytes < simulate(trace, IDEAL).peak_bytes
    _check_accounting(sim)


def _lines_run(fn: Callable[[], object], module: ModuleType) -> int:
    """How many lines of ``module``'s source ``fn()`` executes: a measure of work that, unlike a
    clock, is the same on every run."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        nonlocal count
        if frame.f_code.co_filename != module.__file__:
            return None
        count += event == "line"
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def test_checkpoint_blocks_work_grows_with_the_step_not_blocks_times_families() -> None:
    """Each block's families are cut from one sorted list: a scan of every family per block
    made predict_anchors quadratic (25 of its 37 s at 40k records, profiled)."""
    from offload.lifecycle import _anchors as simulator

    work = {}
    for layers in (16, 64):
        trace = transformer_trace(layers=layers, hidden=256, tokens=512)
        decisions = checkpoint_blocks(trace)  # the step's view is built here, once
        assert sum(d.placement is KEEP for d in decisions.values()) == layers  # each block's input
        work[layers] = _lines_run(lambda t=trace: checkpoint_blocks(t), simulator)
    # 4x the layers (blocks and families alike): linear work is 4x; the scan made it 10.4x.
    assert work[64] <= 4.5 * work[16], work


def test_anchors_and_step_choice() -> None:
    case = gpt_block(seed=0)
    trace = offload.profile(case.step, case.model, steps=2)
    hw = HardwareModel.h200()
    anchors = predict_anchors(trace, hw, step=0)
    assert list(anchors) == ["keep_all", "offload_all", "checkpoint_blocks"]
    assert anchors["offload_all"] == simulate(trace, hw, offload_all(trace, step=0), step=0)
    first, last = simulate(trace, hw, step=0), simulate(trace, hw)
    assert last == simulate(trace, hw, step=1)
    assert first.peak_bytes == last.peak_bytes  # same model, same sizes
    with pytest.raises(ValueError, match="family"):
        simulate(trace, hw, offload_all(trace, step=0), step=1)  # step 0's families
