"""The package's promises: import is free, the API is deliberate, examples run, no upward imports."""

from __future__ import annotations

import ast
import doctest
import importlib
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from offload import storage

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "storage"


def test_public_api_snapshot():
    assert storage.__all__ == [
        "HostPool",
        "HostRegion",
        "shared_host_pool",
        "claim_shared_host_pool",
        "PoolShare",
        "HostTier",
        "NvmeTier",
        "StoredHandle",
        "Tier",
        "CopyEngine",
        "Transfer",
        "byte_view",
        "finish_elsewhere",
        "CgroupMemory",
        "cgroup_memory",
        "default_cpu_budget_bytes",
        "default_nvme_budget_bytes",
        "kvikio_available",
        "local_world_size",
        "measure_disk_bandwidth",
        "rank_share_bytes",
        "ALIGNMENT_BYTES",
        "CHECKSUM_CHUNK_BYTES",
        "IO_THREADS",
        "ChecksumError",
        "StorageError",
        "StorageFullError",
    ]
    for name in storage.__all__:
        assert getattr(storage, name) is not None


def test_error_hierarchy():
    assert issubclass(storage.StorageError, OSError)
    assert issubclass(storage.ChecksumError, storage.StorageError)
    assert issubclass(storage.StorageFullError, storage.StorageError)


def test_errors_survive_pickling():
    import pickle

    err = storage.StorageFullError("full", directory="/d", bytes_needed=5, errno=28)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.directory, back.bytes_needed, back.errno, str(back)) == (
        storage.StorageFullError,
        "/d",
        5,
        28,
        str(err),
    )


def test_storage_never_imports_offload_or_lifecycle():
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                ours = name == "offload" or name.startswith("offload.")
                assert not ours or name.startswith("offload.storage"), f"{path.name} imports {name}"
                assert name.split(".")[0] not in ("lifecycle", "storage"), f"{path.name}: {name}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_import_is_free():
    script = textwrap.dedent(
        """
        import logging, os, sys, threading
        import torch
        threads = {t.name for t in threading.enumerate()}
        fds = set(os.listdir("/proc/self/fd"))
        env = dict(os.environ)
        from offload import storage
        assert {t.name for t in threading.enumerate()} == threads, threading.enumerate()
        assert set(os.listdir("/proc/self/fd")) == fds
        assert dict(os.environ) == env
        assert not torch.cuda.is_initialized()
        assert logging.getLogger("offload.storage").handlers == []
        assert logging.getLogger().handlers == []
        # offload/__init__ runs first (the parent package), but kvikio waits for an NVMe tier
        # that asks for it, and nothing generic lands at the top level.
        for name in ("kvikio", "storage", "lifecycle"):
            assert name not in sys.modules, name
        print("FREE", threading.active_count())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["FREE", "1"]


MODULES = sorted(p.stem for p in PACKAGE.glob("_*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module, monkeypatch):
    monkeypatch.setattr(storage._pool, "_shared_pools", {})  # examples must not touch the real one
    mod = importlib.import_module(f"offload.storage.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_public_symbols_have_examples():
    missing = []
    for name in storage.__all__:
        obj = getattr(storage, name)
        if isinstance(obj, int):
            continue
        if "Example:" not in (obj.__doc__ or ""):
            missing.append(name)
    assert missing == []
