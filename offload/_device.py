"""The compute device, and its clock and memory probe for the recorder.

Nothing here runs at import: CUDA is touched only when a model on a CUDA device is profiled.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lifecycle import Clock, MemoryProbe, MonotonicClock


def compute_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


class DeviceStreams:
    """Which stream work on the compute device is queued on, for the ordering rules that depend
    on it (NOTE [ Stream ordering ] in ``_executor.py``), injected into the executor.

    On CUDA these are ``torch.cuda``'s streams and events. Elsewhere they are ``torch.cpu``'s
    stand-ins for device-agnostic code: ``torch.cpu.stream(s)`` switches what
    ``torch.cpu.current_stream()`` returns, so which stream a copy is ordered after (and which
    stream a buffer is marked used on) is chosen on CPU exactly as on CUDA, and tested there,
    while events and marks do nothing (CPU ops complete in program order).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def current(self) -> Any:
        """The stream ops on the device are queued on now (this thread's current stream)."""
        if self.cuda:
            return torch.cuda.current_stream(self.device)
        return torch.cpu.current_stream()

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now (CUDA), else ``None``."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def mark_used(self, t: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``t``'s block: freed, the block is
        handed out again only after the work queued on ``stream`` so far (CUDA), else nothing."""
        if self.cuda:
            t.record_stream(stream)


# NOTE [ Copy streams ]
#     torch.cuda.Stream() does not create a stream: it hands out the next of a fixed pool of 32
#     per device and priority, round-robin (c10/cuda/CUDAStream.h, "Stream pool note";
#     torch.cuda.Stream(priority=p) draws from the pool of priority p, clamped to the range
#     torch supports, 0 to -3). So copy streams drawn per manager from the default-priority pool
#     alias, after 32 draws, the streams FSDP2 (its priority -1 pool), a trainer or the user
#     drew: the copies then queue behind, and serialize with, their kernels. The copy streams
#     are drawn once per device per process, from the pool of COPY_STREAM_PRIORITY, which
#     neither torch's defaults (0) nor FSDP2 (-1) nor "the highest priority" (clamped to -3)
#     draws from, and every manager on that device shares them (they share one PCIe link
#     anyway). Others get one of them only by drawing 31 streams of priority -2 themselves. On
#     a device whose priority range stops at -1, -2 clamps to -1 and the streams come from
#     FSDP2's pool. Priority orders kernels only; our work on these streams is plain byte
#     copies, which run on the copy engines.
COPY_STREAM_PRIORITY = -2
_copy_streams: dict[int, tuple[Any, Any]] = {}
_copy_streams_lock = threading.Lock()


def copy_streams(device: torch.device) -> tuple[Any, Any]:
    """The process's D2H and H2D streams of CUDA ``device`` (NOTE [ Copy streams ]), drawn at
    the first call for that device (never at import)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _copy_streams_lock:
        streams = _copy_streams.get(index)
        if streams is None:
            dev = torch.device("cuda", index)
            streams = (
                torch.cuda.Stream(dev, priority=COPY_STREAM_PRIORITY),
                torch.cuda.Stream(dev, priority=COPY_STREAM_PRIORITY),
            )
            _copy_streams[index] = streams
        return streams


class CudaClock:
    """Stamps are CUDA events on the current stream; resolved after one synchronize at the end,
    so stamping never blocks the host on the GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stamp(self) -> object:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, stamps: Sequence[object]) -> list[float]:
        if not stamps:
            return []
        torch.cuda.synchronize(self.device)
        first = stamps[0]
        return [first.elapsed_time(s) / 1e3 for s in stamps]  # type: ignore[attr-defined]


def clock_and_probe(device: torch.device) -> tuple[Clock, MemoryProbe | None, str]:
    """The clock, memory probe and a label for ``device``: CUDA events and allocated bytes on a
    CUDA device; the host clock and live saved bytes elsewhere."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        dev = torch.device("cuda", index)

        def cuda_memory_allocated() -> int:
            return torch.cuda.memory_allocated(dev)

        return CudaClock(dev), cuda_memory_allocated, str(dev)
    return MonotonicClock(), None, str(device)
