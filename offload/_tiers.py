"""What the executor does differently per tier, dispatched on the tier's type, not its name.

A tier has one name inside and out: the user's (``tiers=("cpu", "nvme")``), the stats'
(``records_offloaded_cpu``), the plans' (``Placement.CPU``) and ``storage.HostTier.name``. What
differs between tiers for the executor (charging ``cpu_budget``, what a pinned D2H region
becomes, where a reload copies from, which stats count a record) is its :class:`TierKind`'s.

    >>> from offload import storage
    >>> with storage.HostPool(1 << 20, slab_bytes=1 << 20) as pool, storage.HostTier(pool) as t:
    ...     kind_of(t).in_host_memory, kind_of(t).charge(100), t.name
    (True, 4096, 'cpu')
"""

from __future__ import annotations

from typing import ClassVar

from offload import storage
from offload._stats import StepStats
from offload.storage._units import round_up


def cpu_charge(nbytes: int) -> int:
    """What a record of ``nbytes`` takes from ``cpu_budget``: its host region, padded as the
    pool pads it (``HostPool.allocate``). Counted unpadded, one manager's padding took the
    shared pool's room that another manager had claimed for its own budget."""
    return round_up(nbytes)


class TierKind:
    """How the executor uses one type of tier (one instance per type, see :func:`kind_of`)."""

    __slots__ = ()

    # Records live in host-pool regions: they are charged to ``cpu_budget``, a D2H copy's pinned
    # region is adopted as the record, and a reload copies straight from it. Otherwise records
    # live elsewhere (a file): a pinned region is only read by the write (NVMe staging), and a
    # reload reads into memory of its own first (see NOTE [ NVMe reloads land early ]).
    in_host_memory: ClassVar[bool]

    def charge(self, nbytes: int) -> int:
        """What a record of ``nbytes`` in this tier takes from ``cpu_budget``."""
        return cpu_charge(nbytes) if self.in_host_memory else 0

    def count(self, stats: StepStats, nbytes: int, sign: int = 1) -> None:
        """Count a record of ``nbytes`` stored in this tier (``sign`` 1) or taken back (-1)."""
        raise NotImplementedError


class _Cpu(TierKind):
    __slots__ = ()
    in_host_memory = True

    def charge(self, nbytes: int) -> int:
        return round_up(nbytes)  # cpu_charge, one call less (once per record)

    def count(self, stats: StepStats, nbytes: int, sign: int = 1) -> None:
        stats.bytes_offloaded_cpu += sign * nbytes
        stats.records_offloaded_cpu += sign


class _Nvme(TierKind):
    __slots__ = ()
    in_host_memory = False

    def charge(self, nbytes: int) -> int:
        return 0

    def count(self, stats: StepStats, nbytes: int, sign: int = 1) -> None:
        stats.bytes_offloaded_nvme += sign * nbytes
        stats.records_offloaded_nvme += sign


CPU: TierKind = _Cpu()
NVME: TierKind = _Nvme()


def kind_of(tier: storage.Tier) -> TierKind:
    """``tier``'s kind: the cpu tier's (``HostTier``), else a file tier's (``NvmeTier``, and
    any other tier that keeps its records outside the host pool)."""
    return CPU if isinstance(tier, storage.HostTier) else NVME
