"""The host memory pool: fixed power-of-two slabs, sub-allocated in 4 KiB-aligned regions."""

from __future__ import annotations

import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from offload.storage._budget import default_cpu_budget_bytes
from offload.storage._errors import StorageError, StorageFullError
from offload.storage._extents import ExtentAllocator
from offload.storage._transfer import reset_in_forked_child
from offload.storage._units import ALIGNMENT_BYTES, format_bytes, next_pow2, prev_pow2, round_up

logger = logging.getLogger("offload.storage")

_DEFAULT_SLAB_BYTES = 256 << 20

# NOTE [ Host region reuse ]
# A region's bytes may be read or written by work the pool cannot see: a D2H or H2D copy on a CUDA
# stream, a file write on an I/O thread, a checksum. The pool therefore never decides when a region
# is free; its owner does, by calling ``release()`` only after the last event or future that
# touches the region has completed (docs/design.md, NOTE [ Stream ordering ] rule 4). The pool's part:
#   * a range is handed out again only after ``release()``, never while a region covers it;
#   * ``release()`` is idempotent, so an error path and a finalizer may both call it;
#   * with ``poison_on_release`` the bytes are overwritten with 0xFF before the range is reused,
#     so a reader that skipped its ``.wait()`` sees garbage in tests instead of plausible data;
#   * slabs are never returned before ``close()`` (or ``trim()``): once the working set fits, a
#     step allocates nothing from the host (``host_allocations`` stays constant). The one
#     exception: at the cap, unused slabs make way for a region larger than any of them.

# NOTE [ Recent regions ]
# Training repeats itself: every step stores records of the sizes the step before stored. So a
# released range goes first to a list of recent ranges of its exact size, with its byte view,
# and the next request of that size takes it back from there: no best-fit search, no merge with
# its neighbours, and no new view of the slab (three of a record's costs, once per saved tensor
# on the cpu tier). The recent ranges are free space the free list does not see yet: they count
# as free in ``used_bytes``, and are handed to the free list (merged with their neighbours)
# before anything asks it: a request the free list cannot place (so a recent range never makes
# the pool grow or refuse), ``largest_free_bytes``, ``trim`` and making room at the cap. A
# range is still handed out again only after its region was released.

# NOTE [ Reused region objects ]
# A record's region lives from its pack to its unpack: past the collector's young generations,
# so each one allocated is one more object its next full collection walks (NOTE [ Objects per
# saved tensor ] in offload/_executor.py). The cpu tier allocates the regions of its records
# itself, and hands them to no one unless asked for (``StoredHandle.region``); once such a
# record is released, the tier drops its reference and gives the region object back with its
# range (``_release(region, reuse=True)``), and the next request of that size gets the same
# object, live again. A region anyone else may hold is never reused: its range comes back as a
# new region, so a second ``release()`` of the old one still does nothing.

# NOTE [ Typed copies ]
# A contiguous tensor copied whole into a region, or out of one, needs the region's bytes as
# a tensor of its dtype and shape; ``HostRegion._shaped`` makes that view and keeps it with
# the range, among the recent ranges too, so the next record of that dtype and shape (the next
# step's, NOTE [ Recent regions ]) copies without any new view (a uint8 view of the tensor
# took two). The copy is one of equal dtypes: the same bytes as a copy of the bytes. The cpu
# tier's ``_write_whole`` and ``_read_whole`` take these copies for the executor, which
# checked that the tensor is plain, contiguous and free of lazy bits.

# NOTE [ Slab sizes ]
# Slabs are powers of two because torch's pinned host allocator rounds every request up to one
# (768 MiB pinned 1 GiB); asking for powers of two means the cap is what is really pinned. A cap
# that is no power of two (3 MiB, 96 MiB, 100 MB) is then held as the powers of two it is the sum
# of (2 + 1 MiB; 64 + 32 MiB), at most ``slab_bytes`` each, and a region never spans two slabs.
# Once less than ``slab_bytes`` of the cap is left (a small cap, or the last part of a large one
# such as the default, half the available RAM), a new slab is the smallest of those powers that
# holds the region, not the largest: a small first record in the largest would leave a larger
# record after it only the small ones (cap 3 MiB: a 1 MiB record in a 2 MiB slab, then a 2 MiB
# record refused with 1 MiB of the cap never allocated). Before that point, every slab is a
# regular one (a cap of 12.3 GB: four 256 MiB slabs for a first step of 200 records up to
# 16 MiB, not nine from 4 MiB up). What no choice of slabs avoids: each region needs a slab of at
# least its size rounded up to a power of two (a 3 MiB cap holds one 1.5 MiB record, not two).


@dataclass(eq=False)
class _Slab:
    memory: torch.Tensor  # the whole allocation, uint8
    base: int  # first 4 KiB-aligned byte of ``memory`` (align by data_ptr, not by index)
    allocator: ExtentAllocator  # offsets relative to ``base``


class HostRegion:
    """A 4 KiB-aligned piece of a :class:`HostPool` slab, owned until :meth:`release`.

    ``tensor`` is a uint8 view of exactly ``nbytes`` bytes; ``span`` covers the region's whole
    aligned capacity (``nbytes`` rounded up to 4 KiB), which is what O_DIRECT file I/O moves.

    Example:
        >>> pool = HostPool(1 << 20, slab_bytes=1 << 20)
        >>> region = pool.allocate(100)
        >>> region.tensor.numel(), region.capacity_bytes, region.data_ptr() % 4096
        (100, 4096, 0)
        >>> region.release(); region.release()  # idempotent
        >>> pool.close()
    """

    __slots__ = (
        "_address",
        "_capacity",
        "_memory",
        "_nbytes",
        "_offset",
        "_pool",
        "_released",
        "_shaped_view",
        "_slab",
        "_span",
        "_start",
        "_tensor",
    )

    def __init__(
        self,
        pool: HostPool,
        slab: _Slab | None,
        offset: int,
        memory: torch.Tensor,
        start: int,
        capacity: int,
        nbytes: int,
        tensor: torch.Tensor | None = None,
        shaped: Any = None,
    ) -> None:
        self._pool = pool
        self._slab = slab
        self._offset = offset
        # The region is ``memory[start : start + capacity]``; that view (``span``) is made
        # when first asked for (file I/O, poisoning): a copy needs only ``tensor``, and one
        # view less per region counts once per saved tensor.
        self._memory = memory
        self._start = start
        self._address = memory.data_ptr() + start  # (its first byte: a slab never moves)
        self._capacity = capacity
        self._span: torch.Tensor | None = None
        # ``tensor``: that view already made (a recent range's, NOTE [ Recent regions ]).
        self._tensor = memory[start : start + nbytes] if tensor is None else tensor
        self._nbytes = nbytes
        self._released = False
        # ``(key, view)``: the bytes viewed as the last whole tensor copied in or out
        # (``_shaped``), kept with the range (NOTE [ Typed copies ]).
        self._shaped_view = shaped

    @property
    def nbytes(self) -> int:
        """The bytes asked for."""
        return self._nbytes

    @property
    def capacity_bytes(self) -> int:
        """The bytes reserved: ``nbytes`` rounded up to 4 KiB."""
        return self._capacity

    @property
    def tensor(self) -> torch.Tensor:
        """A 1-D uint8 view of the first ``nbytes`` bytes.

        Raises:
            StorageError: the region was released (its bytes may already belong to someone else).
        """
        if self._released:  # _check_live, inline: read once per copy
            self._check_live()
        return self._tensor

    def _shaped(self, key: tuple[Any, ...]) -> torch.Tensor:
        """The region's bytes as a contiguous tensor of dtype ``key[0]`` and size ``key[1]``
        (``key``: a whole tensor's ``(dtype, size, stride)``, with ``nbytes`` bytes), to copy
        it into or out of whole: NOTE [ Typed copies ]. The caller holds the region live."""
        shaped = self._shaped_view
        if shaped is None or (shaped[0] is not key and shaped[0] != key):
            shaped = self._shaped_view = (key, self._tensor.view(key[0]).view(key[1]))
        return shaped[1]

    @property
    def span(self) -> torch.Tensor:
        """A 1-D uint8 view of all ``capacity_bytes`` bytes (4 KiB-aligned start and length)."""
        self._check_live()
        return self._whole()

    def _whole(self) -> torch.Tensor:
        span = self._span
        if span is None:
            if self._capacity == self._nbytes:
                span = self._tensor
            else:
                span = self._memory[self._start : self._start + self._capacity]
            self._span = span
        return span

    @property
    def pinned(self) -> bool:
        """Whether the bytes are page-locked (CUDA pinned host memory)."""
        return self._pool.pinned

    @property
    def released(self) -> bool:
        return self._released

    def data_ptr(self) -> int:
        """Address of the first byte (a multiple of 4096)."""
        return self._address

    def release(self) -> None:
        """Give the bytes back to the pool; calling it again does nothing.

        See NOTE [ Host region reuse ]: call it only after every copy and I/O that touches the
        region has completed.
        """
        self._pool._release(self)

    def _check_live(self) -> None:
        if self._released:
            raise StorageError(
                f"{self!r} was released; its bytes may belong to another record now. Keep the "
                "region until every copy that uses it has completed."
            )

    def __enter__(self) -> HostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"HostRegion(nbytes={self._nbytes}, capacity_bytes={self.capacity_bytes}, {state})"


class HostPool:
    """A capped pool of host memory carved into 4 KiB-aligned regions.

    Memory comes in power-of-two slabs allocated at first use (one log line per slab, with bytes
    and seconds) and kept until :meth:`close`; regions are carved from them best-fit, a released
    region's range serves the next request of its exact size first (NOTE [ Recent regions ]),
    and released ranges merge with free neighbours before any request could be refused, so
    fragmentation does not force new slabs. The pool grows slab by slab up to
    ``capacity_bytes`` (there, unused slabs make way for a larger one) and then raises
    :class:`StorageFullError`, so the caller can fall back to another tier. Thread-safe.

    Args:
        capacity_bytes: the most host memory the pool may hold (slabs included in full).
        pin_memory: page-lock the slabs; honoured only when ``torch.cuda.is_available()``, so the
            same code runs with plain memory on CPU-only machines.
        slab_bytes: the size of a regular slab (a power of two, at least 4 KiB). Larger requests
            get a slab of their own, rounded up to a power of two.
        poison_on_release: fill released regions with 0xFF (for tests of ordering; see NOTE
            [ Host region reuse ]).

    Raises:
        ValueError: ``capacity_bytes`` is negative or ``slab_bytes`` is not a power of two >= 4096.

    Example:
        >>> pool = HostPool(8 << 20, slab_bytes=4 << 20)
        >>> a = pool.allocate(3 << 20)
        >>> pool.host_allocations, pool.used_bytes == 3 << 20
        (1, True)
        >>> a.release()
        >>> pool.close()
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pin_memory: bool = False,
        slab_bytes: int = _DEFAULT_SLAB_BYTES,
        poison_on_release: bool = False,
    ) -> None:
        _check_bytes("capacity_bytes", capacity_bytes)
        # The range is the power-of-two check's to state (-1 said "must be >= 0 bytes").
        _check_bytes("slab_bytes", slab_bytes, negative_ok=True)
        if slab_bytes < ALIGNMENT_BYTES or slab_bytes & (slab_bytes - 1):
            raise ValueError(
                f"slab_bytes must be a power of two >= {ALIGNMENT_BYTES}; got {slab_bytes}"
            )
        self._capacity = capacity_bytes
        self._pin_requested = bool(pin_memory)
        self._pinned: bool | None = None  # decided at the first slab, not at construction
        self._slab_bytes = slab_bytes
        self._poison = bool(poison_on_release)
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        # Released ranges by their regions' ``nbytes``: (slab, offset, capacity, byte view,
        # shaped view or None) each, or the region itself to reuse (NOTE [ Reused region
        # objects ]), not yet in their slab's free list (NOTE [ Recent regions ]).
        self._recent: dict[int, list[HostRegion | tuple[_Slab, int, int, torch.Tensor, Any]]] = {}
        self._reserved = 0
        self._used = 0
        self._host_allocations = 0
        self._closed = False
        self._ever_pinned = False
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        # See NOTE [ Forked children ]: a thread of the parent may have held the lock.
        self._lock = threading.Lock()

    # -- accounting -------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """The cap on :attr:`reserved_bytes`."""
        return self._capacity

    def set_capacity_bytes(self, capacity_bytes: int) -> None:
        """Change the cap. Lowering it below :attr:`reserved_bytes` stops growth; it frees nothing."""
        _check_bytes("capacity_bytes", capacity_bytes)
        with self._lock:
            self._capacity = capacity_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes held in slabs (what the host really gave the pool)."""
        return self._reserved

    @property
    def used_bytes(self) -> int:
        """Bytes in live regions, each counted at its aligned capacity."""
        return self._used

    @property
    def host_allocations(self) -> int:
        """How many slabs were ever allocated; constant once the working set fits."""
        return self._host_allocations

    @property
    def pinned(self) -> bool:
        """Whether the slabs are (or will be) page-locked."""
        if self._pinned is None:
            return self._pin_requested and torch.cuda.is_available()
        return self._pinned

    @property
    def closed(self) -> bool:
        return self._closed

    def largest_free_bytes(self) -> int:
        """The largest region that fits without growing."""
        with self._lock:
            self._free_recent()
            return max((s.allocator.largest_free() for s in self._slabs), default=0)

    # -- allocation -------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> HostRegion:
        """A region of ``nbytes`` bytes, 4 KiB-aligned, owned by the caller until released.

        Raises:
            StorageFullError: it fits neither in free space nor in a new slab under the cap.
            StorageError: the pool is closed.
            ValueError: ``nbytes`` is negative.
        """
        if type(nbytes) is not int or nbytes <= 0:  # (a positive int needs no more checks)
            _check_bytes("nbytes", nbytes)
        if nbytes == 0:
            self._check_open()
            return HostRegion(self, None, 0, torch.empty(0, dtype=torch.uint8), 0, 0, 0)
        with self._lock:
            if self._closed:
                self._check_open()
            recent = self._recent.get(nbytes)
            if recent:  # NOTE [ Recent regions ]: the common case once a step has run
                entry = recent.pop()
                if isinstance(entry, HostRegion):  # NOTE [ Reused region objects ]
                    entry._released = False
                    self._used += entry._capacity
                    return entry
                # (slab, offset, capacity, byte view, shaped view)
                at, where, room, view, shaped = entry
                self._used += room
                return HostRegion(
                    self, at, where, at.memory, at.base + where, room, nbytes, view, shaped
                )
            capacity = round_up(nbytes)
            slabs = self._slabs
            if len(slabs) == 1:  # _place's first case, inline (once per record)
                # (No local holds the slab: _grow may drop it, and its memory must go then.)
                offset = slabs[0].allocator.allocate(capacity)
                placed = None if offset is None else (slabs[0], offset)
            else:
                placed = self._place(capacity)
            if placed is None and self._recent:
                self._free_recent()
                placed = self._place(capacity)
            if placed is None:
                self._grow(capacity, reason=f"a {format_bytes(nbytes)} region", make_room=True)
                placed = self._place(capacity)
                if placed is None:  # pragma: no cover - _grow guarantees room
                    raise StorageError("host pool grew but the region still does not fit")
            slab, offset = placed
            self._used += capacity
        start = slab.base + offset
        return HostRegion(self, slab, offset, slab.memory, start, capacity, nbytes)

    def reserve(self, nbytes: int) -> None:
        """Grow now (not at the first allocation) until at least ``nbytes`` are held in slabs
        (or every whole 4 KiB page of the cap is: regions are made of them).

        Lets a caller that knows its working set pay the allocation once, up front.

        Raises:
            StorageFullError: ``nbytes`` exceeds the cap (nothing is reserved then).
        """
        _check_bytes("nbytes", nbytes)
        with self._lock:
            self._check_open()
            if nbytes > self._capacity:
                raise StorageFullError(
                    f"host pool is full: a reservation of {format_bytes(nbytes)} exceeds its "
                    f"{format_bytes(self._capacity)} cap",
                    bytes_needed=nbytes,
                )
            # Slab by slab, each no larger than the room left allows (see NOTE [ Slab sizes ]):
            # one slab for all that was missing was larger than the room when the cap is no
            # power of two (80 MiB of a 96 MiB cap wanted a 128 MiB slab). Regions are whole
            # 4 KiB pages, so a cap's last part page is never reserved.
            while self._reserved < nbytes and self._capacity - self._reserved >= ALIGNMENT_BYTES:
                room = self._capacity - self._reserved
                want = min(round_up(nbytes - self._reserved), self._slab_bytes, prev_pow2(room))
                self._grow(want, reason=f"a reservation of {format_bytes(nbytes)}")

    def _place(self, capacity: int) -> tuple[_Slab, int] | None:
        if len(self._slabs) == 1:  # the best fit of one slab is its own (None if it is full)
            slab = self._slabs[0]
            offset = slab.allocator.allocate(capacity)
            return (slab, offset) if offset is not None else None
        best: _Slab | None = None
        for slab in self._slabs:
            largest = slab.allocator.largest_free()
            if largest >= capacity and (best is None or largest < best.allocator.largest_free()):
                best = slab
        if best is None:
            return None
        offset = best.allocator.allocate(capacity)
        return (best, offset) if offset is not None else None

    def _slab_size(self, need: int) -> int:
        # See NOTE [ Slab sizes ]: the smallest power of two of the room left that holds ``need``.
        room = self._capacity - self._reserved
        largest = min(self._slab_bytes, prev_pow2(room))
        if largest < need:
            return next_pow2(need)  # a slab of its own; over the cap, _grow says the pool is full
        if largest == self._slab_bytes:
            return largest  # a regular slab: the cap's smaller powers are for its last part
        size = next_pow2(need)
        while size < largest and not room & size:
            size <<= 1
        return size

    def _grow(self, need: int, *, reason: str, make_room: bool = False) -> None:
        # ``make_room``: for a region; a reservation only adds slabs (dropping some for it would
        # undo what it reserved, again and again).
        size = self._slab_size(need)
        if make_room and size > self._capacity - self._reserved:
            # Slabs that no region uses make room under the cap: a region larger than any slab
            # (a new signature's records) after smaller ones had filled the cap with slabs was
            # refused with nothing in use. The steady state never gets here: it fits.
            self._drop_unused_slabs(size - (self._capacity - self._reserved))
            size = self._slab_size(need)
        remaining = self._capacity - self._reserved
        if size > remaining:
            raise StorageFullError(
                f"host pool is full: {reason} needs a new {format_bytes(size)} slab but only "
                f"{format_bytes(max(remaining, 0))} of its {format_bytes(self._capacity)} cap "
                f"is left ({format_bytes(self._used)} in use). Raise cpu_budget, or let the "
                "record go to another tier.",
                bytes_needed=need,
            )
        slab = self._new_slab(size)
        if slab.allocator.largest_free() < need:
            # The base was not page-aligned, so alignment cost a page; one size up always fits.
            self._drop_slab(slab)
            size = next_pow2(need + ALIGNMENT_BYTES)
            if size > remaining:
                raise StorageFullError(
                    f"host pool is full: {reason} does not fit under the "
                    f"{format_bytes(self._capacity)} cap once aligned to 4 KiB",
                    bytes_needed=need,
                )
            slab = self._new_slab(size)

    def _new_slab(self, size: int) -> _Slab:
        if self._pinned is None:
            self._pinned = self._pin_requested and torch.cuda.is_available()
        start = time.perf_counter()
        memory = _allocate_host(size, pinned=self._pinned)
        seconds = time.perf_counter() - start
        misalign = memory.data_ptr() % ALIGNMENT_BYTES
        base = (ALIGNMENT_BYTES - misalign) % ALIGNMENT_BYTES
        allocator = ExtentAllocator(alignment=ALIGNMENT_BYTES)
        usable = (size - base) // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        if usable:
            allocator.add(0, usable)
        slab = _Slab(memory, base, allocator)
        self._slabs.append(slab)
        self._reserved += size
        self._host_allocations += 1
        self._ever_pinned |= self._pinned
        logger.info(
            "storage::host_pool allocated a %s %s slab in %.3f s (%s of %s cap reserved)",
            format_bytes(size),
            "pinned" if self._pinned else "plain",
            seconds,
            format_bytes(self._reserved),
            format_bytes(self._capacity),
        )
        return slab

    def _drop_slab(self, slab: _Slab) -> int:
        """Take ``slab`` out of the pool; returns its bytes."""
        self._slabs.remove(slab)
        self._reserved -= slab.memory.numel()
        return slab.memory.numel()

    def _give_back_pinned(self) -> None:
        """Hand the pinned slabs just dropped back to the driver. torch's pinned allocator keeps
        a freed block cached until its cache is emptied, and reuses it only for a request of the
        same power of two (ATen/core/CachingHostAllocator.h: free -> maybe_cache_block,
        get_free_block by size_index; empty_cache frees the free list only): a dropped slab
        stayed pinned beside the larger one replacing it, or after the last claim on the pool
        closed. The caller must hold no reference to them (no loop variable either): a block
        still in use is not freed by the emptying."""
        if self._ever_pinned:
            _empty_host_cache()

    @staticmethod
    def _unused(slab: _Slab) -> bool:
        usable = (slab.memory.numel() - slab.base) // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        return slab.allocator.largest_free() == usable

    def _drop_unused_slabs(self, nbytes: int) -> None:
        """Give back unused slabs, smallest first, totalling at least ``nbytes``; none when they
        cannot make that much room. Caller holds the lock, and has handed the recent ranges to
        the free lists (``allocate`` does before it grows: NOTE [ Recent regions ])."""
        unused = sorted((s for s in self._slabs if self._unused(s)), key=lambda s: s.memory.numel())
        if sum(s.memory.numel() for s in unused) < nbytes:
            return
        freed = 0
        while freed < nbytes:
            freed += self._drop_slab(unused.pop(0))
        self._give_back_pinned()  # before the larger slab is allocated

    def _release(self, region: HostRegion, reuse: bool = False) -> None:
        """``region.release()``; ``reuse``: the caller holds the only reference to ``region``,
        and drops it, so the object itself serves the next request of its size (NOTE [ Reused
        region objects ])."""
        if region._released:
            return
        if self._poison and region._slab is not None and not self._closed:
            region._whole().fill_(0xFF)  # before the range can be handed out again
        with self._lock:
            if region._released:
                return
            region._released = True
            if region._slab is None or self._closed:
                return
            # To the free list later (NOTE [ Recent regions ]).
            entry: HostRegion | tuple[_Slab, int, int, torch.Tensor, Any] = (
                region
                if reuse
                else (
                    region._slab,
                    region._offset,
                    region._capacity,
                    region._tensor,
                    region._shaped_view,
                )
            )
            recent = self._recent.get(region._nbytes)
            if recent is None:
                self._recent[region._nbytes] = [entry]
            else:
                recent.append(entry)
            self._used -= region._capacity

    def _free_recent(self) -> None:
        """Hand the recent ranges to their slabs' free lists (NOTE [ Recent regions ]). Caller
        holds the lock."""
        recent, self._recent = self._recent, {}
        for entries in recent.values():
            for entry in entries:
                if isinstance(entry, HostRegion):
                    slab, offset, capacity = entry._slab, entry._offset, entry._capacity
                    assert slab is not None  # (a region of no slab is never recent)
                else:
                    slab, offset, capacity = entry[0], entry[1], entry[2]
                slab.allocator.free(offset, capacity)

    # -- lifetime ---------------------------------------------------------------------------------

    def trim(self, keep_bytes: int = 0) -> int:
        """Give back slabs no live region uses, until at most ``keep_bytes`` stay reserved (or
        no free slab is left); returns the bytes given back."""
        _check_bytes("keep_bytes", keep_bytes)
        with self._lock:
            self._free_recent()
            unused = [s for s in self._slabs if self._unused(s)]
            freed = 0
            while unused and self._reserved > keep_bytes:
                freed += self._drop_slab(unused.pop(0))
            if freed:
                self._give_back_pinned()
            return freed

    def close(self) -> None:
        """Drop every slab (regions still live become released) and, for pinned slabs, return the
        memory to the driver. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._slabs.clear()
            self._recent.clear()
            self._reserved = 0
            self._used = 0
            ever_pinned = self._ever_pinned
        if ever_pinned:
            _empty_host_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the host pool is closed; create a new one (or shared_host_pool())")

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "plain"
        return (
            f"HostPool({kind}, used={format_bytes(self._used)}, "
            f"reserved={format_bytes(self._reserved)}, cap={format_bytes(self._capacity)})"
        )


def _allocate_host(nbytes: int, *, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # Anonymous mmap is page-aligned, and its pages are committed on first touch only. Private:
    # Python's default, MAP_SHARED, left a forked child and its parent writing the same slabs
    # (NOTE [ Forked children ]).
    private = getattr(mmap, "MAP_PRIVATE", None)
    buffer = mmap.mmap(-1, nbytes) if private is None else mmap.mmap(-1, nbytes, flags=private)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _empty_host_cache() -> None:
    # torch.accelerator.empty_host_cache is missing from torch 2.11 (and torch.cuda has no such
    # call): there the CUDA build's private torch._C._host_emptyCache is the one that exists.
    accelerator = getattr(torch, "accelerator", None)
    fn = (
        getattr(accelerator, "empty_host_cache", None)
        or getattr(torch.cuda, "empty_host_cache", None)
        or getattr(torch._C, "_host_emptyCache", None)
    )
    if fn is not None:
        fn()


def _check_bytes(name: str, value: object, *, negative_ok: bool = False) -> None:
    """A byte count is an int and, unless the caller checks a narrower range, not negative."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes; got {type(value).__name__}")
    if value < 0 and not negative_ok:
        raise ValueError(f"{name} must be >= 0 bytes; got {value}")


_shared_lock = threading.Lock()
_shared_pools: dict[bool, HostPool] = {}


def shared_host_pool(capacity_bytes: int | None = None, *, pin_memory: bool = True) -> HostPool:
    """The process-wide pool, so several managers share one set of slabs.

    One pool per kind (pinned or plain). The first call creates it (``capacity_bytes=None``
    means :func:`default_cpu_budget_bytes`); a later call with a larger ``capacity_bytes`` raises
    its cap, since the host memory belongs to all of them. A closed pool is replaced.

    Example:
        >>> pool = shared_host_pool(pin_memory=False)  # nothing is allocated until first use
        >>> pool is shared_host_pool(pin_memory=False)
        True
    """
    if capacity_bytes is not None:
        _check_bytes("capacity_bytes", capacity_bytes)
    pinned = bool(pin_memory) and torch.cuda.is_available()
    with _shared_lock:
        pool = _shared_pools.get(pinned)
        if pool is None or pool.closed:
            cap = default_cpu_budget_bytes() if capacity_bytes is None else capacity_bytes
            pool = HostPool(cap, pin_memory=pinned)
            _shared_pools[pinned] = pool
        elif capacity_bytes is not None and capacity_bytes > pool.capacity_bytes:
            pool.set_capacity_bytes(capacity_bytes)
        return pool


class PoolShare:
    """One user's claim on the process-wide pool (see :func:`claim_shared_host_pool`).

    Example:
        >>> share = claim_shared_host_pool(1 << 20, pin_memory=False)
        >>> region = share.pool.allocate(4096)
        >>> region.release()
        >>> share.close()  # the last claim: the pool's free slabs go back to the host
    """

    def __init__(self, pool: HostPool, nbytes: int, staging_bytes: int, default: bool) -> None:
        self.pool = pool
        self.nbytes = nbytes
        self.staging_bytes = staging_bytes
        self.default = default
        self._released = False

    def close(self) -> None:
        """Give the claim back (idempotent): the pool's cap follows the claims left, and free
        slabs beyond it go back to the host (every free slab, once no claim is left)."""
        with _shared_lock:
            if self._released:
                return
            self._released = True
            claims = _shared_claims.get(self.pool, [])
            if self in claims:
                claims.remove(self)
            last = not claims
            cap = 0 if last else _cap_of(claims)
            if last:
                _shared_claims.pop(self.pool, None)
            else:
                self.pool.set_capacity_bytes(cap)
        if not self.pool.closed:
            # Free slabs beyond what the claims left may hold; all of them with the last.
            self.pool.trim(keep_bytes=cap)


_shared_claims: dict[HostPool, list[PoolShare]] = {}


def _cap_of(claims: list[PoolShare]) -> int:
    # Defaults are each the node's share for this rank, not more of it: they count once.
    default = max((c.nbytes for c in claims if c.default), default=0)
    return (
        default
        + sum(c.nbytes for c in claims if not c.default)
        + sum(c.staging_bytes for c in claims)
    )


def claim_shared_host_pool(
    nbytes: int, *, staging_bytes: int = 0, default: bool = False, pin_memory: bool = True
) -> PoolShare:
    """A claim of ``nbytes`` (plus ``staging_bytes`` of staging) on the process-wide pool.

    Several users of one pool (an offload manager per pipeline stage on one rank) each get room
    for what they claimed: the cap is the sum of the live claims, except that claims of the
    node-aware default (``default=True``: :func:`default_cpu_budget_bytes`, this rank's share of
    the node) count once, whichever is largest. Closing the last claim returns the pool's free
    slabs to the host (docs/design.md: the pool is returned on close).

    Example:
        >>> a = claim_shared_host_pool(1 << 20, pin_memory=False)
        >>> b = claim_shared_host_pool(2 << 20, pin_memory=False)
        >>> a.pool is b.pool, a.pool.capacity_bytes >= 3 << 20
        (True, True)
        >>> a.close(); b.close()
    """
    _check_bytes("nbytes", nbytes)
    _check_bytes("staging_bytes", staging_bytes)
    pool = shared_host_pool(pin_memory=pin_memory)
    share = PoolShare(pool, nbytes, staging_bytes, bool(default))
    with _shared_lock:
        claims = _shared_claims.setdefault(pool, [])
        claims.append(share)
        pool.set_capacity_bytes(_cap_of(claims))
    return share
