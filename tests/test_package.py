"""Package-level contracts: import is free, the import direction holds, the public API is deliberate."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lifecycle
import offload

ROOT = Path(__file__).resolve().parents[1]


def test_import_is_free() -> None:
    code = """
import logging, os, sys, threading
env = dict(os.environ)
fds = set(os.listdir('/proc/self/fd'))
import offload, lifecycle, storage
import torch
assert not torch.cuda.is_initialized(), 'CUDA initialised at import'
assert threading.active_count() == 1, threading.enumerate()
assert dict(os.environ) == env, 'environment changed at import'
for name in ('offload', 'lifecycle', 'storage'):
    assert not logging.getLogger(name).handlers, name
assert not logging.getLogger().handlers, 'root handler added'
new = set(os.listdir('/proc/self/fd')) - fds
# torch may open its own library files; none of ours may stay open
for fd in new:
    try:
        target = os.readlink(f'/proc/self/fd/{fd}')
    except OSError:
        continue
    assert 'offload' not in target and 'nvme' not in target, target
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def _imports(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_import_direction() -> None:
    assert not _imports("lifecycle") & {"offload", "storage"}
    assert not _imports("storage") & {"offload", "lifecycle"}


def test_public_api_snapshot() -> None:
    # Change these lists deliberately, together with DESIGN.md's API section.
    assert offload.__all__ == [
        "ActivationOffloader",
        "activations",
        "OffloadStats",
        "StepStats",
        "Recorder",
        "profile",
        "plan",
        "probe_hardware",
        "Event",
        "EventKind",
        "Family",
        "ModuleSpan",
        "TensorRecord",
        "Trace",
        "Plan",
        "HardwareModel",
        "write_memory_png",
        "write_perfetto",
        "OffloadError",
        "BudgetInfeasibleError",
        "StorageError",
        "ChecksumError",
        "StorageFullError",
    ]
    assert lifecycle.__all__ == [
        "Clock",
        "MemoryProbe",
        "MonotonicClock",
        "Recorder",
        "StepBoundary",
        "profile",
        "SCHEMA_VERSION",
        "Event",
        "EventKind",
        "Family",
        "ModuleSpan",
        "TensorRecord",
        "Trace",
        "write_memory_png",
        "write_perfetto",
        "write_plan_png",
        "HARDWARE_SCHEMA_VERSION",
        "HardwareModel",
        "Placement",
        "Decision",
        "Simulation",
        "simulate",
        "offload_all",
        "checkpoint_blocks",
        "predict_anchors",
        "PLAN_SCHEMA_VERSION",
        "BudgetInfeasibleError",
        "Plan",
        "PlanEntry",
        "Prediction",
        "Trigger",
        "plan",
        "transformer_trace",
        "StagePrediction",
        "schedule_1f1b",
        "pipeline_trace",
        "predict_1f1b",
    ]
    for name in offload.__all__:
        assert getattr(offload, name).__doc__, name


def test_readme_commands_match_ci() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = readme.split("```")
    first = blocks[1]
    test_cmd = next(line for line in first.splitlines() if "pytest" in line).strip()
    assert test_cmd in ci, "the README's test command must be what .ci/run runs"


def test_docstring_examples_run() -> None:
    import doctest
    import importlib
    import pkgutil

    failed = attempted = 0
    for pkg in (offload, lifecycle):
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name in ("__main__",):
                continue
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
            failed += result.failed
            attempted += result.attempted
    assert failed == 0 and attempted >= 30
