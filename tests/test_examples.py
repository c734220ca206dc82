"""The examples run as their docstrings give them, each in a process of its own, and report
what they promise (the README's first command runs ``examples/demo.py``).

``examples/pipeline_offload.py`` runs in tests/test_pipelining.py; ``train_gpt.py`` under the
profiling CLI in tests/cli/test_cli_profile.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT_S = 300  # a busy 2-core machine; each takes 2-20 s here


def _run(tmp_path: Path, script: str, *args: str) -> str:
    # A cache directory of the test's own: the demo measures this machine's copy and disk
    # speeds once and caches them (offload.probe_hardware).
    env = {**os.environ, "OFFLOAD_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("tiers", ["cpu", "cpu,nvme"])
def test_demo_profiles_plans_and_trains_exactly(tmp_path: Path, tiers: str) -> None:
    out = _run(tmp_path, "demo.py", "--steps", "2", "--tiers", tiers, "--out", "demo")
    assert "planned step's gradients bitwise equal to no offloading: yes" in out
    assert "plan for a budget of" in out and "checkpoint_blocks" in out
    assert f"offloading to {tiers.replace(',', '+')}" in out
    # The report accounts for the rebuilt activations too (GELU and LayerNorm outputs where the
    # plan, which depends on this machine's timings, rebuilds them), not only what moved.
    assert re.search(r", [0-9.]+ MiB rebuilt from their inputs \(\d+ records\)", out), out
    # What was measured stands beside what was predicted, and the budget holds (it printed the
    # predicted peak alone); the ratio column is explained; a CPU run says it saves nothing.
    held = re.search(
        r"measured peak: ([0-9.]+) MiB of (saved activations held on the device|device memory "
        r"allocated \(CUDA peak\)), against a predicted peak of ([0-9.]+) MiB and a budget of "
        r"([0-9.]+) MiB",
        out,
    )
    assert held, out
    assert 0 < float(held[1]) <= float(held[4]), held[0]
    assert "x keep all: that time over keeping everything on the device" in out
    if "CUDA" not in held[2]:
        assert out.count("so this run exercises the whole path but saves no memory") == 2, out
    written = {p.name for p in (tmp_path / "demo").iterdir()}
    assert {"trace.json", "trace.perfetto.json", "memory.png"} <= written
    if "nvme" in tiers:
        # The spill files are unlinked once open, and gone with the manager.
        assert not any((tmp_path / "demo" / "nvme").iterdir())


def test_profile_minimal_saves_and_loads_a_trace(tmp_path: Path) -> None:
    out = _run(tmp_path, "profile_minimal.py")
    assert "saved and reloaded" in out and "activation bytes saved for backward" in out


def test_gpt_self_check(tmp_path: Path) -> None:
    out = _run(tmp_path, "gpt.py")
    assert "parameters, loss" in out and "blocks.0.mlp.fc2" in out


def test_hf_trainer_example_is_exact(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = _run(tmp_path, "hf_trainer.py")
    assert "final weights bitwise equal to training without offload: yes" in out, out
    assert "steps: 8 " in out and "unplanned records: 0" in out, out


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["fsdp2_offload.py", "tp_offload.py"])
def test_parallel_examples_are_exact_on_two_gloo_ranks(tmp_path: Path, script: str) -> None:
    out = _run(tmp_path, script)
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2, out
    for line in lines:
        assert line.endswith("gradients bitwise equal"), line
