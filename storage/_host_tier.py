"""The cpu tier: a record's bytes stay in a host pool region."""

from __future__ import annotations

from typing import Any

import torch

from offload.storage._pool import HostPool, HostRegion, shared_host_pool
from offload.storage._tier import StoredHandle, Tier, check_nbytes, destination_bytes, source_bytes
from offload.storage._transfer import CopyEngine, Transfer, check_waitable, wait_for


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

    @property
    def pool(self) -> HostPool:
        return self._pool

    @property
    def capacity_bytes(self) -> int:
        return self._pool.capacity_bytes

    def write(
        self, source: HostRegion | torch.Tensor, nbytes: int | None = None, *, after: object = None
    ) -> StoredHandle:
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

    def read(self, handle: StoredHandle, into: HostRegion | torch.Tensor) -> Transfer:
        self._check_own(handle)
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
        if region is not None and not region.released:
            self._engine.poison(region.span)
            region.release()

    def _stop(self) -> None:
        if self._own_engine:
            self._engine.close()
