"""Raw disk bandwidth of a directory, as the NVMe tier would see it."""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from storage._file import SpillFile, storage_error
from storage._units import ALIGNMENT_BYTES, round_up


def measure_disk_bandwidth(
    directory: str | os.PathLike[str],
    nbytes: int = 256 << 20,
    *,
    chunk_bytes: int = 16 << 20,
    threads: int = 4,
) -> dict[str, Any]:
    """Write then read ``nbytes`` through a private spill file in ``directory`` and time both.

    Uses O_DIRECT where the file system supports it (``direct_io`` in the result says which), so
    the page cache does not flatter the numbers; otherwise the write includes an ``fsync`` and the
    cache is dropped (``posix_fadvise``) before the read. The file space is preallocated first, so
    the write measures data, not block allocation. The data is random, so compressing drives are
    not flattered either. Small sizes give noisy numbers; use the default for decisions.

    Args:
        directory: an existing directory on the disk to measure.
        nbytes: bytes to move each way (rounded up to 4 KiB).
        chunk_bytes: size of one I/O request.
        threads: requests in flight at once.

    Returns:
        ``{"directory", "nbytes", "direct_io", "threads", "chunk_bytes", "write_s", "read_s",
        "write_gbps", "read_gbps"}``; bandwidths in GB/s (1e9 bytes per second).

    Example:
        >>> import tempfile
        >>> r = measure_disk_bandwidth(tempfile.gettempdir(), nbytes=1 << 20)
        >>> r["write_gbps"] > 0 and r["read_gbps"] > 0
        True
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int; got {nbytes!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1; got {threads!r}")
    total = round_up(nbytes)
    chunk = min(round_up(max(chunk_bytes, ALIGNMENT_BYTES)), total)
    spill = SpillFile(directory)
    try:
        try:
            spill.grow(total)
        except OSError as e:
            raise storage_error(
                e, action="measuring bandwidth", directory=os.fspath(directory), bytes_needed=total
            ) from e
        pieces = [(off, min(chunk, total - off)) for off in range(0, total, chunk)]
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

        with ThreadPoolExecutor(threads, thread_name_prefix="storage-bandwidth") as pool:
            start = time.perf_counter()
            list(pool.map(write, pieces))
            os.fsync(spill.fd)
            write_s = time.perf_counter() - start
            if not spill.direct_io and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(spill.fd, 0, total, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            list(pool.map(read, enumerate(pieces)))
            read_s = time.perf_counter() - start
    finally:
        spill.close()
    return {
        "directory": os.fspath(directory),
        "nbytes": total,
        "direct_io": spill.direct_io,
        "threads": threads,
        "chunk_bytes": chunk,
        "write_s": write_s,
        "read_s": read_s,
        "write_gbps": total / max(write_s, 1e-9) / 1e9,
        "read_gbps": total / max(read_s, 1e-9) / 1e9,
    }
