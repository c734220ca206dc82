"""The NVMe tier: records in one private spill file, moved by an I/O thread pool, checksummed."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from offload.storage._budget import default_nvme_budget_bytes
from offload.storage._errors import ChecksumError, StorageError, StorageFullError
from offload.storage._extents import ExtentAllocator
from offload.storage._file import SpillFile, buffer_of, remove_stale_private_dirs, storage_error
from offload.storage._kvikio import KvikioFile
from offload.storage._pool import HostPool, HostRegion, shared_host_pool
from offload.storage._tier import StoredHandle, Tier, check_nbytes, destination_bytes, source_bytes
from offload.storage._transfer import (
    CopyEngine,
    IoThreads,
    Transfer,
    chain,
    check_waitable,
    gather,
    in_gc_pass,
    track_gc_passes,
    wait_for,
)
from offload.storage._units import (
    ALIGNMENT_BYTES,
    CHECKSUM_CHUNK_BYTES,
    IO_THREADS,
    check_count,
    format_bytes,
    round_up,
)

_DEFAULT_GROWTH_BYTES = 256 << 20

# NOTE [ Spill file layout ]
# One file per tier, in a private 0700 directory, created 0600 and unlinked at once: no other user
# can open it, and the space returns to the file system even if the process dies. The file grows
# in preallocated chunks (``growth_bytes``; ENOSPC surfaces at growth, synchronously, while the
# caller can still fall back) up to ``capacity_bytes`` and never shrinks before close, so a steady
# state of writes and frees reuses the same ranges. Ranges are 4 KiB-aligned and padded to 4 KiB
# so host regions move with O_DIRECT; the padding bytes are whatever the source region held.
# Each record carries one crc32 per 4 MiB chunk of its data bytes (not the padding), computed on
# the I/O thread that writes the chunk and checked on the thread that reads it back, before the
# read's transfer can complete: a mismatch fails the transfer with ChecksumError.
# The directory and file are made with the tier where they can be; where they cannot (a disk
# read-only, full or out of inodes), the next write that needs bytes tries again, and its
# failure is the record's StorageFullError / StorageError naming the directory, so the caller
# falls back as for any full tier and a disk that comes back is used again.


class NvmeTier(Tier):
    """Records in a private spill file on a (fast) disk, with checksums.

    Bytes go from host memory to the file on an I/O thread pool and come back the same way:
    GPU -> pinned region (the caller's D2H) -> file, so GPU memory is freed at PCIe speed, not
    disk speed. A tensor source is first staged into a region of ``pool``. Writes and reads are
    split into 4 MiB pieces that run in parallel; each piece is checksummed (crc32, which releases
    the GIL) and verified on read before the transfer completes. See NOTE [ Spill file layout ].

    Args:
        directory: an existing directory on the disk to use (``nvme_dir``); the tier works in a
            private subdirectory of it, named after ``RANK``/``LOCAL_RANK`` and the pid.
        capacity_bytes: the most file bytes; ``None`` means :func:`default_nvme_budget_bytes`.
        pool: staging regions for tensor sources; ``None`` means :func:`shared_host_pool`.
        io_threads: size of the I/O thread pool (created at the first I/O).
        growth_bytes: how much the file grows at a time.
        direct_io: use O_DIRECT where the file system supports it.
        preallocate: reserve growth with ``posix_fallocate`` (else sparse ``ftruncate``).
        copy_engine: paces copies and I/O; ``CopyEngine(deferred=True)`` for ordering tests.
        backend: ``"posix"`` (plain files, always available), or ``"kvikio"`` to also accept
            CUDA tensors as sources and destinations (GPU-direct; those records carry no checksum
            because their bytes never reach the host).
        cuda_device: the index of the CUDA device whose events the I/O threads wait on (the
            ``after=`` of writes): made each I/O thread's current device when it starts. A
            thread with none current that waits on a CUDA event creates a CUDA context on
            device 0 (hundreds of MiB there) for a caller on ``cuda:N``. ``None``: not set.

    Raises:
        ValueError: ``directory`` does not exist, or a size, backend or ``cuda_device`` is
            invalid. A directory where the spill file cannot be made (read-only, full) is no
            error here: each write raises ``StorageFullError`` / ``StorageError`` naming it
            until it can.
        ImportError: ``backend="kvikio"`` without kvikio or without a CUDA device.

    Example:
        >>> import tempfile
        >>> d = tempfile.TemporaryDirectory()
        >>> pool = HostPool(1 << 20, slab_bytes=1 << 20)
        >>> tier = NvmeTier(d.name, capacity_bytes=1 << 20, pool=pool)
        >>> x = torch.randn(1000)
        >>> h = tier.write(x)
        >>> y = torch.empty(1000)
        >>> tier.read(h, y).wait()
        >>> torch.equal(x, y)
        True
        >>> tier.free(h); tier.close(); pool.close(); d.cleanup()
    """

    name = "nvme"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        pool: HostPool | None = None,
        io_threads: int = IO_THREADS,
        growth_bytes: int = _DEFAULT_GROWTH_BYTES,
        direct_io: bool = True,
        preallocate: bool = True,
        copy_engine: CopyEngine | None = None,
        backend: str = "posix",
        cuda_device: int | None = None,
    ) -> None:
        super().__init__()
        if backend not in ("posix", "kvikio"):
            raise ValueError(f"backend must be 'posix' or 'kvikio'; got {backend!r}")
        if cuda_device is not None and (
            isinstance(cuda_device, bool) or not isinstance(cuda_device, int) or cuda_device < 0
        ):
            raise ValueError(
                f"cuda_device must be None or a CUDA device index (an int >= 0); got {cuda_device!r}"
            )
        self._cuda_device = cuda_device
        check_count(io_threads, name="io_threads", minimum=1)
        for arg, value in (("capacity_bytes", capacity_bytes), ("growth_bytes", growth_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{arg} must be an int number of bytes; got {type(value).__name__}")
            if value is not None and value < 0:
                raise ValueError(f"{arg} must be >= 0 bytes; got {value}")
        self._directory = os.fspath(directory)
        if capacity_bytes is None:
            if not os.path.isdir(self._directory):
                raise ValueError(f"nvme directory {self._directory!r} does not exist")
            capacity_bytes = default_nvme_budget_bytes(self._directory)
        self._capacity = capacity_bytes // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        self._growth = max(ALIGNMENT_BYTES, round_up(growth_bytes))
        self._io_threads = io_threads
        self._direct_io, self._preallocate = direct_io, preallocate
        if not os.path.isdir(self._directory):
            raise ValueError(f"nvme directory {self._directory!r} does not exist")
        if backend == "kvikio":
            KvikioFile.check_available()
        self._backend = backend
        self._file: SpillFile | None = None  # see NOTE [ Spill file layout ]: made on demand
        self._kvikio: KvikioFile | None = None
        # See NOTE [ Directories left by a killed process ].
        remove_stale_private_dirs(self._directory)
        with contextlib.suppress(StorageError):
            self._open_file(None)  # at once where it can be; else each write tries again
        self._alloc = ExtentAllocator(alignment=ALIGNMENT_BYTES)
        self._pool = pool
        self._own_engine = copy_engine is None
        self._engine = copy_engine if copy_engine is not None else CopyEngine()
        self._executor: IoThreads | None = None
        self._executor_lock = threading.Lock()
        self._stopped = False  # _stop() ran: no new I/O threads
        # Staging regions of tensor writes not yet finished (a set: add and discard are atomic
        # under the GIL), and in a forked child those of the parent's, which no thread finishes.
        self._staging: set[HostRegion] = set()
        self._parent_staging: list[HostRegion] = []

    # -- properties ---------------------------------------------------------------------------------

    @property
    def directory(self) -> str:
        """The directory the user gave (``nvme_dir``)."""
        return self._directory

    @property
    def private_directory(self) -> str | None:
        """This tier's own 0700 subdirectory (empty: the file is unlinked); ``None`` while the
        spill file could not be made yet (a full or read-only disk)."""
        return None if self._file is None else self._file.directory

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def file_bytes(self) -> int:
        """Current size of the spill file (it grows in chunks, never shrinks before close)."""
        return 0 if self._file is None else self._file.size

    @property
    def direct_io(self) -> bool:
        """Whether aligned I/O bypasses the page cache here (False before the file exists)."""
        return self._file is not None and self._file.direct_io

    @property
    def backend(self) -> str:
        return self._backend

    # -- write --------------------------------------------------------------------------------------

    def write(
        self, source: HostRegion | torch.Tensor, nbytes: int | None = None, *, after: object = None
    ) -> StoredHandle:
        check_waitable(after)
        self._check_open()
        if self._parent_staging:
            self._release_parent_staging()
        if isinstance(source, torch.Tensor) and source.device.type != "cpu":
            return self._write_device(source, nbytes, after)
        staging: HostRegion | None = None
        if isinstance(source, HostRegion):
            n = check_nbytes(nbytes, source.nbytes, "the region")
            region = source
            data: torch.Tensor | None = None
        else:
            data, n = source_bytes(source, nbytes)
            staging = region = self._staging_pool().allocate(n)
            self._staging.add(staging)
        # The source region is read by I/O threads until the write completes; see NOTE
        # [ Transfer ordering ]. ``span`` is 4 KiB-aligned and padded, so O_DIRECT applies.
        array = region.span.numpy()

        def cleanup() -> None:
            if staging is not None:
                self._engine.poison(staging.span)
                self._staging.discard(staging)
                staging.release()

        try:
            handle = self._new_record(n, on_device=False)
        except BaseException:
            cleanup()
            raise
        if n == 0:
            cleanup()
            return handle
        pieces = _pieces(n, handle._charge, self._io_threads)

        def start_io() -> Future[Any]:
            io = self._io()
            wait = None if staging is not None else after
            return gather([io.submit(self._write_piece, handle, array, p, wait) for p in pieces])

        def start() -> Future[Any]:
            if staging is None:
                return start_io()
            dst, src = staging.tensor, data[:n]  # type: ignore[index]

            def copy() -> None:
                wait_for(after)
                dst.copy_(src)

            return chain(self._engine.submit(copy), start_io, lambda e: e)

        handle._write = self._start_write(handle, "nvme write", start, cleanup)
        return handle

    def _start_write(
        self,
        handle: StoredHandle,
        label: str,
        start: Callable[[], Future[Any]],
        cleanup: Callable[[], None] | None = None,
    ) -> Transfer:
        try:
            return self._run(
                handle,
                label,
                None,
                start,
                cleanup=cleanup,
                on_error=lambda e: self._map_error(e, "writing a record", handle.nbytes),
                failure_frees=True,
            )
        except BaseException:  # closed meanwhile: nothing started, give everything back
            if cleanup is not None:
                cleanup()
            self.free(handle)
            raise

    def _write_piece(
        self,
        handle: StoredHandle,
        array: np.ndarray,
        piece: tuple[int, int, int, int],
        after: object,
    ) -> None:
        index, start, data_end, io_end = piece
        self._engine.delay()
        wait_for(after)
        crcs = _chunk_crcs(array, start, data_end)
        handle._crcs[index : index + len(crcs)] = crcs  # type: ignore[index]
        self._spill().write(array[start:io_end], handle._offset + start)  # type: ignore[operator]

    # -- read ---------------------------------------------------------------------------------------

    def read(self, handle: StoredHandle, into: HostRegion | torch.Tensor) -> Transfer:
        self._check_own(handle)
        n = handle.nbytes
        if handle._on_device or (isinstance(into, torch.Tensor) and into.device.type != "cpu"):
            return self._read_device(handle, into)
        if isinstance(into, HostRegion):
            check_nbytes(n, into.nbytes, "into")
            # Padding past nbytes may be overwritten only when it is not part of the caller's view.
            array = (into.span if into.nbytes == n else into.tensor[:n]).numpy()
        else:
            array = destination_bytes(into, n).numpy()
        if n == 0:
            return self._run(handle, "nvme read", handle._write._future, _done)
        pieces = _pieces(n, array.size, self._io_threads)

        def start() -> Future[Any]:
            io = self._io()
            return gather([io.submit(self._read_piece, handle, array, p) for p in pieces])

        return self._run(
            handle,
            "nvme read",
            handle._write._future,
            start,
            on_error=lambda e: self._map_error(e, "reading a record", None),
        )

    def _read_piece(
        self, handle: StoredHandle, array: np.ndarray, piece: tuple[int, int, int, int]
    ) -> None:
        index, start, data_end, io_end = piece
        self._engine.delay()
        base = handle._offset
        assert base is not None  # every file record has an offset
        self._spill().read_into(array[start:io_end], base + start)
        for k, actual in enumerate(_chunk_crcs(array, start, data_end)):
            expected = handle._crcs[index + k]  # type: ignore[index]
            if actual == expected:
                continue
            lo = start + k * CHECKSUM_CHUNK_BYTES
            hi = min(lo + CHECKSUM_CHUNK_BYTES, data_end)
            raise ChecksumError(
                f"checksum mismatch in an NVMe record: bytes [{base + lo}, {base + hi}) of the "
                f"spill file in {self.private_directory} read back with crc32 {actual:#010x}, "
                f"written with {expected:#010x}. The disk returned different bytes (or the file "
                "was modified); they were not handed back.",
                path=self.private_directory,
                file_offset=base + lo,
                nbytes=hi - lo,
            )

    # -- GPU-direct (kvikio) ------------------------------------------------------------------------

    def _write_device(
        self, source: torch.Tensor, nbytes: int | None, after: object
    ) -> StoredHandle:
        self._require_kvikio(source)
        data, n = source_bytes(source, nbytes)
        handle = self._new_record(n, on_device=True)
        if n == 0:
            return handle
        kv = self._require_kvikio(source)
        assert kv is not None  # the record's claim opened the file
        pieces = _pieces(n, n)

        def write_piece(piece: tuple[int, int, int, int]) -> None:
            _, start, end, _ = piece
            self._engine.delay()
            wait_for(after)  # kvikio orders on the null stream, not on the caller's D2H stream
            if kv.pwrite(data[start:end], handle._offset + start) != end - start:  # type: ignore[operator]
                raise StorageError("kvikio wrote fewer bytes than asked")

        handle._write = self._start_write(
            handle,
            "nvme write (kvikio)",
            lambda: gather([self._io().submit(write_piece, p) for p in pieces]),
        )
        return handle

    def _read_device(self, handle: StoredHandle, into: object) -> Transfer:
        kv = self._require_kvikio(into)
        if not isinstance(into, torch.Tensor) or into.device.type == "cpu":
            raise TypeError("a record written from a CUDA tensor reads back into a CUDA tensor")
        if not handle._on_device:
            raise TypeError(
                "a record written from host memory reads back into host memory, where its "
                "checksum is verified before the bytes are used; read it into a HostRegion"
            )
        n = handle.nbytes
        dst = destination_bytes(into, n)
        pieces = _pieces(n, n)

        def read_piece(piece: tuple[int, int, int, int]) -> None:
            _, start, end, _ = piece
            self._engine.delay()
            assert kv is not None  # a record with bytes: its claim opened the file
            if kv.pread(dst[start:end], handle._offset + start) != end - start:  # type: ignore[operator]
                raise StorageError("kvikio read fewer bytes than asked (short file?)")

        return self._run(
            handle,
            "nvme read (kvikio)",
            handle._write._future,
            lambda: gather([self._io().submit(read_piece, p) for p in pieces]),
            on_error=lambda e: self._map_error(e, "reading a record", None),
        )

    def _require_kvikio(self, tensor: object) -> KvikioFile | None:
        """The kvikio file (``None`` before the spill file exists); a TypeError without kvikio."""
        if self._backend != "kvikio":
            device = getattr(tensor, "device", "a device")
            raise TypeError(
                f"the NVMe tier takes host bytes; got a {device} tensor. Copy it into a "
                "HostRegion on your D2H stream and pass the region with after=<its event>, or "
                "create the tier with backend='kvikio'."
            )
        return self._kvikio

    # -- space --------------------------------------------------------------------------------------

    def _new_record(self, n: int, *, on_device: bool) -> StoredHandle:
        padded = round_up(n)
        chunks = -(-n // CHECKSUM_CHUNK_BYTES)
        offset = self._claim(padded, n) if padded else 0
        handle = StoredHandle(
            self,
            n,
            charge=padded,
            offset=offset,
            crcs=None if on_device else [0] * chunks,
            on_device=on_device,
        )
        try:
            self._register(handle)
        except BaseException:
            if padded:
                with self._lock:
                    self._alloc.free(offset, padded)
            raise
        return handle

    def _claim(self, padded: int, n: int) -> int:
        with self._lock:
            self._check_open()
            offset = self._alloc.allocate(padded)
            if offset is not None:
                return offset
            if self._file is None:
                self._open_file(n)
            file = self._spill()
            size = file.size
            need = padded - self._alloc.trailing_free()
            if size + need > self._capacity:
                raise StorageFullError(
                    f"the NVMe tier in {self._directory} is at its cap: a record of "
                    f"{format_bytes(n)} does not fit in {format_bytes(self._capacity)} "
                    f"({format_bytes(self._used)} in use, largest free range "
                    f"{format_bytes(self._alloc.largest_free())}). Raise the NVMe capacity or "
                    "let the record go to another tier.",
                    directory=self._directory,
                    bytes_needed=n,
                )
            # Grow by a whole chunk when the cap allows; near a full disk, by just what is needed.
            target = min(size + max(need, self._growth), self._capacity)
            try:
                file.grow(target)
            except OSError as first:
                if target == size + need:
                    raise self._map_error(first, "growing the spill file", n) from first
                try:
                    file.grow(size + need)
                except OSError as e:
                    raise self._map_error(e, "growing the spill file", n) from e
            self._alloc.add(size, file.size - size)
            offset = self._alloc.allocate(padded)
            if offset is None:  # pragma: no cover - the growth above made room
                raise StorageError("the spill file grew but the record still does not fit")
            return offset

    def _open_file(self, nbytes: int | None) -> None:
        """Make the private directory and spill file (and kvikio's view of it), under the lock
        or in ``__init__``. An OS error (ENOSPC, EDQUOT, EROFS, EACCES) is raised mapped,
        naming the directory: the record for ``nbytes`` goes to another tier, and the next
        write tries again."""
        try:
            spill = SpillFile(
                self._directory, direct_io=self._direct_io, preallocate=self._preallocate
            )
        except OSError as e:
            raise self._map_error(e, "creating the spill file", nbytes) from e
        if self._backend == "kvikio":
            try:
                self._kvikio = KvikioFile(spill.fd)
            except BaseException:
                spill.close()
                raise
        self._file = spill

    def _spill(self) -> SpillFile:
        file = self._file
        assert file is not None  # a record with bytes was claimed in it
        return file

    def _release(self, handle: StoredHandle) -> None:
        if handle._charge and not self._closed:
            with self._lock:
                self._alloc.free(handle._offset, handle._charge)  # type: ignore[arg-type]

    def _map_error(self, error: BaseException, action: str, nbytes: int | None) -> BaseException:
        if isinstance(error, OSError) and not isinstance(error, StorageError):
            mapped = storage_error(
                error, action=action, directory=self._directory, bytes_needed=nbytes
            )
            mapped.__cause__ = error
            return mapped
        return error

    # -- threads and lifetime -----------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        # See NOTE [ Forked children ]: the parent's records live in the parent's file, and the
        # I/O threads that moved them are not here. The next write makes new ones.
        super()._after_fork_in_child()
        for handle in self._live:
            handle._freed = handle._released = True  # reads say "freed"; free() is a no-op
        self._live = set()
        self._used = 0
        self._alloc = ExtentAllocator(alignment=ALIGNMENT_BYTES)
        file, self._file, self._kvikio = self._file, None, None
        if file is not None:
            file.forget_in_child()
        self._executor = None
        self._executor_lock = threading.Lock()
        # Given back at the next write or close, once the pool's lock is new too.
        self._parent_staging, self._staging = list(self._staging), set()

    def _release_parent_staging(self) -> None:
        regions, self._parent_staging = self._parent_staging, []
        for region in regions:
            region.release()

    def _staging_pool(self) -> HostPool:
        if self._pool is None:
            self._pool = shared_host_pool()
        return self._pool

    def _io(self) -> IoThreads:
        with self._executor_lock:
            if self._executor is None:
                if self._stopped:
                    raise StorageError("the nvme tier is closed")
                track_gc_passes()
                self._executor = IoThreads(
                    self._io_threads,
                    "storage-io",
                    f"NVMe I/O in {self.private_directory or self._directory}",
                    initializer=(
                        None
                        if self._cuda_device is None
                        else functools.partial(torch.cuda.set_device, self._cuda_device)
                    ),
                )
            return self._executor

    def _stop(self) -> None:
        self._release_parent_staging()
        with self._executor_lock:
            executor, self._executor = self._executor, None
            self._stopped = True
        if executor is not None:
            # No transfer is in flight: the workers are idle. Not joined inside a GC pass, where
            # joining can wait on this thread itself (NOTE [ Closing inside a GC pass ]).
            executor.shutdown(wait=not in_gc_pass())
        if self._own_engine:
            self._engine.close()
        if self._kvikio is not None:
            self._kvikio.close()
        if self._file is not None:
            self._file.close()

    def __repr__(self) -> str:
        return (
            f"NvmeTier({self._directory!r}, used={format_bytes(self._used)}, "
            f"file={format_bytes(self.file_bytes)}, cap={format_bytes(self._capacity)}, "
            f"direct_io={self.direct_io})"
        )


def _pieces(nbytes: int, room: int, threads: int = 1) -> list[tuple[int, int, int, int]]:
    """``(first chunk index, start, data_end, io_end)`` per I/O request.

    A request spans up to ``_MAX_CHUNKS_PER_PIECE`` checksum chunks (4 MiB each), fewer when that
    leaves the ``threads`` I/O threads idle: large requests reach the disk's bandwidth (a 16 MiB
    request read faster than four 4 MiB ones on the project's VM disk) and small records still
    spread over every thread. The checksums cover the data bytes; the I/O also covers the padding
    up to the next 4 KiB when the buffer has ``room`` for it.
    """
    io_total = min(round_up(nbytes), room)
    chunks = -(-nbytes // CHECKSUM_CHUNK_BYTES)
    per = max(1, min(_MAX_CHUNKS_PER_PIECE, chunks // max(1, threads)))
    step = per * CHECKSUM_CHUNK_BYTES
    out = []
    for start in range(0, nbytes, step):
        data_end = min(start + step, nbytes)
        io_end = data_end if data_end < nbytes else max(data_end, io_total)
        out.append((start // CHECKSUM_CHUNK_BYTES, start, data_end, io_end))
    return out


_MAX_CHUNKS_PER_PIECE = 4


def _chunk_crcs(array: np.ndarray, start: int, end: int) -> list[int]:
    """crc32 of each checksum chunk of ``array[start:end]`` (``start`` is chunk-aligned)."""
    return [
        zlib.crc32(buffer_of(array[s : min(s + CHECKSUM_CHUNK_BYTES, end)]))
        for s in range(start, end, CHECKSUM_CHUNK_BYTES)
    ]


def _done() -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(None)
    return future
