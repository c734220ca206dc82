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
