"""Deferred mode (docs/design.md "Stream ordering", testing rule (a)): copies and I/O run late on worker
threads, ``.wait()`` is the only synchronisation, and released regions hold 0xFF."""

from __future__ import annotations

import pytest
import torch

from offload.storage import CopyEngine, HostPool, HostTier, NvmeTier

MiB = 1 << 20


@pytest.fixture
def engine():
    e = CopyEngine(deferred=True, max_delay_s=0.003, seed=1234)
    yield e
    e.close()


@pytest.fixture
def pool():
    p = HostPool(32 * MiB, slab_bytes=8 * MiB, poison_on_release=True)
    yield p
    p.close()


def test_immediate_engine_refuses_pause():
    with pytest.raises(ValueError, match="deferred"):
        CopyEngine().paused().__enter__()


def test_nvme_round_trip_in_deferred_mode(tmp_path, pool, engine):
    with NvmeTier(tmp_path, capacity_bytes=32 * MiB, pool=pool, copy_engine=engine) as tier:
        data = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1, 4096, 5 * MiB + 7)]
        handles = [tier.write(x) for x in data]
        outs = [pool.allocate(x.numel()) for x in data]
        reads = [tier.read(h, o) for h, o in zip(handles, outs, strict=True)]  # before writes end
        for t, x, o in zip(reads, data, outs, strict=True):
            t.wait()
            assert torch.equal(o.tensor, x)
        for h, o in zip(handles, outs, strict=True):
            tier.free(h)
            o.release()
        assert tier.used_bytes == 0 and pool.used_bytes == 0


def test_a_reader_that_does_not_wait_sees_poison(tmp_path, pool, engine):
    x = torch.randint(0, 255, (3 * MiB,), dtype=torch.uint8)  # never 0xFF
    with NvmeTier(tmp_path, capacity_bytes=32 * MiB, pool=pool, copy_engine=engine) as tier:
        h = tier.write(x)
        h.wait()  # the staging region went back to the pool, poisoned
        with engine.paused():
            out = pool.allocate(x.numel())  # the staging region again
            t = tier.read(h, out)
            assert not t.done()
            assert bool((out.tensor == 0xFF).all())  # not waited: garbage, never plausible data
        t.wait()
        assert torch.equal(out.tensor, x)
        out.release()
        tier.free(h)


def test_deferred_mode_exposes_a_missing_wait_on_the_source(pool, engine):
    """A caller that reuses its source before the write completed stores the wrong bytes, every
    time, instead of only under an unlucky interleaving."""
    with HostTier(pool, copy_engine=engine) as tier:
        x = torch.arange(100, dtype=torch.uint8)
        with engine.paused():
            h = tier.write(x)
            x.zero_()  # the bug: the source changes before h.wait()
        out = torch.empty(100, dtype=torch.uint8)
        tier.read(h, out).wait()
        assert bool((out == 0).all())
        tier.free(h)


def test_free_during_a_deferred_read_releases_only_after_it(pool, engine):
    with HostTier(pool, copy_engine=engine) as tier:
        x = torch.randint(0, 255, (MiB,), dtype=torch.uint8)
        h = tier.write(x)
        out = torch.empty(MiB, dtype=torch.uint8)
        with engine.paused():
            t = tier.read(h, out)
            tier.free(h)
            assert tier.used_bytes > 0  # the region is still needed by the pending read
        t.wait()
        assert torch.equal(out, x)
        assert tier.used_bytes == 0 and pool.used_bytes == 0
