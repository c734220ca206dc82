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
