"""The 1F1B scenario of the simulator: schedule order, stash depth, per-stage peaks, overhead."""

from __future__ import annotations

import dataclasses
import math

import pytest

from offload.lifecycle import (
    BudgetInfeasibleError,
    HardwareModel,
    Plan,
    pipeline_trace,
    plan,
    predict_1f1b,
    schedule_1f1b,
    simulate,
    transformer_trace,
)

IDEAL = HardwareModel(
    h2d_bytes_per_s=math.inf,
    d2h_bytes_per_s=math.inf,
    duplex_bytes_per_s=math.inf,
    disk_write_bytes_per_s=1e9,
    disk_read_bytes_per_s=1e9,
)


def _one() -> object:
    # Big enough for the H200 link to hide a good part of the copies.
    return transformer_trace(layers=2, hidden=4096, tokens=4096, base_bytes=1 << 30)


def test_schedule_matches_torch_pipelining_order() -> None:
    # Observed on 2 gloo ranks with 4 microbatches (notes/integration-facts.md, 3.1).
    got = [" ".join(f"{k}{m}" for k, m in a) for a in schedule_1f1b(2, 4)]
    assert got == ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]
    for p, m in [(4, 8), (4, 2), (1, 3)]:
        for actions in schedule_1f1b(p, m):
            assert sorted(actions) == sorted(
                [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            )
            # A microbatch's backward comes after its forward.
            assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_stage_keep_peak_is_its_stash_depth_times_one_microbatch(stage: int) -> None:
    one = _one()
    composed = pipeline_trace(one, stage=stage, stages=4, microbatches=8)
    assert len(composed.records) == 8 * len(one.records)
    per_mb = one.peak_saved_bytes
    depth = 4 - stage
    # Stage s holds `depth` microbatches' forward activations at its first backward.
    assert composed.peak_saved_bytes == pytest.approx(depth * per_mb, rel=0.02)
    sim = simulate(composed, IDEAL)
    assert sim.peak_bytes == (1 << 30) + composed.peak_saved_bytes


def test_predicted_stages_stash_less_further_down_and_offload_lowers_their_peak() -> None:
    stages = predict_1f1b(_one(), HardwareModel.h200(), stages=4, microbatches=8)
    assert [s.stashed_microbatches for s in stages] == [4, 3, 2, 1]
    peaks = [s.keep.peak_bytes for s in stages]
    assert peaks == sorted(peaks, reverse=True)
    for s in stages:
        assert s.offload.peak_bytes <= s.keep.peak_bytes
        assert s.overhead >= 1.0
    # Reloads look one microbatch ahead (as mgr.attach does): a stage that stashes more
    # microbatches keeps a smaller share of its saved bytes at its peak. The last stage, which
    # holds one, gains only the activation outputs min-memory mode rebuilds instead of holding
    # (offload_all's REBUILD placements: 0.75 here, 1.0 when everything was moved).
    fractions = [s.peak_saved_fraction for s in stages]
    assert stages[0].offload.peak_bytes < stages[0].keep.peak_bytes
    assert fractions == sorted(fractions)
    assert 0 < fractions[0] < fractions[-1] <= 1


def test_ideal_link_makes_offloading_free_on_every_stage() -> None:
    # Copies cost nothing on an ideal link: no stalls, and what offloading adds is the compute
    # of the outputs min-memory mode rebuilds, the same on every stage (each runs the same
    # microbatches' backwards).
    stages = predict_1f1b(_one(), IDEAL, stages=3, microbatches=6)
    extra = [s.offload.step_s - s.keep.step_s for s in stages]
    for s in stages:
        assert s.offload.stall_s == 0.0
        assert s.overhead >= 1.0
    assert extra == pytest.approx([extra[0]] * len(stages), rel=1e-9)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="stages"):
        schedule_1f1b(0, 4)
    with pytest.raises(ValueError, match="stage"):
        pipeline_trace(_one(), stage=4, stages=4, microbatches=8)
    with pytest.raises(TypeError, match="trace"):
        pipeline_trace("x", stage=0, stages=2, microbatches=2)  # type: ignore[arg-type]
    # Another type than int is a TypeError naming the argument (a ValueError before).
    with pytest.raises(TypeError, match=r"stages must be an int >= 1; got float 2\.0"):
        schedule_1f1b(2.0, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="microbatches must be an int >= 1; got bool"):
        schedule_1f1b(2, True)
    with pytest.raises(TypeError, match="stage must be an int"):
        pipeline_trace(_one(), stage=0.0, stages=2, microbatches=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an int"):
        predict_1f1b(_one(), IDEAL, stages=2, microbatches=2, step=0.0)  # type: ignore[arg-type]
    # A step the trace does not have, as lifecycle.plan refuses it (not wrapped around).
    for step in (1, -2):
        with pytest.raises(ValueError, match=r"step must be in \[-1, 0\] .*got " + str(step)):
            pipeline_trace(_one(), stage=0, stages=2, microbatches=2, step=step)
        with pytest.raises(ValueError, match=r"step must be in \[-1, 0\] .*got " + str(step)):
            predict_1f1b(_one(), IDEAL, stages=2, microbatches=2, step=step)


def _budget_below_stage0(fraction: float) -> int:
    """Base plus ``fraction`` of stage 0's kept saved peak (4 stages, 8 microbatches)."""
    # Kept, a stage peaks at the base plus its saved peak (test_stage_keep_peak_is_...).
    composed = pipeline_trace(_one(), stage=0, stages=4, microbatches=8)
    return (1 << 30) + int(fraction * composed.peak_saved_bytes)


def _moved(p: Plan | None) -> int:
    """Bytes a plan does not keep on the device (offloaded or recomputed)."""
    assert p is not None
    return sum(v for k, v in p.bytes_by_placement().items() if k != "keep")


def test_per_stage_budgets_move_bytes_where_the_stash_is_deep() -> None:
    budget = _budget_below_stage0(0.6)
    stages = predict_1f1b(
        _one(), HardwareModel.h200(), stages=4, microbatches=8, gpu_budget=[budget] * 4
    )
    moved = []
    for s in stages:
        assert s.planned is not None
        assert s.planned.gpu_budget_bytes == budget
        assert s.planned.predicted_peak_bytes <= budget
        moved.append(_moved(s.planned))
    # Stage 0 stashes 4 microbatches and must shed 40% of them; the last stash (1 microbatch,
    # a quarter of stage 0's) fits the budget as it is.
    assert stages[0].keep.peak_bytes > budget >= stages[-1].keep.peak_bytes
    assert moved[0] > 0
    assert moved[-1] < moved[0]
    assert moved[-1] == 0
    # The plan is lifecycle.plan's on that stage's composed timeline, not on one microbatch.
    composed = pipeline_trace(_one(), stage=0, stages=4, microbatches=8)
    direct = plan(composed, budget, HardwareModel.h200(), tiers=("cpu",), min_offload_bytes=0)
    assert stages[0].planned.bytes_by_placement() == direct.bytes_by_placement()
    assert stages[0].planned.predicted_peak_bytes == direct.predicted_peak_bytes


def test_one_budget_applies_to_every_stage_and_none_plans_nothing() -> None:
    # 1.6 microbatches' saved bytes: 2 stages' stage 0 (2 stashed) must move some, stage 1 not.
    budget = _budget_below_stage0(0.4)
    as_string = f"{budget}B"
    one = predict_1f1b(_one(), IDEAL, stages=2, microbatches=4, gpu_budget=as_string)
    listed = predict_1f1b(_one(), IDEAL, stages=2, microbatches=4, gpu_budget=(budget, budget))
    for a, b in zip(one, listed, strict=True):
        assert a.planned is not None and b.planned is not None
        assert a.planned.gpu_budget_bytes == budget
        assert a.planned.bytes_by_placement() == b.planned.bytes_by_placement()
        assert a.planned.predicted_peak_bytes <= budget
    assert [_moved(s.planned) > 0 for s in one] == [True, False]
    assert all(s.planned is None for s in predict_1f1b(_one(), IDEAL, stages=2, microbatches=4))


def test_bad_gpu_budget() -> None:
    def run(budget: object) -> None:
        predict_1f1b(_one(), IDEAL, stages=4, microbatches=8, gpu_budget=budget)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"gpu_budget.*one budget per stage \(4\).*got 3"):
        run(["8GiB"] * 3)
    with pytest.raises(TypeError, match=r"gpu_budget must be None, one budget.*got float"):
        run(8.0e9)
    with pytest.raises(TypeError, match=r"gpu_budget"):
        run(True)
    with pytest.raises(TypeError, match=r"gpu_budget\[2\]"):
        run(["8GiB", "8GiB", None, "8GiB"])
    with pytest.raises(ValueError, match=r"gpu_budget\[1\]='lots'"):
        run(["8GiB", "lots", "8GiB", "8GiB"])


def test_infeasible_stage_budget_names_the_stage() -> None:
    big, tiny = _budget_below_stage0(1.0) * 2, 1 << 30  # tiny: the base alone
    with pytest.raises(BudgetInfeasibleError, match=r"^stage 2: gpu_budget") as info:
        predict_1f1b(
            _one(), HardwareModel.h200(), stages=4, microbatches=8, gpu_budget=[big, big, tiny, big]
        )
    composed = pipeline_trace(_one(), stage=2, stages=4, microbatches=8)
    with pytest.raises(BudgetInfeasibleError) as direct:
        plan(composed, tiny, HardwareModel.h200(), tiers=("cpu",), min_offload_bytes=0)
    assert info.value.budget_bytes == tiny
    assert info.value.min_feasible_bytes == direct.value.min_feasible_bytes > tiny
    assert str(info.value) == f"stage 2: {direct.value}"


def test_pipeline_rounds_search_a_longest_lived_first_order() -> None:
    """In a 1F1B round lifetimes do not fall along pack order (each microbatch's backward comes
    a few forwards later), so the planner also offloads longest-lived first; on stage 1 of the
    synthetic h=4096 pipeline that order wins. A single step (LIFO backward) gets no such order."""
    from offload.lifecycle._plan_model import _Model, _Step
    from offload.lifecycle._plan_search import _Search

    one = transformer_trace(layers=8, hidden=4096, tokens=8192)
    # Without rebuildable GELU outputs (with them, 15 GiB fits either order equally fast).
    one = dataclasses.replace(
        one, records=tuple(dataclasses.replace(r, rebuild_from=-1) for r in one.records)
    )
    hw = HardwareModel.h200()

    def model_of(trace):
        view = _Step(trace, 0, 0)
        return _Model(view, hw, ("cpu",), math.inf, math.inf, None)

    assert not any(by_life for _, by_life, _ in model_of(one).variants)
    stage1 = pipeline_trace(one, stage=1, stages=4, microbatches=8)
    full = model_of(stage1)
    assert (0, True, False) in full.variants
    target = 15 * 2**30
    pack_order_only = model_of(stage1)
    pack_order_only.variants = [v for v in pack_order_only.variants if not v[1]]
    best, restricted = _Search(full).search(target), _Search(pack_order_only).search(target)
    assert best is not None and restricted is not None
    assert best.peak <= target and best.step_s < restricted.step_s
