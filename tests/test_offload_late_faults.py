"""Late storage failures: writes that fail after pack returned go to the next tier from
the held source, with the stats, the logs and the tiers' accounts right."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import threading
from typing import Any

import faults
import pytest
import torch
from models import gpt_block
from offload_util import (
    ENGINES,
    Saver,
    assert_bitwise,
    assert_nothing_live,
    drain,
    garbage,
    gc_pass_when_returning,
    hand_family,
    manager,
    offloaded_step,
    reference_grads,
)
from torch import nn

from offload import storage
from offload._family import Life


def test_late_nvme_write_failure_falls_back_to_host_and_balances(tmp_path, monkeypatch) -> None:
    """An I/O error after pack returned: the record goes to the next tier from the held source;
    the host-tier accounting must come back to zero once the graph is gone."""
    want = reference_grads("gpt_block")
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, tiers=("nvme", "cpu"), nvme_dir=tmp_path) as mgr:
        with mgr:
            nvme.fail("write", OSError(5, os.strerror(5)))  # every write, once it ran
            loss = case.loss(case.batch())
        # The failures surface when the I/O thread runs the writes: wait for them (an unsettled
        # check raced that thread, and failed under load).
        for fam in mgr._executor.step.families:
            if fam.handle is not None:
                with contextlib.suppress(storage.StorageError):
                    fam.handle.wait()
        mgr._executor.poll()
        assert mgr.stats.last.fallbacks > 0 and nvme.injected > 0
        assert mgr._executor.cpu_bytes > 0
        case.model.zero_grad(set_to_none=True)
        loss.backward()
        assert_bitwise(case.grads(), want)
        # Counted where the bytes went: the host tier.
        last = mgr.stats.last
        assert last.bytes_offloaded_nvme == last.records_offloaded_nvme == 0
        assert last.bytes_offloaded_cpu > 0 and last.records_offloaded_cpu > 0
        del loss
        gc.collect()
        assert_nothing_live(mgr)


@pytest.mark.parametrize("tiers", [("nvme",), ("nvme", "cpu")])
@pytest.mark.parametrize("engine", ENGINES)
def test_nvme_writes_that_fail_late_are_not_counted_as_nvme_bytes(
    engine: str, tiers, tmp_path, monkeypatch
) -> None:
    """Every file write fails (EIO), each only once a gate opens: the NVMe bytes of a record
    count only if its write succeeded. Step 1: backward uses the sources still held and releases
    the records while their writes run; they fail after. Steps 2 and 3: two forwards, then the
    writes fail during step 3, and step 2's records go to the next tier (or stay) after step 2
    was added to the totals. A failed record counted as NVMe bytes (in ``last`` of step 1, or
    in the totals for step 2) whenever its failure came after its release or its step."""
    want = [reference_grads("gpt_block", s) for s in range(4)]
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, engine, tiers=tiers, nvme_dir=tmp_path) as mgr:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])
        drain(mgr)
        mgr._executor.poll()
        stored = mgr.stats.last.bytes_offloaded_nvme
        assert stored > 0
        gate = threading.Event()
        nvme.fail("write", OSError(5, os.strerror(5)), gate=gate)

        def fail_the_writes() -> None:
            gate.set()
            drain(mgr)
            mgr._executor.poll()
            gate.clear()

        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        loss.backward()
        assert_bitwise(case.grads(), want[1])
        del loss
        fail_the_writes()
        assert_nothing_live(mgr)
        last = mgr.stats.last
        assert last.bytes_offloaded_nvme == last.records_offloaded_nvme == 0
        assert last.bytes_offloaded_cpu == 0  # released before they failed: nothing to move
        before = mgr.stats.total

        losses = []
        for s in (2, 3):
            with mgr:
                losses.append(case.loss(case.batch(s)))
        fail_the_writes()
        for s, loss in zip((2, 3), losses, strict=True):
            case.model.zero_grad(set_to_none=True)
            loss.backward()
            assert_bitwise(case.grads(), want[s])
        del loss, losses
        gc.collect()
        assert_nothing_live(mgr)
        total = mgr.stats.total
        assert nvme.injected > 0
        assert total.bytes_offloaded_nvme == before.bytes_offloaded_nvme == stored
        assert total.records_offloaded_nvme == before.records_offloaded_nvme
        moved = total.bytes_offloaded_cpu - before.bytes_offloaded_cpu
        assert moved == (2 * stored if "cpu" in tiers else 0)


@pytest.mark.parametrize("read", ["after_backward", "before_backward"])
@pytest.mark.parametrize("tiers", [("nvme",), ("nvme", "cpu")])
@pytest.mark.parametrize("engine", ENGINES)
def test_stats_are_final_when_read_while_nvme_writes_still_run(
    engine: str, tiers, read: str, tmp_path, monkeypatch
) -> None:
    """``mgr.stats`` read while the step's NVMe writes still run (each fails with EIO, only
    after the read began): the read waits for them, so the numbers are final. Before, a read
    right after backward showed the step's 12 records (397312 bytes) as stored on NVMe, and
    kept showing them (nothing accounted for the failures until the next step, whose totals
    then dropped them). ``before_backward``: the records still live go to the host tier (or
    stay) and count as fallbacks in the step that packed them; gradients stay exact."""
    want = [reference_grads("gpt_block", s) for s in range(2)]
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, engine, tiers=tiers, nvme_dir=tmp_path) as mgr:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])
        step0 = mgr.stats.last
        assert step0.bytes_offloaded_nvme > 0 and step0.fallbacks == 0
        gate = threading.Event()  # each write fails (EIO) once it opens: late, after pack
        nvme.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)), gate=gate)
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        if read == "after_backward":
            loss.backward()
            assert_bitwise(case.grads(), want[1])
        opener = threading.Timer(0.05, gate.set)  # the writes fail while stats waits for them
        opener.start()
        last = mgr.stats.last
        opener.join()
        assert last.bytes_offloaded_nvme == last.records_offloaded_nvme == 0
        if read == "after_backward":
            # Released before they failed: no tier takes them, nothing falls back.
            assert last.bytes_offloaded_cpu == last.records_offloaded_cpu == last.fallbacks == 0
        else:
            assert last.fallbacks == step0.records_offloaded_nvme
            moved = step0.bytes_offloaded_nvme if "cpu" in tiers else 0
            assert last.bytes_offloaded_cpu == moved
            loss.backward()
            assert_bitwise(case.grads(), want[1])
        del loss
        gc.collect()
        moved_fields = ("bytes_offloaded_nvme", "records_offloaded_nvme", "bytes_offloaded_cpu",
                        "records_offloaded_cpu", "fallbacks")  # fmt: skip
        again = mgr.stats.last  # and they stay so (backward, if it ran since, adds reloads)
        assert [getattr(again, f) for f in moved_fields] == [getattr(last, f) for f in moved_fields]
        assert_nothing_live(mgr)
        total = mgr.stats.total
        assert nvme.injected > 0
        assert total.bytes_offloaded_nvme == step0.bytes_offloaded_nvme
        assert total.bytes_offloaded_cpu == last.bytes_offloaded_cpu
        assert total.fallbacks == last.fallbacks


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("engine", ENGINES)
def test_writes_that_fail_at_close_leave_the_totals_right(
    engine: str, backward: bool, tmp_path, monkeypatch
) -> None:
    """The last step's NVMe writes fail (EIO) only while ``close()`` waits for them. Its
    records were released by backward first (``backward``), or die with the closed manager:
    either way they stored nothing. Before, with backward first, ``stats.total`` after close
    still counted them: 24 records (794624 bytes) on NVMe where step 0's 12 (397312) were."""
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, engine, tiers=("nvme", "cpu"), nvme_dir=tmp_path) as mgr:
        offloaded_step(case, mgr, 0)
        step0 = mgr.stats.last
        assert step0.bytes_offloaded_nvme > 0
        gate = threading.Event()  # each write fails (EIO) once it opens: late, after pack
        nvme.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)), gate=gate)
        with mgr:
            loss = case.loss(case.batch(1))
        if backward:
            loss.backward()
            del loss
        opener = threading.Timer(0.05, gate.set)
        opener.start()
        mgr.close()
        opener.join()
        total = mgr.stats.total
        assert total.steps == 2 and nvme.injected > 0
        assert total.bytes_offloaded_nvme == step0.bytes_offloaded_nvme
        assert total.records_offloaded_nvme == step0.records_offloaded_nvme
        assert total.bytes_offloaded_cpu == total.records_offloaded_cpu == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_full_disk_is_logged_once_per_tier_and_counted_in_fallbacks(
    engine: str, tmp_path, monkeypatch, caplog
) -> None:
    """Every NVMe write fails with ENOSPC after pack returned; the host tier (64 KiB) takes
    some of the records and the others stay on the device. Each record that stayed was a
    warning (24 in these 4 steps); now the first failure is one warning that says where later
    ones are counted (``fallbacks``), and the rest go to the debug level. Gradients stay exact."""
    want = [reference_grads("gpt_block", s) for s in range(4)]
    case = gpt_block(seed=0)
    caplog.set_level(logging.DEBUG, logger="offload")
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(
        case.model, engine, tiers=("nvme", "cpu"), nvme_dir=tmp_path, cpu_budget="64KiB"
    ) as mgr:
        for s in range(4):
            case.model.zero_grad(set_to_none=True)
            with mgr:
                if s == 0:
                    nvme.fail("write", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
                loss = case.loss(case.batch(s))
            # Every failure is seen while its record lives (one seen after backward released
            # the record is no fallback, and says nothing).
            drain(mgr)
            mgr._executor.poll()
            loss.backward()
            assert_bitwise(case.grads(), want[s])
            del loss
        failed = [r for r in caplog.records if "No space left on device" in r.getMessage()]
        warned = [r for r in failed if r.levelno == logging.WARNING]
        assert len(warned) == 1
        assert "to the nvme tier failed" in warned[0].getMessage()
        assert "counted in stats.fallbacks" in warned[0].getMessage()
        assert len(failed) == mgr.stats.total.fallbacks > 4  # the others at the debug level
        assert nvme.injected >= len(failed)
        gc.collect()
        assert_nothing_live(mgr)


def test_a_release_while_a_failed_write_goes_to_the_next_tier_frees_the_new_copy(
    tmp_path, monkeypatch
) -> None:
    """A late write failure sends the record to the next tier from its held source, inside
    poll; a GC pass at that write (a dropped graph's finalizer released the family) left poll
    moving a freed family back 'off device' (an illegal move raised out of the pack or module
    boundary that polled) and its new copy held for good. The new copy is freed instead."""
    from offload._tiers import cpu_charge

    seen: list[Any] = []
    x1 = torch.randn(32, 32, requires_grad=True)
    x2 = torch.randn(32, 32, requires_grad=True)
    kw = {"tiers": ("nvme", "cpu"), "nvme_dir": tmp_path}
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(nn.Linear(2, 2), "deferred", **kw) as mgr:
        gc.collect()
        gc.disable()  # only the pass below may finalize the dropped graph
        try:
            with mgr._engine.paused(), mgr:  # no write fails before the step's last poll
                nvme.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)))
                y1 = Saver.apply(seen, x1 * 1)  # family a: its graph is dropped below
                y2 = Saver.apply(seen, x2 * 1)
            ex = mgr._executor
            a, b = ex.step.families
            for fam in (a, b):
                with contextlib.suppress(storage.StorageError):
                    fam.handle.wait()  # failed, on the I/O thread
            garbage(y1)
            del y1
            with gc_pass_when_returning(storage.HostTier.write) as passes:
                ex.poll()
            assert passes[0] == 2 and a.life is Life.FREED  # what this test is about
            assert nvme.injected == 2
            assert b.life is Life.OFF_DEVICE and b.tier.name == "cpu"
            assert ex.cpu_bytes == cpu_charge(b.nbytes) == mgr._tiers[1].used_bytes
            y2.backward()
        finally:
            gc.enable()
        assert torch.equal(seen[-1][0][1], x2) and torch.equal(x2.grad, torch.ones_like(x2))
        assert_nothing_live(mgr)
        assert [t.used_bytes for t in mgr._tiers] == [0, 0]


@pytest.mark.parametrize("host_room", [True, False], ids=["to_host", "stays_pinned"])
def test_a_release_while_a_failed_nvme_write_goes_elsewhere_frees_its_copy(
    tmp_path, monkeypatch, host_room: bool
) -> None:
    """GPU + NVMe, driven by hand on CPU: a file write from pinned staging failed late, so
    poll adopts the pinned copy into the host tier (or, with no room there, keeps it as the
    record's copy); a GC pass at that write (or at the log line saying so) finalized the
    family's last member and freed the family first, and the copy was then kept for good (in
    the host tier, counted in ``cpu_bytes``; or the pinned region). It is freed with its
    family."""
    from offload import _faults
    from offload._executor import Executor
    from offload._family import _Member

    pool = storage.HostPool(1 << 22, slab_bytes=1 << 20)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    nvme = faults.FailingNvmeTier(tmp_path, capacity_bytes=1 << 22, pool=pool, copy_engine=engine)
    host = storage.HostTier(pool)
    ex = Executor(
        device=torch.device("cpu"),
        tiers=[nvme, host],
        cpu_budget_bytes=1 << 20 if host_room else 0,
        max_inflight_bytes=0,
        prefetch_bytes=0,
        pool=pool,
        staging_bytes=1 << 20,
    )
    where = storage.HostTier.write if host_room else _faults.say_write_failed
    gc.collect()
    gc.disable()  # only the pass below may finalize the member
    try:
        nvme.faults.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)))
        data = torch.zeros(4096, dtype=torch.uint8)
        fam = hand_family(data)
        region = pool.allocate(4096)
        fam.tier, fam.handle, fam.spill = nvme, nvme.write(region, 4096), region
        fam.to(Life.COPYING_OUT)
        fam.to(Life.OFF_DEVICE)
        ex._writing.append((fam, fam.handle))  # as _retire queues it on CUDA
        ex._writing_bytes += 4096
        ex._live[fam] = None
        member = _Member(ex, fam, data.dtype, data.shape, data.stride(), 0, 0, None)
        fam.members = 1
        garbage(member)
        del member
        with contextlib.suppress(storage.StorageError):
            ex._writing[0][1].wait()  # failed
        with gc_pass_when_returning(where) as passes:
            ex.poll()
        assert passes[0] == 1 and fam.life is Life.FREED  # what this test is about
        assert nvme.faults.injected == 1
        assert fam.handle is None and fam.spill is None and ex.cpu_bytes == 0
        assert not ex._writing and host.used_bytes == 0 and pool.used_bytes == 0
    finally:
        gc.enable()
        ex.close()
        host.close()
        nvme.close()
        engine.close()
        pool.close()
