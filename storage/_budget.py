"""Default byte budgets: host memory and disk belong to the node, not to one process.

Every rank on a node computes its default the same way and takes an equal share, so the RAM (or
the disk) is not promised once per rank. psutil ignores cgroup limits, so the cgroup's headroom is
read too.
"""

from __future__ import annotations

import os
from collections.abc import Callable

_SHARE = 0.5
# cgroup v1 spells "no limit" as a huge page-aligned number (2**63 - 4096 on x86-64).
_V1_UNLIMITED = 1 << 62


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
            raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a positive integer")
        return n
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import torch

        return max(1, torch.cuda.device_count())
    return 1


def default_cpu_budget_bytes() -> int:
    """Host bytes this rank may keep: 0.5 x min(available RAM, cgroup headroom) / local ranks.

    The cgroup headroom is ``memory.max - memory.current`` (v2) or ``memory.limit_in_bytes -
    memory.usage_in_bytes`` (v1) of this process's cgroup and its ancestors, when a limit is set.

    Example:
        >>> default_cpu_budget_bytes() > 0
        True
    """
    import psutil

    available = psutil.virtual_memory().available
    headroom = cgroup_memory_headroom_bytes()
    if headroom is not None:
        available = min(available, headroom)
    return int(_SHARE * max(0, available)) // local_world_size()


def default_nvme_budget_bytes(directory: str | os.PathLike[str]) -> int:
    """Disk bytes this rank may use under ``directory``: 0.5 x its free space / local ranks.

    Example:
        >>> import tempfile
        >>> default_nvme_budget_bytes(tempfile.gettempdir()) >= 0
        True
    """
    import psutil

    return int(_SHARE * psutil.disk_usage(os.fspath(directory)).free) // local_world_size()


def cgroup_memory_headroom_bytes(root: str = "/") -> int | None:
    """Bytes this process's memory cgroup (and its ancestors) still allow, or ``None`` if unlimited.

    Args:
        root: the file system root to read ``/proc`` and the cgroup mounts under (tests point it
            at a synthetic tree).
    """
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            memberships = f.read().splitlines()
        with open(os.path.join(root, "proc/self/mountinfo")) as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    best: int | None = None
    for mount_root, mount_point, fstype, options in _cgroup_mounts(mounts):
        if fstype == "cgroup2":
            path = _membership(memberships, lambda controllers, hid: hid == "0")
            limit_file, usage_file = "memory.max", "memory.current"
        elif fstype == "cgroup" and "memory" in options:
            path = _membership(memberships, lambda controllers, hid: "memory" in controllers)
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        if path is None:
            continue
        top = os.path.join(root, mount_point.lstrip("/"))
        rel = os.path.relpath(path, mount_root) if _is_within(path, mount_root) else "."
        directory = os.path.normpath(os.path.join(top, rel))
        while True:
            headroom = _level_headroom(directory, limit_file, usage_file)
            if headroom is not None:
                best = headroom if best is None else min(best, headroom)
            if directory == top or not directory.startswith(top):
                break
            directory = os.path.dirname(directory)
    return best


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


def _level_headroom(directory: str, limit_file: str, usage_file: str) -> int | None:
    try:
        with open(os.path.join(directory, limit_file)) as f:
            limit_text = f.read().strip()
        if limit_text == "max":
            return None
        limit = int(limit_text)
        if limit >= _V1_UNLIMITED:
            return None
        with open(os.path.join(directory, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return max(0, limit - usage)


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
