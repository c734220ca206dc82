"""Node-aware default budgets and the cgroup reader, on synthetic cgroup trees."""

from __future__ import annotations

import collections

import pytest

from offload.storage import (
    CgroupMemory,
    cgroup_memory,
    default_cpu_budget_bytes,
    default_nvme_budget_bytes,
    local_world_size,
    rank_share_bytes,
)
from offload.storage import _budget as budget

GiB = 1 << 30
MiB = 1 << 20
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"


def write_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_takes_the_tightest_level(tmp_path):
    write_tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/job.slice/step\n",
            "proc/self/mountinfo": V2_MOUNT,
            "sys/fs/cgroup/job.slice/step/memory.max": "max\n",
            "sys/fs/cgroup/job.slice/step/memory.current": f"{512 * MiB}\n",
            "sys/fs/cgroup/job.slice/memory.max": f"{4 * GiB}\n",
            "sys/fs/cgroup/job.slice/memory.current": f"{1 * GiB}\n",
            "sys/fs/cgroup/memory.max": f"{8 * GiB}\n",  # looser, and no usage: no headroom
        },
    )
    assert cgroup_memory(tmp_path) == CgroupMemory(
        version=2,
        path=str(tmp_path / "sys/fs/cgroup/job.slice/step"),
        limit_bytes=4 * GiB,  # the tightest limit on the way up
        usage_bytes=512 * MiB,  # the process's own cgroup
        headroom_bytes=3 * GiB,  # the job's limit minus the job's usage
    )
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) == 3 * GiB


def test_cgroup_v1_and_unlimited(tmp_path):
    files = {
        "proc/self/cgroup": "5:cpu:/\n4:memory:/process_api/abc\n",
        "proc/self/mountinfo": (
            "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
            "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        ),
        "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": "9223372036854771712\n",
        "sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes": "1000\n",
    }
    write_tree(tmp_path, files)
    cg = cgroup_memory(tmp_path)
    assert cg is not None and cg.version == 1 and cg.usage_bytes == 1000
    assert cg.limit_bytes is None and cg.headroom_bytes is None  # v1's "no limit"
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) is None
    (tmp_path / "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes").write_text(
        f"{2 * GiB}\n"
    )
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) == 2 * GiB - 1000


def test_cgroup_v1_without_a_namespace_reads_the_mount_point(tmp_path):
    # Without a cgroup namespace the process sees the host's path, which does not exist under
    # the container's mount: its cgroup is the mount point itself.
    write_tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/docker/abc\n1:cpu:/docker/abc\n0::/\n",
            "proc/self/mountinfo": (
                "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
            ),
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GiB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": "100\n",
        },
    )
    cg = cgroup_memory(tmp_path)
    assert cg == CgroupMemory(
        version=1,
        path=str(tmp_path / "sys/fs/cgroup/memory"),
        limit_bytes=GiB,
        usage_bytes=100,
        headroom_bytes=GiB - 100,
    )


def test_cgroup_hybrid_reports_the_hierarchy_with_memory_files(tmp_path):
    # systemd's hybrid layout: cgroup2 is mounted without the memory controller, v1 has it.
    write_tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/user.slice\n7:memory:/user.slice\n",
            "proc/self/mountinfo": (
                "30 23 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
                "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            ),
            "sys/fs/cgroup/unified/user.slice/cgroup.procs": "1\n",
            "sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes": f"{GiB}\n",
            "sys/fs/cgroup/memory/user.slice/memory.usage_in_bytes": "0\n",
        },
    )
    cg = cgroup_memory(tmp_path)
    assert cg is not None and (cg.version, cg.headroom_bytes) == (1, GiB)


def test_cgroup_namespace_mount_root(tmp_path):
    # Inside a container the mount's root is the container's own cgroup.
    write_tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/docker/abc\n",
            "proc/self/mountinfo": "40 30 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n",
            "sys/fs/cgroup/memory.max": f"{GiB}\n",
            "sys/fs/cgroup/memory.current": "0\n",
        },
    )
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) == GiB
    assert cgroup_memory(tmp_path).path == str(tmp_path / "sys/fs/cgroup")


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert cgroup_memory(tmp_path) is None
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) is None
    # A cgroup mount whose walk finds no memory files shows no memory cgroup either.
    write_tree(tmp_path, {"proc/self/cgroup": "0::/a\n", "proc/self/mountinfo": V2_MOUNT})
    (tmp_path / "sys/fs/cgroup/a").mkdir(parents=True)
    assert cgroup_memory(tmp_path) is None


def test_rank_share_is_half_split_over_local_ranks():
    assert rank_share_bytes(64 * GiB, 4) == 8 * GiB
    assert rank_share_bytes(7, 2) == 1  # rounded down, in integers (no float rounding)
    assert rank_share_bytes((1 << 62) + 2, 1) == (1 << 61) + 1
    assert rank_share_bytes(-5, 1) == 0
    for bad in (0, -1):
        with pytest.raises(ValueError, match="local_ranks"):
            rank_share_bytes(GiB, bad)
    for bad in (1.5, 2.0, True):  # no int: a TypeError (it was a ValueError)
        with pytest.raises(TypeError, match="local_ranks must be an int >= 1; got"):
            rank_share_bytes(GiB, bad)


def test_cpu_budget_is_half_the_tighter_limit_split_over_local_ranks(monkeypatch):
    import psutil

    memory = collections.namedtuple("memory", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(available=64 * GiB))
    monkeypatch.setattr(budget, "cgroup_memory_headroom_bytes", lambda root="/": 16 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_cpu_budget_bytes() == 2 * GiB
    monkeypatch.setattr(budget, "cgroup_memory_headroom_bytes", lambda root="/": None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_cpu_budget_bytes() == 32 * GiB


def test_real_defaults_are_positive(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size() == 1
    assert default_cpu_budget_bytes() > 0
    one = default_nvme_budget_bytes(tmp_path)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert 0 < default_nvme_budget_bytes(tmp_path) <= one // 8 + (1 << 24)


@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_bad_local_world_size_is_named(monkeypatch, value):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE={value!r} is not a positive integer"):
        local_world_size()
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        default_cpu_budget_bytes()
