"""Node-aware default budgets and the cgroup reader, on synthetic cgroup trees."""

from __future__ import annotations

import collections

import pytest

import storage._budget as budget
from storage import default_cpu_budget_bytes, default_nvme_budget_bytes, local_world_size

GiB = 1 << 30


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
            "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n",
            "sys/fs/cgroup/job.slice/step/memory.max": "max\n",
            "sys/fs/cgroup/job.slice/step/memory.current": "123\n",
            "sys/fs/cgroup/job.slice/memory.max": f"{4 * GiB}\n",
            "sys/fs/cgroup/job.slice/memory.current": f"{1 * GiB}\n",
        },
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
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) is None
    (tmp_path / "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes").write_text(
        f"{2 * GiB}\n"
    )
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) == 2 * GiB - 1000


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


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert budget.cgroup_memory_headroom_bytes(str(tmp_path)) is None


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


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_local_world_size_is_named(monkeypatch, value):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        local_world_size()
