"""The failing tiers of ``tests/faults.py`` keep the ``Tier`` contract while they fail: the
errors arrive where ``storage/_tier.py`` says, a failed write gives its space back, a gated
failure is waited for by ``close()``, and managers build them under ``faults.install``."""

from __future__ import annotations

import errno
import os
import threading

import faults
import pytest
import torch
from torch import nn

import offload
from offload import storage

MiB = 1 << 20


@pytest.fixture
def pool():
    with storage.HostPool(8 * MiB, slab_bytes=MiB) as p:
        yield p


def test_a_write_refused_at_submit_holds_nothing(pool) -> None:
    with faults.FailingHostTier(pool) as tier:
        tier.faults.fail("write", storage.StorageFullError("injected"), at="submit", calls={0})
        with pytest.raises(storage.StorageFullError, match="injected"):
            tier.write(torch.ones(1024))
        assert tier.used_bytes == 0 and pool.used_bytes == 0
        h = tier.write(torch.ones(1024))  # call 1: not armed
        h.wait()
        assert tier.faults.calls["write"] == 2 and tier.faults.injected == 1
        tier.free(h)


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_write_failing_at_completion_releases_its_record(kind: str, pool, tmp_path) -> None:
    tier: storage.Tier = (
        faults.FailingHostTier(pool)
        if kind == "cpu"
        else faults.FailingNvmeTier(tmp_path, capacity_bytes=4 * MiB, pool=pool)
    )
    with tier:
        tier.faults.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)))  # type: ignore[attr-defined]
        h = tier.write(torch.ones(1024))
        with pytest.raises(storage.StorageError) as info:
            h.wait()
        assert info.value.errno == errno.EIO and h.freed
        assert tier.used_bytes == 0 and pool.used_bytes == 0
        with pytest.raises(storage.StorageError):
            tier.read(h, torch.empty(1024))  # every read of a failed write re-raises


def test_an_nvme_error_is_what_a_failing_disk_gives(pool, tmp_path) -> None:
    with faults.FailingNvmeTier(tmp_path, capacity_bytes=4 * MiB, pool=pool) as tier:
        tier.faults.fail("write", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        region = pool.allocate(4096)
        h = tier.write(region)
        error = h.written.exception()
        assert isinstance(error, storage.StorageFullError)
        assert error.directory == os.fspath(tmp_path) and error.bytes_needed == 4096
        assert "No space left on device" in str(error)
        assert not region.released  # a region source stays the caller's, for the next tier
        region.release()


def test_a_read_failing_at_completion_leaves_the_record_readable(pool, tmp_path) -> None:
    with faults.FailingNvmeTier(tmp_path, capacity_bytes=4 * MiB, pool=pool) as tier:
        x = torch.arange(1024.0)
        h = tier.write(x)
        tier.faults.fail("read", storage.ChecksumError("injected"), calls={0})
        with pytest.raises(storage.ChecksumError):
            tier.read(h, torch.empty(1024)).wait()
        out = torch.empty(1024)
        tier.read(h, out).wait()
        assert torch.equal(out, x)
        tier.free(h)
        assert tier.used_bytes == 0


def test_a_gated_failure_arrives_when_the_gate_opens_and_close_waits_for_it(pool) -> None:
    gate = threading.Event()
    tier = faults.FailingHostTier(pool)
    tier.faults.fail("write", storage.StorageError("late"), gate=gate)
    h = tier.write(torch.ones(1024))
    assert not h.done() and tier.transfers_running
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    tier.close()  # waits for the write in flight
    opener.join()
    assert h.done() and isinstance(h.written.exception(), storage.StorageError)
    assert pool.used_bytes == 0


def test_fault_arguments_are_checked() -> None:
    f = faults.Faults()
    with pytest.raises(ValueError, match="method"):
        f.fail("free", OSError())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at"):
        f.fail("read", OSError(), at="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gate"):
        f.fail("read", OSError(), at="submit", gate=threading.Event())


def test_install_makes_a_managers_tiers_failing_ones(monkeypatch, tmp_path) -> None:
    armed = faults.install(monkeypatch)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    mgr = offload.ActivationOffloader(
        model, tiers=("nvme", "cpu"), nvme_dir=tmp_path, min_offload_bytes=0
    )
    try:
        armed["nvme"].fail("write", storage.StorageFullError("injected: no room"), at="submit")
        with mgr:
            loss = model(torch.randn(32, 64)).sum()
        loss.backward()
        nvme, host = mgr._tiers
        assert isinstance(nvme, faults.FailingNvmeTier) and isinstance(nvme, storage.NvmeTier)
        assert isinstance(host, faults.FailingHostTier) and isinstance(host, storage.HostTier)
        last = mgr.stats.last
        assert armed["nvme"].injected > 0 and last.fallbacks == armed["nvme"].injected
        assert last.records_offloaded_cpu > 0 and last.records_offloaded_nvme == 0
    finally:
        mgr.close()
