"""The cpu tier: a record's bytes stay in a host pool region."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from offload.storage._errors import StorageError
from offload.storage._pool import HostPool, HostRegion, shared_host_pool
from offload.storage._tier import (
    _WRITTEN,
    StoredHandle,
    Tier,
    check_nbytes,
    destination_bytes,
    source_bytes,
)
from offload.storage._transfer import CopyEngine, Transfer, byte_view, check_waitable, wait_for

# What a read done at once returns (NOTE [ Copies done at once ]): a transfer holds nothing
# but its finished future and a label, so one serves them all.
_READ_DONE = Transfer.completed("host read")


def read_at_once(transfer: Transfer) -> bool:
    """Whether a read's ``transfer`` completed in its call, without error (NOTE [ Copies done
    at once ]); False says nothing more."""
    return transfer is _READ_DONE


# NOTE [ Copies done at once ]
#     With an engine that is not deferred (the default) every copy runs on the calling thread
#     before the call returns, so a write of a CPU tensor (no ``after``) and a read of a record
#     whose write completed, into a CPU tensor, copy in the call itself: the same steps as
#     ``Tier._run`` (the record counted pending while the copy runs, so ``free`` and ``close``
#     wait for it; an error freeing a write's record and carried by its transfer), without the
#     closure, the future chain and the transfer each copy cost there. On a CPU "device" the
#     executor takes these paths once per saved tensor. A region source, an ``after``, and a
#     deferred engine (the ordering tests) take ``_run``.


class HostTier(Tier):
    """Records kept in (pinned) host memory, one pool region each.

    ``write(region)`` adopts the region as the record's storage (the executor copies D2H into a
    region on its own stream, then hands it over); ``write(cpu_tensor)`` copies into a new region.
    ``handle.region`` exposes the bytes so a reload can copy H2D straight from them.

    Args:
        pool: where regions come from; ``None`` means :func:`shared_host_pool`.
        copy_engine: runs the copies; ``CopyEngine(deferred=True)`` for ordering tests.

    Example:
        >>> tier = HostTier(HostPool(1 << 20, slab_bytes=1 << 20))
        >>> x = torch.randn(10)
        >>> h = tier.write(x)
        >>> out = torch.empty(10)
        >>> tier.read(h, out).wait()
        >>> torch.equal(out, x)
        True
        >>> tier.free(h); tier.close()
    """

    name = "cpu"  # the tier users name in ``tiers=("cpu", ...)``

    def __init__(self, pool: HostPool | None = None, *, copy_engine: CopyEngine | None = None):
        super().__init__()
        self._pool = pool if pool is not None else shared_host_pool()
        self._own_engine = copy_engine is None
        self._engine = copy_engine if copy_engine is not None else CopyEngine()
        # NOTE [ Copies done at once ]: an engine that is not deferred copies on the calling
        # thread, so a tensor write and a read of a stored record copy here, without a closure,
        # a future chain or a transfer of their own (once per saved tensor: the hot path).
        self._now = not self._engine.deferred
        # Whole tensors copied as themselves (``_write_whole``, ``_read_whole``) where copies are
        # done at once and no subclass made ``write`` or ``read`` its own (that one is called).
        cls = type(self)
        self._whole = self._now and cls.write is HostTier.write and cls.read is HostTier.read

    @property
    def pool(self) -> HostPool:
        return self._pool

    @property
    def capacity_bytes(self) -> int:
        return self._pool.capacity_bytes

    def write(
        self, source: HostRegion | torch.Tensor, nbytes: int | None = None, *, after: object = None
    ) -> StoredHandle:
        if after is None and self._now and type(source) is torch.Tensor and source.is_cpu:
            return self._write_now(source, nbytes)
        check_waitable(after)
        self._check_open()
        start: Any
        if isinstance(source, HostRegion):
            n = check_nbytes(nbytes, source.nbytes, "the region")
            handle = StoredHandle(self, n, charge=source.capacity_bytes, region=source)
            start = (
                None if after is None else (lambda: self._engine.submit(lambda: wait_for(after)))
            )
        else:
            if isinstance(source, torch.Tensor) and source.device.type != "cpu":
                raise TypeError(
                    f"the cpu tier takes host bytes; got a {source.device} tensor. Copy it into a "
                    "HostRegion on your D2H stream and pass the region with after=<its event>."
                )
            data, n = source_bytes(source, nbytes)
            region = self._pool.allocate(n)
            handle = StoredHandle(self, n, charge=region.capacity_bytes, region=region)
            dst, src = region.tensor, data[:n]

            def copy() -> None:
                wait_for(after)
                dst.copy_(src)

            start = lambda: self._engine.submit(copy)  # noqa: E731
        try:
            self._register(handle)
        except BaseException:
            if not isinstance(source, HostRegion):
                handle._region.release()  # type: ignore[union-attr]
            raise
        if start is not None:
            handle._write = self._run(handle, "host write", None, start, failure_frees=True)
        return handle

    def _write_whole(self, source: torch.Tensor, nbytes: int, key: Any) -> StoredHandle:
        """``write(source)`` of a plain contiguous CPU tensor of ``nbytes`` bytes without a
        conjugate or negative bit, ``key`` its ``(dtype, size, stride)``: copied as itself into
        the region's view of its shape (NOTE [ Typed copies ] in _pool.py). The executor's
        whole tensors (NOTE [ Whole tensors ] in offload/_family.py), which it checked."""
        if not self._whole or not source.is_cpu:
            return self.write(source)
        return self._write_now(source, nbytes, key)

    def _write_now(self, source: torch.Tensor, nbytes: int | None, key: Any = None) -> StoredHandle:
        """``write(source)`` with the copy done here (NOTE [ Copies done at once ]); ``key``:
        see ``_write_whole``."""
        if key is not None:
            assert nbytes is not None
            data, n = source, nbytes
            size = n
        else:
            if source.dtype is torch.uint8 and source.dim() == 1 and source.is_contiguous():
                data = source  # its bytes already: byte_view's first case
            else:
                data = byte_view(source)  # (source_bytes, for a tensor)
            size = data.numel()
            n = size if nbytes is None else check_nbytes(nbytes, size, "source")
        region = self._pool.allocate(n)
        # (Its fields, not its properties: a region just allocated is live. Once per record.)
        handle = StoredHandle(self, n, region._capacity, region)
        try:
            self._register(handle)
        except BaseException:
            region.release()
            raise
        handle._own_region = True  # (NOTE [ Reused region objects ] in _pool.py)
        if key is not None:
            error = _copy_whole(region, key, data, True)
        else:
            error = _copy(region._tensor, data if n == size else data[:n])
        if error is not None:
            # As a failed write of the engine: the record is freed, its space back, and its
            # ``written`` re-raises the error.
            self.free(handle)
            handle._write = Transfer.failed(error, "host write")
        return handle

    def _read_whole(self, handle: StoredHandle, into: torch.Tensor, key: Any) -> Transfer:
        """``read(handle, into)`` into a plain contiguous CPU tensor of the record's size, and
        dtype, size and stride ``key``: filled from the region's view of its shape (NOTE
        [ Typed copies ] in _pool.py). The executor's reloads of whole tensors."""
        written = handle._write
        region = handle._region
        if (
            self._whole
            and into.is_cpu
            and type(handle) is StoredHandle
            and handle._tier is self
            and (written is _WRITTEN or written.done())
            and region is not None
            and region._nbytes == handle.nbytes
        ):
            return self._read_now(handle, into, key)
        return self.read(handle, into)

    def _read_now(self, handle: StoredHandle, dst: torch.Tensor, key: Any = None) -> Transfer:
        """``read`` of a stored record with the copy done here (NOTE [ Copies done at once ]);
        ``key``: see ``_read_whole``."""
        n = handle.nbytes
        small = key is not None and _memmove_fits(n, dst)
        with self._lock:
            if self._closed:
                self._check_open()
            if handle._freed:  # (a reused region may be another record's now)
                raise StorageError(f"{handle!r} was freed (or its write failed); it has no bytes")
            if small:
                # NOTE [ Small copies ]: a memmove, under the lock (no free() can run
                # meanwhile, so the read needs no count of its own, nor a release after it).
                region = handle._region
                assert region is not None  # every host record not freed has one
                _memmove(dst.data_ptr(), region._address, n)
                return _READ_DONE
            # As _run's: free() waits for this read, close() for this call.
            handle._pending += 1
            self._starting += 1
        try:
            region = handle._region
            assert region is not None  # every host record has one
            src = region._tensor  # (live: free() waits for this read to release it)
            if key is not None:
                error = _copy_whole(region, key, dst, False)
            else:
                error = _copy(dst, src if region._nbytes == n else src[:n])
        finally:
            with self._lock:
                handle._pending -= 1
                self._starting -= 1
                if self._closed:
                    self._started.notify_all()
                release = handle._freed and self._take_for_release(handle)
            if release:
                self._release(handle)
        return _READ_DONE if error is None else Transfer.failed(error, "host read")

    def read(self, handle: StoredHandle, into: HostRegion | torch.Tensor) -> Transfer:
        if type(handle) is not StoredHandle or handle._tier is not self:  # (once per reload)
            self._check_own(handle)
        written = handle._write
        if (
            self._now
            and (written is _WRITTEN or written.done())
            and type(into) is torch.Tensor
            and into.is_cpu
        ):
            n = handle.nbytes
            if (
                into.dtype is torch.uint8
                and into.dim() == 1
                and into.numel() == n
                and into.is_contiguous()
            ):
                dst = into  # already the bytes to fill (the executor's reloads)
            else:
                dst = destination_bytes(into, n)
            return self._read_now(handle, dst)
        n = handle.nbytes
        if isinstance(into, HostRegion):
            check_nbytes(n, into.nbytes, "into")
            dst = into.tensor[:n]
        else:
            if isinstance(into, torch.Tensor) and into.device.type != "cpu":
                raise TypeError(
                    f"the cpu tier reads into host memory; got a {into.device} tensor. Copy "
                    "handle.region.tensor to the device on your H2D stream instead."
                )
            dst = destination_bytes(into, n)
        region = handle._region
        assert region is not None  # every host record has one

        def copy() -> None:
            # The record cannot be released while this runs: see NOTE [ Transfer ordering ].
            dst.copy_(region.tensor[:n])

        return self._run(
            handle,
            "host read",
            handle._write._future,
            lambda: self._engine.submit(copy),
        )

    def _release(self, handle: StoredHandle) -> None:
        region = handle._region
        if region is not None and not region._released:
            if not self._now:  # (a deferred engine's poisoning; the span is made for it only)
                self._engine.poison(region.span)
            if handle._own_region:  # (NOTE [ Reused region objects ] in _pool.py)
                handle._region = None
                self._pool._release(region, True)
            else:
                region.release()

    def _stop(self) -> None:
        if self._own_engine:
            self._engine.close()


# NOTE [ Small copies ]
# A whole tensor of a few KiB copied into its region, or out of it, is a memcpy of its bytes;
# torch's ``copy_`` of it cost twice that call here (0.94 us for 64 bytes of float32 on the
# 2-core CPU of benchmarks/results/cpu, ``ctypes.memmove`` with both addresses 0.54 us), and
# it runs twice per saved tensor. So one of at most ``_SMALL_COPY_BYTES`` is moved by
# ``ctypes.memmove``, on the calling thread (one thread is what torch's copy of fewer than its
# grain of 32,768 elements takes too); a larger one, or a tensor that is not contiguous or
# not of the record's size (memmove would read or write past it), is torch's. The bytes are
# the same either way: a copy between equal dtypes moves them as they are.
_SMALL_COPY_BYTES = 32 << 10
_memmove = ctypes.memmove


def _memmove_fits(n: int, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are a record's ``n`` bytes for NOTE [ Small copies ]' memmove."""
    return n <= _SMALL_COPY_BYTES and t.nbytes == n and t.is_contiguous()


def _copy_whole(region: HostRegion, key: Any, t: torch.Tensor, into: bool) -> BaseException | None:
    """``t`` copied into the region's view of its shape ``key`` (``into``), else out of it;
    the error returned, as ``_copy``'s (NOTE [ Typed copies ] in _pool.py)."""
    if into and _memmove_fits(region._nbytes, t):  # (a small read: _read_now's own)
        _memmove(region._address, t.data_ptr(), region._nbytes)
        return None
    try:
        shaped = region._shaped(key)
        if into:
            shaped.copy_(t)
        else:
            t.copy_(shaped)
    except BaseException as e:
        return e
    return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> BaseException | None:
    """``dst.copy_(src)``; its error returned, not raised (it belongs to whoever waits)."""
    try:
        dst.copy_(src)
    except BaseException as e:
        return e
    return None
