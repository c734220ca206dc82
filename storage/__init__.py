"""storage: where bytes live off the GPU.

A pinned (or, without CUDA, plain) host memory pool carved into 4 KiB-aligned regions, an NVMe
tier that keeps records in a private, unlinked, checksummed spill file, and the small interface
both implement (:class:`Tier`, returning :class:`Transfer` handles whose ``.wait()`` is the only
synchronisation). Knows nothing about autograd; never imports ``offload`` or ``lifecycle``.
Importing it starts no thread, touches no file and creates no CUDA context.
"""

from offload.storage._bandwidth import measure_disk_bandwidth
from offload.storage._budget import (
    CgroupMemory,
    cgroup_memory,
    default_cpu_budget_bytes,
    default_nvme_budget_bytes,
    local_world_size,
    rank_share_bytes,
)
from offload.storage._errors import ChecksumError, StorageError, StorageFullError
from offload.storage._host_tier import HostTier
from offload.storage._kvikio import kvikio_available
from offload.storage._nvme import NvmeTier
from offload.storage._pool import (
    HostPool,
    HostRegion,
    PoolShare,
    claim_shared_host_pool,
    shared_host_pool,
)
from offload.storage._tier import StoredHandle, Tier
from offload.storage._transfer import CopyEngine, Transfer, byte_view, finish_elsewhere
from offload.storage._units import ALIGNMENT_BYTES, CHECKSUM_CHUNK_BYTES, IO_THREADS

__all__ = [
    # host memory
    "HostPool",
    "HostRegion",
    "shared_host_pool",
    "claim_shared_host_pool",
    "PoolShare",
    # tiers
    "HostTier",
    "NvmeTier",
    "StoredHandle",
    "Tier",
    # transfers
    "CopyEngine",
    "Transfer",
    "byte_view",
    "finish_elsewhere",
    # budgets and measurements
    "CgroupMemory",
    "cgroup_memory",
    "default_cpu_budget_bytes",
    "default_nvme_budget_bytes",
    "kvikio_available",
    "local_world_size",
    "measure_disk_bandwidth",
    "rank_share_bytes",
    # constants
    "ALIGNMENT_BYTES",
    "CHECKSUM_CHUNK_BYTES",
    "IO_THREADS",
    # errors
    "ChecksumError",
    "StorageError",
    "StorageFullError",
]
