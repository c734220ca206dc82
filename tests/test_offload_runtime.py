"""The runtime's behaviour around exactness: dedupe, skip rules, faults, leaks, files, stats, API."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import errno
import gc
import os
import stat
import threading
import time
import warnings
from typing import Any

import faults
import psutil
import pytest
import torch
import torch.nn.functional as F
from models import ALL_MODELS, gpt_block, mlp, views_model
from torch import nn

import offload
from offload import storage


def step(case, mgr, s: int = 0) -> torch.Tensor:
    case.model.zero_grad(set_to_none=True)
    with mgr:
        loss = case.loss(case.batch(s))
    loss.backward()
    return loss.detach()


def settle(mgr) -> None:
    """Wait for the last step's copies out and retire them (copies retire in order), so that
    backward reads the tier, not the sources held while writing: polling before the writes had
    finished raced the I/O threads."""
    for fam in mgr._executor.step.families:
        if fam.handle is not None:
            fam.handle.wait()
    mgr._executor.poll()


def open_files() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory listing's own fd is gone already
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_alias_families_stored_once() -> None:
    case = views_model(seed=0)
    other = views_model(seed=0)
    trace = offload.profile(other.step, other.model, warmup_steps=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        step(case, mgr)
        last = mgr.stats.last
        fams = [f for f in trace.families() if not f.is_parameter]
        assert last.records_deduplicated == sum(len(f.records) - 1 for f in fams) > 0
        assert last.records_offloaded_cpu == len(fams)
        assert last.bytes_offloaded_cpu == trace.saved_bytes
    finally:
        mgr.close()


def test_skip_rules_parameters_small_and_keep() -> None:
    case = mlp(seed=0)
    # Everything >= 1 MiB by default: this model's activations are all smaller.
    mgr = offload.ActivationOffloader(case.model)
    try:
        step(case, mgr)
        assert mgr.stats.last.bytes_offloaded_cpu == 0
        assert mgr.stats.last.records_kept == mgr.stats.last.records
    finally:
        mgr.close()
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, keep=("fc2", nn.GELU))
    try:
        other = mlp(seed=0)
        trace = offload.profile(other.step, other.model, warmup_steps=0)
        step(case, mgr)
        moved_modules = {"fc1", "act2", "fc3", "<outside>"}
        expected_kept = [
            r for r in trace.records if r.is_parameter or r.module not in moved_modules
        ]
        assert mgr.stats.last.records_kept == len(expected_kept)
    finally:
        mgr.close()


def test_exception_mid_forward_releases_everything(tmp_path) -> None:
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("cpu", "nvme"), nvme_dir=tmp_path
    )
    try:
        step(case, mgr)  # warm: pool slab and spill file exist
        pool = mgr._executor.pool
        nvme = mgr._tiers[1]
        used0, nvme0 = pool.used_bytes, nvme.used_bytes

        class Boom(Exception):
            pass

        kept = None
        with pytest.raises(Boom):
            with mgr:
                out = case.loss(case.batch())
                kept = out  # a reference that outlives the step, like a traceback does
                raise Boom
        assert mgr._executor.live_families() == 0
        assert pool.used_bytes == used0 and nvme.used_bytes == nvme0
        with pytest.raises(offload.OffloadError, match="raised"):
            kept.backward()
        # The manager keeps working.
        step(case, mgr)
    finally:
        mgr.close()


def test_dropped_graph_releases() -> None:
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        with mgr:
            loss = case.loss(case.batch())
        assert mgr._executor.live_families() > 0
        del loss
        gc.collect()
        assert mgr._executor.live_families() == 0
        assert mgr._executor.cpu_bytes == 0
    finally:
        mgr.close()


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


def test_steady_state_no_growth(tmp_path) -> None:
    case = mlp(seed=0)
    mgr = offload.ActivationOffloader(
        case.model,
        min_offload_bytes=0,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget=48 << 10,
        max_inflight_bytes=1 << 20,  # see the soak test below
    )
    proc = psutil.Process()
    try:
        for s in range(20):
            step(case, mgr, s)
        pool = mgr._executor.pool
        nvme = mgr._tiers[1]
        allocs, file_bytes = pool.host_allocations, nvme.file_bytes
        fds = len(open_files())
        rss = proc.memory_info().rss
        for s in range(200):
            step(case, mgr, s)
        assert pool.host_allocations == allocs
        assert nvme.file_bytes == file_bytes
        assert len(open_files()) == fds
        assert mgr._executor.live_families() == 0
        assert mgr.stats.total.steps == 220
        assert mgr.stats.total.bytes_offloaded_nvme > 0
        # RSS: allow allocator noise, not per-step growth (200 steps x 100 KiB would be 20 MiB).
        assert proc.memory_info().rss - rss < 16 << 20
    finally:
        mgr.close()


def test_stats_fields_and_as_dict() -> None:
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        step(case, mgr)
        step(case, mgr, 1)
        st = mgr.stats
        d = st.as_dict()
        assert set(d) == {"last", "total"}
        for key in (
            "bytes_offloaded_cpu",
            "bytes_offloaded_nvme",
            "bytes_recomputed",
            "records_deduplicated",
            "stalls",
            "stall_s",
            "prefetch_lead_s_p50",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "predicted_peak_bytes",
            "step_s",
            "predicted_step_s",
            "unplanned_records",
            "min_memory_steps",
            "fallbacks",
            "host_allocations",
            "prefetches_skipped",
        ):
            assert key in d["last"]
        assert st.total.steps == 2 and st.last.steps == 1
        assert st.total.bytes_offloaded_cpu == 2 * st.last.bytes_offloaded_cpu
        assert st.last.reloads > 0 and st.last.step_s > 0
        # Every family came back: prefetched or stalled.
        assert st.last.reloads == st.last.records_offloaded_cpu
        mgr.close()
        # close() folds the last step into the total: the totals stay what they were.
        assert mgr.stats.total.as_dict() == st.total.as_dict()
    finally:
        mgr.close()


def test_host_allocations_count_the_slabs_a_step_made(monkeypatch) -> None:
    """The first step of a new pool allocates its slab; later steps reuse it (the GPU test
    asserts 0 in steady state on pinned memory, so the count must be real)."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        step(case, mgr)
        first = mgr.stats.last.host_allocations
        step(case, mgr, 1)
        assert first >= 1 and mgr.stats.last.host_allocations == 0
        assert mgr.stats.total.host_allocations == first == mgr._executor.pool.host_allocations
    finally:
        mgr.close()


def test_total_stats_keep_a_bounded_window_of_lead_times() -> None:
    """A long run's totals must not grow with it (docs/design.md: no leaks): the lead-time median of
    the total is over the last LEAD_WINDOW prefetches."""
    from offload._stats import LEAD_WINDOW, StepStats

    total = StepStats()
    for i in range(5):
        step_stats = StepStats(steps=1, _leads=[float(i)] * (LEAD_WINDOW // 2))
        total.add(step_stats)
    assert len(total._leads) == LEAD_WINDOW and total.steps == 5
    # The last two steps (3.0 s and 4.0 s) only; over all five it would be 2.0 s.
    assert total.prefetch_lead_s_p50 == 3.5


def test_prefetch_runs_ahead_of_unpack() -> None:
    """A deep stack: most reloads start from backward pre-hooks before their unpack."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
    x = torch.randn(128, 256)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, max_inflight_bytes=1 << 20)
    try:
        with mgr:
            loss = model(x).sum()
        loss.backward()
        last = mgr.stats.last
        assert last.reloads == last.records_offloaded_cpu > 0
        assert last.stalls <= 1  # at most the first unpack, before any module's pre-hook
    finally:
        mgr.close()


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


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"tiers": ("gpu",)}, ValueError, "tiers"),
        ({"tiers": ()}, ValueError, "tiers"),
        ({"tiers": ("cpu", "cpu")}, ValueError, "twice"),
        ({"tiers": ("nvme",)}, ValueError, "nvme_dir"),
        ({"tiers": ("nvme",), "nvme_dir": "/definitely/not/here"}, ValueError, "nvme_dir"),
        ({"cpu_budget": "lots"}, ValueError, "cpu_budget"),
        ({"cpu_budget": 1.5}, TypeError, "cpu_budget"),
        ({"min_offload_bytes": -1}, ValueError, "min_offload_bytes"),
        ({"max_inflight_bytes": "2 parsecs"}, ValueError, "max_inflight_bytes"),
        ({"keep": ("nonexistent",)}, ValueError, "keep"),
        ({"keep": (3,)}, TypeError, "keep"),
        ({"on_infeasible": "shrug"}, ValueError, "on_infeasible"),
        ({"gpu_budget": "85%"}, ValueError, "gpu_budget"),
        ({"gpu_budget": "lots"}, ValueError, "gpu_budget"),
        ({"gpu_budget": -1}, ValueError, "gpu_budget"),
        # 0 was taken, and the step after the profiling one raised BudgetInfeasibleError.
        ({"gpu_budget": 0}, ValueError, r"gpu_budget must be more than 0 bytes.*got 0$"),
        ({"gpu_budget": "0GiB"}, ValueError, r"more than 0 bytes.*got '0GiB' \(0 bytes\)"),
        ({"plan": object()}, TypeError, "plan"),
        ({"hardware": 3}, TypeError, "hardware"),
        # A missing or wrong file named the argument nowhere (a bare "[Errno 2] No such file").
        ({"hardware": "/definitely/not/here.json"}, FileNotFoundError, r"hardware=.*not/here"),
        ({"plan": "/definitely/not/here.json"}, FileNotFoundError, r"plan=.*not/here"),
        ({"hardware": __file__}, ValueError, r"hardware=.*test_offload_runtime.py.*not valid JSON"),
        ({"plan": __file__}, ValueError, r"plan=.*test_offload_runtime.py.*not valid JSON"),
        ({"tiers": None}, TypeError, "tiers"),
        ({"tiers": ("nvme",), "nvme_dir": 5}, TypeError, "nvme_dir"),
        ({"tiers": ("nvme",), "nvme_dir": __file__}, ValueError, r"nvme_dir.*not a directory"),
        ({"cpu_budget": 0}, ValueError, "cpu_budget 0"),
        ({"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes must be more than 0 bytes"),
        # Each said "is not a size" for a size out of range.
        ({"cpu_budget": "-5GiB"}, ValueError, r"cpu_budget must be >= 0 bytes; got '-5GiB' \("),
        ({"gpu_budget": "-5GiB"}, ValueError, r"gpu_budget must be more than 0 bytes.*'-5GiB'"),
        ({"min_offload_bytes": "-1MB"}, ValueError, r"min_offload_bytes must be >= 0 bytes"),
        # '' was the working directory, until the first step failed.
        ({"tiers": ("nvme",), "nvme_dir": ""}, ValueError, r"nvme_dir '': is empty.*directory"),
        # "is not writable (No such file or directory)", of a directory that exists.
        pytest.param(
            {"tiers": ("nvme",), "nvme_dir": "/proc"},
            ValueError,
            r"nvme_dir '/proc': is not writable: .*\(ENOENT: .*virtual file system",
            marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc"),
        ),
        # Bytes are iterable: "tiers: 99 is not a tier".
        ({"tiers": b"cpu"}, TypeError, r"tiers must be 'cpu', 'nvme' or a sequence.*got bytes"),
    ],
)
def test_bad_arguments(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        offload.ActivationOffloader(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        # Each raised "TypeError: cannot create weak reference to 'NoneType' object" (or 'str',
        # 'list'): the model is a key of the managers' cache.
        ({"model": None}, TypeError, r"^model must be a torch.nn.Module; got NoneType$"),
        ({"model": "model"}, TypeError, r"^model must be a torch.nn.Module; got str$"),
        ({"model": [nn.Linear(2, 2)]}, TypeError, r"^model must be a torch.nn.Module; got list$"),
        # "'NoneType' object is not iterable", and realpath's "expected str, bytes or ...".
        ({"tiers": None}, TypeError, r"^tiers must be 'cpu', 'nvme' or a sequence of them"),
        ({"tiers": "nvme", "nvme_dir": 5}, TypeError, r"^nvme_dir must be a directory path"),
        ({"tiers": "nvme", "nvme_dir": ""}, ValueError, r"^nvme_dir '': is empty"),
    ],
)
def test_bad_arguments_to_activations(kwargs, exc, match) -> None:
    kwargs.setdefault("model", nn.Linear(2, 2))
    with pytest.raises(exc, match=match):
        offload.activations(**kwargs)


@pytest.mark.parametrize(
    ("name", "none_means"),
    [("gpu_budget", "min-memory mode"), ("max_inflight_bytes", "twice the largest record")],
)
def test_sizes_that_take_no_zero_say_so_for_negative_values(name: str, none_means: str) -> None:
    """``gpu_budget=-1`` and ``max_inflight_bytes=-5`` said "must be >= 0 bytes", though 0 is
    refused too (with another message). Negative, 0 and '0GiB' now get one message: more than 0
    bytes, or None and what it means."""
    for value in (-5, -1, 0, "0GiB"):
        with pytest.raises(ValueError) as info:
            offload.ActivationOffloader(nn.Linear(2, 2), **{name: value})
        message = str(info.value)
        assert f"{name} must be more than 0 bytes, or None" in message, message
        assert none_means in message and ">= 0" not in message, message
        assert f"got {value!r}" in message, message


@pytest.mark.parametrize("where", ["a directory", "nowhere"])
def test_nvme_dir_without_nvme_in_tiers_is_ignored_with_a_warning(where: str, tmp_path) -> None:
    """``nvme_dir`` while ``"nvme"`` is not in ``tiers``: nothing ever goes there. Before, that
    passed silently (and a directory that does not exist raised NvmeDirError, for an argument
    never used); now a RuntimeWarning names both arguments and the directory is not checked."""
    nvme_dir = tmp_path if where == "a directory" else "/definitely/not/here"
    case = mlp(seed=0)
    ignored = r"nvme_dir=.* is ignored: 'nvme' is not in tiers="
    with pytest.warns(RuntimeWarning, match=ignored) as w:
        mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, nvme_dir=nvme_dir)
    assert len(w) == 1 and w[0].filename == __file__ and "('cpu',)" in str(w[0].message)
    try:
        assert mgr.config.nvme_dir is None
        step(case, mgr)
        assert mgr.stats.last.bytes_offloaded_cpu > 0 == mgr.stats.last.bytes_offloaded_nvme
    finally:
        mgr.close()
    # Made by offload.activations, the warning names the user's line too (it named
    # offload/_offloader.py).
    with pytest.warns(RuntimeWarning, match=ignored) as w:
        offload.activations(case.model, nvme_dir=nvme_dir).close()
    assert len(w) == 1 and w[0].filename == __file__


def test_a_tiers_string_with_a_comma_is_refused_without_a_warning_about_nvme_dir(tmp_path):
    """``tiers="cpu,nvme"`` (the CLI's spelling) with ``nvme_dir``: the ValueError about tiers
    came after a RuntimeWarning that nvme_dir was ignored because 'nvme' was not in tiers,
    which sent the user after the wrong argument."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"tiers: 'cpu,nvme' is not a tier"):
            offload.ActivationOffloader(nn.Linear(2, 2), tiers="cpu,nvme", nvme_dir=tmp_path)


def test_a_model_moved_after_its_manager_was_made_warns() -> None:
    """The manager fixes its device when it is made. Made on a meta model and the model moved
    to its device afterwards (or made before ``model.cuda()``), every saved tensor is on
    another device than the manager's: steps ran, offloaded 0 bytes and said nothing."""
    with torch.device("meta"):
        case_model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    mgr = offload.ActivationOffloader(case_model, min_offload_bytes=0)
    case_model.to_empty(device="cpu")
    for p in case_model.parameters():
        nn.init.normal_(p)
    try:
        x = torch.randn(32, 64)
        with pytest.warns(RuntimeWarning, match=r"on cpu.*made when they were on meta") as w:
            with mgr:
                loss = case_model(x).sum()
        loss.backward()
        assert len(w) == 1 and w[0].filename == __file__
        assert mgr.stats.last.bytes_offloaded_cpu == 0  # as documented: only meta tensors move
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per manager
            with mgr:
                loss = case_model(x).sum()
            loss.backward()
    finally:
        mgr.close()


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


def test_an_nvme_dir_this_process_cannot_write_fails_at_construction(tmp_path) -> None:
    """An unwritable nvme_dir used to pass construction and fail every step with a bare
    PermissionError; it is checked up front, with the argument named."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        if os.access(ro, os.W_OK):  # root writes anyway, unless the capability is dropped
            pytest.skip("this process can write into a 0500 directory (root)")
        with pytest.raises(ValueError, match=r"nvme_dir.*not writable"):
            offload.ActivationOffloader(nn.Linear(2, 2), tiers=("nvme",), nvme_dir=ro)
    finally:
        ro.chmod(0o700)


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


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match="model"):
        offload.ActivationOffloader(object())  # type: ignore[arg-type]


@pytest.mark.slow
def test_soak_1000_steps_no_growth(tmp_path) -> None:
    """docs/design.md's no-leak invariant: 1000 steps grow no host pool, file, fd or live-family count.
    Both tiers, spilling (a tiny cpu_budget), deferred copies; kept short enough for CI."""
    case = mlp(seed=0)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=3)
    mgr = offload.ActivationOffloader(
        case.model,
        min_offload_bytes=0,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget=48 << 10,
        _copy_engine=engine,
        # Writes still running when backward frees their families hold their sources until they
        # end, up to this bound; the default (256 MiB) exceeds the RSS check below when the I/O
        # lags behind the steps on a loaded machine.
        max_inflight_bytes=1 << 20,
    )
    proc = psutil.Process()
    try:
        for s in range(50):
            step(case, mgr, s)
        pool, nvme = mgr._executor.pool, mgr._tiers[1]

        def threads() -> tuple[int, int]:
            """(threads besides the NVMe tier's I/O pool, threads of that pool)."""
            io = sum(t.name.startswith("storage-io") for t in threading.enumerate())
            return threading.active_count() - io, io

        base = (pool.host_allocations, nvme.file_bytes, len(open_files()), threads()[0])
        rss = proc.memory_info().rss
        for s in range(1000):
            step(case, mgr, s % 7)
        others, io = threads()
        assert (pool.host_allocations, nvme.file_bytes, len(open_files()), others) == base
        # The I/O pool starts its threads (storage.IO_THREADS) at its first request.
        assert 0 < io <= storage.IO_THREADS
        assert mgr._executor.live_families() == 0
        assert mgr.stats.total.steps == 1050
        assert proc.memory_info().rss - rss < 32 << 20
    finally:
        mgr.close()
        engine.close()


class _SoakBlock(nn.Module):
    """LayerNorm -> Linear -> GELU -> dropout -> Linear, with a residual: rebuilt norm and GELU
    outputs, deferred dropout masks, blocks for the plan to recompute."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.act = nn.Linear(d, 2 * d), nn.GELU()
        self.drop, self.fc2 = nn.Dropout(0.1), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(self.ln(x)))))


class _SoakModel(nn.Module):
    """Four blocks, F.rrelu (its noise is filled after its pack), a branch switched by an
    attribute (a structure outside the signature) and a head under bf16 autocast (weight
    casts)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_SoakBlock(d) for _ in range(4)])
        self.extra, self.head = nn.Linear(d, d), nn.Linear(d, d)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.rrelu(self.blocks(x), training=self.training)
        if self.use_extra:
            x = x + torch.tanh(self.extra(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(x).float()


# Ten input lengths (past the 8 profiled signatures: the merged plan), the branch switched every
# 30 steps and the backward inside the step every third: the run repeats every 60 steps.
_SOAK_LENGTHS = [8 * k for k in range(1, 11)]
_SOAK_PERIOD = 60


def _soak_step(model: nn.Module, mgr: Any, s: int) -> dict[str, torch.Tensor]:
    model.use_extra = (s // 30) % 2 == 1
    x = torch.randn(
        4, _SOAK_LENGTHS[s % len(_SOAK_LENGTHS)], 32, generator=torch.Generator().manual_seed(s)
    )
    torch.manual_seed(s)  # dropout and rrelu draw the same in the reference run
    model.zero_grad(set_to_none=True)
    inside = s % 3 == 0 and mgr is not None
    with mgr if mgr is not None else contextlib.nullcontext():
        loss = model(x).pow(2).mean()
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _budget_state(mgr: offload.ActivationOffloader) -> dict[str, int]:
    """Sizes of everything a budgeted manager keeps across steps: per signature (plans,
    profiles, structures, counters), per step (cleared at each start: compared at the same point
    of the run's cycle), the executor's queues and the profiler's recording."""
    budget, step = mgr._budget, mgr._step
    per_signature = [
        "_plans",
        "_active_plans",
        "_struck",
        "_unplanned_sigs",
        "_over_budget",
        "_profiled",
        "_shared",
        "_timed",
        "_unfinished",
        "_overlap_skips",
        "_structure",
        "_structures",
        "_reprofile",
        "_structure_fixed",
        "_futile",
    ]
    per_step = ["kept_seq", "kept_refs", "deferred", "rebuilds", "plan_kept"]
    out = {n: len(getattr(budget, n)) for n in per_signature}
    out["states"] = len(budget._states._of)  # infeasible, given, planned (to be timed), ...
    out.update({n: len(getattr(step, n)) for n in per_step})
    out["calls"], out["stack"] = len(step.calls.counts), len(step.calls.frames)
    out["recompute"] = len(mgr._recomputes.installed)
    out["task_ends"], out["attachments"] = len(mgr._task_ends), len(mgr._attachments)
    out["warned"] = len(mgr._warn.warned)
    out["structures"] = sum(len(s) for s in mgr._budget._structures.values())
    ex = mgr._executor
    for n in [
        "_pending_free",
        "_pending_regions",
        "_inflight",
        "_deferred_releases",
        "_orphans",
        "_writing",
        "_live",
    ]:
        out["ex." + n] = len(getattr(ex, n))
    rec = mgr._budget._profiler.recorder
    out["rec.steps"] = rec.steps_recorded
    for n in [
        "_events",
        "_records",
        "_dims",
        "_kept_serials",
        "_retained",
        "_create_graph",
        "_seq_of",
    ]:
        out["rec." + n] = len(getattr(rec, n))
    return out


@pytest.mark.slow
def test_soak_budget_mode_grows_nothing(tmp_path) -> None:
    """docs/design.md's no-leak invariant in budget mode, whose state is per signature: 10 input
    lengths (the merged plan past 8), a structure switched outside the signature, dropout and
    rrelu (deferred packs), rebuilt GELU / LayerNorm outputs and weight casts, recomputed
    blocks, records on both tiers (a small cpu_budget spills to NVMe), deferred copies, backward
    inside and after the step. After a warm-up, the manager's maps, the executor's queues, the
    profiler's recording, host pool slabs, NVMe file bytes, fds and threads stay as they were,
    RSS within 32 MiB; sampled steps are bitwise equal to no offloading. Longer:
    OFFLOAD_SOAK_STEPS=3000."""
    from offload.lifecycle import HardwareModel

    torch.manual_seed(0)
    model = _SoakModel()
    ref = copy.deepcopy(model)
    # A link so slow that recomputing a block beats copying it whatever this machine's compute
    # times (the plans were the same with the profiled times scaled 0.01x to 100x; at 5e8 B/s
    # they recomputed nothing once a block's forward took longer than on a fast machine).
    hw = HardwareModel.cpu_only(
        copy_bytes_per_s=1e4, disk_write_bytes_per_s=4e3, disk_read_bytes_per_s=4e3
    )
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=3)
    mgr = offload.ActivationOffloader(
        model,
        gpu_budget=600 << 10,  # the longest input saves 1.5 MiB
        hardware=hw,
        min_offload_bytes=0,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget=64 << 10,
        _copy_engine=engine,
        max_inflight_bytes=1 << 20,  # see the soak test above
    )
    warm = 3 * _SOAK_PERIOD
    steps = int(os.environ.get("OFFLOAD_SOAK_STEPS", 4 * _SOAK_PERIOD))
    steps = -(-steps // _SOAK_PERIOD) * _SOAK_PERIOD  # ends where the warm-up ended
    proc = psutil.Process()

    def check(s: int) -> None:
        got = _soak_step(model, mgr, s)
        if s % 23 == 0:
            want = _soak_step(ref, None, s)
            assert got.keys() == want.keys()
            for k in want:
                assert torch.equal(got[k], want[k]), (s, k)

    def threads() -> int:
        return threading.active_count() - sum(
            t.name.startswith("storage-io") for t in threading.enumerate()
        )

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the structure's changes, said once
            for s in range(warm):
                check(s)
            gc.collect()
            pool, nvme = mgr._executor.pool, mgr._tiers[1]
            base = (pool.host_allocations, nvme.file_bytes, len(open_files()), threads())
            state, done = _budget_state(mgr), mgr.stats.total
            rss = proc.memory_info().rss
            for s in range(warm, warm + steps):
                check(s)
            gc.collect()
        assert (pool.host_allocations, nvme.file_bytes, len(open_files()), threads()) == base
        assert _budget_state(mgr) == state
        assert mgr._executor.live_families() == 0
        assert proc.memory_info().rss - rss < 32 << 20
        # Everything the run is for happened after the warm-up.
        total = mgr.stats.total
        assert total.steps == warm + steps
        assert total.bytes_offloaded_cpu > done.bytes_offloaded_cpu
        assert total.bytes_offloaded_nvme > done.bytes_offloaded_nvme
        assert total.bytes_recomputed > done.bytes_recomputed
        assert total.records_rebuilt > done.records_rebuilt
        assert isinstance(mgr._budget._merged, offload.Plan)
        assert any(name.endswith("[structure 2]") for name in mgr.plans)
    finally:
        mgr.close()
        engine.close()


def test_step_time_goes_to_the_step_whose_backward_ended() -> None:
    """Two forwards before their backwards (accumulation, pipelining): each step's ``step_s``
    runs from its own start to the end of its own backward, and the total holds both."""
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    x = torch.randn(16, 32)
    t_a = time.perf_counter()
    with mgr:
        loss_a = model(x).sum()
    t_b = time.perf_counter()
    with mgr:
        loss_b = model(x).pow(2).sum()
    loss_a.backward()
    t_a_end = time.perf_counter()
    loss_b.backward()
    t_b_end = time.perf_counter()
    last, total = mgr.stats.last, mgr.stats.total
    mgr.close()
    # B's time: from B's start to the end of B's backward, not of A's.
    assert t_a_end - t_b < last.step_s <= t_b_end - t_b
    a = total.step_s - last.step_s  # A's time, credited after A was folded into the total
    assert t_a_end - t_b < a <= t_a_end - t_a


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
