"""The compute device: its clock and memory probe for the recorder; its room probe, graph
capture state and completion queries for the executor.

Nothing here runs at import: CUDA is touched only when a model on a CUDA device is profiled.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from offload.lifecycle import Clock, MemoryProbe, MonotonicClock


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
        if not self.cuda:
            # ``current``, one call less where it asks torch.cpu (once per store, reload and
            # unpack).
            self.current = torch.cpu.current_stream  # type: ignore[method-assign]

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


# NOTE [ No query while capturing ]
#     While a stream captures a CUDA graph, CUDA forbids asking whether work finished or waiting
#     for it (cudaEventQuery, cudaEventSynchronize, ...: in the default global capture mode from
#     any thread): the call fails and invalidates the capture. Pack and unpack pass through then
#     (docs/design.md), and every executor entry point that would ask an event (poll at pack and
#     module boundaries, a step's start collecting the last step's reloads and releases, a
#     prefetch, a release, a count of live families) asks ``GraphCapture.capturing()`` first:
#     while it says yes it leaves that work (releases queued) to the first call after the
#     capture. The executor asks every completion through ``query()`` / ``done()`` below, one
#     place. A release from another thread (an I/O thread's GC pass) cannot see the capture on
#     its own stream: it follows the last answer given to the step's threads.


class GraphCapture:
    """Whether the current stream is capturing a CUDA graph, and every completion query of the
    executor (see NOTE [ No query while capturing ]).

    On CPU nothing captures; :meth:`simulate` makes :meth:`capturing` say yes, so that a test
    can run steps as if inside ``torch.cuda.graph`` and count the queries asked meanwhile
    (``queries``), each of which would have invalidated a real capture.

    Example:
        >>> capture = GraphCapture(torch.device("cpu"))
        >>> with capture.simulate():
        ...     capture.capturing()
        True
        >>> capture.capturing(), capture.queries
        (False, 0)
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._simulated = 0
        # Whether a capture can run at all (a CUDA device, or a simulated one): the hot paths
        # ask this attribute before calling capturing() (a call per pack saved on CPU).
        self.possible = self.cuda
        self.queries = 0  # completion queries asked while a simulated capture ran

    def capturing(self) -> bool:
        """Whether the current stream (of the calling thread) is capturing a CUDA graph."""
        if self._simulated:
            return True
        return self.cuda and torch.cuda.is_current_stream_capturing()

    def query(self, event: Any) -> bool:
        """Whether a CUDA event completed (``cudaEventQuery``)."""
        if self._simulated:
            self.queries += 1
        return bool(event.query())

    def done(self, transfer: Any) -> bool:
        """Whether a storage transfer or stored handle finished (the CPU path's completion)."""
        if self._simulated:
            self.queries += 1
        return bool(transfer.done())

    @contextlib.contextmanager
    def simulate(self) -> Iterator[None]:
        """Say "capturing" until the block exits (CPU tests; see the class docstring).

        Raises:
            ValueError: on a CUDA device, where captures are real.
        """
        if self.cuda:
            raise ValueError("simulate() is for CPU devices; on CUDA use torch.cuda.graph")
        self._simulated += 1
        self.possible = True
        try:
            yield
        finally:
            self._simulated -= 1
            self.possible = self.cuda or self._simulated > 0


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


# NOTE [ Prefetch under memory pressure ]
#     A prefetch is only ahead of time: when the device has no room for a reload, the unpack
#     that needs it loads it then. Trying anyway costs more than the stall it saves: the caching
#     allocator, out of cached blocks, frees its whole cache (cudaFree, which synchronizes the
#     device) and retries before it raises, at every trigger while memory stays short. So the
#     executor asks a room probe (``room_probe``, injected) before it allocates a prefetch's
#     buffer, and skips the prefetch (``stats.prefetches_skipped``) when the probe says no. The
#     probe on CUDA asks the allocator's counters and ``cudaMemGetInfo``, neither of which waits
#     for the device. It can be wrong only towards trying (fragmented cached blocks): then the
#     out-of-memory path catches it as before.

RoomProbe = Callable[[int], bool]
"""Whether a new device buffer of that many bytes fits now without the allocator emptying its
cache."""

_SMALL_BYTES = 1 << 20  # c10's kSmallSize: requests up to it come from the small pool
_MIN_LARGE_BYTES = 10 << 20  # kMinLargeAlloc: smaller large requests get a 20 MiB segment


def _segment_bytes(nbytes: int) -> int:
    """The device segment c10's caching allocator cudaMallocs for a request it cannot serve
    from its cache (``get_allocation_size`` in CUDACachingAllocator.cpp)."""
    if nbytes <= _SMALL_BYTES:
        return 2 << 20
    if nbytes < _MIN_LARGE_BYTES:
        return 20 << 20
    return -(-nbytes // (2 << 20)) * (2 << 20)


class CudaRoom:
    """The room probe of a CUDA device: the allocator's cached, unallocated bytes in the pool
    the request comes from, else free device memory for a new segment. No synchronization:
    the allocator's counters are host state, and ``cudaMemGetInfo`` does not wait for work
    queued on the device (see NOTE [ Prefetch under memory pressure ])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, nbytes: int) -> bool:
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # {} before CUDA's init
        pool = "small_pool" if nbytes <= _SMALL_BYTES else "large_pool"
        try:
            cached = (
                stats["reserved_bytes"][pool]["current"] - stats["allocated_bytes"][pool]["current"]
            )
        except KeyError:
            cached = 0
        if cached >= nbytes:
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= _segment_bytes(nbytes)


def room_probe(device: torch.device) -> RoomProbe | None:
    """The room probe of ``device``: :class:`CudaRoom` on CUDA; none elsewhere (host memory is
    not the allocator's to empty)."""
    return CudaRoom(device) if device.type == "cuda" else None
