"""The executor's writes: the GPU + NVMe write queue driven by hand on CPU, writes of freed
families under the in-flight bound, and a manager finalized on an I/O thread."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from models import gpt_block, mlp
from offload_util import assert_bitwise, hand_family, manager, reference_grads

import offload
from offload import storage
from offload._family import Life


def hand_executor(nvme: storage.NvmeTier, pool: storage.HostPool) -> Any:
    """An executor on CPU over one NVMe tier, for driving its GPU + NVMe queue by hand."""
    from offload._executor import Executor

    return Executor(
        device=torch.device("cpu"),
        tiers=[nvme],
        cpu_budget_bytes=0,
        max_inflight_bytes=0,
        prefetch_bytes=0,
        pool=pool,
        staging_bytes=1 << 20,
    )


def assert_write_queue_drains(ex: Any, pool: storage.HostPool, nvme: storage.NvmeTier) -> None:
    """Once its one queued write ended, a poll empties the queue and gives every byte back."""
    ex._writing[0][1].wait()
    ex.poll()
    assert not ex._writing and ex._writing_bytes == 0
    assert pool.used_bytes == 0 and nvme.used_bytes == 0


def test_a_family_freed_while_its_nvme_write_is_queued_keeps_the_queue_sound(tmp_path) -> None:
    """The GPU + NVMe queue of file writes (pinned copies awaiting their write), driven by hand
    on CPU, where it is not used otherwise: a family freed while queued (its members died, or
    its step failed) no longer breaks every later poll, and its pinned copy goes back once its
    write is done."""
    from offload import _release

    pool = storage.HostPool(1 << 22, slab_bytes=1 << 20)
    nvme = storage.NvmeTier(tmp_path, capacity_bytes=1 << 22, pool=pool)
    ex = hand_executor(nvme, pool)
    try:
        data = torch.zeros(4096, dtype=torch.uint8)
        fam = hand_family(data)
        region = pool.allocate(4096)
        fam.tier, fam.handle, fam.spill = nvme, nvme.write(region, 4096), region
        fam.to(Life.COPYING_OUT)
        fam.to(Life.OFF_DEVICE)
        ex._writing.append((fam, fam.handle))  # as _retire queues it on CUDA
        ex._writing_bytes += 4096
        _release.free(ex, fam)  # before the queue was polled
        assert fam.handle is None and fam.life is Life.FREED
        assert_write_queue_drains(ex, pool, nvme)
    finally:
        ex.close()
        nvme.close()
        pool.close()


def test_a_family_released_while_its_nvme_write_runs_joins_the_write_queue(tmp_path) -> None:
    """GPU + NVMe, driven by hand on CPU: a family whose members died before its copy out was
    retired (backward ran ahead of the disk) waited unqueued for its file write, holding its
    device source and pinned copy, counted by neither the in-flight nor the staging bound. It
    now joins the queue of file writes: the staging bound counts it, its device source can go
    once D completed, and its pinned copy goes back when the write ends."""
    pool = storage.HostPool(1 << 22, slab_bytes=1 << 20)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    nvme = storage.NvmeTier(tmp_path, capacity_bytes=1 << 22, pool=pool, copy_engine=engine)
    ex = hand_executor(nvme, pool)
    try:
        data = torch.zeros(4096, dtype=torch.uint8)
        fam = hand_family(data)
        with engine.paused():  # the disk is behind
            region = pool.allocate(4096)
            fam.tier, fam.handle, fam.spill = nvme, nvme.write(region, 4096), region
            fam.source, fam.members = data, 1
            fam.to(Life.COPYING_OUT)
            ex._inflight.append(fam)  # as _store leaves it
            ex._inflight_bytes += 4096
            ex.release(fam)  # its last member died before a poll retired the copy out
            assert fam.life is Life.FREED and fam.source is None
            assert [f for f, _ in ex._writing] == [fam] and ex._writing_bytes == 4096
            assert ex._inflight_bytes == 0 and pool.used_bytes == 4096  # the write reads it
        assert_write_queue_drains(ex, pool, nvme)
    finally:
        ex.close()
        nvme.close()
        engine.close()
        pool.close()


def test_writes_of_freed_families_count_toward_the_in_flight_bound() -> None:
    """Backward ran ahead of a slow tier: its families were freed while their writes still ran
    (reading their sources). Those writes count toward ``max_inflight_bytes`` until they end, so
    the next step waits for them; uncounted, they piled up without bound (a 1000-step soak with
    slow I/O grew by 150 MiB)."""
    case = mlp(seed=0)
    want = [reference_grads("mlp", s) for s in range(2)]
    with manager(case.model) as probe:
        with probe:
            loss = case.loss(case.batch(0))
        loss.backward()  # as below: the loss's target is stored at the step's exit
        step_bytes = probe.stats.last.bytes_offloaded_cpu
    assert step_bytes > 0
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, _copy_engine=engine, max_inflight_bytes=step_bytes
    )
    paused, waited, finished = threading.Event(), threading.Event(), threading.Event()

    def hold_the_writes() -> None:
        # Every copy waits until step 2 waits on step 1's writes; with no such wait (the bug),
        # until step 2 has finished (30 s at most, so that nothing can hang the suite).
        with engine.paused():
            paused.set()
            deadline = time.monotonic() + 30
            while not finished.is_set() and time.monotonic() < deadline:
                ex = mgr._executor  # made by the first step
                step = ex.step if ex is not None else None
                if step is not None and step.index == 2 and step.stats.backpressure_waits > 0:
                    waited.set()
                    break
                time.sleep(0.001)

    holder = threading.Thread(target=hold_the_writes)
    holder.start()
    try:
        paused.wait()
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(0))
        loss.backward()  # from the sources: no write has run
        assert_bitwise(case.grads(), want[0])
        ex = mgr._executor
        assert ex.live_families() == 0 and ex._orphan_bytes == step_bytes
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        finished.set()
        holder.join()
        loss.backward()
        assert_bitwise(case.grads(), want[1])
        assert waited.is_set() and mgr.stats.last.backpressure_waits > 0
        assert ex._inflight_bytes + ex._orphan_bytes <= step_bytes
    finally:
        finished.set()
        holder.join()
        mgr.close()
        engine.close()


def test_a_manager_finalized_on_an_io_thread_closes_from_a_thread_of_its_own(tmp_path) -> None:
    """A GC pass on an NVMe I/O thread, in the middle of a write, may finalize a dropped
    manager: closing waited for that very write (a deadlock). Now the finalizer hands the
    closing to a thread of its own, and everything is released."""
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=tmp_path
    )
    go, finalized, errors, calls = threading.Event(), threading.Event(), [], []
    with mgr:
        nvme = mgr._tiers[0]
        private, real = nvme.private_directory, nvme._file.write

        def write_then_finalize(*args: Any, **kw: Any) -> None:
            go.wait(10)  # once the step has ended (no pack runs after a real finalizer)
            real(*args, **kw)
            if not calls:
                calls.append(threading.current_thread().name)
                try:
                    mgr._finalizer()  # what a GC pass here runs for a dropped manager
                except BaseException as e:
                    errors.append(e)
                finalized.set()

        nvme._file.write = write_then_finalize
        loss = case.loss(case.batch())
    go.set()
    assert finalized.wait(10) and calls[0].startswith("storage-io")
    for t in threading.enumerate():
        if t.name == "storage-close":
            t.join(10)
    assert errors == []
    assert not os.path.exists(private)
    assert mgr._executor.live_families() == 0 and mgr._executor.cpu_bytes == 0
    with pytest.raises(offload.OffloadError, match="closed"):
        loss.backward()
    mgr.close()
