"""The host pool: alignment, coalescing, the cap, steady state, close."""

from __future__ import annotations

import gc
import itertools
import os
import random
import threading
import time
import weakref

import pytest
import torch

from offload import storage
from offload.storage import (
    ALIGNMENT_BYTES,
    HostPool,
    StorageError,
    StorageFullError,
    claim_shared_host_pool,
    shared_host_pool,
)

KiB, MiB = 1 << 10, 1 << 20


def test_every_region_is_4k_aligned_and_padded():
    with HostPool(64 * MiB, slab_bytes=4 * MiB) as pool:
        regions = [pool.allocate(n) for n in (1, 63, 64, 4095, 4096, 4097, 100_000, 3 * MiB + 1)]
        for r in regions:
            assert r.data_ptr() % ALIGNMENT_BYTES == 0
            assert r.tensor.data_ptr() == r.data_ptr()
            assert r.tensor.dtype == torch.uint8 and r.tensor.numel() == r.nbytes
            assert r.capacity_bytes % ALIGNMENT_BYTES == 0 and r.capacity_bytes >= r.nbytes
            assert r.span.numel() == r.capacity_bytes


def test_regions_never_overlap_and_accounting_balances():
    rng = random.Random(0)
    with HostPool(16 * MiB, slab_bytes=2 * MiB) as pool:
        live = []
        for _ in range(2000):
            if live and (rng.random() < 0.5 or pool.used_bytes > 12 * MiB):
                live.pop(rng.randrange(len(live))).release()
            else:
                live.append(pool.allocate(rng.choice([1, 5000, 40_000, 300_000])))
            spans = sorted((r.data_ptr(), r.data_ptr() + r.capacity_bytes) for r in live)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            assert pool.used_bytes == sum(r.capacity_bytes for r in live)
        for r in live:
            r.release()
        assert pool.used_bytes == 0


def test_fragmented_slab_coalesces_into_one_large_region():
    with HostPool(1 * MiB, slab_bytes=1 * MiB) as pool:
        small = [pool.allocate(4 * KiB) for _ in range(256)]  # fills the only slab
        assert pool.host_allocations == 1
        with pytest.raises(StorageFullError):
            pool.allocate(1)
        odd, even = small[1::2], small[0::2]
        for r in odd:
            r.release()
        # Half the slab is free, but in 4 KiB holes: a 8 KiB region does not fit, and the cap
        # forbids a second slab.
        assert pool.largest_free_bytes() == 4 * KiB
        with pytest.raises(StorageFullError):
            pool.allocate(8 * KiB)
        random.Random(1).shuffle(even)
        for r in even:
            r.release()
        big = pool.allocate(1 * MiB)  # the whole slab again: every hole merged
        assert big.capacity_bytes == 1 * MiB
        assert pool.host_allocations == 1


def test_a_released_range_serves_the_next_request_of_its_size():
    """NOTE [ Recent regions ]: a step's records come back at the sizes of the step before."""
    with HostPool(1 * MiB, slab_bytes=1 * MiB, poison_on_release=True) as pool:
        first = [pool.allocate(n) for n in (5000, 100, 5000)]
        addresses = {r.data_ptr() for r in first}
        first[0].tensor.fill_(7)
        for r in first:
            r.release()
        assert pool.used_bytes == 0  # a recent range is free space
        again = [pool.allocate(n) for n in (100, 5000, 5000)]
        assert {r.data_ptr() for r in again} == addresses
        assert [r.tensor.numel() for r in again] == [100, 5000, 5000]
        assert all(not r.released for r in again) and all(r.released for r in first)
        assert pool.used_bytes == sum(r.capacity_bytes for r in again)
        # The old handle of a reused range stays released: releasing it again, or asking for
        # its bytes, touches nothing of the new owner's.
        first[0].release()
        assert not again[1].released and again[1].tensor.numel() == 5000
        with pytest.raises(StorageError, match="released"):
            first[0].tensor  # noqa: B018
        assert pool.host_allocations == 1


def test_recent_ranges_merge_before_a_request_that_they_would_refuse():
    """A request the free list cannot place first gets the recent ranges back, merged: they
    never make the pool grow, refuse, or hide room from largest_free_bytes and trim."""
    with HostPool(1 * MiB, slab_bytes=1 * MiB) as pool:
        small = [pool.allocate(4 * KiB) for _ in range(256)]  # the whole slab
        for r in small:
            r.release()
        assert pool.largest_free_bytes() == 1 * MiB
        small = [pool.allocate(4 * KiB) for _ in range(256)]
        for r in small:
            r.release()
        big = pool.allocate(1 * MiB)  # the cap allows no second slab
        assert big.capacity_bytes == 1 * MiB and pool.host_allocations == 1
        big.release()
        assert pool.trim() == 1 * MiB and pool.reserved_bytes == 0


def test_cap_raises_storage_full_with_bytes_needed():
    with HostPool(2 * MiB, slab_bytes=1 * MiB) as pool:
        a = pool.allocate(1 * MiB)
        b = pool.allocate(1 * MiB)
        with pytest.raises(StorageFullError) as info:
            pool.allocate(10)
        assert info.value.bytes_needed == 4 * KiB
        assert info.value.directory is None
        assert "cap" in str(info.value)
        assert isinstance(info.value, OSError)
        with pytest.raises(StorageFullError):
            HostPool(1 * MiB).allocate(2 * MiB)
        a.release()
        b.release()
        assert pool.reserved_bytes == 2 * MiB


def test_slabs_are_powers_of_two_and_grow_up_to_the_cap():
    with HostPool(10 * MiB, slab_bytes=4 * MiB) as pool:
        pool.allocate(3 * MiB)
        pool.allocate(3 * MiB)
        # 2 MiB of cap left: a third 4 MiB slab does not fit and a 2 MiB one cannot hold 3 MiB,
        with pytest.raises(StorageFullError):
            pool.allocate(3 * MiB)
        pool.allocate(2 * MiB)  # but the last 2 MiB become a slab of their own.
        assert [s.memory.numel() for s in pool._slabs] == [4 * MiB, 4 * MiB, 2 * MiB]
        assert pool.reserved_bytes == pool.capacity_bytes
    with HostPool(16 * MiB, slab_bytes=1 * MiB) as pool:
        r = pool.allocate(5 * MiB)  # larger than a slab: a slab of its own, 8 MiB
        assert [s.memory.numel() for s in pool._slabs] == [8 * MiB]
        r.release()


def test_unused_slabs_at_the_cap_make_room_for_a_larger_region():
    """A cap filled with slabs of small regions, all released, refused a region larger than any
    slab ("0 B in use"): a larger record after smaller ones (a new signature) failed, or went to
    NVMe. Now unused slabs, smallest first, go back for the new one; slabs in use stay."""
    with HostPool(64 * MiB, slab_bytes=16 * MiB) as pool:
        for r in [pool.allocate(8 * MiB) for _ in range(8)]:
            r.release()
        assert pool.host_allocations == 4 and pool.reserved_bytes == 64 * MiB
        kept = pool.allocate(8 * MiB)
        kept.tensor.fill_(7)
        big = pool.allocate(20 * MiB)  # a 32 MiB slab, in place of two unused 16 MiB ones
        assert sorted(s.memory.numel() for s in pool._slabs) == [16 * MiB, 16 * MiB, 32 * MiB]
        assert pool.reserved_bytes == 64 * MiB and pool.host_allocations == 5
        assert bool((kept.tensor == 7).all())
        with pytest.raises(StorageFullError):
            pool.allocate(40 * MiB)  # a 64 MiB slab: the unused 16 MiB one is not enough
        assert pool.reserved_bytes == 64 * MiB and len(pool._slabs) == 3  # nothing was dropped
        big.release()
        kept.release()


def test_a_cap_of_no_power_of_two_keeps_its_larger_slab_for_a_larger_region():
    """A 3 MiB cap is held as a 2 and a 1 MiB slab (see NOTE [ Slab sizes ]). The first region,
    1 MiB, took the 2 MiB slab, so a 2 MiB region after it was refused with 1 MiB of the cap
    never allocated: 1 MiB stored of 3 (96 MiB cap: 32 of 96 MiB; 100 MB: 16 of 95.37 MiB).
    Now a new slab is the smallest that holds its region: both fit, step after step, in two
    slabs allocated once."""
    for cap, small, large in (
        (3 * MiB, 1 * MiB, 2 * MiB),
        (96 * MiB, 32 * MiB, 64 * MiB),
        (100_000_000, 16 * MiB, 64 * MiB),
    ):
        with HostPool(cap) as pool:
            for _ in range(3):
                a = pool.allocate(small)
                b = pool.allocate(large)
                assert pool.used_bytes == small + large
                a.release()
                b.release()
            assert sorted(s.memory.numel() for s in pool._slabs) == [small, large]
            assert pool.host_allocations == 2


def test_a_large_cap_of_no_power_of_two_still_grows_by_regular_slabs():
    """The smallest-slab rule is for a cap's last part only: with room for regular slabs, a
    small region still gets one (a cap of 10 MiB + 12 KiB gave a 4 KiB region a 4 KiB slab, and
    the next regions 8 KiB, then 1 MiB slabs: three host allocations where one serves)."""
    with HostPool(10 * MiB + 12 * 1024, slab_bytes=MiB) as pool:
        regions = [pool.allocate(4096) for _ in range(3)]
        assert [s.memory.numel() for s in pool._slabs] == [MiB]
        for r in regions:
            r.release()


def test_steady_state_allocates_nothing_over_200_cycles():
    sizes = [1, 4096, 10_000, 300_000, 2 * MiB + 5]
    with HostPool(32 * MiB, slab_bytes=4 * MiB) as pool:
        for r in [pool.allocate(n) for n in sizes]:
            r.release()
        allocations, reserved = pool.host_allocations, pool.reserved_bytes
        rng = random.Random(2)
        for _ in range(200):
            order = sizes[:]
            rng.shuffle(order)
            regions = [pool.allocate(n) for n in order]
            rng.shuffle(regions)
            for r in regions:
                r.release()
        assert pool.host_allocations == allocations
        assert pool.reserved_bytes == reserved
        assert pool.used_bytes == 0


def test_reserve_allocates_up_front():
    with HostPool(8 * MiB, slab_bytes=2 * MiB) as pool:
        pool.reserve(5 * MiB)
        assert pool.reserved_bytes >= 5 * MiB
        count = pool.host_allocations
        regions = [pool.allocate(1 * MiB) for _ in range(5)]
        assert pool.host_allocations == count
        for r in regions:
            r.release()
        with pytest.raises(StorageFullError):
            pool.reserve(9 * MiB)


def test_reserve_fills_a_cap_of_no_power_of_two():
    """reserve() asked for one slab as large as all it missed: 80 MiB of a 96 MiB cap wanted a
    128 MiB slab and raised StorageFullError with nothing reserved, and so did reserving a
    whole 3 MiB or 100 MB cap. Now it grows slab by slab within the room left."""
    with HostPool(96 * MiB) as pool:
        pool.reserve(80 * MiB)
        assert sorted(s.memory.numel() for s in pool._slabs) == [32 * MiB, 64 * MiB]
    with HostPool(3 * MiB) as pool:
        pool.reserve(3 * MiB)
        assert pool.reserved_bytes == 3 * MiB and pool.host_allocations == 2
        regions = [pool.allocate(2 * MiB), pool.allocate(1 * MiB)]
        assert pool.host_allocations == 2
        for r in regions:
            r.release()
    with HostPool(100_000_000) as pool:
        pool.reserve(100_000_000)  # every whole 4 KiB page of the cap; the last 256 B are none
        assert pool.reserved_bytes == 100_000_000 // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    with HostPool(8 * MiB) as pool:
        with pytest.raises(StorageFullError, match=r"exceeds its 8\.00 MiB cap"):
            pool.reserve(9 * MiB)
        assert pool.reserved_bytes == 0  # refused before reserving part of it


def test_release_is_idempotent_and_released_region_refuses_access():
    with HostPool(1 * MiB, slab_bytes=1 * MiB) as pool:
        r = pool.allocate(100)
        r.release()
        r.release()
        assert r.released and pool.used_bytes == 0
        with pytest.raises(StorageError, match="released"):
            _ = r.tensor
        with pool.allocate(10) as scoped:
            assert not scoped.released
        assert scoped.released


def test_poison_on_release_fills_0xff_before_reuse():
    with HostPool(1 * MiB, slab_bytes=1 * MiB, poison_on_release=True) as pool:
        r = pool.allocate(8192)
        r.tensor.zero_()
        address = r.data_ptr()
        r.release()
        again = pool.allocate(8192)
        assert again.data_ptr() == address
        assert bool((again.tensor == 0xFF).all())


def test_zero_byte_region():
    with HostPool(1 * MiB) as pool:
        r = pool.allocate(0)
        assert r.nbytes == 0 and r.tensor.numel() == 0
        r.release()
        assert pool.host_allocations == 0


def test_close_releases_everything():
    pool = HostPool(4 * MiB, slab_bytes=1 * MiB)
    r = pool.allocate(1000)
    slab_ref = weakref.ref(pool._slabs[0].memory)
    r.release()
    del r
    pool.close()
    pool.close()  # idempotent
    gc.collect()
    assert slab_ref() is None  # the slab's memory went back to the host
    assert pool.reserved_bytes == 0 and pool.used_bytes == 0
    with pytest.raises(StorageError, match="closed"):
        pool.allocate(1)


def test_region_released_after_close_is_a_no_op():
    pool = HostPool(1 * MiB, slab_bytes=1 * MiB)
    r = pool.allocate(10)
    pool.close()
    r.release()
    assert pool.used_bytes == 0


def test_concurrent_allocate_and_release_from_threads():
    pool = HostPool(16 * MiB, slab_bytes=4 * MiB)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                r = pool.allocate(rng.choice([100, 5000, 70_000]))
                r.tensor.fill_(seed)
                assert bool((r.tensor == seed).all())  # nobody else wrote into it
                r.release()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.used_bytes == 0
    pool.close()


def test_without_cuda_pin_memory_falls_back_to_plain_memory():
    with HostPool(1 * MiB, pin_memory=True, slab_bytes=1 * MiB) as pool:
        r = pool.allocate(10)
        assert pool.pinned == torch.cuda.is_available()
        assert r.pinned == pool.pinned
        r.release()


def test_invalid_arguments_name_the_argument():
    with pytest.raises(ValueError, match="slab_bytes"):
        HostPool(1 * MiB, slab_bytes=3000)
    # -1 said "must be >= 0 bytes", though 0 is no slab size either.
    for value in (-1, 0):
        with pytest.raises(ValueError, match=r"slab_bytes must be a power of two >= 4096; got"):
            HostPool(1 * MiB, slab_bytes=value)
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostPool(-1)
    with pytest.raises(TypeError, match="capacity_bytes"):
        HostPool("1GiB")  # type: ignore[arg-type]
    with HostPool(1 * MiB) as pool, pytest.raises(ValueError, match="nbytes"):
        pool.allocate(-5)


def test_shared_host_pool_is_one_per_process_and_raises_its_cap(monkeypatch):
    # A private registry: the process-wide pool other tests (and managers) use stays untouched.
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    a = shared_host_pool(1 * MiB, pin_memory=False)
    try:
        b = shared_host_pool(2 * MiB, pin_memory=False)
        assert a is b and a.capacity_bytes >= 2 * MiB
        assert shared_host_pool(pin_memory=False) is a
    finally:
        a.close()
    c = shared_host_pool(1 * MiB, pin_memory=False)
    assert c is not a and not c.closed
    c.close()


def test_claims_on_the_shared_pool_add_up_and_the_last_one_returns_the_slabs(monkeypatch):
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    a = claim_shared_host_pool(1 * MiB, staging_bytes=256 * KiB, pin_memory=False)
    b = claim_shared_host_pool(2 * MiB, pin_memory=False)
    pool = a.pool
    assert b.pool is pool and pool.capacity_bytes == 3 * MiB + 256 * KiB
    # Claims of the node-aware default are this rank's share each: counted once, the largest.
    c = claim_shared_host_pool(4 * MiB, default=True, pin_memory=False)
    d = claim_shared_host_pool(5 * MiB, default=True, pin_memory=False)
    assert pool.capacity_bytes == 5 * MiB + 3 * MiB + 256 * KiB
    pool.allocate(4 * MiB).release()  # a free 4 MiB slab, beyond what a and b claim
    d.close()
    c.close()  # the pool keeps no more than the claims left: that slab goes back
    assert pool.capacity_bytes == 3 * MiB + 256 * KiB and pool.reserved_bytes == 0
    pool.allocate(2 * MiB).release()  # a 2 MiB slab
    a.close()
    a.close()  # idempotent
    assert pool.capacity_bytes == 2 * MiB
    assert pool.reserved_bytes == 2 * MiB  # within b's claim: b keeps its free slab
    held = pool.allocate(512 * KiB)
    b.close()  # the last claim: free slabs go back, the one holding ``held`` stays
    assert pool.reserved_bytes == 2 * MiB and not pool.closed
    held.release()
    e = claim_shared_host_pool(1 * MiB, pin_memory=False)
    assert e.pool is pool
    e.close()  # the last claim again, and nothing held: every slab goes back
    assert pool.reserved_bytes == 0
    pool.close()


def test_trim_returns_only_slabs_no_region_uses():
    with HostPool(8 * MiB, slab_bytes=1 * MiB) as pool:
        kept = pool.allocate(512 * KiB)
        kept.tensor.fill_(7)
        big = pool.allocate(MiB + 1)  # a 2 MiB slab of its own
        assert pool.reserved_bytes == 3 * MiB
        assert pool.trim() == 0  # both slabs in use
        big.release()
        assert pool.trim() == 2 * MiB and pool.reserved_bytes == 1 * MiB
        assert bool((kept.tensor == 7).all())
        again = pool.allocate(MiB + 1)  # grows again under the cap
        again.release()
        kept.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_slabs_are_pinned_aligned_and_returned_on_close():
    pool = HostPool(64 * MiB, pin_memory=True, slab_bytes=32 * MiB)
    r = pool.allocate(3 * MiB + 1)
    assert r.tensor.is_pinned()
    assert r.data_ptr() % ALIGNMENT_BYTES == 0
    dev = torch.arange(r.nbytes, device="cuda").to(torch.uint8)
    r.tensor.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(r.tensor.cuda(), dev)
    r.release()
    pool.close()


def test_pinned_slabs_go_back_through_torchs_private_host_cache_call_on_torch_2_11(monkeypatch):
    """torch 2.11 (the GPU machines' build) has neither ``torch.accelerator.empty_host_cache``
    nor ``torch.cuda.empty_host_cache``; its CUDA build has ``torch._C._host_emptyCache`` (what
    ``offload._probe`` calls). Dropped pinned slabs must still be handed back through it, or
    torch's host allocator keeps them cached after close (no-op before). The calls are counted
    in place of the real one, which a CPU build lacks."""
    from offload.storage import _pool

    calls = []
    accelerator = type("Accelerator211", (), {})()  # a torch.accelerator without the call
    monkeypatch.setattr(_pool.torch, "accelerator", accelerator)
    monkeypatch.delattr(_pool.torch.cuda, "empty_host_cache", raising=False)
    monkeypatch.setattr(_pool.torch._C, "_host_emptyCache", lambda: calls.append(1), raising=False)
    _pool._empty_host_cache()
    assert calls == [1]


def _count_host_cache_empties(monkeypatch, dropped: list[weakref.ref]) -> list[bool]:
    """Each call of torch's host-cache emptying, in place of the real one (a CPU build has none),
    records whether every slab dropped so far was gone by then: a pinned slab still referenced
    when the cache is emptied is not freed then, and stays page-locked in torch's cache."""
    from offload.storage import _pool

    calls: list[bool] = []
    monkeypatch.setattr(_pool.torch, "accelerator", type("NoHostCache", (), {})())
    monkeypatch.delattr(_pool.torch.cuda, "empty_host_cache", raising=False)
    monkeypatch.setattr(
        _pool.torch._C,
        "_host_emptyCache",
        lambda: calls.append(all(ref() is None for ref in dropped)),
        raising=False,
    )
    return calls


def test_slabs_given_back_are_gone_before_torchs_host_cache_is_emptied(monkeypatch):
    """torch's pinned allocator caches a freed block until its cache is emptied, and reuses it
    only for a request of the same power of two (ATen/core/CachingHostAllocator.h: free ->
    maybe_cache_block, get_free_block by size_index, empty_cache frees the free list). A slab
    given back must be unreferenced when the cache is emptied, and trim() must empty it: else
    the slab stays pinned beside the larger one that replaces it, or after the last claim
    closed. The slabs here are plain (a CPU build pins nothing) and counted as pinned."""
    with HostPool(2 * MiB, slab_bytes=1 * MiB) as pool:
        pool._ever_pinned = True  # what a pinned slab sets (see _new_slab)
        dropped: list[weakref.ref] = []
        calls = _count_host_cache_empties(monkeypatch, dropped)
        pool.allocate(512 * KiB).release()
        dropped.append(weakref.ref(pool._slabs[0].memory))
        pool.allocate(MiB + 1).release()  # a 2 MiB slab: the unused 1 MiB one makes room
        assert calls == [True]
        dropped.append(weakref.ref(pool._slabs[0].memory))
        assert pool.trim() == 2 * MiB
        assert calls == [True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_slabs_given_back_leave_torchs_host_cache():
    """The CUDA side of the test above, read from torch's pinned allocator: a slab dropped for a
    larger one, and a trimmed slab, are no longer pinned (allocated_bytes counts cached blocks)."""
    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("this torch has no torch.cuda.host_memory_stats")

    def pinned() -> int:
        return torch.cuda.host_memory_stats()["allocated_bytes.current"]

    storage._pool._empty_host_cache()
    before = pinned()
    with HostPool(32 * MiB, pin_memory=True, slab_bytes=16 * MiB) as pool:
        pool.allocate(MiB).release()
        assert pinned() - before == 16 * MiB
        pool.allocate(17 * MiB).release()  # a 32 MiB slab: the unused 16 MiB one makes room
        assert pinned() - before == 32 * MiB  # not 48 MiB
        assert pool.trim() == 32 * MiB
        assert pinned() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_has_its_own_copy_of_the_pool():
    """Unpinned slabs were MAP_SHARED anonymous mmaps: a forked child's records and staging
    overwrote the parent's bytes in the same slabs (the parent read back 2s here). Private
    now: each process writes its own copy, and the child's pool works with a lock of its own."""
    with HostPool(1 << 20, slab_bytes=1 << 20) as pool:
        region = pool.allocate(8192)
        region.tensor.fill_(1)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                region.tensor.fill_(2)
                other = pool.allocate(4096)  # the child's own lock and bookkeeping
                other.release()
                code = 0 if bool((region.tensor == 2).all()) else 1
            finally:
                os._exit(code)
        for _ in range(600):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung")
        assert os.waitstatus_to_exitcode(status) == 0
        assert bool((region.tensor == 1).all())
        region.release()
