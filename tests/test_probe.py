"""probe_hardware(): a measured HardwareModel, its JSON cache, and its argument checks."""

from __future__ import annotations

import itertools
import json
import logging
import math
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offload import _probe
from offload._probe import probe_hardware
from offload.lifecycle import HardwareModel
from offload.lifecycle._units import format_bytes

SMALL = 1 << 20  # 1 MiB probes: quick, and noisy figures are fine for these checks


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(d))
    return d


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    d = tmp_path / "nvme"
    d.mkdir()
    return d


def _rates(hw: HardwareModel) -> list[float]:
    return [
        hw.h2d_bytes_per_s,
        hw.d2h_bytes_per_s,
        hw.duplex_bytes_per_s,
        hw.disk_write_bytes_per_s,
        hw.disk_read_bytes_per_s,
        hw.pointwise_bytes_per_s,
    ]


def _only_file(d: Path) -> Path:
    files = sorted(d.iterdir())
    assert len(files) == 1, files
    return files[0]


def test_cpu_probe_measures_a_valid_model(disk_dir: Path) -> None:
    hw = probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL, cache=False)
    assert isinstance(hw, HardwareModel)
    assert hw.copies_overlap_compute is False
    assert (hw.device_name, hw.link) == ("cpu", "host memcpy")
    assert all(math.isfinite(r) and r > 0 for r in _rates(hw))
    assert hw.source.startswith("measured") and str(disk_dir) in hw.source
    # One memcpy serves both directions (HardwareModel.cpu_only).
    assert hw.h2d_bytes_per_s == hw.d2h_bytes_per_s == hw.duplex_bytes_per_s
    # The probe file is gone.
    assert list(disk_dir.iterdir()) == []


def test_without_nvme_dir_the_disk_is_a_named_placeholder(cache_dir: Path) -> None:
    hw = probe_hardware(device=torch.device("cpu"), nbytes="1MiB", cache=False)
    assumed = HardwareModel.h200()
    assert hw.disk_write_bytes_per_s == assumed.disk_write_bytes_per_s
    assert hw.disk_read_bytes_per_s == assumed.disk_read_bytes_per_s
    assert "disk not measured" in hw.source
    assert not cache_dir.exists()  # cache=False writes nothing


def test_cache_round_trip(cache_dir: Path, disk_dir: Path) -> None:
    first = probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL)
    path = _only_file(cache_dir)
    assert path.name.startswith("hardware-") and path.suffix == ".json"
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    assert HardwareModel.load(path) == first
    # Written, not left to HardwareModel's assumed default on the way back.
    assert json.loads(path.read_text())["pointwise_bytes_per_s"] == first.pointwise_bytes_per_s
    assert probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL) == first
    assert _only_file(cache_dir) == path


def _planted() -> HardwareModel:
    """A model no probe would produce: a call that returns it has read the cache file."""
    return HardwareModel.cpu_only(
        copy_bytes_per_s=123.0,
        disk_write_bytes_per_s=4.0,
        disk_read_bytes_per_s=5.0,
        source="planted by the test",
    )


def test_second_call_reads_the_file_and_refresh_measures_again(
    cache_dir: Path, disk_dir: Path
) -> None:
    probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL)
    path = _only_file(cache_dir)
    # A model no probe would produce: a call that returns it has read the file.
    marker = _planted()
    marker.save(path)
    assert probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL) == marker

    fresh = probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL, refresh=True)
    assert fresh != marker and fresh.source.startswith("measured")
    assert HardwareModel.load(path) == fresh


@pytest.mark.parametrize(
    ("nbytes", "cap", "gelu_input_bytes"),
    [(SMALL, 32 << 20, SMALL), (SMALL, SMALL // 4, SMALL // 4), (SMALL + 2, 32 << 20, SMALL)],
)
def test_cpu_pointwise_rate_is_input_plus_output_bytes_per_second(
    monkeypatch: pytest.MonkeyPatch, nbytes: int, cap: int, gelu_input_bytes: int
) -> None:
    # A host clock that advances one second per reading: every timed copy and GELU takes exactly
    # 1 s, so each rate is the bytes that operation moves. The last case is not a whole number
    # of float32 elements: the GELU runs on the whole elements it holds.
    ticks = itertools.count()
    monkeypatch.setattr(_probe, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(_probe, "MAX_CPU_POINTWISE_BYTES", cap)
    hw = probe_hardware(device="cpu", nbytes=nbytes, cache=False)
    assert hw.h2d_bytes_per_s == nbytes
    assert hw.pointwise_bytes_per_s == 2 * gelu_input_bytes  # read the input, write the output
    assert f"float32 GELU of {format_bytes(gelu_input_bytes)}," in hw.source


def test_cache_file_from_an_older_probe_is_measured_again(
    cache_dir: Path, disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL)
    path = _only_file(cache_dir)
    # What the probe wrote before it measured elementwise kernels: every field but that one. A
    # marker, so that a call returning it (with the assumed pointwise rate) has read the file.
    marker = _planted()
    old = marker.to_dict()
    del old["pointwise_bytes_per_s"]
    path.write_text(json.dumps(old))
    assert HardwareModel.load(path).pointwise_bytes_per_s > 0  # loadable: only the probe refuses

    with caplog.at_level(logging.INFO, logger="offload"):
        hw = probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL)
    assert hw.source.startswith("measured") and hw.h2d_bytes_per_s != 123.0
    assert json.loads(path.read_text())["pointwise_bytes_per_s"] == hw.pointwise_bytes_per_s
    messages = [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("older probe" in m and "pointwise_bytes_per_s" in m for m in messages)
    # The fresh figures are logged, the GELU rate among them.
    assert any(f"GELU {hw.pointwise_bytes_per_s / 1e9:.2f} GB/s" in m for m in messages)
    # The rewritten file is complete, so the next call reads it.
    assert probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL) == hw


def test_cache_key_separates_disks_and_probe_sizes(cache_dir: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    probe_hardware(device="cpu", nvme_dir=a, nbytes=SMALL)
    probe_hardware(device="cpu", nvme_dir=b, nbytes=SMALL)
    probe_hardware(device="cpu", nvme_dir=b, nbytes=2 * SMALL)
    assert len(list(cache_dir.iterdir())) == 3
    # CPU copies are timed with torch's threads: another thread count is another probe (the
    # suite's one-thread figures once stood in for a two-thread process's).
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        probe_hardware(device="cpu", nvme_dir=b, nbytes=2 * SMALL)
    finally:
        torch.set_num_threads(threads)
    assert len(list(cache_dir.iterdir())) == 4


@pytest.mark.parametrize("content", ["{not json", '{"format": "something else"}', ""])
def test_corrupt_cache_file_is_ignored_and_rewritten(
    cache_dir: Path, disk_dir: Path, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL)
    path = _only_file(cache_dir)
    path.write_text(content)
    with caplog.at_level(logging.INFO, logger="offload"):
        hw = probe_hardware(device="cpu", nvme_dir=disk_dir, nbytes=SMALL)
    assert hw.source.startswith("measured")
    assert HardwareModel.load(path) == hw
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "host memcpy" in infos[0].getMessage()


def test_unwritable_cache_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(blocker / "cache"))  # under a file: ENOTDIR
    with caplog.at_level(logging.WARNING, logger="offload"):
        hw = probe_hardware(device="cpu", nbytes=SMALL)
    assert hw.source.startswith("measured")
    assert any("could not write the cache" in r.getMessage() for r in caplog.records)


def test_cache_dir_falls_back_to_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OFFLOAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe_hardware(device="cpu", nbytes=SMALL)
    assert _only_file(tmp_path / "offload").name.startswith("hardware-")


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"device": "mps"}, ValueError, "device"),
        ({"device": "not a device"}, ValueError, "device"),
        ({"device": 1.5}, TypeError, "device"),
        ({"device": True}, TypeError, "device"),
        ({"device": -1}, ValueError, "device"),
        ({"nvme_dir": "/no/such/dir/for/offload"}, ValueError, "nvme_dir"),
        ({"nvme_dir": 3}, TypeError, "nvme_dir"),
        # -5 said "must be >= 0 bytes", 0 "a positive size": both say what is taken now.
        ({"nbytes": 0}, ValueError, r"nbytes must be more than 0 bytes, or None .*; got 0$"),
        ({"nbytes": -5}, ValueError, r"nbytes must be more than 0 bytes, or None .*; got -5$"),
        ({"nbytes": "lots"}, ValueError, "nbytes"),
        ({"nbytes": 1.5}, TypeError, "nbytes"),
        ({"cache": "yes"}, TypeError, "cache"),
        ({"refresh": 1}, TypeError, "refresh"),
    ],
)
def test_bad_arguments_name_themselves(
    cache_dir: Path, kwargs: dict[str, object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        probe_hardware(**kwargs)  # type: ignore[arg-type]
    assert not cache_dir.exists()


def test_nvme_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match=r"nvme_dir.*not a directory"):
        probe_hardware(device="cpu", nvme_dir=f, cache=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_cuda_device_without_cuda_is_refused(device: object) -> None:
    with pytest.raises(ValueError, match=r"device.*CUDA is not available"):
        probe_hardware(device=device, cache=False)  # type: ignore[arg-type]


def test_default_device_without_cuda_is_the_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("the default is the current CUDA device here")
    assert probe_hardware(nbytes=SMALL, cache=False).device_name == "cpu"


@pytest.mark.gpu
def test_cuda_probe_measures_both_directions(tmp_path: Path) -> None:
    allocated = torch.cuda.memory_allocated()
    hw = probe_hardware(device="cuda", nvme_dir=tmp_path, nbytes=64 << 20, cache=False)
    assert hw.copies_overlap_compute is True
    assert hw.device_name == torch.cuda.get_device_name()
    assert all(math.isfinite(r) and r > 0 for r in _rates(hw))
    assert hw.pinned_alloc_s_per_byte >= 0
    assert hw.link  # "PCIe GenN xW", or "unknown link" without NVML
    # Both at once moves more in total than either direction alone (or as much, on a link
    # whose directions share one copy engine); 10% slack for noise.
    assert hw.duplex_bytes_per_s >= max(hw.h2d_bytes_per_s, hw.d2h_bytes_per_s) * 0.9
    # A GELU reads and writes device memory, which any GPU's memory outruns its PCIe link.
    assert hw.pointwise_bytes_per_s > hw.duplex_bytes_per_s
    assert "bf16 GELU" in hw.source
    # The probe's buffers are freed.
    assert torch.cuda.memory_allocated() == allocated


def test_one_thread_is_one_thread(tmp_path: Path) -> None:
    """The measured model's source said "(1 torch threads)" and "4.00 KiB, ..., 1 threads"."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hw = probe_hardware(device="cpu", nvme_dir=tmp_path, nbytes="4KiB", cache=False)
    finally:
        torch.set_num_threads(threads)
    assert "(1 torch thread)" in hw.source and ", 1 thread" in hw.source, hw.source
    assert "1 threads" not in hw.source and "1 torch threads" not in hw.source, hw.source
