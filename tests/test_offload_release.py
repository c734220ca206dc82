"""Releases at awkward moments: a KeyboardInterrupt inside a handle's release, and GC passes
inside the executor (NOTE [ Re-entrant release ])."""

from __future__ import annotations

import gc
import threading
from typing import Any

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
    manager,
    offloaded_step,
    reference_grads,
)
from torch import nn

import offload
from offload import storage
from offload._family import Life


def _interrupted_once(fn: Any) -> Any:
    """``fn``, except that its first call raises KeyboardInterrupt (Ctrl-C arriving there)."""
    calls: list[int] = []

    def wrapper(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return fn(*args, **kw)

    return wrapper


@pytest.mark.parametrize("where", ["release", "drop", "tier"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_release_cut_short_by_an_interrupt_is_finished(engine: str, where: str, monkeypatch):
    """Ctrl-C while backward frees the graph: the KeyboardInterrupt is raised inside a saved
    tensor's handle's ``__del__`` (Python prints it and drops it) as it releases its family: on
    entry, where its bytes are about to be freed (``drop``), or inside the tier's ``free``. That family kept its 32 KiB
    in the host tier (and in ``cpu_bytes``, the cpu_budget count) until close(); now the next
    count of live families finishes the release, and the next steps are exact and leave nothing."""
    from offload import _release

    want = [reference_grads("gpt_block", s) for s in range(3)]
    case = gpt_block(seed=0)
    dropped: list[type[BaseException] | None] = []  # not the exceptions: their frames hold handles
    monkeypatch.setattr("sys.unraisablehook", lambda u: dropped.append(u.exc_type))
    with manager(case.model, engine) as mgr:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])
        ex = mgr._executor
        host = mgr._tiers[0]
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        if where == "tier":
            monkeypatch.setattr(host, "free", _interrupted_once(host.free))
        elif where == "release":
            monkeypatch.setattr(type(ex), "release", _interrupted_once(type(ex).release))
        else:
            monkeypatch.setattr(_release, "drop", _interrupted_once(_release.drop))
        loss.backward()
        monkeypatch.undo()
        assert dropped == [KeyboardInterrupt]
        assert_bitwise(case.grads(), want[1])
        del loss
        gc.collect()
        assert_nothing_live(mgr)
        drain(mgr)
        assert host.used_bytes == 0
        assert_bitwise(offloaded_step(case, mgr, 2), want[2])
        gc.collect()
        assert_nothing_live(mgr)
        drain(mgr)
        assert host.used_bytes == 0


def test_a_release_while_poll_asks_about_a_copy_retires_no_running_copy() -> None:
    """A GC pass inside poll's query of the oldest copy out (a dropped graph's finalizer
    released that family) made poll retire the next family instead, whose copy was still
    running: its source was dropped (on CUDA, device memory the D2H copy still read; on CPU the
    retire raised TimeoutError asking the unfinished write for its error). Poll now retires
    only the family it asked about."""
    from offload._executor import Executor

    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    mgr = offload.ActivationOffloader(nn.Linear(2, 2), min_offload_bytes=0, _copy_engine=engine)
    hold = threading.Event()
    seen: list[Any] = []
    x1 = torch.randn(32, 32, requires_grad=True)
    x2 = torch.randn(32, 32, requires_grad=True)
    gc.collect()
    gc.disable()  # only the pass below may finalize the dropped graph
    try:
        with engine.paused():  # nothing is copied before the step's last poll
            with mgr:
                y1 = Saver.apply(seen, x1 * 1)  # family a
                blocker = engine.submit(hold.wait)  # the copy worker stops after a's copy
                y2 = Saver.apply(seen, x2 * 1)  # family b: copied once the blocker returns
        ex = mgr._executor
        a, b = ex.step.families
        a.handle.wait()
        assert not b.handle.done() and list(ex._inflight) == [a, b]
        garbage(y1)
        del y1
        with gc_pass_when_returning(Executor._copy_out_done) as passes:
            ex.poll()
        assert passes[0] >= 1 and a.life is Life.FREED  # what this test is about
        assert b.life is Life.COPYING_OUT and b.source is not None
        assert list(ex._inflight) == [b] and ex._inflight_bytes == b.nbytes
        hold.set()
        blocker.result(timeout=30)
        y2.backward()
        assert torch.equal(seen[-1][0][1], x2) and torch.equal(x2.grad, torch.ones_like(x2))
        assert_nothing_live(mgr)
    finally:
        gc.enable()
        hold.set()
        mgr.close()
        engine.close()


def test_a_release_while_a_prefetch_allocates_stops_that_reload() -> None:
    """A GC pass at the allocation of a prefetch's buffer (a dropped graph's finalizer released
    the family being reloaded) left the reload going on a freed family: an illegal move from
    'freed' to 'copying in' raised out of the backward that prefetched it. The reload stops."""
    from offload._family import aligned_buffer

    mgr = offload.ActivationOffloader(nn.Linear(2, 2), min_offload_bytes=0)
    seen: list[Any] = []
    x1 = torch.randn(32, 32, requires_grad=True)
    x2 = torch.randn(16, 16, requires_grad=True)
    gc.collect()
    gc.disable()  # only the pass below may finalize the dropped graph
    try:
        with mgr:
            y1 = Saver.apply(seen, x1 * 1)  # family a: its graph is dropped below
            y2 = Saver.apply(seen, x2 * 1)  # family b: its backward's look-ahead reaches a
        ex = mgr._executor
        a, b = ex.step.families
        assert a.life is Life.OFF_DEVICE and b.life is Life.OFF_DEVICE
        garbage(y1)
        del y1
        with gc_pass_when_returning(aligned_buffer, nbytes=a.nbytes) as passes:
            y2.backward()
        assert passes[0] == 1 and a.life is Life.FREED and a.resident is None
        assert torch.equal(seen[-1][0][1], x2) and torch.equal(x2.grad, torch.ones_like(x2))
        assert ex._ahead_bytes == 0
        assert_nothing_live(mgr)
    finally:
        gc.enable()
        mgr.close()
