"""The interface every storage tier implements, and the handle to one stored record."""

from __future__ import annotations

import concurrent.futures
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from offload.storage._errors import StorageError
from offload.storage._transfer import (
    Transfer,
    byte_view,
    chain,
    finish_elsewhere,
    finished,
    on_worker_thread,
    reset_in_forked_child,
)

if TYPE_CHECKING:
    from offload.storage._pool import HostRegion


# A handle's write until one is started (transfers are immutable: one serves every handle).
_WRITTEN = Transfer.completed("write")


def written_at_once(handle: StoredHandle) -> bool:
    """Whether ``handle``'s write completed in its call, without error (NOTE [ Copies done at
    once ] in _host_tier.py), known without a lock or a wait; False says nothing more. (Its
    executor asks once per record, where ``written.done()`` and ``written.exception()`` each
    took the future's lock.)"""
    return handle._write is _WRITTEN


class StoredHandle:
    """Where one record's bytes live in a tier, and the write that put them there.

    Made by :meth:`Tier.write`; pass it to :meth:`Tier.read` (as often as needed) and once to
    :meth:`Tier.free`. ``written`` completes when the bytes are stored; a failed write releases
    the record's space and every later read re-raises its error.

    Example:
        >>> from offload.storage import HostPool, HostTier
        >>> tier = HostTier(HostPool(1 << 20, slab_bytes=1 << 20))
        >>> h = tier.write(torch.arange(8, dtype=torch.uint8))
        >>> h.wait(); (h.nbytes, h.tier is tier)
        (8, True)
        >>> tier.free(h); tier.close()
    """

    __slots__ = (
        "__weakref__",
        "_charge",
        "_crcs",
        "_freed",
        "_offset",
        "_on_device",
        "_own_region",
        "_pending",
        "_region",
        "_released",
        "_tier",
        "_write",
        "nbytes",
    )

    def __init__(
        self,
        tier: Tier,
        nbytes: int,
        charge: int,
        region: HostRegion | None = None,
        offset: int | None = None,
        crcs: list[int] | None = None,
        on_device: bool = False,
    ) -> None:
        self._tier = tier
        self.nbytes = nbytes
        self._charge = charge  # bytes of the tier's capacity this record holds
        self._region = region
        # The tier allocated ``region`` and no one else was handed it: it is reused once the
        # record is released (NOTE [ Reused region objects ] in _pool.py).
        self._own_region = False
        self._offset = offset
        self._crcs = crcs
        self._on_device = on_device
        self._write: Transfer = _WRITTEN
        self._pending = 0  # transfers in flight that touch this record's bytes
        self._freed = False  # the owner called free() (or the write failed)
        self._released = False  # the space went back to the tier

    @property
    def tier(self) -> Tier:
        return self._tier

    @property
    def written(self) -> Transfer:
        """The write that stored the bytes."""
        return self._write

    @property
    def region(self) -> HostRegion | None:
        """The host region holding the bytes (cpu tier only), for a direct H2D copy from it;
        None once the record was released, if it was not asked for before."""
        self._own_region = False  # (someone may hold it now: never reused)
        return self._region

    @property
    def freed(self) -> bool:
        return self._freed

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the write; re-raise its error."""
        self._write.wait(timeout)

    def done(self) -> bool:
        """Whether the write finished."""
        return self._write.done()

    def __repr__(self) -> str:
        where = f", file_offset={self._offset}" if self._offset is not None else ""
        state = "freed" if self._freed else ("written" if self._write.done() else "writing")
        return f"StoredHandle({self._tier.name}, nbytes={self.nbytes}{where}, {state})"


class Tier(ABC):
    """A place for bytes off the GPU: write a record, read it back any number of times, free it.

    Every method is thread-safe and returns quickly; the bytes move in :class:`Transfer`\\ s whose
    ``.wait()`` is the only synchronisation (see NOTE [ Transfer ordering ]). A record's space
    returns to the tier only once it was freed *and* every transfer touching it completed.

    Sources and destinations are host memory: a :class:`~offload.storage.HostRegion` (4 KiB-aligned, the
    fast path for file I/O) or a contiguous CPU tensor of any dtype. A region source is adopted by
    the cpu tier (it becomes the record's storage) but only read by the NVMe tier, whose caller
    keeps it and may release it once the write completed; if the write failed, the region still
    holds the bytes, so the record can go to the next tier.

    Errors: ``write`` raises :class:`~offload.storage.StorageFullError` at once when the record does not
    fit; I/O errors arrive through ``.wait()`` of the returned handle or transfer.

    Example:
        >>> from offload.storage import HostPool, HostTier
        >>> def round_trip(tier: Tier, x: torch.Tensor) -> torch.Tensor:
        ...     handle = tier.write(x)
        ...     out = torch.empty_like(x)
        ...     tier.read(handle, out).wait()
        ...     tier.free(handle)
        ...     return out
        >>> with HostPool(1 << 20, slab_bytes=1 << 20) as pool, HostTier(pool) as tier:
        ...     round_trip(tier, torch.arange(3.0)).tolist()
        [0.0, 1.0, 2.0]
    """

    name: ClassVar[str] = "tier"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[StoredHandle] = set()
        self._inflight: set[Future[Any]] = set()
        # Transfers past the open check whose future is not in _inflight yet: close() waits for
        # them to be counted (a write started on another thread as close() ran was missed, and
        # went on to a closed, or reused, file descriptor).
        self._starting = 0
        self._started = threading.Condition(self._lock)
        self._used = 0
        self._closed = False
        self._close_done = threading.Event()  # close()'s work has finished (see close)
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        """In a forked child: new locks, and the parent's transfers forgotten (they never end
        here). Subclasses drop what else the parent's threads or files held. See NOTE [ Forked
        children ]."""
        self._lock = threading.Lock()
        self._started = threading.Condition(self._lock)
        self._inflight = set()
        self._starting = 0
        for handle in self._live:
            handle._pending = 0  # their transfers were the parent's
        if self._closed:
            self._close_done.set()

    @abstractmethod
    def write(
        self, source: HostRegion | torch.Tensor, nbytes: int | None = None, *, after: object = None
    ) -> StoredHandle:
        """Store the first ``nbytes`` bytes of ``source`` (all of it by default).

        Args:
            source: a host region or a contiguous CPU tensor.
            nbytes: how many of its bytes to store.
            after: something with ``.synchronize()`` (a CUDA event recorded after the D2H copy
                into ``source``; make it with ``blocking=True``, see NOTE [ Transfer ordering ])
                or ``.wait()``; the source is read only after it completed.

        Returns:
            The record's handle; its ``written`` transfer completes when the bytes are stored.
            Do not change or release the source before then (a tier may copy it late; deferred
            mode always does). With the default engine a tensor source is copied before
            ``write`` returns, waiting for ``after`` on the calling thread.

        Raises:
            StorageFullError: the record does not fit (cap reached or disk full).
            StorageError: the tier is closed.
        """

    @abstractmethod
    def read(self, handle: StoredHandle, into: HostRegion | torch.Tensor) -> Transfer:
        """Copy a record's bytes into the first ``handle.nbytes`` bytes of ``into``.

        Starts after the record's write completed. ``into`` is a host region or a contiguous CPU
        tensor with room for ``handle.nbytes`` bytes.

        Raises (from ``.wait()``):
            ChecksumError: the bytes read back differ from those written.
            StorageError: an I/O error, or the write itself failed.
        """

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """The most bytes the tier will hold."""

    @property
    def used_bytes(self) -> int:
        """Bytes held by records not yet released (at their aligned size)."""
        return self._used

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def transfers_running(self) -> bool:
        """Whether a transfer of this tier may still be in flight: a snapshot taken without the
        lock, so it never blocks (a GC pass may run while this thread holds it)."""
        try:
            return self._starting > 0 or any(not f.done() for f in list(self._inflight))
        except RuntimeError:  # the set changed while it was copied: something is in flight
            return True

    def free(self, handle: StoredHandle) -> None:
        """Forget a record. Its space returns once transfers that use it completed. Idempotent.

        Raises:
            ValueError: the handle belongs to another tier.
        """
        if type(handle) is not StoredHandle or handle._tier is not self:  # (once per record)
            self._check_own(handle)
        with self._lock:
            if handle._freed:
                return
            handle._freed = True
            release = self._take_for_release(handle)
        if release:
            self._release(handle)

    def close(self) -> None:
        """Wait for transfers in flight, release every record, stop threads. Idempotent.

        Called on one of storage's threads (a done callback, or a GC pass there that finalized
        the tier's owner), it returns once later calls are refused, and the rest runs on a thread
        of its own: waiting there for the transfers in flight would wait on that thread itself.
        A close elsewhere meanwhile waits for that thread's work.
        """
        with self._lock:
            first, self._closed = not self._closed, True
        if first:
            if not finish_elsewhere(self._finish_close):
                self._finish_close()
        elif not on_worker_thread():
            self._close_done.wait()

    def _finish_close(self) -> None:
        try:
            with self._lock:
                self._started.wait_for(lambda: self._starting == 0)
                inflight = list(self._inflight)
            concurrent.futures.wait(inflight)
            self._stop()
            with self._lock:
                handles = [h for h in list(self._live) if self._take_for_release(h, force=True)]
            for handle in handles:
                self._release(handle)
        finally:
            self._close_done.set()

    @abstractmethod
    def _release(self, handle: StoredHandle) -> None:
        """Give a record's space back (called once, outside the lock, when nothing uses it)."""

    @abstractmethod
    def _stop(self) -> None:
        """Stop threads and close files; runs in :meth:`close` once no transfer is in flight,
        before the remaining records are released."""

    # -- bookkeeping shared by the tiers ------------------------------------------------------------

    def _register(self, handle: StoredHandle) -> None:
        with self._lock:
            if self._closed:  # (_check_open, asked first: once per record)
                self._check_open()
            self._live.add(handle)
            self._used += handle._charge

    def _take_for_release(self, handle: StoredHandle, *, force: bool = False) -> bool:
        # Called under the lock: True exactly once per record, when it may be released.
        if handle._released or (handle._pending and not force):
            return False
        handle._released = True
        handle._freed = True
        self._live.discard(handle)
        self._used -= handle._charge
        return True

    def _run(
        self,
        handle: StoredHandle,
        label: str,
        prerequisite: Future[Any] | None,
        start: Callable[[], Future[Any]],
        *,
        cleanup: Callable[[], None] | None = None,
        on_error: Callable[[BaseException], BaseException] | None = None,
        failure_frees: bool = False,
    ) -> Transfer:
        """Start a transfer on ``handle`` (see NOTE [ Transfer ordering ]): ``start()`` after
        ``prerequisite``; when it ends, ``cleanup()``, error mapping, and the deferred release of a
        freed record all happen before the returned transfer completes."""
        with self._lock:
            self._check_open()
            if handle._freed:
                raise StorageError(f"{handle!r} was freed (or its write failed); it has no bytes")
            handle._pending += 1
            self._starting += 1

        def finish(error: BaseException | None) -> BaseException | None:
            if cleanup is not None:
                cleanup()
            if error is not None and on_error is not None:
                error = on_error(error)
            with self._lock:
                handle._pending -= 1
                if error is not None and failure_frees:
                    handle._freed = True
                release = handle._freed and self._take_for_release(handle)
            if release:
                self._release(handle)
            return error

        future: Future[Any] | None = None
        try:
            future = chain(prerequisite, start, finish)
        finally:
            with self._lock:
                # One that finished already (a copy run at once) has nothing left for close()
                # to wait for.
                running = future is not None and not finished(future)
                if running:
                    self._inflight.add(future)  # type: ignore[arg-type]  # not None: running
                self._starting -= 1
                if self._closed:  # only close() waits on it, and it sets _closed first
                    self._started.notify_all()
        assert future is not None  # chain() returned, or its error left above
        if running:
            future.add_done_callback(self._forget_inflight)
        return Transfer(future, label)

    def _forget_inflight(self, future: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(future)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"the {self.name} tier is closed")

    def _check_own(self, handle: StoredHandle) -> None:
        if not isinstance(handle, StoredHandle):
            raise TypeError(f"expected a StoredHandle; got {type(handle).__name__}")
        if handle._tier is not self:
            raise ValueError(f"{handle!r} belongs to another tier ({handle._tier!r})")

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def source_bytes(source: object, nbytes: int | None) -> tuple[torch.Tensor, int]:
    """The flat uint8 view of a tensor source and the byte count to store from it."""
    if not isinstance(source, torch.Tensor):
        raise TypeError(
            f"source must be a HostRegion or a torch.Tensor; got {type(source).__name__}"
        )
    data = byte_view(source)
    return data, check_nbytes(nbytes, data.numel(), "source")


def check_nbytes(nbytes: int | None, available: int, what: str) -> int:
    """``nbytes`` (default ``available``), validated against what ``what`` holds."""
    if nbytes is None:
        return available
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int or None; got {type(nbytes).__name__}")
    if not 0 <= nbytes <= available:
        raise ValueError(f"nbytes={nbytes} must be in [0, {available}] (the bytes {what} holds)")
    return nbytes


def destination_bytes(into: object, nbytes: int) -> torch.Tensor:
    """The flat uint8 view that a read of ``nbytes`` bytes fills (regions handled by the caller)."""
    if not isinstance(into, torch.Tensor):
        raise TypeError(f"into must be a HostRegion or a torch.Tensor; got {type(into).__name__}")
    data = byte_view(into)
    n = data.numel()
    if n < nbytes:
        raise ValueError(f"into has {n} bytes; the record needs {nbytes}")
    return data if n == nbytes else data[:nbytes]
