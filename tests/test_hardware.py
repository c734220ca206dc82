"""The hardware model: presets, JSON round trips, files that are not one, and validation
that names the field."""

from __future__ import annotations

import json
import math

import pytest
from simulate_util import IDEAL, _lifo

from offload.lifecycle import (
    HardwareModel,
)


def test_hardware_presets() -> None:
    h200 = HardwareModel.h200()
    assert (h200.h2d_bytes_per_s, h200.d2h_bytes_per_s, h200.duplex_bytes_per_s) == (
        54.5e9,
        55.2e9,
        84.6e9,
    )
    assert h200.source == "assumed" and h200.copies_overlap_compute
    cpu = HardwareModel.cpu_only(
        copy_bytes_per_s=8e9,
        disk_write_bytes_per_s=1e9,
        disk_read_bytes_per_s=2e9,
        source="measured",
    )
    assert not cpu.copies_overlap_compute and cpu.source == "measured"


@pytest.mark.parametrize(
    "hw",
    [
        HardwareModel.h200(),
        HardwareModel.cpu_only(
            copy_bytes_per_s=8e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=2e9
        ),
        IDEAL,
    ],
    ids=["h200", "cpu_only", "ideal"],
)
def test_hardware_json_round_trip(tmp_path, hw: HardwareModel) -> None:
    path = tmp_path / "hw.json"
    hw.save(path)
    assert HardwareModel.load(path) == hw

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(path.read_text(), parse_constant=no_constants)  # strict JSON (no Infinity)
    assert data["format"] == "offload.hardware" and data["schema_version"] == 1


def test_hardware_load_rejects_other_files(tmp_path) -> None:
    good = HardwareModel.h200().to_dict()
    cases = {
        "trace": _lifo().to_dict(),
        "version": {**good, "schema_version": 99},
        "unknown": {**good, "pcie_lanes": 16},
        "missing": {k: v for k, v in good.items() if k != "h2d_bytes_per_s"},
        "type": {**good, "d2h_bytes_per_s": "fast"},
        "text_type": {**good, "link": 5},
    }
    messages = {
        "trace": "not an offload hardware model",
        "version": "schema_version 99",
        "unknown": "pcie_lanes",
        "missing": "h2d_bytes_per_s",
        "type": "d2h_bytes_per_s",
        "text_type": "link",
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=messages[name]):
            HardwareModel.load(path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        HardwareModel.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        HardwareModel.load(tmp_path / "absent.json")


def test_hardware_validation_names_the_field() -> None:
    base = HardwareModel.h200().to_dict()
    del base["format"], base["schema_version"]
    bad = {
        "h2d_bytes_per_s": 0,
        "d2h_bytes_per_s": -1.0,
        "duplex_bytes_per_s": math.nan,
        "disk_write_bytes_per_s": True,
        "disk_read_bytes_per_s": "6.8e9",
        "pinned_alloc_s_per_byte": -1e-9,
        "pointwise_bytes_per_s": 0.0,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            HardwareModel(**{**base, name: value})
    with pytest.raises(ValueError, match=r"duplex_bytes_per_s must be math\.inf"):
        HardwareModel(**{**base, "h2d_bytes_per_s": math.inf})
    with pytest.raises(TypeError, match="device_name"):
        HardwareModel(**{**base, "device_name": 3})
    with pytest.raises(TypeError, match="copies_overlap_compute"):
        HardwareModel(**{**base, "copies_overlap_compute": "yes"})
    with pytest.raises(TypeError):
        HardwareModel(1e9, 1e9, 1e9, 1e9, 1e9)  # type: ignore[misc]  # keyword-only
