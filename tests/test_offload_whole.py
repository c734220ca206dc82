"""Whole tensors copied as themselves (NOTE [ Whole tensors ] in offload/_family.py, NOTE
[ Typed copies ] in storage/_pool.py): a family that is one plain contiguous tensor over its
storage's whole bytes is stored from the tensor itself, into the host region's view of its
shape, and reloaded into its own view over the reload buffer. Each case against a run without
offloading, bitwise; the storage calls against the bytes they copied."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from offload_util import ENGINES, assert_nothing_live, manager, nvme_kw
from torch import nn

from offload import storage

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype is torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride())


@pytest.mark.parametrize("dtype", DTYPES)
# The last two are larger than NOTE [ Small copies ]' memmove takes (32 KiB) in every dtype.
@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 4), (40000,), (129, 16, 17)])
def test_a_whole_tensor_goes_through_the_cpu_tier_as_itself(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    with storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool, storage.HostTier(pool) as tier:
        x = _sample(dtype, shape)
        n = x.numel() * x.element_size()
        handle = tier._write_whole(x, n, _key(x))
        handle.written.wait()
        assert handle.nbytes == n
        # What is stored is x's bytes, as a write of its bytes stores them.
        raw = torch.empty(n, dtype=torch.uint8)
        tier.read(handle, raw).wait()
        assert torch.equal(raw, x.reshape(-1).view(torch.uint8))
        out = torch.empty_like(x)
        tier._read_whole(handle, out, _key(out)).wait()
        assert torch.equal(out.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))
        tier.free(handle)
        assert pool.used_bytes == 0


def test_the_region_view_of_a_shape_is_kept_with_its_range() -> None:
    """The next record of one size and shape copies through the view the last one made; one
    of another shape (the same bytes) makes its own. (64 KiB: torch's copies, not NOTE
    [ Small copies ]' memmove, which needs no view.)"""
    with storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool, storage.HostTier(pool) as tier:
        a = torch.randn(128, 128)
        h = tier._write_whole(a, a.numel() * 4, _key(a))
        view = h.region._shaped_view[1]
        tier.free(h)
        b = torch.randn(128, 128)
        h = tier._write_whole(b, b.numel() * 4, _key(b))
        assert h.region._shaped_view[1] is view  # the recent range's, with its view
        out = torch.empty(128, 128)
        tier._read_whole(h, out, _key(out)).wait()
        assert torch.equal(out, b)
        tier.free(h)
        c = torch.randn(256, 64)
        h = tier._write_whole(c, c.numel() * 4, _key(c))
        assert h.region._shaped_view[1] is not view
        assert h.region._shaped_view[1].shape == (256, 64)
        out = torch.empty(256, 64)
        tier._read_whole(h, out, _key(out)).wait()
        assert torch.equal(out, c)
        tier.free(h)


def test_a_subclass_with_its_own_write_and_read_is_called() -> None:
    calls: list[str] = []

    class Counting(storage.HostTier):
        def write(self, source: Any, nbytes: int | None = None, *, after: Any = None) -> Any:
            calls.append("write")
            return super().write(source, nbytes, after=after)

        def read(self, handle: Any, into: Any) -> Any:
            calls.append("read")
            return super().read(handle, into)

    with storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool, Counting(pool) as tier:
        x = torch.randn(16)
        h = tier._write_whole(x, 64, _key(x))
        out = torch.empty(16)
        tier._read_whole(h, out, _key(out)).wait()
        assert torch.equal(out, x)
        assert calls == ["write", "read"]
        tier.free(h)


def test_a_deferred_engine_takes_the_engine_path() -> None:
    engine = storage.CopyEngine(deferred=True, seed=3)
    try:
        with (
            storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool,
            storage.HostTier(pool, copy_engine=engine) as tier,
        ):
            x = torch.randn(3, 16, dtype=torch.bfloat16)
            h = tier._write_whole(x, x.numel() * 2, _key(x))
            h.written.wait()
            out = torch.empty_like(x)
            tier._read_whole(h, out, _key(out)).wait()
            assert torch.equal(out, x)
            tier.free(h)
    finally:
        engine.close()


def test_a_whole_copy_that_fails_frees_its_record_and_says_why() -> None:
    """A copy that raises (a source of another size than the record's, or than its key's)
    fails the write as the engine's failed writes do: its space goes back and ``written``
    raises the error. Small ones included: NOTE [ Small copies ]' memmove takes only a source
    of the record's size."""
    with storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool, storage.HostTier(pool) as tier:
        for x, nbytes, key in [
            (torch.randn(16), 32, (torch.float32, (8,), (1,))),
            (torch.randn(16384), 32768, (torch.float32, (8192,), (1,))),
            (torch.randn(32768), 131072, (torch.float32, (16384,), (1,))),  # key: another size
        ]:
            h = tier._write_whole(x, nbytes, key)
            with pytest.raises(RuntimeError):
                h.written.wait()
            assert pool.used_bytes == 0


def test_a_small_whole_record_reads_into_nothing_of_another_size() -> None:
    """NOTE [ Small copies ]: a reload target of another size goes to torch's copy, which
    refuses it, and a transposed one gets its elements where they belong (a memmove would
    have put them in the record's order); the record's bytes stay."""
    with storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool, storage.HostTier(pool) as tier:
        x = torch.randn(4, 4)
        h = tier._write_whole(x, 64, _key(x))
        for into in (torch.empty(8), torch.empty(32)):
            with pytest.raises(RuntimeError):
                tier._read_whole(h, into, _key(x)).wait()
        transposed = torch.empty(4, 4).t()
        tier._read_whole(h, transposed, _key(x)).wait()
        assert torch.equal(transposed, x)
        out = torch.empty(4, 4)
        tier._read_whole(h, out, _key(out)).wait()
        assert torch.equal(out, x)
        tier.free(h)
        assert pool.used_bytes == 0


class SavesViews(torch.autograd.Function):
    """Saves a whole tensor, its transpose and its bytes as int32: three members of one dense
    family, of two dtypes and two layouts."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, a.t(), a.view(torch.int32))
        return a * 3.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        a, at, bits = ctx.saved_tensors
        assert torch.equal(at, a.t()) and torch.equal(bits, a.view(torch.int32))
        return g * a + (bits & 1).to(g.dtype) + at.t()


def _body(x: torch.Tensor, last: bool) -> torch.Tensor:
    y = torch.tanh(x)
    y = SavesViews.apply(y)
    if not last:
        y = torch.sin(y) * y
    return y


def _grad(mgr: Any, x0: torch.Tensor, last: bool) -> torch.Tensor:
    x = x0.clone().requires_grad_()
    with mgr if mgr is not None else contextlib.nullcontext():
        loss = _body(x, last).sum()
    loss.backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("last", [False, True], ids=["then-more-ops", "last-op"])
@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)])
@pytest.mark.parametrize("engine", ENGINES)
def test_members_of_other_dtypes_and_layouts_come_back_exact(
    engine: str, tiers: tuple[str, ...], last: bool, tmp_path: Any
) -> None:
    """Every member bitwise, the int32 one included: reloaded from the tier, or (the deferred
    engine, whose copies may still run when backward begins) rebuilt from the family's source,
    which is the whole tensor itself (``_Member.source_view``)."""
    x0 = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))
    want = _grad(None, x0, last)
    with manager(nn.Identity(), engine, tiers=tiers, **nvme_kw(tiers, tmp_path)) as mgr:
        for _ in range(3):
            assert torch.equal(_grad(mgr, x0, last), want)
        assert mgr.stats.last.records_deduplicated >= 2  # the views joined the whole tensor
        assert_nothing_live(mgr)


class SavesOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return g * a.abs() if not a.is_complex() else g * a.conj()


SAVED = {
    "whole": (lambda x: x * 2.0, True),
    "whole view": (lambda x: (x * 2.0).view(36), True),
    "small slice": (lambda x: (x.repeat(8, 1) * 1.0)[:6], False),
    # A view at offset 0 over half its storage: its family takes the whole storage along
    # (NOTE [ Alias handling ]), of which the view is not the whole.
    "half view": (lambda x: (x * 2.0)[:3], False),
    "transposed": (lambda x: (x * 1.0).t().contiguous().t(), False),
    "conjugate": (lambda x: torch.complex(x * 1.0, x * 2.0).conj(), False),
}


@pytest.mark.parametrize("name", list(SAVED))
def test_which_families_are_whole(name: str) -> None:
    """Whole: a plain contiguous tensor over its storage's whole bytes, whose source is the
    tensor itself. Not: a slice of a larger storage, a transposed tensor, a conjugate view."""
    make, whole = SAVED[name]
    x0 = torch.randn(6, 6, generator=torch.Generator().manual_seed(4))

    def grad(mgr: Any) -> torch.Tensor:
        x = x0.clone().requires_grad_()
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = SavesOne.apply(make(x)).real.sum()
            if mgr is not None:
                fam = mgr._executor.step.families[-1]  # SavesOne's, the last: still copying out
                assert (fam.dense is not None) is whole
                assert (fam.source is not None and fam.source is fam.guard) is whole
        loss.backward()
        assert x.grad is not None
        return x.grad

    want = grad(None)
    with manager(nn.Identity()) as mgr:
        assert torch.equal(grad(mgr), want)
        assert mgr.stats.last.fallbacks == 0  # stored where it was sent, not after a failure
        assert mgr.stats.last.records_offloaded_cpu >= 1
        assert_nothing_live(mgr)


def test_a_tensor_at_an_address_no_multiple_of_its_item_size_is_kept() -> None:
    """``torch.frombuffer`` at an odd offset makes a float tensor at an address that is no
    multiple of 4: no view of a reload buffer can start there, so it stays where it is (counted
    kept), and its gradient is exact. Offloaded, its unpack raised an internal error."""
    buf = bytearray(4 * 16 + 2)
    x = torch.frombuffer(buf, dtype=torch.float32, offset=2, count=16)
    x.copy_(torch.randn(16, generator=torch.Generator().manual_seed(5)))
    assert x.data_ptr() % 4 == 2
    x.requires_grad_()
    want = torch.autograd.grad((x * x).tanh().sum(), x)[0]
    with manager(nn.Identity()) as mgr:
        with mgr:
            loss = (x * x).tanh().sum()
        got = torch.autograd.grad(loss, x)[0]
        assert torch.equal(got, want)
        last = mgr.stats.last
        assert last.records_kept >= 2  # x, twice
        assert last.records_offloaded_cpu >= 1  # x * x (a tensor of its own) still goes
        assert_nothing_live(mgr)


def test_a_small_whole_read_of_a_freed_record_or_a_closed_tier_raises() -> None:
    """NOTE [ Small copies ]: the read under the lock still refuses a freed record (its region
    may be another record's by then) and a closed tier, and copies nothing."""
    with storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool:
        tier = storage.HostTier(pool)
        x = torch.randn(4, 4)
        h = tier._write_whole(x, 64, _key(x))
        tier.free(h)
        y = torch.randn(4, 4)
        other = tier._write_whole(y, 64, _key(y))  # h's region, reused
        out = torch.zeros(4, 4)
        with pytest.raises(storage.StorageError, match="freed"):
            tier._read_now(h, out, _key(out))
        assert torch.equal(out, torch.zeros(4, 4))
        tier._read_whole(other, out, _key(out)).wait()
        assert torch.equal(out, y)
        lent = tier._write_whole(x, 64, _key(x))
        assert lent.region is not None  # asked for: kept by the handle once freed
        tier.free(lent)
        with pytest.raises(storage.StorageError, match="freed"):
            tier._read_now(lent, out, _key(out))
        assert torch.equal(out, y)
        tier.close()
        with pytest.raises(storage.StorageError, match="closed"):
            tier._read_now(other, out, _key(out))
