"""The manager's public surface: ``paused()``, ``activations()``, ``close()`` (with copies
or writes still in flight, at exit), steps that do not nest, and repr."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from models import gpt_block, mlp
from torch import nn

import offload
from offload import storage


def test_paused_allows_torch_func() -> None:
    model = nn.Linear(16, 16)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    x = torch.randn(4, 16)
    try:
        with mgr:
            with mgr.paused():
                g = torch.func.grad(lambda w: torch.tanh(x @ w).sum())(torch.randn(16, 16))
            loss = model(x).pow(2).sum()
        loss.backward()
        assert g.shape == (16, 16)
        assert mgr.stats.last.bytes_offloaded_cpu > 0
    finally:
        mgr.close()


def test_activations_caches_one_manager_per_model_and_settings() -> None:
    case = mlp(seed=0)
    a = offload.activations(case.model, min_offload_bytes=0)
    with offload.activations(case.model, min_offload_bytes=0) as b:
        loss = case.loss(case.batch())
    loss.backward()
    assert a is b
    assert offload.activations(case.model, min_offload_bytes="0") is a  # by value
    assert offload.activations(case.model) is not a
    a.close()
    assert offload.activations(case.model, min_offload_bytes=0) is not a


def test_close_is_idempotent_and_later_unpack_raises() -> None:
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    with mgr:
        loss = case.loss(case.batch())
    mgr.close()
    mgr.close()
    # Says what happened and what to do (it said only "the offload manager was closed").
    with pytest.raises(offload.OffloadError, match=r"closed .* Run backward before closing"):
        loss.backward()
    with pytest.raises(offload.OffloadError, match="closed"):
        with mgr:
            pass
    assert not case.model._forward_pre_hooks


def test_close_with_copies_in_flight_then_backward_raises_offload_error(tmp_path) -> None:
    """close() releases families whose copies out are still in flight (a deferred engine holds
    them back): a later backward raises OffloadError, not an error from a released handle."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.01, seed=1)
    mgr = offload.ActivationOffloader(
        model,
        min_offload_bytes=0,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget="300KiB",
        _copy_engine=engine,
    )
    paused = threading.Event()

    def hold_copies_until_close() -> None:
        # The copies wait until close() has begun (a slow test thread let them finish first).
        with engine.paused():
            paused.set()
            deadline = time.monotonic() + 30
            while not mgr.closed and time.monotonic() < deadline:
                time.sleep(0.001)

    holder = threading.Thread(target=hold_copies_until_close)
    holder.start()
    try:
        paused.wait()
        with mgr:
            loss = model(torch.randn(256, 256)).sum()
        assert mgr._executor._inflight  # what this test is about
        pool = mgr._executor.pool
        mgr.close()
        with pytest.raises(offload.OffloadError, match="closed"):
            loss.backward()
        assert pool.used_bytes == 0 and [t.used_bytes for t in mgr._tiers] == [0, 0]
    finally:
        mgr.close()
        holder.join()
        engine.close()


def test_steps_do_not_nest() -> None:
    mgr = offload.ActivationOffloader(nn.Linear(2, 2))
    try:
        with mgr, pytest.raises(offload.OffloadError, match="nest"):
            with mgr:
                pass
    finally:
        mgr.close()


def test_repr_shows_the_mode() -> None:
    """The mode is the first thing to know about a manager; repr did not say it."""
    plain = offload.ActivationOffloader(nn.Linear(2, 2))
    budgeted = offload.ActivationOffloader(nn.Linear(2, 2), gpu_budget="1MiB")
    try:
        assert repr(plain) == "ActivationOffloader(device=cpu, min-memory, tiers=('cpu',), 0 steps)"
        assert repr(budgeted) == (
            "ActivationOffloader(device=cpu, gpu_budget=1048576, tiers=('cpu',), 0 steps)"
        )
    finally:
        plain.close()
        budgeted.close()
    assert repr(budgeted).endswith("gpu_budget=1048576, tiers=('cpu',), closed)")


def test_a_manager_collected_while_its_writes_hang_is_closed_in_the_background(tmp_path) -> None:
    """A manager dropped without close() in a reference cycle is closed by a GC pass, which may
    run at any allocation of the training thread. Its NVMe writes are stuck (a disk that
    stalls: the spill file's writes wait for a gate). Before, the pass waited for them inside
    the collection: the gate was opened by a 10 s watchdog, never by the training thread, which
    stayed blocked. Now the waiting part of the close goes to a background closer; once the
    writes end it has released everything: the private directory, the spill file's fd, the
    staging regions of the host pool. Run in a child (a hang there stays there)."""
    import subprocess
    import sys
    import textwrap

    tests = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(
        f"""
        import gc, os, sys, threading
        sys.path[:0] = [{tests!r}, {os.path.dirname(tests)!r}]
        import offload
        from models import gpt_block

        case = gpt_block(seed=0)
        fds = len(os.listdir("/proc/self/fd"))
        mgr = offload.ActivationOffloader(
            case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir={str(tmp_path)!r}
        )
        with mgr:
            loss = case.loss(case.batch(0))
        loss.backward()
        assert mgr.stats.last.bytes_offloaded_nvme > 0  # (waits for the writes)
        spill, pool = mgr._tiers[0]._file, mgr._executor.pool
        private = mgr._tiers[0].private_directory
        gate, opened_by = threading.Event(), []
        write = spill.write

        def stalled(*args, **kw):
            gate.wait()
            return write(*args, **kw)

        spill.write = stalled
        with mgr:
            loss = case.loss(case.batch(1))
        del loss
        assert pool.used_bytes > 0  # staging of the stuck writes
        mgr.cycle = mgr  # dropped, only a GC pass frees it
        del mgr

        def watchdog():
            if not gate.wait(10):
                opened_by.append("watchdog")
                gate.set()

        threading.Thread(target=watchdog, daemon=True).start()
        gc.collect()  # finalizes the manager
        if not gate.is_set():
            opened_by.append("training thread")
            gate.set()
        print("OPENED BY", opened_by[0], flush=True)
        from offload.storage._transfer import wait_for_closes

        assert wait_for_closes(20)
        print("LEFT", os.path.exists(private), pool.used_bytes, len(os.listdir("/proc/self/fd")) - fds)
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung")
    assert "OPENED BY training thread" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stderr
    assert "LEFT False 0 0" in done.stdout, done.stdout  # directory, staging bytes, fds


def test_exit_with_a_managers_writes_stuck_ends_and_leaves_nothing(tmp_path) -> None:
    """A manager left open at exit is closed by its finalizer, which waits for its writes. With
    the disk stalled for good (the deferred engine held paused), the exit hung for ever: first
    in the join of the copy and I/O threads, then in that close. Now the stuck copies are
    abandoned with one warning, their transfers fail, the close goes on and nvme_dir is left
    empty. Run in a child (a hang there stays there)."""
    import subprocess
    import sys
    import textwrap

    tests = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{tests!r}, {os.path.dirname(tests)!r}]
        import offload, storage
        from models import gpt_block

        case = gpt_block(seed=0)
        engine = storage.CopyEngine(deferred=True, max_delay_s=0.0, seed=0)
        mgr = offload.ActivationOffloader(
            case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir={str(tmp_path)!r},
            _copy_engine=engine,
        )
        with mgr:
            loss = case.loss(case.batch(0))
        loss.backward()
        assert mgr.stats.last.bytes_offloaded_nvme > 0  # (waits for the writes)
        stall = engine.paused()  # the disk stalls from here on, for ever
        stall.__enter__()
        with mgr:
            loss = case.loss(case.batch(1))
        assert mgr._tiers[0].transfers_running
        print("EXITING", flush=True)
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung at exit; its output: {e.stdout!r}")
    assert done.returncode == 0, done.stderr
    assert "EXITING" in done.stdout
    assert done.stderr.startswith("storage: exiting with "), done.stderr
    assert done.stderr.count("\n") == 1 and "(deferred copies)" in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []
