"""Default byte budgets: host memory and disk belong to the node, not to one process.

Every rank on a node computes its default the same way and takes an equal share (half the
resource, split over the local ranks; :func:`rank_share_bytes`), so the RAM (or the disk) is not
promised once per rank. psutil ignores cgroup limits, so the cgroup's headroom is read too
(:func:`cgroup_memory`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from offload.storage._units import check_count

# The share of a node resource all ranks together take by default is 1 / _SHARE_DIVISOR: the
# rest is left to the framework, the data loader and the page cache.
_SHARE_DIVISOR = 2
# cgroup v1 spells "no limit" as a huge page-aligned number (2**63 - page size; PAGE_COUNTER_MAX
# times the page size).
_V1_UNLIMITED = 1 << 62


@dataclasses.dataclass(frozen=True, kw_only=True)
class CgroupMemory:
    """This process's memory cgroup, as :func:`cgroup_memory` read it.

    Attributes:
        version: 2 (``memory.max``/``memory.current``) or 1 (``memory.limit_in_bytes``/
            ``memory.usage_in_bytes``).
        path: the process's cgroup directory (the deepest level of the walk that exists).
        limit_bytes: the tightest limit of the cgroup and its ancestors; ``None`` when no level
            sets one.
        usage_bytes: the usage of the deepest level that reports one.
        headroom_bytes: the smallest ``limit - usage`` over the levels that set a limit (a parent's
            usage includes its other children); ``None`` when no level sets a limit.

    Example:
        >>> cg = CgroupMemory(version=2, path="/sys/fs/cgroup/job", limit_bytes=4 << 30,
        ...                   usage_bytes=1 << 30, headroom_bytes=3 << 30)
        >>> dataclasses.asdict(cg)["headroom_bytes"] == 3 << 30
        True
    """

    version: int
    path: str
    limit_bytes: int | None
    usage_bytes: int | None
    headroom_bytes: int | None


def local_world_size() -> int:
    """How many ranks share this node: ``LOCAL_WORLD_SIZE``, else the visible GPUs when
    ``torch.distributed`` is initialised, else 1.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set but is not a positive integer.

    Example:
        >>> local_world_size() >= 1
        True
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is not None:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={value!r} is not a positive integer; set it to the number of "
                "ranks on this node (torchrun does), or unset it"
            )
        return n
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import torch

        return max(1, torch.cuda.device_count())
    return 1


def rank_share_bytes(node_bytes: int, local_ranks: int | None = None) -> int:
    """One rank's default share of a node resource: half of ``node_bytes``, split evenly over the
    local ranks (rounded down; a negative amount counts as 0).

    Args:
        node_bytes: what the node has left (available RAM, free disk space).
        local_ranks: ranks sharing it; ``None`` means :func:`local_world_size`.

    Raises:
        TypeError: ``local_ranks`` is not an int (a float, a bool).
        ValueError: ``local_ranks`` is below 1.

    Example:
        >>> rank_share_bytes(64 << 30, local_ranks=4) == 8 << 30
        True
    """
    if local_ranks is None:
        local_ranks = local_world_size()
    check_count(local_ranks, name="local_ranks", minimum=1)
    return max(0, int(node_bytes)) // _SHARE_DIVISOR // local_ranks


def default_cpu_budget_bytes() -> int:
    """Host bytes this rank may keep: 0.5 x min(available RAM, cgroup headroom) / local ranks.

    The cgroup headroom is that of :func:`cgroup_memory`: ``memory.max - memory.current`` (v2) or
    ``memory.limit_in_bytes - memory.usage_in_bytes`` (v1) of this process's cgroup and its
    ancestors, when a limit is set. The share is :func:`rank_share_bytes`.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set but is not a positive integer.

    Example:
        >>> default_cpu_budget_bytes() > 0
        True
    """
    import psutil

    available = int(psutil.virtual_memory().available)
    headroom = cgroup_memory_headroom_bytes()
    if headroom is not None:
        available = min(available, headroom)
    return rank_share_bytes(available, local_world_size())


def default_nvme_budget_bytes(directory: str | os.PathLike[str]) -> int:
    """Disk bytes this rank may use under ``directory``: 0.5 x its free space / local ranks.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set but is not a positive integer.

    Example:
        >>> import tempfile
        >>> default_nvme_budget_bytes(tempfile.gettempdir()) >= 0
        True
    """
    import psutil

    return rank_share_bytes(psutil.disk_usage(os.fspath(directory)).free, local_world_size())


def cgroup_memory_headroom_bytes(root: str = "/") -> int | None:
    """Bytes this process's memory cgroup (and its ancestors) still allow, or ``None`` if unlimited.

    Args:
        root: the file system root to read ``/proc`` and the cgroup mounts under (tests point it
            at a synthetic tree).
    """
    cg = cgroup_memory(root)
    return None if cg is None else cg.headroom_bytes


def cgroup_memory(root: str | os.PathLike[str] = "/") -> CgroupMemory | None:
    """This process's memory cgroup: version, tightest limit, usage and headroom.

    psutil reads ``/proc/meminfo``, which knows nothing of container limits. The process's cgroup
    is found from ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (v2 and v1 memory mounts);
    the walk goes from it up to the mount's root, because every ancestor's limit applies. Where
    several mounts show memory files (the same hierarchy mounted twice), the one with the least
    headroom is reported. A container without its own cgroup namespace sees the host's path,
    which does not exist under the mount: the walk then starts at the deepest level that does.

    Args:
        root: the file system root to read ``proc/self`` and the cgroup mounts under (tests point
            it at a synthetic tree).

    Returns:
        A :class:`CgroupMemory`, or ``None`` when no memory cgroup shows (no ``/proc``, no cgroup
        mount, or no memory files on the walk).

    Example:
        >>> cg = cgroup_memory()
        >>> cg is None or cg.version in (1, 2)
        True
    """
    root = os.fspath(root)
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            memberships = f.read().splitlines()
        with open(os.path.join(root, "proc/self/mountinfo")) as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    found: list[CgroupMemory] = []
    for mount_root, mount_point, fstype, options in _cgroup_mounts(mounts):
        if fstype == "cgroup2":
            version = 2
            path = _membership(memberships, lambda controllers, hid: hid == "0")
            limit_file, usage_file = "memory.max", "memory.current"
        elif fstype == "cgroup" and "memory" in options:
            version = 1
            path = _membership(memberships, lambda controllers, hid: "memory" in controllers)
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        if path is None:
            continue
        top = os.path.normpath(os.path.join(root, mount_point.lstrip("/")))
        rel = os.path.relpath(path, mount_root) if _is_within(path, mount_root) else "."
        reading = _walk(
            version, top, os.path.normpath(os.path.join(top, rel)), limit_file, usage_file
        )
        if reading is not None:
            found.append(reading)
    if not found:
        return None
    # Least headroom first (unlimited last), then v2 before v1.
    return min(found, key=lambda r: (r.headroom_bytes is None, r.headroom_bytes or 0, -r.version))


def _walk(
    version: int, top: str, leaf: str, limit_file: str, usage_file: str
) -> CgroupMemory | None:
    """Read ``leaf`` and its ancestors up to ``top`` (the mount point); None when no level has
    memory files."""
    path = limit = usage = headroom = None
    seen = False
    directory = leaf
    while True:
        if path is None and os.path.isdir(directory):
            path = directory
        limit_text = _read_text(os.path.join(directory, limit_file))
        usage_text = _read_text(os.path.join(directory, usage_file))
        seen = seen or limit_text is not None or usage_text is not None
        lim, use = _to_int(limit_text), _to_int(usage_text)  # "max" (v2's no limit) -> None
        if usage is None:
            usage = use
        if lim is not None and lim < _V1_UNLIMITED:
            limit = lim if limit is None else min(limit, lim)
            if use is not None:
                room = max(0, lim - use)
                headroom = room if headroom is None else min(headroom, room)
        if directory == top or not directory.startswith(top):
            break
        directory = os.path.dirname(directory)
    if not seen:
        return None
    return CgroupMemory(
        version=version,
        path=path or top,
        limit_bytes=limit,
        usage_bytes=usage,
        headroom_bytes=headroom,
    )


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _to_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_mounts(lines: list[str]) -> list[tuple[str, str, str, set[str]]]:
    out = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        options = set(tail[2].split(",")) | set(fields[5].split(",") if len(fields) > 5 else ())
        out.append((_unescape(fields[3]), _unescape(fields[4]), tail[0], options))
    return out


def _membership(lines: list[str], match: Callable[[set[str], str], bool]) -> str | None:
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if match(set(controllers.split(",")), hid):
            return path or "/"
    return None


def _is_within(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
