"""The 1F1B scenario of the simulator: schedule order, stash depth, per-stage peaks, overhead."""

from __future__ import annotations

import math

import pytest

from lifecycle import (
    HardwareModel,
    pipeline_trace,
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
    # Reloads look one microbatch ahead (as mgr.attach does): a stage that stashes several
    # microbatches peaks lower offloaded; the last stage, which holds one, does not.
    assert stages[0].offload.peak_bytes < stages[0].keep.peak_bytes
    assert 0 < stages[0].peak_saved_fraction < 1
    assert stages[-1].peak_saved_fraction == pytest.approx(1.0)


def test_ideal_link_makes_offloading_free_on_every_stage() -> None:
    for s in predict_1f1b(_one(), IDEAL, stages=3, microbatches=6):
        assert s.overhead == pytest.approx(1.0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="stages"):
        schedule_1f1b(0, 4)
    with pytest.raises(ValueError, match="stage"):
        pipeline_trace(_one(), stage=4, stages=4, microbatches=8)
    with pytest.raises(TypeError, match="trace"):
        pipeline_trace("x", stage=0, stages=2, microbatches=2)  # type: ignore[arg-type]
