"""``offload info``: what it collects and how it shows it, and the CLI's exit codes.

The mechanisms it reports on (cgroup parsing, budgets, the disk probe) are tested in
tests/storage/; here only that ``collect_info`` wires them up and formats the result.
"""

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

from offload._info import NvmeDirError, check_nvme_dir, pcie_gb_per_s
from offload.cli._info import add_parser
from offload.cli._node_report import collect_info, format_info
from offload.storage import rank_share_bytes

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")


def _python(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra_env)
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
    assert nvme["probe_bytes"] == 8 * MiB and "probe_note" not in nvme
    assert nvme["write_gb_per_s"] > 0 and nvme["read_gb_per_s"] > 0
    assert 1 <= nvme["io_threads"] <= 4
    if nvme["o_direct"]:
        assert nvme["io_mode"] == "O_DIRECT" and nvme["o_direct_note"] is None
    else:
        assert nvme["io_mode"].startswith("buffered + fsync") and nvme["o_direct_note"]
    assert nvme["default_nvme_bytes"] == rank_share_bytes(nvme["free_bytes"], nvme["local_ranks"])
    assert list(d.iterdir()) == []  # the probe file is gone
    assert json.loads(json.dumps(info)) == info  # plain JSON types only


def test_host_memory_and_default_budget(disk_info: tuple[Path, dict]) -> None:
    host = disk_info[1]["host_memory"]
    assert 0 < host["available_bytes"] <= host["total_bytes"]
    assert host["headroom_bytes"] <= host["available_bytes"]
    cg = host["cgroup"]
    if (
        cg is None
        or cg["headroom_bytes"] is None
        or cg["headroom_bytes"] >= host["available_bytes"]
    ):
        assert host["headroom_limited_by"] == "available RAM"
        assert host["headroom_bytes"] == host["available_bytes"]
    else:
        assert host["headroom_limited_by"] == "cgroup limit - usage"
        assert host["headroom_bytes"] == cg["headroom_bytes"]
    if cg is not None:
        assert set(cg) == {"version", "path", "limit_bytes", "usage_bytes", "headroom_bytes"}
    assert host["default_cpu_budget_bytes"] == rank_share_bytes(
        host["headroom_bytes"], host["local_ranks"]
    )


def test_local_ranks_split_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    host = collect_info()["host_memory"]
    assert (host["local_ranks"], host["local_ranks_source"]) == (4, "LOCAL_WORLD_SIZE")
    assert host["default_cpu_budget_bytes"] == rank_share_bytes(host["headroom_bytes"], 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    host = collect_info()["host_memory"]
    assert (host["local_ranks"], host["local_ranks_source"]) == (1, "LOCAL_WORLD_SIZE unset")


def test_bad_local_world_size_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The offloader refuses it (storage.local_world_size), so the report does not guess either.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='four'"):
        collect_info()
    assert _cli(["info"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("offload info: error: LOCAL_WORLD_SIZE='four' is not a positive")


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


def test_save_hardware_writes_what_plan_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``offload info --save-hardware FILE`` writes the HardwareModel this machine plans with
    (probe_hardware's), which HardwareModel.load and ``offload plan --hardware`` read; with
    --json, standard output stays one JSON object."""
    from offload import probe_hardware
    from offload.lifecycle import HardwareModel, transformer_trace

    disk = tmp_path / "disk"
    disk.mkdir()
    saved = tmp_path / "hw.json"
    argv = ["info", "--json", "--probe-bytes", "4MiB", "--nvme-dir", str(disk)]
    assert _cli([*argv, "--save-hardware", str(saved)]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert f"wrote {saved}" in err
    hw = HardwareModel.load(saved)
    assert hw == probe_hardware(nvme_dir=disk)  # the cached model, as the planner gets it
    assert f"disk {disk.resolve()}" in hw.source and "datasheet" not in hw.source
    from offload.cli import main

    trace = tmp_path / "trace.json"
    transformer_trace(layers=1, hidden=64, tokens=64).save(trace)
    code = main(["plan", str(trace), "--gpu-budget", "1GiB", "--hardware", str(saved), "--no-png"])
    assert code == 0
    assert hw.source in capsys.readouterr().out


def test_save_hardware_to_a_directory_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(["info", "--save-hardware", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--save-hardware {str(tmp_path)!r}: is a directory" in err, err


def test_pcie_theoretical_bandwidth() -> None:
    assert round(pcie_gb_per_s(5, 16), 1) == 63.0
    assert round(pcie_gb_per_s(4, 16), 2) == 31.51
    assert pcie_gb_per_s(1, 1) == 0.25  # 2.5 GT/s with 8b/10b
    assert pcie_gb_per_s(None, 16) is None and pcie_gb_per_s(4, None) is None


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
    # An empty name is refused, not taken for the current directory.
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _cli(["info", "--nvme-dir="])
    assert e.value.code == 2
    assert "argument --nvme-dir: give a directory; got an empty name" in capsys.readouterr().err


def test_python_m_offload_info_json(tmp_path: Path) -> None:
    """Standard output is the JSON alone, also while warnings are emitted (here Python's
    EncodingWarning for every ``open`` without an encoding): they go to standard error."""
    r = _python(
        "-m", "offload", "info", "--nvme-dir", str(tmp_path), "--json", "--probe-bytes", "8MiB",
        PYTHONWARNDEFAULTENCODING="1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "EncodingWarning" in r.stderr  # the case checked: warnings while collecting
    info = json.loads(r.stdout)
    assert info["nvme"]["path"] == str(tmp_path.resolve())
    assert info["nvme"]["write_gb_per_s"] > 0 and info["nvme"]["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == []


def test_import_is_free_and_bad_dir_exits_2(tmp_path: Path) -> None:
    # One interpreter for both checks (importing torch is most of a subprocess's time): the
    # imports start nothing, then `python -m offload info` (run_module) rejects a missing dir.
    missing = tmp_path / "no-such-dir"
    code = (
        "import runpy, sys, torch, offload._info, offload.cli._info, offload.cli._node_report\n"
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


def test_format_info_shows_a_failed_or_shrunk_disk_probe(disk_info: tuple[Path, dict]) -> None:
    info = dict(disk_info[1])
    keep = ("path", "free_bytes", "total_bytes", "filesystem", "local_ranks", "default_nvme_bytes")
    nvme = {k: info["nvme"][k] for k in keep}
    info["nvme"] = {**nvme, "error": "disk probe failed: /x has 0 B free"}
    info["warnings"] = ["NVMe probe in /x: disk probe failed: /x has 0 B free"]
    text = format_info(info)
    assert "disk probe failed: /x has 0 B free" in text and "  ! NVMe probe in /x" in text
    info["nvme"] = {**disk_info[1]["nvme"], "probe_note": "probe shrunk from 8.00 MiB to fit"}
    assert "probe shrunk from 8.00 MiB to fit" in format_info(info)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "argument --probe-bytes: must be more than 0 bytes; got '0'"),
        ("1.5", "argument --probe-bytes: '1.5' is 1.5 bytes, not a whole number of bytes"),
        ("lots", "argument --probe-bytes: 'lots' is not a size"),
    ],
)
def test_bad_probe_bytes_name_the_option_once(
    capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    """argparse names the option; the message does not name it again (it said
    "argument --probe-bytes: --probe-bytes='1.5' is ...")."""
    with pytest.raises(SystemExit) as e:
        _cli(["info", "--probe-bytes", value])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert message in err and err.count("--probe-bytes") == 2, err  # usage line and message


@pytest.mark.parametrize("value", [-1, 0, "0MiB"])
def test_probe_bytes_out_of_range_says_what_is_taken(value: int | str) -> None:
    """``probe_bytes=-1`` said "must be >= 0 bytes", though 0 is refused too."""
    with pytest.raises(ValueError, match=r"^probe_bytes must be more than 0 bytes; got ") as e:
        collect_info(probe_bytes=value)
    assert ">= 0" not in str(e.value)


def test_one_io_thread_is_one_thread(tmp_path: Path) -> None:
    """A 4 KiB disk probe runs on one I/O thread: the report said "1 threads"."""
    info = collect_info(nvme_dir=tmp_path, probe_bytes="4KiB")
    assert info["nvme"]["io_threads"] == 1
    text = format_info(info)
    assert ", 1 thread)" in text and "1 threads" not in text, text
