"""Byte arithmetic shared by the pool, the file store and the tiers."""

from __future__ import annotations

ALIGNMENT_BYTES = 4096
"""Alignment of every host region and file offset: O_DIRECT needs 4 KiB-aligned buffers, offsets
and lengths, and a plain torch CPU tensor is only 64-byte aligned."""

CHECKSUM_CHUNK_BYTES = 4 << 20
"""Records are checksummed (crc32) and moved in pieces of this size, so one large record spreads
over several I/O threads and a mismatch names a small range of the file."""

IO_THREADS = 8
"""Requests in flight at once, by default, in the NVMe tier and the raw disk probe. A step's
records are mostly 1-4 MiB, and reads need more of them in flight than four: on the project's VM
disk, 8 threads read a step's records (1-4 MiB each, 267 MiB, checksums on) at 1.59 GB/s against
0.84 GB/s with 4 (median of 7 interleaved rounds), and 64 MiB records at 1.89 against 1.27 GB/s;
writes did not slow down."""


def round_up(n: int, multiple: int = ALIGNMENT_BYTES) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= ``n`` (0 for ``n < 1``)."""
    return 0 if n < 1 else 1 << (n.bit_length() - 1)


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``: binary units, for log lines and error messages."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"


def check_count(value: object, *, name: str, minimum: int = 0) -> int:
    """An int argument (a count of threads, bytes ...) of at least ``minimum``, as lifecycle's
    ``check_count`` checks one (the two packages do not import each other).

    Raises:
        TypeError: ``value`` is not an int: a float (``1.5``, or ``2.0``, which is no count
            either), a str, or a bool (an int to Python, never meant as a count).
        ValueError: ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return value
