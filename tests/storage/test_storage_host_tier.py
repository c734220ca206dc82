"""The host tier: records in pool regions."""

from __future__ import annotations

import pytest
import torch

from offload.storage import (
    HostPool,
    HostTier,
    NvmeTier,
    StorageError,
    StorageFullError,
    Tier,
    Transfer,
)

MiB = 1 << 20


@pytest.fixture
def pool():
    p = HostPool(8 * MiB, slab_bytes=4 * MiB)
    yield p
    p.close()


def test_tiers_implement_the_interface():
    assert issubclass(HostTier, Tier) and issubclass(NvmeTier, Tier)
    with pytest.raises(TypeError):
        Tier()  # type: ignore[abstract]


def test_tensor_round_trip_and_accounting(pool):
    with HostTier(pool) as tier:
        x = torch.randn(1000, 3)
        h = tier.write(x)
        assert h.done() and h.tier is tier and h.nbytes == x.numel() * 4
        assert tier.used_bytes == h.region.capacity_bytes and pool.used_bytes == tier.used_bytes
        out = torch.empty_like(x)
        t = tier.read(h, out)
        assert isinstance(t, Transfer)
        t.wait()
        assert torch.equal(out, x)
        into = pool.allocate(h.nbytes)
        tier.read(h, into).wait()
        assert torch.equal(into.tensor.view(torch.float32).view(1000, 3), x)
        into.release()
        tier.free(h)
        tier.free(h)
        assert tier.used_bytes == 0 and pool.used_bytes == 0


def test_region_source_is_adopted(pool):
    with HostTier(pool) as tier:
        region = pool.allocate(5000)
        region.tensor.fill_(7)
        h = tier.write(region, 4000)
        assert h.region is region and h.nbytes == 4000
        out = torch.zeros(4000, dtype=torch.uint8)
        tier.read(h, out).wait()
        assert bool((out == 7).all())
        tier.free(h)
        assert region.released  # the tier owned it


def test_full_pool_raises_and_the_record_goes_elsewhere(pool):
    with HostTier(pool) as tier:
        big = tier.write(torch.zeros(7 * MiB, dtype=torch.uint8))
        with pytest.raises(StorageFullError):
            tier.write(torch.zeros(2 * MiB, dtype=torch.uint8))
        tier.free(big)
        tier.write(torch.zeros(2 * MiB, dtype=torch.uint8))


def test_closed_tier_and_foreign_handles(pool):
    a, b = HostTier(pool), HostTier(pool)
    h = a.write(torch.ones(10))
    with pytest.raises(ValueError, match="another tier"):
        b.read(h, torch.empty(10))
    with pytest.raises(TypeError, match="takes host bytes"):
        a.write(torch.ones(10, device="meta"))
    a.close()
    assert pool.used_bytes == 0  # close released the live record
    with pytest.raises(StorageError, match="closed"):
        a.write(torch.ones(10))
    b.close()


def test_after_is_waited_before_the_source_is_read(pool):
    with HostTier(pool) as tier:
        ready = Transfer.completed()
        h = tier.write(torch.arange(10, dtype=torch.uint8), after=ready)
        out = torch.empty(10, dtype=torch.uint8)
        tier.read(h, out).wait()
        assert out.tolist() == list(range(10))
        tier.free(h)


def _regions() -> list:
    import gc

    from offload.storage import HostRegion

    return [o for o in gc.get_objects() if type(o) is HostRegion]


def test_a_released_records_region_object_serves_the_next_record_of_its_size(pool):
    """NOTE [ Reused region objects ]: a region only the tier held comes back as itself, live
    again, and the freed handle that held it lets go of it."""
    with HostTier(pool) as tier:
        x = torch.arange(1000, dtype=torch.float32)
        first = tier.write(x)
        region = first._region
        tier.free(first)
        assert region.released and first._region is None
        second = tier.write(x + 1)
        assert second._region is region and not region.released
        assert pool.used_bytes == region.capacity_bytes
        # The freed handle touches nothing of the new record's: freeing it again does nothing,
        # a read raises, and the new record reads back its own bytes.
        tier.free(first)
        with pytest.raises(StorageError, match="freed"):
            tier.read(first, torch.empty(1000))
        out = torch.empty(1000)
        tier.read(second, out).wait()
        assert torch.equal(out, x + 1) and not region.released
        tier.free(second)
        assert pool.used_bytes == 0 and tier.used_bytes == 0
        # Another size takes another range (the recent one waits for its size or a merge).
        third = tier.write(torch.zeros(10))
        assert third._region is not region
        tier.free(third)


def test_a_region_handed_out_is_never_reused(pool):
    """A record whose region was asked for (``handle.region``), or adopted from the caller,
    comes back as a new region object: the old one, held by whoever asked, stays released."""
    with HostTier(pool) as tier:
        x = torch.arange(1000, dtype=torch.float32)
        h = tier.write(x)
        lent = h.region
        tier.free(h)
        assert lent.released and h.region is lent
        again = tier.write(x)
        assert again.region is not lent and again.region.data_ptr() == lent.data_ptr()
        lent.release()  # a second release of the old object: nothing of the new record's
        assert not again.region.released
        with pytest.raises(StorageError, match="released"):
            lent.tensor  # noqa: B018
        tier.free(again)
        adopted = pool.allocate(4000)
        h = tier.write(adopted)
        tier.free(h)
        assert adopted.released
        h = tier.write(torch.zeros(4000, dtype=torch.uint8))
        assert h._region is not adopted
        tier.free(h)
        # (pool.allocate's own regions, released by their owner, are never reused either)
        mine = pool.allocate(300)
        mine.release()
        other = pool.allocate(300)
        assert other is not mine and mine.released and not other.released
        other.release()


def test_reused_region_objects_merge_back_before_a_request_they_would_refuse():
    """Recent ranges held as region objects go back to the free list like the others: a
    request the free list cannot place gets them merged, and trim gives the slab back."""
    with HostPool(1 * MiB, slab_bytes=1 * MiB, poison_on_release=True) as pool:
        with HostTier(pool) as tier:
            small = [tier.write(torch.full((1024,), i, dtype=torch.float32)) for i in range(256)]
            for h in small:
                tier.free(h)
            big = tier.write(torch.ones(1 * MiB, dtype=torch.uint8))  # the whole slab
            assert big._region.capacity_bytes == 1 * MiB and pool.host_allocations == 1
            tier.free(big)
        assert pool.trim() == 1 * MiB and pool.reserved_bytes == 0


def test_a_tiers_steady_records_make_no_new_region_objects(pool):
    """Step after step of the same sizes, the records' regions are the step before's."""
    with HostTier(pool) as tier:
        xs = [torch.randn(n) for n in (10, 1000, 1000, 50000)]
        for _ in range(2):
            for h in [tier.write(x) for x in xs]:
                tier.free(h)
        before = {id(r) for r in _regions()}
        for _ in range(5):
            handles = [tier.write(x) for x in xs]
            assert {id(h._region) for h in handles} <= before
            for h, x in zip(handles, xs, strict=True):
                out = torch.empty_like(x)
                tier.read(h, out).wait()
                assert torch.equal(out, x)
                tier.free(h)
