"""The raw disk probe used by ``offload info`` and the benchmarks (numbers are printed, never
asserted beyond being positive)."""

from __future__ import annotations

import os

import pytest

from offload.storage import StorageFullError, measure_disk_bandwidth
from offload.storage._bandwidth import fit_probe_bytes

MiB = 1 << 20


def test_measure_disk_bandwidth_returns_positive_numbers(tmp_path):
    result = measure_disk_bandwidth(tmp_path, nbytes=2 << 20, chunk_bytes=1 << 20, threads=2)
    print(result)
    assert result["nbytes"] == result["requested_nbytes"] == 2 << 20
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    assert isinstance(result["direct_io"], bool)
    if result["direct_io"]:
        assert (result["io_mode"], result["direct_io_note"]) == ("O_DIRECT", None)
    else:
        assert result["io_mode"].startswith("buffered + fsync")
        assert result["direct_io_note"] in (
            "not available on this platform",
            "refused by the file system",
        )
    assert os.listdir(tmp_path) == []  # the private file and directory are gone


def test_buffered_probe_drops_the_page_cache(tmp_path):
    result = measure_disk_bandwidth(tmp_path, nbytes=MiB + 1, threads=8, direct_io=False)
    assert result["nbytes"] == result["requested_nbytes"] == MiB + 4096  # rounded up to 4 KiB
    assert result["direct_io"] is False and result["direct_io_note"] == "not tried"
    expected = "buffered + fsync" + (" + fadvise(DONTNEED)" if hasattr(os, "posix_fadvise") else "")
    assert result["io_mode"] == expected
    assert result["threads"] == 1  # one 16 MiB chunk holds it all: no idle threads reported
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    assert os.listdir(tmp_path) == []


def test_probe_takes_at_most_a_quarter_of_the_free_space():
    assert fit_probe_bytes(256 * MiB, 10_000 * MiB) == 256 * MiB
    assert fit_probe_bytes(256 * MiB, 100 * MiB + 123) == 25 * MiB  # a 4 KiB multiple
    assert fit_probe_bytes(256 * MiB, 4 * 4096) == 4096
    with pytest.raises(StorageFullError, match="too little for a bandwidth probe") as e:
        fit_probe_bytes(256 * MiB, 4 * 4096 - 1, directory="/full")
    assert e.value.directory == "/full"


def test_measure_disk_bandwidth_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="nbytes"):
        measure_disk_bandwidth(tmp_path, nbytes=0)
    with pytest.raises(ValueError, match="threads"):
        measure_disk_bandwidth(tmp_path, nbytes=4096, threads=0)
    with pytest.raises(TypeError, match="nbytes must be an int >= 1; got float"):
        measure_disk_bandwidth(tmp_path, nbytes=4096.0)
    with pytest.raises(TypeError, match="threads must be an int >= 1; got bool"):
        measure_disk_bandwidth(tmp_path, nbytes=4096, threads=True)
    with pytest.raises(ValueError, match="not a directory"):
        measure_disk_bandwidth(tmp_path / "missing", nbytes=4096)
