"""Storage faults the manager must survive on real file systems: a disk read-only, full or out of
inodes before the first step, a forked child, a tier that keeps failing, spill directories left
by a killed process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from models import ALL_MODELS, gpt_block

import offload


def step(case, mgr, s: int = 0) -> torch.Tensor:
    case.model.zero_grad(set_to_none=True)
    with mgr:
        loss = case.loss(case.batch(s))
    loss.backward()
    return loss.detach()


def assert_grads_equal(case, want) -> None:
    for k, g in want.grads().items():
        assert torch.equal(case.grads()[k], g), k


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted at ``path`` (needs CAP_SYS_ADMIN: skipped elsewhere)."""
    if sys.platform != "linux":
        pytest.skip("tmpfs is Linux")
    path.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
        )
    except OSError:
        pytest.skip("no mount command here")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_inodes(directory: Path) -> None:
    """Create empty files until the file system has no inode left (a real ENOSPC)."""
    for i in range(100_000):
        try:
            (directory / f"fill{i}").touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            return
    raise AssertionError("the file system never ran out of inodes")


def fill_blocks(directory: Path) -> None:
    """Write one file until the file system has no block left (a real ENOSPC)."""
    with open(directory / "fill.bin", "wb", buffering=0) as f:
        chunk = b"\xa5" * (64 << 10)
        while True:
            try:
                f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return


def make_unusable(mount: Path, how: str) -> None:
    """After the manager was made (``nvme_dir`` was checked then), before its first step."""
    if how == "read-only":
        done = subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True)
        assert done.returncode == 0, done.stderr
    elif how == "out of inodes":
        fill_inodes(mount)
    else:
        fill_blocks(mount)


UNUSABLE = {
    # how -> (mount options, the errno the real call gives, the error class with no tier left)
    "read-only": ("size=4m", errno.EROFS, offload.StorageError),
    "out of inodes": ("size=4m,nr_inodes=16", errno.ENOSPC, offload.StorageFullError),
    # The tier's default capacity is the free space when it is made: 0 B, a cap (no errno).
    # (This case passed before too; the two above raised a bare OSError.)
    "full": ("size=1m", None, offload.StorageFullError),
}


@pytest.mark.parametrize("how", list(UNUSABLE))
def test_unusable_disk_before_the_first_step_falls_back(tmp_path, caplog, how) -> None:
    """A disk read-only, out of inodes or full by the first step: making the private directory
    (or growing the file) fails with a real EROFS / ENOSPC. Every record goes to the cpu tier,
    counted in fallbacks, and the step is bitwise, with one warning naming the error (once per
    manager, for an error the OS gave); with only the nvme tier, pack raises
    StorageError / StorageFullError naming the directory (a bare OSError on every step before,
    for the read-only and the inode cases, even with the cpu tier)."""
    options, code, error = UNUSABLE[how]
    want = ALL_MODELS["gpt_block"](seed=0)
    want.step()
    with tmpfs(tmp_path / "disk", options) as mount:
        case = gpt_block(seed=0)
        both = offload.ActivationOffloader(
            case.model, min_offload_bytes=0, tiers=("nvme", "cpu"), nvme_dir=mount
        )
        other = gpt_block(seed=0)
        alone = offload.ActivationOffloader(
            other.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=mount
        )
        try:
            make_unusable(mount, how)
            caplog.set_level(logging.WARNING, logger="offload")
            for _ in range(2):  # the second step tries the disk again, and falls back again
                step(case, both)
                last = both.stats.last
                assert last.bytes_offloaded_nvme == 0 and last.bytes_offloaded_cpu > 0
                assert last.fallbacks == last.records_offloaded_cpu > 0
                assert_grads_equal(case, want)
            said = [
                r.getMessage() for r in caplog.records if "the nvme tier failed" in r.getMessage()
            ]
            if code is None:
                assert said == []  # a cap: the tier is full, not failing
            else:
                assert len(said) == 1 and str(mount) in said[0], said
                assert os.strerror(code) in said[0] and "went to the cpu tier" in said[0]
            with pytest.raises(error) as info, alone:
                other.loss(other.batch())
            assert str(mount) in str(info.value) and info.value.errno == code
            assert isinstance(info.value, offload.OffloadError)
        finally:
            both.close()
            alone.close()
        assert [p for p in os.listdir(mount) if p.startswith("offload-")] == []


def corrupt_nvme_records(mgr) -> int:
    """Flip bytes of every record of the last step in the spill file itself (through the tier's
    descriptor: the file is unlinked), after its writes completed, as a disk losing writes
    would. Returns how many records were changed."""
    ex = mgr._executor
    fams = [f for f in ex.step.families if f.handle is not None and f.tier.name == "nvme"]
    for fam in fams:
        fam.handle.wait()
    ex.poll()  # retire the copies out: backward reads the file, not the sources still held
    fd = mgr._tiers[0]._file.fd
    for fam in fams:
        n = min(64, fam.nbytes)
        at = fam.handle._offset
        good = os.pread(fd, n, at)
        os.pwrite(fd, bytes(b ^ 0x5A for b in good), at)
    return len(fams)


def drop_failed_step(mgr) -> None:
    """After a backward that raised: wait for the reads it had started (prefetches), so the
    step's families are all released before the next step."""
    gc.collect()
    for tier in mgr._tiers:
        with tier._lock:
            reads = list(tier._inflight)
        concurrent.futures.wait(reads)


def test_a_tier_failing_in_consecutive_steps_is_quarantined(tmp_path) -> None:
    """A disk losing writes: every step's NVMe records read back with a bad checksum (the
    spill file's bytes are changed on every step), so every backward raises ChecksumError.
    After QUARANTINE_FAILING_STEPS such steps the nvme tier is set aside with one warning
    (stats.tiers_quarantined), later steps put their records in the cpu tier and their
    gradients are bitwise; before, every step failed for ever."""
    from offload._faults import QUARANTINE_FAILING_STEPS

    want = ALL_MODELS["gpt_block"](seed=0)
    want.step()
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme", "cpu"), nvme_dir=tmp_path
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(QUARANTINE_FAILING_STEPS):
                case.model.zero_grad(set_to_none=True)
                with mgr:
                    loss = case.loss(case.batch())
                assert corrupt_nvme_records(mgr) > 0
                with pytest.raises(offload.ChecksumError):
                    loss.backward()
                del loss
                drop_failed_step(mgr)
            for _ in range(3):  # still corrupting: nothing is there to corrupt any more
                case.model.zero_grad(set_to_none=True)
                with mgr:
                    loss = case.loss(case.batch())
                assert corrupt_nvme_records(mgr) == 0
                loss.backward()
                last = mgr.stats.last
                assert last.bytes_offloaded_nvme == 0 and last.bytes_offloaded_cpu > 0
                assert_grads_equal(case, want)
        said = [str(w.message) for w in caught if "set aside" in str(w.message)]
        assert len(said) == 1, said
        assert "nvme tier failed in 3 consecutive steps" in said[0] and "crc32" in said[0]
        assert mgr.stats.total.tiers_quarantined == 1
        assert mgr._executor.live_families() == 0 and mgr._tiers[0].used_bytes == 0
    finally:
        mgr.close()


def test_the_last_tier_is_never_quarantined(tmp_path) -> None:
    """With no other tier to take its records, a failing tier stays: each step raises its
    ChecksumError as before, and nothing is set aside or warned about."""
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=tmp_path
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                with mgr:
                    loss = case.loss(case.batch())
                assert corrupt_nvme_records(mgr) > 0
                with pytest.raises(offload.ChecksumError):
                    loss.backward()
                del loss
                drop_failed_step(mgr)
        assert not [w for w in caught if "set aside" in str(w.message)]
        assert mgr.stats.total.tiers_quarantined == 0
    finally:
        mgr.close()


KILLED_CHILD = """
import sys, time
import torch
from torch import nn
import offload
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
mgr = offload.ActivationOffloader(
    model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=sys.argv[1]
)
with mgr:
    loss = model(torch.randn(32, 64)).sum()
loss.backward()
print(mgr._tiers[0].private_directory, flush=True)
time.sleep(600)  # killed here, its tier still open
"""


def test_directories_of_a_killed_process_are_removed_by_the_next_manager(tmp_path) -> None:
    """A process SIGKILLed during training leaves its private directory in nvme_dir; the next
    manager to start there removes it, and only such directories: not a symlink named like one
    (nor its target), not a live process's, not a name that is not ours, not a directory
    holding anything but a spill file. (Before, they piled up, one per killed run.)"""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, str(nvme)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None
        left = child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait(60)
    assert os.path.basename(left).startswith(f"offload-pid{child.pid}-"), left
    assert os.path.isdir(left)
    dead = child.pid
    # Killed between creating its spill file and unlinking it: removed with its spill file.
    unlinked_late = nvme / f"offload-rank0-local0-pid{dead}-abc_123"
    unlinked_late.mkdir()
    (unlinked_late / "spill.bin").write_bytes(b"x" * 4096)
    # Kept: a symlink named like ours (and its target), a live process's directory, one that
    # holds something else, names that are not ours.
    target = tmp_path / "target"
    target.mkdir()
    (target / "spill.bin").write_bytes(b"keep")
    kept = [
        nvme / f"offload-pid{dead}-symlink1",
        nvme / f"offload-pid{os.getppid()}-liveproc",
        nvme / f"offload-pid{dead}-notempty",
        nvme / f"offload-pid{dead}-",
        nvme / f"offload-pid{dead}x-abcdefgh",
        nvme / "my-data",
    ]
    kept[0].symlink_to(target, target_is_directory=True)
    for path in kept[1:]:
        path.mkdir()
    (kept[2] / "weights.pt").write_bytes(b"mine")
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=nvme
    )
    try:
        step(case, mgr)
        ours = mgr._tiers[0].private_directory
        assert sorted(os.listdir(nvme)) == sorted([os.path.basename(ours), *(p.name for p in kept)])
        assert (target / "spill.bin").read_bytes() == b"keep"
        assert (kept[2] / "weights.pt").read_bytes() == b"mine"
    finally:
        mgr.close()


def wait_child(pid: int, timeout_s: float) -> int | None:
    """The exit code of child ``pid``, or None (and the child killed) if it did not end within
    ``timeout_s``: the parent never hangs on a child that does."""
    for _ in range(int(timeout_s * 10)):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_trains_with_its_own_threads_and_files(tmp_path) -> None:
    """A manager used in a child forked after an NVMe step of the parent, with one of the
    parent's file writes still in flight at the fork: the child's step runs on I/O threads and
    a private directory of its own, its gradients are bitwise, and ``stats`` and ``close()``
    return (before, they waited for ever for the parent's I/O threads, which a child does not
    have). A graph saved before the fork raises a clear error in the child. The parent goes on
    unharmed."""
    want = ALL_MODELS["gpt_block"](seed=0)
    want.step()
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme", "cpu"), nvme_dir=tmp_path
    )
    gate = threading.Event()
    try:
        step(case, mgr)
        tier = mgr._tiers[0]
        parent_dir = tier.private_directory
        # One more forward whose writes wait at a gate the child never sees open.
        real = tier._file.write

        def gated(*args, **kwargs):
            gate.wait()
            return real(*args, **kwargs)

        tier._file.write = gated
        with mgr:
            held = case.loss(case.batch())
        pid = os.fork()
        if pid == 0:  # the child: report by exit status only, never return into pytest
            code = 1
            try:
                signal.alarm(60)  # a hang ends the child (the parent's wait sees no 0)
                try:
                    held.backward()
                except offload.OffloadError as e:
                    assert "fork" in str(e), e
                else:
                    raise AssertionError("a graph saved before the fork ran backward")
                del held
                step(case, mgr)
                for k, g in want.grads().items():
                    assert torch.equal(case.grads()[k], g), k
                last = mgr.stats.last
                assert last.bytes_offloaded_nvme > 0 and last.fallbacks == 0, last
                ex = mgr._executor
                assert ex.live_families() == 0 and ex.cpu_bytes == 0
                # The parent's staging of the writes in flight at the fork went back too.
                assert ex.pool.used_bytes == 0, ex.pool.used_bytes
                child_dir = mgr._tiers[0].private_directory
                assert child_dir != parent_dir and f"pid{os.getpid()}-" in child_dir
                mgr.close()
                assert not os.path.exists(child_dir) and os.path.isdir(parent_dir)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        assert wait_child(pid, 90) == 0, "the child failed or hung (its traceback is above)"
        gate.set()
        tier._file.write = real
        held.backward()
        del held
        assert os.path.isdir(parent_dir)
        step(case, mgr)
        assert_grads_equal(case, want)
        assert mgr.stats.last.bytes_offloaded_nvme > 0
    finally:
        gate.set()  # else close() waits for the gated writes
        mgr.close()


def test_the_executors_lifecycle_points_show_in_torch_profiler(tmp_path) -> None:
    """The executor's points are ``record_function`` ranges while torch's profiler runs: a step
    offloading to the cpu tier shows ``offload::prefetch`` (its backward triggers) and
    ``offload::drain`` (its stats read waits for the copies), and a step whose nvme tier is a
    full disk (a real ENOSPC: its capacity is the 0 B left) shows ``offload::fault`` for the
    records that fell back to the cpu tier; its gradients stay bitwise."""
    want = ALL_MODELS["gpt_block"](seed=0)
    want.step()

    def keys(tiers: tuple[str, ...], nvme_dir: Path | None) -> set[str]:
        case = gpt_block(seed=0)
        mgr = offload.ActivationOffloader(
            case.model, min_offload_bytes=0, tiers=tiers, nvme_dir=nvme_dir
        )
        try:
            if nvme_dir is not None:
                fill_blocks(nvme_dir)  # after the manager checked nvme_dir, as make_unusable
            with torch.profiler.profile() as prof:
                step(case, mgr)
                last = mgr.stats.last
            assert last.bytes_offloaded_cpu > 0 and last.reloads > 0, last
            assert last.fallbacks == (last.records_offloaded_cpu if nvme_dir else 0), last
            assert_grads_equal(case, want)
        finally:
            mgr.close()
        return {e.key for e in prof.key_averages() if e.key.startswith("offload::")}

    moved = keys(("cpu",), None)
    assert {"offload::prefetch", "offload::drain"} <= moved and "offload::fault" not in moved
    with tmpfs(tmp_path / "disk", "size=1m") as mount:
        faulted = keys(("nvme", "cpu"), mount)
        assert "offload::fault" in faulted, faulted
