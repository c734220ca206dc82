"""Storage faults at store and reload time: full tiers fall back to the next, I/O errors
and corrupted records raise, and nothing leaks (files private and removed)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import gc
import os
import stat

import faults
import pytest
import torch
from models import ALL_MODELS, gpt_block
from runtime_util import open_files, step
from torch import nn

import offload
from offload import storage


def settle(mgr) -> None:
    """Wait for the last step's copies out and retire them (copies retire in order), so that
    backward reads the tier, not the sources held while writing: polling before the writes had
    finished raced the I/O threads."""
    for fam in mgr._executor.step.families:
        if fam.handle is not None:
            fam.handle.wait()
    mgr._executor.poll()


def test_nvme_files_private_and_removed(tmp_path) -> None:
    case = gpt_block(seed=0)
    fds = open_files()
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=tmp_path
    )
    with mgr:
        loss = case.loss(case.batch())
    tier = mgr._tiers[0]
    private = tier.private_directory
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    assert os.listdir(private) == []  # the spill file is unlinked once opened
    assert any(private in p and "(deleted)" in p for p in open_files())
    loss.backward()
    mgr.close()
    assert not os.path.exists(private)
    assert not any(private in p for p in open_files())
    assert len(open_files()) <= len(fds)


def test_corrupted_nvme_record_raises_checksum_error(tmp_path) -> None:
    """A record whose file bytes changed raises ChecksumError in backward; once the graph is
    dropped the step holds nothing (file range, families, fds) and the next step is exact."""
    want = ALL_MODELS["gpt_block"](seed=0)
    want.step(1)
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=tmp_path
    )
    try:
        with mgr:
            loss = case.loss(case.batch())
        fds = len(open_files())  # the spill file is open from the first step
        settle(mgr)
        fam = max(mgr._executor.step.families, key=lambda f: f.nbytes)
        handle = fam.handle
        fd = mgr._tiers[0]._file.fd
        os.pwrite(fd, b"\x5a" * 64, handle._offset + 8)
        with pytest.raises(offload.ChecksumError) as info:
            loss.backward()
        assert isinstance(info.value, storage.ChecksumError)
        assert isinstance(info.value, offload.OffloadError)
        del info, loss
        gc.collect()
        tier = mgr._tiers[0]
        with tier._lock:
            reads = list(tier._inflight)  # prefetches backward started before it raised
        concurrent.futures.wait(reads)
        assert mgr._executor.live_families() == 0 and tier.used_bytes == 0
        assert len(open_files()) == fds
        case.model.zero_grad(set_to_none=True)
        step(case, mgr, 1)
        for k, g in want.grads().items():
            assert torch.equal(case.grads()[k], g), k
    finally:
        mgr.close()


def test_full_cpu_budget_falls_back_to_nvme(tmp_path) -> None:
    want = ALL_MODELS["gpt_block"](seed=0)
    want.step()
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model,
        min_offload_bytes=0,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget=64 << 10,
    )
    try:
        step(case, mgr)
        last = mgr.stats.last
        assert last.fallbacks > 0
        assert last.bytes_offloaded_nvme > 0 and last.bytes_offloaded_cpu <= 64 << 10
        for k, g in want.grads().items():
            assert torch.equal(case.grads()[k], g), k
    finally:
        mgr.close()


def test_full_store_without_fallback_raises_and_leaks_nothing() -> None:
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, cpu_budget=64 << 10)
    try:
        with pytest.raises(offload.StorageFullError) as info:
            with mgr:
                case.loss(case.batch())
        assert info.value.bytes_needed > 0
        assert "cpu_budget" in str(info.value)
        assert mgr._executor.live_families() == 0
        assert mgr._executor.cpu_bytes == 0
    finally:
        mgr.close()


def test_a_store_failing_at_the_steps_exit_fails_the_step_and_leaks_nothing() -> None:
    """The last op's saved tensor without gradient is stored at the step's exit (NOTE [ Fill
    after pack ]); when the host tier has no room for it, the exit raises StorageFullError as a
    pack would, and the step is failed as if its block had raised: nothing of it stays held
    while the loss lives, and its backward raises OffloadError. Before, the step went on with
    2 families (32 KiB of host memory) held by the loss, and its backward ran."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(64, 64)
    mask = torch.rand(64, 4096)  # 1 MiB, no gradient: mul saves it; more than cpu_budget
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, cpu_budget=256 << 10)
    try:
        loss = None
        with pytest.raises(offload.StorageFullError, match="cpu_budget"):
            with mgr:
                loss = (model(x).repeat(1, 64) * mask).sum()
        assert loss is not None  # the forward ran: the exit raised
        assert not mgr._step.deferred
        assert mgr._executor.live_families() == 0
        assert mgr._executor.cpu_bytes == 0
        with pytest.raises(offload.OffloadError, match="raised"):
            loss.backward()
        del loss
        with mgr:  # the manager goes on
            loss = model(x).sum()
        loss.backward()
        assert mgr.stats.last.records_offloaded_cpu == 2
    finally:
        mgr.close()


def test_real_enospc_falls_back_to_cpu(tmp_path) -> None:
    """A tiny tmpfs as nvme_dir: the disk really fills; records go to the next tier."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=256k tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        want = ALL_MODELS["gpt_block"](seed=0)
        want.step()
        case = gpt_block(seed=0)
        mgr = offload.ActivationOffloader(
            case.model, min_offload_bytes=0, tiers=("nvme", "cpu"), nvme_dir=mnt
        )
        try:
            step(case, mgr)
            last = mgr.stats.last
            assert last.fallbacks > 0 and last.bytes_offloaded_cpu > 0
            for k, g in want.grads().items():
                assert torch.equal(case.grads()[k], g), k
        finally:
            mgr.close()
    finally:
        os.system(f"umount {mnt}")


@contextlib.contextmanager
def gc_off():
    """The cyclic GC held off: what a step leaves behind must go by reference counting alone
    (a reference cycle would hold its tensors and host bytes until some later GC pass)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_an_io_error_writing_falls_back_and_frees_at_once(tmp_path, monkeypatch) -> None:
    """docs/design.md: on ENOSPC or EIO a record goes to the next tier. An EIO growing the spill file
    (raised by the write itself) sends it on; the step stays bitwise, and what it stored is
    freed when its graph goes, without a GC pass."""
    want = ALL_MODELS["gpt_block"](seed=0)
    want.step()
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    nvme.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)), at="submit")
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme", "cpu"), nvme_dir=tmp_path
    )
    try:
        with gc_off():
            step(case, mgr)
            last = mgr.stats.last
            assert last.fallbacks > 0 and last.bytes_offloaded_cpu > 0
            assert last.bytes_offloaded_nvme == 0
            assert mgr._executor.live_families() == 0 and mgr._executor.cpu_bytes == 0
            assert nvme.injected > 0
        for k, g in want.grads().items():
            assert torch.equal(case.grads()[k], g), k
    finally:
        mgr.close()


def test_an_io_error_reading_raises_and_frees_at_once(tmp_path, monkeypatch) -> None:
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=tmp_path
    )
    try:
        with gc_off():
            with mgr:
                loss = case.loss(case.batch())
            settle(mgr)  # backward reads the file (not the sources still held while writing)
            nvme.fail("read", OSError(errno.EIO, os.strerror(errno.EIO)))
            with pytest.raises(offload.StorageError) as info:
                loss.backward()
            assert info.value.errno == errno.EIO and nvme.injected > 0
            del info, loss
            assert mgr._executor.live_families() == 0
    finally:
        mgr.close()
    assert mgr._tiers[0].used_bytes == 0  # once the writes still in flight have completed


def test_cpu_budget_zero_with_nvme_sends_everything_to_nvme(tmp_path) -> None:
    """0 means no host room (it used to mean the default): with 'nvme' in tiers, every record
    goes there."""
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("cpu", "nvme"), nvme_dir=tmp_path, cpu_budget=0
    )
    try:
        assert mgr.config.cpu_budget_bytes == 0
        step(case, mgr)
        assert mgr.stats.last.bytes_offloaded_cpu == 0 < mgr.stats.last.bytes_offloaded_nvme
    finally:
        mgr.close()
