"""Which stream the copies are ordered after, on CPU: ``torch.cpu``'s stream stand-ins
(``torch.cpu.stream(s)`` switches ``torch.cpu.current_stream()``) make the executor choose
streams here exactly as it does on CUDA, where ``tests/test_gpu_offload.py`` checks the bytes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import offload
from offload._device import DeviceStreams


class RecordingStreams(DeviceStreams):
    """The executor's real stream layer for the CPU, also noting which stream each event was
    recorded on and which buffers were marked used on which stream."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.recorded: list[Any] = []
        self.marked: list[tuple[int, Any]] = []

    def record(self, stream: Any) -> Any:
        self.recorded.append(stream)
        return super().record(stream)

    def mark_used(self, t: torch.Tensor, stream: Any) -> None:
        self.marked.append((t.untyped_storage().data_ptr(), stream))
        super().mark_used(t, stream)


def _streams_api(device: torch.device) -> Any:
    return torch.cuda if device.type == "cuda" else torch.cpu


class SideBranch(nn.Module):
    """Two branches of one input joined: ``a`` and a dropout on a side stream (after ``busy``
    matmuls queued there), ``b`` on the caller's stream. The dropout's mask needs no gradient,
    so its pack is deferred (NOTE [ Fill after pack ]) and stored at ``b``'s pre-hook, on the
    caller's stream, while the side stream may not have written the mask yet."""

    def __init__(self, width: int = 64, busy: int = 0, busy_width: int = 4096) -> None:
        super().__init__()
        self.a = nn.Linear(width // 2, width)
        self.b = nn.Linear(width // 2, width)
        self.busy, self.busy_width = busy, busy_width
        self.side: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        api = _streams_api(x.device)
        if self.side is None:
            self.side = api.Stream(x.device) if x.device.type == "cuda" else api.Stream()
        main = api.current_stream(x.device) if x.device.type == "cuda" else api.current_stream()
        self.side.wait_stream(main)
        with api.stream(self.side):
            if self.busy:
                with torch.no_grad():
                    w = torch.full((self.busy_width,) * 2, 1e-4, device=x.device)
                    for _ in range(self.busy):  # the side stream's queue: the mask comes late
                        w = torch.tanh(w @ w)
            m = F.dropout(self.a(x), 0.5, training=True)
        y = self.b(x)  # its pre-hook stores the mask, on the caller's stream
        main.wait_stream(self.side)
        if x.device.type == "cuda":
            m.record_stream(main)  # made on the side stream, used on this one
        return m + y


def _run(model: SideBranch, x: torch.Tensor, mgr: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the dropout draws the same mask with and without offload
    if mgr is None:
        loss = model(x).pow(2).sum()
    else:
        with mgr:
            loss = model(x).pow(2).sum()
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_a_deferred_pack_is_ordered_after_the_stream_its_op_ran_on() -> None:
    """The dropout under a side stream saves its mask (no gradient: stored only at the next
    op's pack, on the caller's stream). Its copy out must wait on an event recorded on the side
    stream, where the mask is written, not on the stream current when it is stored: there the
    copy could run before the mask exists (stale bytes, reloaded exactly). Before, its event
    went on the caller's stream: recorded streams [side, main, main] instead of [side, side,
    main] (x, the mask, the loss's input)."""
    torch.manual_seed(0)
    model = SideBranch()
    x = torch.randn(8, 32)
    want = _run(model, x, None)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    try:
        _run(model, x, mgr)  # makes the executor
        assert mgr._executor is not None
        rec = RecordingStreams(mgr.device)
        mgr._executor.streams = rec
        got = _run(model, x, mgr)
        side = model.side
        assert [s is side for s in rec.recorded] == [True, True, False]
        assert mgr.stats.last.records_offloaded_cpu == 3
        for k in want:
            assert torch.equal(got[k], want[k]), k
    finally:
        mgr.close()


def _reload_on(prefetch_stream: Any, unpack_stream: Any) -> tuple[RecordingStreams, set[int]]:
    """Prefetch every family of a step under one stream, run its backward under another; the
    buffers reloaded and the marks made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    want = _run_plain(model, x)
    mgr = offload.ActivationOffloader(
        model, min_offload_bytes=0, max_inflight_bytes="1MiB"
    )  # a window for all 3
    try:
        with mgr:
            pass  # makes the executor
        ex = mgr._executor
        assert ex is not None
        rec = RecordingStreams(mgr.device)
        ex.streams = rec
        model.zero_grad(set_to_none=True)
        with mgr:
            loss = model(x).pow(2).sum()
        step = ex.step
        assert step is not None and len(step.families) == 3  # x, the tanh output, the loss's
        with torch.cpu.stream(prefetch_stream):
            ex.prefetch(step.families)  # a backward pre-hook of a node on prefetch_stream
        buffers = {
            f.resident.untyped_storage().data_ptr() for f in step.families if f.resident is not None
        }
        assert len(buffers) == 3
        with torch.cpu.stream(unpack_stream):
            loss.backward()  # its nodes unpack on unpack_stream
        for k, p in model.named_parameters():
            assert p.grad is not None and torch.equal(p.grad, want[k]), k
        return rec, buffers
    finally:
        mgr.close()


def _run_plain(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_a_reload_unpacked_on_another_stream_is_marked_used_there() -> None:
    """A reload buffer comes from the pool of the stream current when it was allocated (the
    prefetching node's); unpacked by a node on another stream, it is marked used there, so the
    allocator does not hand it out on the first stream while the second still reads it (NOTE
    [ Reload buffers used on another stream ]). Before, nothing was marked: 0 marks, not 4
    (the tanh output has two members: tanh's output and the second Linear's input)."""
    a, b = torch.cpu.Stream(), torch.cpu.Stream()
    rec, buffers = _reload_on(a, b)
    assert {ptr for ptr, _ in rec.marked} == buffers
    assert all(s is b for _, s in rec.marked)
    assert len(rec.marked) == 4


def test_a_reload_unpacked_on_its_own_stream_is_not_marked() -> None:
    a = torch.cpu.Stream()
    rec, _ = _reload_on(a, a)
    assert rec.marked == []
