"""Raw disk bandwidth of a directory, as the NVMe tier would see it."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from offload.storage._errors import StorageFullError
from offload.storage._file import SpillFile, storage_error
from offload.storage._units import ALIGNMENT_BYTES, IO_THREADS, check_count, format_bytes, round_up

# A probe takes at most 1 / _FREE_SPACE_DIVISOR of the directory's free space: measuring a disk
# must not fill it (other ranks, or the job itself, may be writing there).
_FREE_SPACE_DIVISOR = 4


def measure_disk_bandwidth(
    directory: str | os.PathLike[str],
    nbytes: int = 256 << 20,
    *,
    chunk_bytes: int = 16 << 20,
    threads: int = IO_THREADS,
    direct_io: bool = True,
) -> dict[str, Any]:
    """Write then read ``nbytes`` through a private spill file in ``directory`` and time both.

    Uses O_DIRECT where the file system supports it (``direct_io`` in the result says which), so
    the page cache does not flatter the numbers, and then no ``fsync`` (the NVMe tier does not
    fsync either, so the two compare like for like); otherwise (tmpfs, some network and overlay file
    systems, or ``direct_io=False``) the write includes an ``fsync`` and the cache is dropped
    (``posix_fadvise(DONTNEED)``) before the read; ``io_mode`` and ``direct_io_note`` say what was
    done and why. The file space is preallocated first, so the write measures data, not block
    allocation. The data is random, so compressing drives are not flattered either. The probe
    takes at most a quarter of the free space: a larger ``nbytes`` is shrunk (``requested_nbytes``
    keeps the ask). Small sizes give noisy numbers; use the default for decisions.

    Args:
        directory: an existing directory on the disk to measure.
        nbytes: bytes to move each way (rounded up to 4 KiB).
        chunk_bytes: size of one I/O request.
        threads: requests in flight at once (no more than there are chunks).
        direct_io: try O_DIRECT; False measures buffered I/O.

    Returns:
        ``{"directory", "requested_nbytes", "nbytes", "direct_io", "direct_io_note", "io_mode",
        "threads", "chunk_bytes", "write_s", "read_s", "write_gbps", "read_gbps"}``; bandwidths in
        GB/s (1e9 bytes per second). ``direct_io_note`` is None when O_DIRECT was used, else why
        not (``"not tried"``, ``"not available on this platform"``, ``"refused by the file
        system"``).

    Raises:
        TypeError: ``nbytes`` or ``threads`` is not an int (a float, a bool).
        ValueError: ``nbytes`` or ``threads`` is below 1, or ``directory`` is not a directory.
        StorageFullError: the directory has too little free space for even a 4 KiB probe, or
            the file space could not be reserved.
        OSError: a write or read failed (EIO, ...).

    Example:
        >>> import tempfile
        >>> r = measure_disk_bandwidth(tempfile.gettempdir(), nbytes=1 << 20)
        >>> r["write_gbps"] > 0 and r["read_gbps"] > 0
        True
        >>> r["direct_io"] == (r["direct_io_note"] is None)
        True
    """
    check_count(nbytes, name="nbytes", minimum=1)
    check_count(threads, name="threads", minimum=1)
    where = os.fspath(directory)
    requested = round_up(nbytes)
    spill = SpillFile(directory, direct_io=direct_io)  # ValueError if it is no directory
    direct = spill.direct_io
    try:
        total = fit_probe_bytes(requested, shutil.disk_usage(where).free, directory=where)
        chunk = min(round_up(max(chunk_bytes, ALIGNMENT_BYTES)), total)
        pieces = [(off, min(chunk, total - off)) for off in range(0, total, chunk)]
        threads = min(threads, len(pieces))
        try:
            spill.grow(total)
        except OSError as e:
            raise storage_error(
                e, action="measuring bandwidth", directory=where, bytes_needed=total
            ) from e
        # Page-aligned buffers (anonymous mmap). Writes share one source; reads land in a few
        # sinks whose contents nobody looks at, so two reads sharing one does not matter.
        source = np.frombuffer(mmap.mmap(-1, chunk), dtype=np.uint8)
        source[:] = np.frombuffer(os.urandom(chunk), dtype=np.uint8)
        sinks = [np.frombuffer(mmap.mmap(-1, chunk), dtype=np.uint8) for _ in range(threads)]

        def write(piece: tuple[int, int]) -> None:
            spill.write(source[: piece[1]], piece[0])

        def read(args: tuple[int, tuple[int, int]]) -> None:
            i, (offset, length) = args
            spill.read_into(sinks[i % threads][:length], offset)

        # Buffered pages must be clean to be dropped: the fsync (timed, as part of the write)
        # comes first.
        drop_cache = not direct and hasattr(os, "posix_fadvise")
        with ThreadPoolExecutor(threads, thread_name_prefix="storage-bandwidth") as pool:
            start = time.perf_counter()
            list(pool.map(write, pieces))
            if not direct:
                os.fsync(spill.fd)  # O_DIRECT writes bypass the page cache; the tier never fsyncs
            write_s = time.perf_counter() - start
            if drop_cache:
                os.posix_fadvise(spill.fd, 0, total, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            list(pool.map(read, enumerate(pieces)))
            read_s = time.perf_counter() - start
    finally:
        spill.close()
    if direct:
        note, mode = None, "O_DIRECT"
    else:
        if not direct_io:
            note = "not tried"
        elif not hasattr(os, "O_DIRECT"):
            note = "not available on this platform"
        else:
            note = "refused by the file system"
        mode = "buffered + fsync" + (" + fadvise(DONTNEED)" if drop_cache else "")
    return {
        "directory": where,
        "requested_nbytes": requested,
        "nbytes": total,
        "direct_io": direct,
        "direct_io_note": note,
        "io_mode": mode,
        "threads": threads,
        "chunk_bytes": chunk,
        "write_s": write_s,
        "read_s": read_s,
        "write_gbps": total / max(write_s, 1e-9) / 1e9,
        "read_gbps": total / max(read_s, 1e-9) / 1e9,
    }


def fit_probe_bytes(nbytes: int, free_bytes: int, *, directory: str = "") -> int:
    """``nbytes``, or less so that a probe takes at most a quarter of ``free_bytes`` (4 KiB steps).

    Raises:
        StorageFullError: not even 4 KiB fits.
    """
    fit = max(0, free_bytes) // _FREE_SPACE_DIVISOR // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    if fit <= 0:
        raise StorageFullError(
            f"{directory} has {format_bytes(max(0, free_bytes))} free: too little for a bandwidth "
            f"probe, which takes at most a quarter of the free space. Free space there or measure "
            "another directory.",
            directory=directory,
            bytes_needed=ALIGNMENT_BYTES * _FREE_SPACE_DIVISOR,
            errno=errno.ENOSPC,
        )
    return min(nbytes, fit)
