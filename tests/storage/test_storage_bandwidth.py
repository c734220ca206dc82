"""The raw disk probe used by ``offload info`` and the benchmarks (numbers are printed, never
asserted beyond being positive)."""

from __future__ import annotations

import os

import pytest

from storage import measure_disk_bandwidth


def test_measure_disk_bandwidth_returns_positive_numbers(tmp_path):
    result = measure_disk_bandwidth(tmp_path, nbytes=2 << 20, chunk_bytes=1 << 20, threads=2)
    print(result)
    assert result["nbytes"] == 2 << 20
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    assert isinstance(result["direct_io"], bool)
    assert os.listdir(tmp_path) == []  # the private file and directory are gone


def test_measure_disk_bandwidth_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="nbytes"):
        measure_disk_bandwidth(tmp_path, nbytes=0)
    with pytest.raises(ValueError, match="threads"):
        measure_disk_bandwidth(tmp_path, nbytes=4096, threads=0)
