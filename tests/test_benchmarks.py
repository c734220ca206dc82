"""The benchmarks' own logic on CPU: bench_budget's budget points and gpu_check.sh's sections.

The benchmarks run on a GPU only where one is lent (benchmarks/gpu_check.sh), so what decides
what they measure, and whether a short device call returns anything, is checked here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import offload
from offload.lifecycle import transformer_trace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_budget  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("layers", [4, 8])
def test_bench_budget_points_are_feasible_on_a_gpu_trace(layers: int) -> None:
    """On a CUDA trace the margin, max(5% of the budget, 256 MiB), outweighs a quarter of a
    small model's activations: the sweep's budgets are fractions of the range from the smallest
    feasible budget to keep-all's peak, and the planner meets every one. (The old points,
    ``base + f x (P - base)``, at 25% and 50% were infeasible on the 4-layer trace, 1 GiB
    saved, and at 25% on the 8-layer one.)"""
    base = 1 * GiB
    trace = transformer_trace(layers=layers, hidden=2048, tokens=4096, base_bytes=base)
    assert trace.metadata["device"].startswith("cuda")  # the planner's CUDA margin applies
    hw = offload.HardwareModel.h200()
    args = argparse.Namespace(min_offload_bytes=1 * MiB)
    floor = bench_budget.smallest_feasible_budget(args, trace, hw)
    peak = trace.peak_memory_bytes
    assert base < floor < peak
    with pytest.raises(offload.BudgetInfeasibleError):
        offload.plan(trace, floor - 1, hw, min_offload_bytes=args.min_offload_bytes)
    points = bench_budget.budget_points([0.25, 0.5, 0.75], floor, peak)
    assert list(points) == [0.25, 0.5, 0.75]
    assert floor < points[0.25] < points[0.5] < points[0.75] < peak
    for budget in (floor, *points.values()):
        plan = offload.plan(trace, budget, hw, min_offload_bytes=args.min_offload_bytes)
        assert plan.predicted_peak_bytes <= plan.target_bytes


def test_bench_budget_points_of_an_empty_range_are_the_floor() -> None:
    """Keep-all already at (or under) the smallest feasible budget: every point is that budget,
    never one below it."""
    assert bench_budget.budget_points([0.25, 1.0], 100, 80) == {0.25: 100, 1.0: 100}
    assert bench_budget.budget_points([0.5], 100, 300) == {0.5: 200}


def test_gpu_check_starts_only_what_can_finish_and_returns_this_calls_files(
    tmp_path: Path,
) -> None:
    """benchmarks/gpu_check.sh on CPU, with 100 s in all: the GPU tests (expected 180 s) are not
    started, ``offload info`` (20 s) runs and its JSON stays parseable although warnings are
    emitted (Python's EncodingWarning, to stderr), and $OUT gets at most 8 files, none of them
    an earlier run's."""
    results, out, disk = tmp_path / "results", tmp_path / "out", tmp_path / "disk"
    results.mkdir()
    disk.mkdir()
    for name in ("budget-h2048.md", "step-h2048.md", "budget-h4096.md", "gpu_tests.txt"):
        (results / name).write_text("an earlier run's\n")  # as committed results would be
    old = time.time() - 3600
    for f in results.iterdir():
        os.utime(f, (old, old))
    env = dict(os.environ, TOTAL_S="100", PARTS="tests,info", OUT=str(out),
               RESULTS_DIR=str(results), NVME_DIR=str(disk), PROBE_BYTES="8MiB",
               PYTHONWARNDEFAULTENCODING="1")  # fmt: skip
    r = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    sections = (results / "sections.txt").read_text()
    assert "tests: skipped: expected 180 s" in sections, sections
    assert "info: exit 0" in sections, sections
    info = json.loads((results / "info.json").read_text())  # stdout alone
    assert info["nvme"]["path"] == str(disk.resolve())
    assert "EncodingWarning" in (results / "info.err").read_text()  # a warning was emitted
    returned = sorted(p.name for p in out.iterdir())
    assert returned == ["gpu-results.tgz", "hardware.txt", "sections.txt"], returned
    with tarfile.open(out / "gpu-results.tgz") as tar:
        packed = sorted(Path(n).name for n in tar.getnames())
    assert packed == ["hardware.txt", "info.err", "info.json", "sections.txt"], packed
    assert (results / "budget-h2048.md").read_text() == "an earlier run's\n"  # left as it was


def test_bench_hooks_compares_with_a_revision(tmp_path: Path) -> None:
    """``--baseline-rev``: both trees run in fresh processes each round, and the report gains
    one row per figure with both medians and the ratio of the rounds (no timing asserted)."""
    import bench_hooks

    out = tmp_path / "out"
    result = bench_hooks.main(
        ["--tensors", "40", "--repeats", "1", "--rounds", "1", "--baseline-rev", "HEAD",
         "--out", str(out)]
    )  # fmt: skip
    cmp = result["baseline"]
    assert cmp["rounds"] == 1 and set(cmp["figures"]) == {
        "identity_hooks",
        "offload_min_memory_minus_identity",
        "offload_budget_minus_identity",
    }
    for row in cmp["figures"].values():
        assert len(row["this_us"]) == len(row["baseline_us"]) == 1
    report = (out / "hooks.md").read_text()
    assert f"## Against {cmp['rev']}" in report and "| offload, min-memory |" in report
    assert json.loads((out / "hooks.json").read_text())["baseline"]["rev"] == cmp["rev"]


def test_bench_hooks_tanh_workload_saves_each_tensor_once(tmp_path: Path) -> None:
    """``--workload tanh``: every saved tensor is a family of its own, reported apart from the
    default workload's files (no timing asserted)."""
    import bench_hooks

    out = tmp_path / "out"
    result = bench_hooks.main(
        ["--workload", "tanh", "--tensors", "80", "--repeats", "1", "--out", str(out)]
    )
    assert result["workload"] == "tanh" and result["packs_per_step"] == 80
    mm = result["offload"]["min_memory"]
    assert mm["records"] == mm["families_offloaded"] == 80
    assert sorted(p.name for p in out.iterdir()) == ["hooks-tanh.json", "hooks-tanh.md"]
    assert "each tanh saves its output once" in (out / "hooks-tanh.md").read_text()


def test_profile_hooks_counts_calls_per_saved_tensor() -> None:
    import profile_hooks

    out = profile_hooks.main(["--steps", "1", "--top", "5"])
    assert out["saved_tensors_per_step"] == 2000 and out["python_calls_per_saved_tensor"] > 10
    assert len(out["functions"]) == 5 and 0 < out["stages"]["pack hook"] < 1
