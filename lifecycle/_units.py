"""Byte quantities: parsing budget strings and printing sizes, in one place."""

from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
}
# A sign is matched so that "-5GiB" is told it is out of range, not that it is no size.
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_DECIMAL_UNITS = frozenset({"kb", "mb", "gb", "tb"})
_UNIT_HELP = (
    "use bytes or a number with a unit: KiB, MiB, GiB, TiB (binary: 1 GiB = 2**30 bytes; K, "
    "M, G, T are binary too) or KB, MB, GB, TB (decimal: 1 GB = 10**9 bytes), e.g. '12GiB'"
)
MAX_BYTES = 2**63 - 1  # sizes are int64 to torch and numpy


def parse_bytes(
    value: int | str,
    *,
    name: str = "value",
    total: int | None = None,
    positive: bool = False,
    or_none: str = "",
) -> int:
    """Parse ``12GiB``, ``512MB``, ``1e9``-free integers, or ``"85%"`` (of ``total``) into bytes.

    KiB, MiB, GiB, TiB and K, M, G, T are binary (``"12G"`` = ``"12GiB"`` = 12 x 2**30 bytes);
    KB, MB, GB, TB are decimal (``"12GB"`` = 12 x 10**9 bytes, 7% less). A number with a unit of a kilobyte or more is computed exactly and rounded down to whole
    bytes (``"1.44MiB"`` is 1509949 bytes, as ``offload plan`` prints budgets); a number of
    bytes must be whole (``"0.5"`` is refused: it is no size of memory); a percentage is
    rounded down.

    Args:
        value: an int (bytes) or a string with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; K, M,
            G, T mean KiB, MiB, GiB, TiB) or a percentage when ``total`` is given.
        name: the argument's name, used in error messages.
        total: what a percentage is a share of; ``None`` for an argument that takes no
            percentage (the error messages then offer none).
        positive: refuse 0 bytes too, for an argument that means nothing at 0.
        or_none: what ``None`` means for an argument that also takes it (``"min-memory
            mode"``), offered in the error for a value out of range.

    Raises:
        ValueError: the value is negative (or 0, with ``positive``), unparsable, more than
            :data:`MAX_BYTES` (2**63 - 1), a fraction of a byte without a larger unit, or a
            percentage without a total.
        TypeError: the value is neither int nor str.

    Example:
        >>> parse_bytes("1.5GiB")
        1610612736
        >>> parse_bytes("50%", total=1000)
        500
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        forms = "'12GiB' or '85%'" if total is not None else "'12GiB'"
        raise TypeError(
            f"{name} must be an int (bytes) or a string like {forms}; got {type(value).__name__}"
        )
    if isinstance(value, int):
        return _in_range(_at_most_max(value, name, value), name, value, positive, or_none)
    text = value.strip()
    if text.endswith("%"):
        if total is None:
            raise ValueError(
                f"{name}={value!r}: {name} takes bytes, not a percentage; give an int or a size "
                "such as '12GiB'"
            )
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a percentage like '85%'") from None
        if not 0 < pct <= 100:
            raise ValueError(f"{name}={value!r}: a percentage must be in (0, 100]")
        return _in_range(int(total * pct / 100), name, value, positive, or_none)
    m = _PATTERN.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={value!r} is not a size; {_UNIT_HELP}")
    try:
        n = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:  # more digits than Python converts to an int (4300)
        return _at_most_max(MAX_BYTES + 1, name, value)
    _at_most_max(n, name, value)
    if n < 0:  # below every range taken (floor: "-0.1KiB" is no 0 bytes)
        _in_range(math.floor(n), name, value, positive, or_none)
    if n.denominator != 1 and _UNITS[m.group(2).lower()] == 1:
        raise ValueError(
            f"{name}={value!r} is {float(n):.15g} bytes, not a whole number of bytes; give "
            "whole bytes, or a size with a unit such as '1.5GiB'"
        )
    return _in_range(int(n), name, value, positive, or_none)  # rounded down


def _in_range(n: int, name: str, value: int | str, positive: bool, or_none: str) -> int:
    # One message for a negative value and for 0 where 0 is refused too: "must be >= 0 bytes"
    # for -1 where 0 was refused as well told the user a range that is not the one taken.
    if n > 0 or (n == 0 and not positive):
        return n
    taken = "more than 0 bytes" if positive else ">= 0 bytes"
    if or_none:
        taken += f", or None ({or_none})"
    got = repr(value) if isinstance(value, int) else size_note(value, n)
    raise ValueError(f"{name} must be {taken}; got {got}")


def size_note(value: str, n: int) -> str:
    """A size string beside the bytes it was read as, for error messages: ``"'12GB'
    (12,000,000,000 bytes: decimal; use GiB for binary)"``, ``"'12GiB' (12,884,901,888 bytes)"``.
    """
    m = _PATTERN.match(value.strip())
    decimal = m is not None and m.group(2).lower() in _DECIMAL_UNITS
    return f"{value!r} ({n:,} bytes{': decimal; use GiB for binary' if decimal else ''})"


def _at_most_max(n: int | Fraction, name: str, value: int | str) -> int:
    if n > MAX_BYTES:
        shown = (
            repr(value)
            if len(repr(value)) <= 40
            else f"{repr(value)[:24]}... ({len(str(value))} characters)"
        )
        raise ValueError(f"{name}={shown} is too large; at most {MAX_BYTES} bytes (2**63 - 1)")
    return int(n)


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``: binary units, three significant digits."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, with an ``s`` unless ``n`` is 1: ``plural(1, "thread") == "1 thread"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def check_count(value: object, *, name: str, minimum: int = 0) -> int:
    """An int argument (a count of steps, stages, threads ...) of at least ``minimum``.

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
