"""Steps: accumulation, interleaved forwards and backwards, exceptions in backward,
``paused()``, foreign hooks, and steps entered or paused from other threads."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import pytest
import torch
from models import fail_backward_at, gpt_block, mlp
from offload_util import (
    ENGINES,
    assert_bitwise,
    assert_nothing_live,
    drain,
    manager,
    offloaded_step,
    on_another_thread,
    reference_grads,
)
from torch import nn

import offload
from offload import lifecycle, storage
from offload._family import Life


def test_a_second_thread_entering_a_running_step_is_told_why() -> None:
    """``with mgr:`` on another thread while a step runs: an error that says so (before, it
    said steps do not nest), and the running step goes on unharmed."""
    want = reference_grads("mlp")
    case = mlp(seed=0)
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with mgr:
                pass
        except offload.OffloadError as e:
            errors.append(e)

    with manager(case.model) as mgr:
        case.model.zero_grad(set_to_none=True)
        with mgr:
            on_another_thread(enter)
            loss = case.loss(case.batch())
        loss.backward()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        assert_bitwise(case.grads(), want)
    (error,) = errors
    assert "running on another thread" in str(error) and "one step at a time" in str(error)


def test_a_pause_on_another_thread_leaves_the_running_step_alone() -> None:
    """``mgr.paused()`` entered on another thread while a step runs (an evaluation thread
    keeping its own work out of the manager): saved-tensor hooks are per thread, so nothing of
    that thread's reached the step anyway; counted, the pause turned the step's offloading off
    (0 bytes offloaded while it was held)."""
    want = reference_grads("mlp")
    case = mlp(seed=0)
    held, release = threading.Event(), threading.Event()

    def pause() -> None:
        with mgr.paused():
            held.set()
            release.wait(30)

    with manager(case.model) as mgr:
        case.model.zero_grad(set_to_none=True)
        other = threading.Thread(target=pause)
        with mgr:
            other.start()
            assert held.wait(30)
            loss = case.loss(case.batch())
            release.set()
        other.join(30)
        loss.backward()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        assert_bitwise(case.grads(), want)
        with mgr.paused():  # on the step's thread, outside a step: as before
            assert mgr._paused == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_gradient_accumulation_over_two_micro_steps(engine: str) -> None:
    ref = gpt_block(seed=0)
    ref.model.zero_grad(set_to_none=True)
    for s in range(2):
        ref.loss(ref.batch(s)).backward()
    want = ref.grads()
    case = gpt_block(seed=0)
    with manager(case.model, engine) as mgr:
        case.model.zero_grad(set_to_none=True)
        for s in range(2):
            with mgr:
                loss = case.loss(case.batch(s))
            loss.backward()
        assert mgr.stats.total.steps == 2
        assert mgr.stats.total.records_offloaded_cpu > 0
        assert_bitwise(case.grads(), want)
        del loss
        assert_nothing_live(mgr)


def test_two_forwards_then_two_backwards() -> None:
    """Pipelining's shape: step 2 begins while step 1's copies are still in flight and before its
    backward. Step 1's copies must still be retired (their sources dropped) and its backward must
    prefetch its own families."""
    ref = gpt_block(seed=0)
    ref.model.zero_grad(set_to_none=True)
    losses = [ref.loss(ref.batch(s)) for s in range(2)]
    for loss in losses:
        loss.backward()
    want = ref.grads()

    case = gpt_block(seed=0)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=4)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, _copy_engine=engine, max_inflight_bytes=1 << 30
    )
    try:
        case.model.zero_grad(set_to_none=True)
        with engine.paused(), mgr:
            loss1 = case.loss(case.batch(0))
        ex = mgr._executor
        first = list(ex.step.families)
        assert first and all(f.life is Life.COPYING_OUT for f in first)
        with mgr:
            loss2 = case.loss(case.batch(1))
        for f in first:
            f.handle.wait()
        ex.poll()
        assert all(f.life is Life.OFF_DEVICE and f.source is None for f in first)
        ex.poll()
        for f in ex.step.families:
            f.handle.wait()
        ex.poll()
        loss1.backward()
        # Step 1's backward prefetched step 1's families, not step 2's.
        assert all(f.life is Life.OFF_DEVICE for f in ex.step.families)
        assert mgr.stats.last.stalls <= 1
        loss2.backward()
        assert_bitwise(case.grads(), want)
        del loss1, loss2
        gc.collect()
        assert_nothing_live(mgr)
    finally:
        mgr.close()
        engine.close()


class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("backward_inside", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_exception_in_backward_leaves_nothing_live(engine: str, backward_inside: bool) -> None:
    case = gpt_block(seed=0)
    with manager(case.model, engine) as mgr:
        offloaded_step(case, mgr)  # warm: the pool has its slab
        drain(mgr)  # the warm step's late transfers end first (else `used` raced them)
        mgr._executor.poll()
        pool = mgr._executor.pool
        used = pool.used_bytes
        with pytest.raises(RuntimeError, match="boom in backward") as info:
            with mgr:
                h = case.model(case.batch()[0])
                loss = (Explode.apply(h[:, :16]).sum() + h.pow(2).sum()) * 1.0
                if backward_inside:
                    loss.backward()
            loss.backward()
        del info, h, loss
        gc.collect()
        assert_nothing_live(mgr)
        drain(mgr)  # reloads started before the error release their regions when they end
        assert pool.used_bytes == used
        # The manager keeps working, exactly.
        assert_bitwise(offloaded_step(case, mgr), reference_grads("gpt_block"))


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("mode", ["min_memory", "budget"])
def test_a_backward_that_raises_midway_leaves_host_and_file_as_before(
    mode: str, fault: type[BaseException], tmp_path
) -> None:
    """A gradient hook raises (or Ctrl-C arrives) in the middle of backward, after the MLP's
    unpacks, with records in pinned memory and on NVMe (a 64 KiB cpu_budget), in min-memory
    mode and under a plan. Once the loss is dropped (and the reads backward had started end),
    the host tier, the spill file's ranges and the open files are as before the step, and the
    next step is bitwise."""
    want = [reference_grads("gpt_block", s) for s in range(4)]
    case = gpt_block(seed=0)
    failing = fail_backward_at(case.model.attn, fault)  # its gradient comes after the MLP's
    budget: dict[str, Any] = {}
    if mode == "budget":
        hw = lifecycle.HardwareModel.cpu_only(
            copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
        )
        budget = {"gpu_budget": "384KiB", "hardware": hw}  # keeps, cpu and nvme
    with manager(
        case.model, tiers=("cpu", "nvme"), nvme_dir=tmp_path, cpu_budget="64KiB", **budget
    ) as mgr:
        for s in range(2):  # a budget's profiling step, then its plan
            assert_bitwise(offloaded_step(case, mgr, s), want[s])
        drain(mgr)
        ex, (host, nvme) = mgr._executor, mgr._tiers
        files = len(os.listdir("/proc/self/fd"))
        assert (ex.live_families(), host.used_bytes, nvme.used_bytes) == (0, 0, 0)
        failing.append(1)
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(2))
        # Both tiers hold records (a refined plan may place them otherwise: some, at least).
        held = [host.used_bytes > 0, nvme.used_bytes > 0]
        assert all(held) if mode == "min_memory" else any(held)
        with pytest.raises(fault):
            loss.backward()
        failing.clear()
        del loss
        gc.collect()
        drain(mgr)
        assert (ex.live_families(), ex.cpu_bytes, host.used_bytes, nvme.used_bytes) == (0,) * 4
        assert len(os.listdir("/proc/self/fd")) == files
        assert not mgr._step.deferred and mgr._budget._profiling is None
        assert_bitwise(offloaded_step(case, mgr, 3), want[3])


def test_pack_while_paused_passes_through() -> None:
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with manager(model) as mgr:
        with mgr:
            with mgr.paused():
                y = torch.tanh(model(x))
            records = mgr.stats.last.records
            z = torch.tanh(model(x))
        assert records == 0
        assert mgr.stats.last.records > 0
        # The paused graph holds plain tensors, not offload handles.
        assert isinstance(y.grad_fn._saved_result, torch.Tensor)
        assert mgr._executor.live_families() == len(mgr._executor.step.families)
        (y.sum() + z.sum()).backward()


def test_a_step_that_ends_inside_paused_leaves_the_hook_stack_sound() -> None:
    """close() (or a step's exit) inside ``paused()`` used to pop a hook pair that paused() had
    taken off already: torch's internal assert on an empty stack. The stack stays balanced, and
    the next step offloads as usual."""
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with manager(model) as mgr:
        mgr.__enter__()
        paused = mgr.paused()
        paused.__enter__()
        mgr.__exit__(None, None, None)  # the step ends inside the paused region
        paused.__exit__(None, None, None)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        with mgr:
            loss = torch.tanh(model(x)).sum()
        assert mgr.stats.last.records > 0
        loss.backward()
        with mgr:
            with mgr.paused():
                mgr.close()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_paused_leaves_a_foreign_hook_alone() -> None:
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    foreign: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        foreign.append(t)
        return t

    with manager(model) as mgr:
        with mgr:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with mgr.paused():
                    y = torch.tanh(model(x))
            n_foreign = len(foreign)
            before = mgr.stats.last.records
            z = torch.tanh(model(x))  # ours again
        assert n_foreign > 0  # the innermost (foreign) pair kept firing inside paused()
        assert mgr.stats.last.records > before
        assert len(foreign) == n_foreign
        (y.sum() + z.sum()).backward()
