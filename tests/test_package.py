"""Package-level contracts: import is free, the import direction holds, the public API is deliberate."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import offload
from offload import lifecycle

ROOT = Path(__file__).resolve().parents[1]


def test_import_is_free() -> None:
    code = """
import logging, os, sys, threading
env = dict(os.environ)
fds = set(os.listdir('/proc/self/fd'))
import offload, offload.lifecycle, offload.storage
import torch
assert not torch.cuda.is_initialized(), 'CUDA initialised at import'
assert threading.active_count() == 1, threading.enumerate()
assert dict(os.environ) == env, 'environment changed at import'
for name in ('offload', 'offload.lifecycle', 'offload.storage'):
    assert not logging.getLogger(name).handlers, name
assert not logging.getLogger().handlers, 'root handler added'
assert 'transformers' not in sys.modules and 'lightning' not in sys.modules, 'a trainer imported'
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
    """The modules ``package``'s files import, by full name (``offload.storage._tier``)."""
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def _ours(names: set[str]) -> set[str]:
    """Which of offload's packages ``names`` reach: ``offload``, ``offload.lifecycle``, ..."""
    inner = ("offload.lifecycle", "offload.storage")
    found = set()
    for name in names:
        if name == "offload" or name.startswith("offload."):
            found.add(next((p for p in inner if name == p or name.startswith(p + ".")), "offload"))
    return found


def test_import_direction() -> None:
    # offload.lifecycle and offload.storage are pure: neither imports the other nor the manager.
    assert _ours(_imports("lifecycle")) <= {"offload.lifecycle"}
    assert _ours(_imports("storage")) <= {"offload.storage"}


def test_inner_packages_are_namespaced(tmp_path: Path) -> None:
    """A script whose folder holds its own ``storage.py`` and ``lifecycle.py`` (common names) still
    imports offload, and offload's packages never import as top-level ``storage`` or ``lifecycle``."""
    (tmp_path / "storage.py").write_text("raise ImportError('the user storage.py was imported')\n")
    (tmp_path / "lifecycle.py").write_text(
        "raise ImportError('the user lifecycle.py was imported')\n"
    )
    (tmp_path / "train.py").write_text(
        "import sys\n"
        "import torch\n"
        "import offload\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))\n"
        "with offload.ActivationOffloader(model, min_offload_bytes=0) as mgr:\n"
        "    model(torch.randn(4, 8)).sum().backward()\n"
        "assert mgr.stats.total.steps == 1 and mgr.stats.total.records_offloaded_cpu > 0\n"
        "assert 'storage' not in sys.modules and 'lifecycle' not in sys.modules\n"
        "import offload.storage, offload.lifecycle\n"
        "print(offload.storage.__name__, offload.lifecycle.__name__)\n"
    )
    r = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["offload.storage", "offload.lifecycle"]


def test_public_api_snapshot() -> None:
    # Change these lists deliberately, together with docs/design.md's API section.
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

    from offload import cli

    failed = attempted = 0
    for pkg in (offload, lifecycle, cli):
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name in ("__main__",):
                continue
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
            failed += result.failed
            attempted += result.attempted
    assert failed == 0 and attempted >= 30


def test_no_top_level_import_of_the_inner_packages() -> None:
    """Code, docstrings, docs and scripts say ``offload.lifecycle`` / ``offload.storage``: from a
    checkout on ``sys.path`` the bare top-level name would still import, as a second copy."""
    bare = re.compile(
        r"(?<!from offload )\bimport (lifecycle|storage)\b|\bfrom (lifecycle|storage)\b"
    )
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.sh"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    found = [
        f"{name}:{i}"
        for name in tracked
        if (ROOT / name).is_file()
        for i, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if bare.search(line)
    ]
    assert tracked and not found, found


def test_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    """The built wheel installs ``offload`` only: lifecycle/ and storage/ land inside it."""
    src = tmp_path / "src"  # pip builds in the source folder: a copy keeps the checkout clean
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "offload", "lifecycle", "storage"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True)
        else:
            shutil.copy(ROOT / name, src / name)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("offload-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "offload",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    for name in (
        "lifecycle/_trace.py",
        "lifecycle/py.typed",
        "storage/_tier.py",
        "storage/py.typed",
    ):
        assert f"offload/{name}" in names, name
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
