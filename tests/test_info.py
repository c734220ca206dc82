"""``offload info``: node facts, disk probe on real files, cgroup parsing, the CLI's exit codes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from offload._cli_info import add_parser
from offload._info import (
    ALIGN_BYTES,
    NvmeDirError,
    cgroup_memory,
    check_nvme_dir,
    collect_info,
    format_info,
    pcie_gb_per_s,
    probe_disk,
)

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="offload")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


@pytest.fixture(scope="module")
def disk_info(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("nvme")
    return d, collect_info(nvme_dir=d, probe_bytes="8MiB")


def test_collect_info_measures_the_disk(disk_info: tuple[Path, dict]) -> None:
    d, info = disk_info
    nvme = info["nvme"]
    assert nvme["path"] == str(d.resolve())
    assert 0 < nvme["free_bytes"] <= nvme["total_bytes"] == psutil.disk_usage(str(d)).total
    assert nvme["probe_bytes"] == 8 * MiB
    assert nvme["write_gb_per_s"] > 0 and nvme["read_gb_per_s"] > 0
    assert nvme["io_mode"] == ("O_DIRECT" if nvme["o_direct"] else nvme["io_mode"])
    assert nvme["default_nvme_bytes"] == int(0.5 * nvme["free_bytes"] / nvme["local_ranks"])
    assert list(d.iterdir()) == []  # the probe file is gone
    assert json.loads(json.dumps(info)) == info  # plain JSON types only


def test_host_memory_and_default_budget(disk_info: tuple[Path, dict]) -> None:
    host = disk_info[1]["host_memory"]
    assert 0 < host["available_bytes"] <= host["total_bytes"]
    assert host["headroom_bytes"] <= host["available_bytes"]
    cg = host["cgroup"]
    if cg is not None and cg["headroom_bytes"] is not None:
        assert host["headroom_bytes"] <= cg["headroom_bytes"]
    assert host["default_cpu_budget_bytes"] == int(
        0.5 * host["headroom_bytes"] / host["local_ranks"]
    )


def test_local_ranks_split_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    host = collect_info()["host_memory"]
    assert host["local_ranks"] == 4
    assert host["default_cpu_budget_bytes"] == int(0.5 * host["headroom_bytes"] / 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    host = collect_info()["host_memory"]
    assert host["local_ranks"] == 1 and "not an integer" in host["local_ranks_source"]


def test_format_info_has_the_key_lines(disk_info: tuple[Path, dict]) -> None:
    d, info = disk_info
    text = format_info(info)
    for needle in (
        "python",
        f"torch               {torch.__version__}",
        "CUDA available",
        "PCIe link (NVML)",
        "pinned pool budget",
        "0.5 x min(available, cgroup headroom) / local ranks",
        str(d.resolve()),
        "O_DIRECT",
        "write",
        "read",
        "extra that fits",
        "0.4 s per GiB (measured on an H200 host)",
        "profile step",
    ):
        assert needle in text, needle
    assert "not measured (pass --nvme-dir DIR" in format_info(collect_info())


@no_cuda
def test_cpu_only_report_does_not_initialise_cuda(disk_info: tuple[Path, dict]) -> None:
    info = disk_info[1]
    assert info["cuda_available"] is False
    assert info["cuda_build"] == torch.version.cuda
    assert info["gpus"] == []
    assert "skipped" in info["pcie_measured"]
    assert info["kvikio"]["usable"] is False
    assert not torch.cuda.is_initialized()
    text = format_info(info)
    assert "CUDA available      no" in text
    assert "not measured: CUDA is not available" in text


def test_kvikio_extra_follows_the_cuda_build() -> None:
    kv = collect_info()["kvikio"]
    major = torch.version.cuda.split(".")[0] if torch.version.cuda else None
    assert kv["extra"] == {"12": "gds-cu12", "13": "gds-cu13"}.get(major)
    assert kv["python_ok"] is (sys.version_info >= (3, 11))
    if not kv["importable"]:
        assert kv["error"] and kv["version"] is None


def test_probe_disk_buffered_path(tmp_path: Path) -> None:
    r = probe_disk(tmp_path, MiB + 1, direct=False, threads=2)
    assert r["probe_bytes"] == MiB + ALIGN_BYTES  # rounded up to the O_DIRECT alignment
    assert r["o_direct"] is False and r["io_mode"].startswith("buffered")
    assert r["write_gb_per_s"] > 0 and r["read_gb_per_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_check_nvme_dir_names_the_problem(tmp_path: Path) -> None:
    assert check_nvme_dir(tmp_path) == tmp_path.resolve()
    with pytest.raises(NvmeDirError, match="does not exist") as e:
        check_nvme_dir(tmp_path / "missing")
    assert e.value.path == str(tmp_path / "missing")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NvmeDirError, match="is not a directory"):
        check_nvme_dir(f)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0500 directory")
def test_unwritable_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    try:
        assert _cli(["info", "--nvme-dir", str(d)]) == 2
    finally:
        d.chmod(0o700)
    assert f"--nvme-dir {d}: is not writable" in capsys.readouterr().err


def test_pcie_theoretical_bandwidth() -> None:
    assert round(pcie_gb_per_s(5, 16), 1) == 63.0
    assert round(pcie_gb_per_s(4, 16), 2) == 31.51
    assert pcie_gb_per_s(1, 1) == 0.25  # 2.5 GT/s with 8b/10b
    assert pcie_gb_per_s(None, 16) is None and pcie_gb_per_s(4, None) is None


def _write_cgroup(root: Path, rel: str, files: dict[str, str]) -> None:
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text + "\n")


def test_cgroup_v2_tightest_ancestor(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    _write_cgroup(mount, "job", {"memory.max": str(2 << 30), "memory.current": str(1 << 30)})
    _write_cgroup(mount, "job/step", {"memory.max": "max", "memory.current": str(512 * MiB)})
    (tmp_path / "cgroup").write_text("0::/job/step\n")
    (tmp_path / "mountinfo").write_text(
        f"30 23 0:27 / {mount} rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    cg = cgroup_memory(tmp_path / "cgroup", tmp_path / "mountinfo")
    assert cg == {
        "version": 2,
        "path": str(mount / "job/step"),
        "limit_bytes": 2 << 30,
        "usage_bytes": 512 * MiB,
        "headroom_bytes": 1 << 30,  # the job's limit minus the job's usage
    }


def test_cgroup_v1_unlimited_and_host_path(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    files = {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "100"}
    _write_cgroup(mount, ".", files)
    # Without a cgroup namespace the process shows the host's path; its cgroup is the mount.
    (tmp_path / "cgroup").write_text("4:memory:/docker/abc\n1:cpu:/docker/abc\n0::/\n")
    (tmp_path / "mountinfo").write_text(
        f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n"
    )
    cg = cgroup_memory(tmp_path / "cgroup", tmp_path / "mountinfo")
    assert cg is not None and cg["version"] == 1
    assert cg["limit_bytes"] is None and cg["headroom_bytes"] is None
    assert cg["usage_bytes"] == 100
    assert cgroup_memory(tmp_path / "absent", tmp_path / "mountinfo") is None


def test_cli_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["info", "--nvme-dir", str(tmp_path), "--probe-bytes", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert "NVMe directory" in out and str(tmp_path.resolve()) in out
    assert _cli(["info", "--nvme-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"--nvme-dir {tmp_path / 'nope'}: does not exist" in err
    with pytest.raises(SystemExit) as e:
        _cli(["info", "--probe-bytes", "lots"])
    assert e.value.code == 2


def test_python_m_offload_info_json(tmp_path: Path) -> None:
    r = _python(
        "-m", "offload", "info", "--nvme-dir", str(tmp_path), "--json", "--probe-bytes", "8MiB"
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["nvme"]["path"] == str(tmp_path.resolve())
    assert info["nvme"]["write_gb_per_s"] > 0 and info["nvme"]["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == []


def test_import_is_free_and_bad_dir_exits_2(tmp_path: Path) -> None:
    # One interpreter for both checks (importing torch is most of a subprocess's time): the
    # imports start nothing, then `python -m offload info` (run_module) rejects a missing dir.
    missing = tmp_path / "no-such-dir"
    code = (
        "import runpy, sys, torch, offload._info, offload._cli_info\n"
        "assert not torch.cuda.is_initialized(), 'import initialised CUDA'\n"
        # torch.cuda imports pynvml itself, so only kvikio (2 GB of CUDA libraries) is checked.
        "assert 'kvikio' not in sys.modules, 'import loaded kvikio'\n"
        f"sys.argv = ['offload', 'info', '--nvme-dir', {str(missing)!r}]\n"
        "runpy.run_module('offload', run_name='__main__', alter_sys=True)\n"
    )
    r = _python("-c", code)
    assert r.returncode == 2, r.stderr
    assert str(missing) in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr
