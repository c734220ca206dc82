"""The compute device, and its clock and memory probe for the recorder.

Nothing here runs at import: CUDA is touched only when a model on a CUDA device is profiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        pool = "small_pool" if nbytes <= _SMALL_BYTES else "large_pool"
        cached = (
            stats["reserved_bytes"][pool]["current"] - stats["allocated_bytes"][pool]["current"]
        )
        if cached >= nbytes:
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= _segment_bytes(nbytes)


def room_probe(device: torch.device) -> RoomProbe | None:
    """The room probe of ``device``: :class:`CudaRoom` on CUDA; none elsewhere (host memory is
    not the allocator's to empty)."""
    return CudaRoom(device) if device.type == "cuda" else None
