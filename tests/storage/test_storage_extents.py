"""The free-list allocator under the pool and the spill file."""

from __future__ import annotations

import random

import pytest

from offload.storage._extents import ExtentAllocator

PAGE = 4096


def test_free_merges_with_both_neighbours():
    a = ExtentAllocator(alignment=PAGE)
    a.add(0, 8 * PAGE)
    offsets = [a.allocate(PAGE) for _ in range(8)]
    assert offsets == [i * PAGE for i in range(8)] and a.free_bytes == 0
    for i in (1, 3, 2):  # 2 joins 1 and 3
        a.free(offsets[i], PAGE)
    assert a.extents() == [(PAGE, 3 * PAGE)]
    for i in (0, 4, 5, 6, 7):
        a.free(offsets[i], PAGE)
    assert a.extents() == [(0, 8 * PAGE)]


def test_best_fit_keeps_large_ranges_whole():
    a = ExtentAllocator(alignment=PAGE)
    a.add(0, 16 * PAGE)
    x = a.allocate(4 * PAGE)
    hole = a.allocate(PAGE)
    a.allocate(PAGE)
    a.free(hole, PAGE)
    assert a.allocate(PAGE) == hole  # the 1-page hole, not the big tail
    assert x == 0 and a.largest_free() == 10 * PAGE


def test_growth_extends_the_trailing_free_range():
    a = ExtentAllocator(alignment=PAGE)
    a.add(0, 2 * PAGE)
    a.allocate(PAGE)
    assert a.trailing_free() == PAGE
    a.add(2 * PAGE, 2 * PAGE)
    assert a.extents() == [(PAGE, 3 * PAGE)] and a.end == 4 * PAGE
    with pytest.raises(ValueError):
        a.add(8 * PAGE, PAGE)  # not at the end


def test_double_free_and_misaligned_ranges_raise():
    a = ExtentAllocator(alignment=PAGE)
    a.add(0, 4 * PAGE)
    x = a.allocate(2 * PAGE)
    a.free(x, 2 * PAGE)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x, PAGE)
    with pytest.raises(ValueError):
        a.allocate(100)
    with pytest.raises(ValueError):
        a.free(4 * PAGE, PAGE)  # past the end


def test_random_workload_returns_to_one_range():
    rng = random.Random(3)
    a = ExtentAllocator(alignment=PAGE)
    a.add(0, 256 * PAGE)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            off, n = live.pop(rng.randrange(len(live)))
            a.free(off, n)
        else:
            n = rng.choice([1, 2, 3, 8]) * PAGE
            off = a.allocate(n)
            if off is not None:
                assert all(off + n <= o or o + m <= off for o, m in live)
                live.append((off, n))
        assert a.free_bytes + sum(n for _, n in live) == 256 * PAGE
    for off, n in live:
        a.free(off, n)
    assert a.extents() == [(0, 256 * PAGE)]


def _best_fit(free: dict[int, int], n: int) -> int | None:
    """The reference: the smallest free range that holds ``n``, the lowest of equal ones."""
    fits = [(length, off) for off, length in free.items() if length >= n]
    return min(fits)[1] if fits else None


def _merged(free: dict[int, int]) -> dict[int, int]:
    out: list[tuple[int, int]] = []
    for off, length in sorted(free.items()):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((off, length))
    return dict(out)


def test_best_fit_matches_a_walk_over_every_free_range():
    # The size index (a binary search) picks what walking the free list picked.
    rng = random.Random(7)
    for _ in range(40):
        a = ExtentAllocator(alignment=PAGE)
        a.add(0, 200 * PAGE)
        free, live = {0: 200 * PAGE}, []
        for _ in range(300):
            if live and rng.random() < 0.45:
                off, n = live.pop(rng.randrange(len(live)))
                a.free(off, n)
                free = _merged({**free, off: n})
            else:
                n = rng.randint(1, 8) * PAGE
                want = _best_fit(free, n)
                assert a.allocate(n) == want
                if want is not None:
                    length = free.pop(want)
                    if length > n:
                        free[want + n] = length - n
                    live.append((want, n))
            assert a.extents() == sorted(free.items())
            assert a.largest_free() == max(free.values(), default=0)
