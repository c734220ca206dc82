"""What the copy links and the disk can do, as plain data: the simulator's and planner's hardware.

A :class:`HardwareModel` holds bandwidths and a few costs, nothing else. ``offload`` measures one
(``probe_hardware()``) or loads one from JSON; this module never measures anything, so importing it
and building one touch no device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from offload.lifecycle._jsonfile import check_header, read_json, write_json

HARDWARE_SCHEMA_VERSION = 1
_FORMAT = "offload.hardware"

# Figures measured on one H200 (docs/design.md, The physics): each direction alone, then both at
# once. The disk figures are a typical NVMe Gen4 x4 drive's datasheet;
# the pinned allocation cost is docs/design.md's (about 0.4 s per GiB).
_H200_H2D_BYTES_PER_S = 54.5e9
_H200_D2H_BYTES_PER_S = 55.2e9
_H200_DUPLEX_BYTES_PER_S = 84.6e9
_GEN4_NVME_WRITE_BYTES_PER_S = 4.3e9
_GEN4_NVME_READ_BYTES_PER_S = 6.8e9
_PINNED_ALLOC_S_PER_BYTE = 0.4 / (1 << 30)
# Elementwise kernels (a GELU: read the input, write the output) run near the memory bandwidth on
# a GPU: 4.0e12 on an H200 (HBM3e, 4.8 TB/s peak), the figure lifecycle.transformer_trace uses
# too. A model without the figure (older JSON) assumes a tenth of that.
_H200_POINTWISE_BYTES_PER_S = 4.0e12
_ASSUMED_POINTWISE_BYTES_PER_S = 0.4e12
_CPU_POINTWISE_BYTES_PER_S = 4.0e9  # a GELU on a few cores, input plus output (assumed)

_REQUIRED_RATES = (
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
    "duplex_bytes_per_s",
    "disk_write_bytes_per_s",
    "disk_read_bytes_per_s",
)
_RATES = (*_REQUIRED_RATES, "pointwise_bytes_per_s")
_TEXTS = ("device_name", "link", "source")


@dataclass(frozen=True, kw_only=True)
class HardwareModel:
    """Bandwidths of the device links and the disk, as the simulator and the planner use them.

    Rates are bytes per second (1 GB/s = ``1e9``); ``math.inf`` stands for an ideal link (useful
    for bounds: what a plan would cost if moving bytes were free). All rates are for one rank.

    Attributes:
        h2d_bytes_per_s: host to device, alone.
        d2h_bytes_per_s: device to host, alone.
        duplex_bytes_per_s: both directions at once, in total. While both channels are busy each
            gets its alone rate scaled by ``min(1, duplex / (h2d + d2h))``; a figure at or above
            ``h2d + d2h`` means the directions never slow each other.
        disk_write_bytes_per_s: host (pinned staging) to the NVMe directory.
        disk_read_bytes_per_s: the NVMe directory to host (pinned staging).
        pointwise_bytes_per_s: bytes an elementwise kernel on the device reads and writes per
            second (its input plus its output): the rate at which a saved activation output is
            rebuilt from its input at unpack (``Placement.REBUILD``).
        pinned_alloc_s_per_byte: seconds to allocate one byte of pinned host memory (a start-up
            cost of the pool: the planner may report it; a step does not pay it).
        copies_overlap_compute: True when copies run on their own streams beside compute (CUDA).
            False when the compute thread runs each host copy itself: on a CPU-only run "offload
            to cpu" is a memcpy in the caller's thread, so its time adds to the step.
        device_name: the accelerator, free text ("NVIDIA H200", "cpu").
        link: the link, free text ("PCIe Gen5 x16", "host memcpy").
        source: where the figures come from: ``"measured"`` (a probe on this machine),
            ``"assumed"`` (a preset or a guess), or any other short note.

    Raises:
        ValueError: a rate is not a number > 0 (or ``math.inf``), the duplex rate is finite while
            a direction is ideal, or the allocation cost is negative or infinite.
        TypeError: a text field is not a ``str`` or ``copies_overlap_compute`` is not a ``bool``.

    Example:
        >>> hw = HardwareModel.h200()
        >>> hw.h2d_bytes_per_s / 1e9, hw.duplex_bytes_per_s / 1e9
        (54.5, 84.6)
        >>> slow = HardwareModel(
        ...     h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=1.5e9,
        ...     disk_write_bytes_per_s=0.5e9, disk_read_bytes_per_s=1e9)
        >>> slow.source
        'assumed'
    """

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    disk_write_bytes_per_s: float
    disk_read_bytes_per_s: float
    pointwise_bytes_per_s: float = _ASSUMED_POINTWISE_BYTES_PER_S
    pinned_alloc_s_per_byte: float = 0.0
    copies_overlap_compute: bool = True
    device_name: str = ""
    link: str = ""
    source: str = "assumed"

    def __post_init__(self) -> None:
        for name in _RATES:
            value = getattr(self, name)
            if not _is_number(value) or math.isnan(value) or value <= 0:
                raise ValueError(
                    f"{name} must be a number of bytes per second > 0 (math.inf for an ideal "
                    f"link); got {value!r}"
                )
        if math.isinf(self.h2d_bytes_per_s + self.d2h_bytes_per_s) and not math.isinf(
            self.duplex_bytes_per_s
        ):
            raise ValueError(
                "duplex_bytes_per_s must be math.inf when h2d_bytes_per_s or d2h_bytes_per_s is "
                f"(an ideal direction cannot share a finite total); got {self.duplex_bytes_per_s!r}"
            )
        alloc = self.pinned_alloc_s_per_byte
        if not _is_number(alloc) or not math.isfinite(alloc) or alloc < 0:
            raise ValueError(
                f"pinned_alloc_s_per_byte must be a finite number of seconds >= 0; got {alloc!r}"
            )
        if not isinstance(self.copies_overlap_compute, bool):
            raise TypeError(
                "copies_overlap_compute must be a bool; got "
                f"{type(self.copies_overlap_compute).__name__}"
            )
        for name in _TEXTS:
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str; got {type(getattr(self, name)).__name__}")

    # -- presets -----------------------------------------------------------------------------

    @classmethod
    def h200(cls) -> HardwareModel:
        """The H200 figures docs/design.md plans with when nothing was probed.

        PCIe as measured on one H200 (H2D 54.5 GB/s, D2H 55.2 GB/s alone, 84.6 GB/s both at once);
        the disk is assumed to be one NVMe Gen4 x4 drive (4.3 GB/s write, 6.8 GB/s read); pinned
        allocation about 0.4 s per GiB. ``source`` is ``"assumed"``: on another machine these are
        a guess until ``probe_hardware()`` replaces them.

        Example:
            >>> HardwareModel.h200().link
            'PCIe Gen5 x16'
        """
        return cls(
            h2d_bytes_per_s=_H200_H2D_BYTES_PER_S,
            d2h_bytes_per_s=_H200_D2H_BYTES_PER_S,
            duplex_bytes_per_s=_H200_DUPLEX_BYTES_PER_S,
            disk_write_bytes_per_s=_GEN4_NVME_WRITE_BYTES_PER_S,
            disk_read_bytes_per_s=_GEN4_NVME_READ_BYTES_PER_S,
            pointwise_bytes_per_s=_H200_POINTWISE_BYTES_PER_S,
            pinned_alloc_s_per_byte=_PINNED_ALLOC_S_PER_BYTE,
            device_name="NVIDIA H200",
            link="PCIe Gen5 x16",
            source="assumed",
        )

    @classmethod
    def cpu_only(
        cls,
        *,
        copy_bytes_per_s: float,
        disk_write_bytes_per_s: float,
        disk_read_bytes_per_s: float,
        pointwise_bytes_per_s: float = _CPU_POINTWISE_BYTES_PER_S,
        source: str = "assumed",
    ) -> HardwareModel:
        """A CPU-only run, where "offload to cpu" is a memcpy run by the compute thread.

        Both directions are the same memcpy and share memory bandwidth (``duplex`` equals
        ``copy_bytes_per_s``), and copies do not overlap compute. This class never measures:
        pass figures you measured (a timed ``torch`` copy of a large tensor, the disk probe of
        ``offload info``) and say so in ``source``.

        Args:
            copy_bytes_per_s: memcpy bandwidth, bytes per second.
            disk_write_bytes_per_s: write bandwidth of the NVMe directory.
            disk_read_bytes_per_s: read bandwidth of the NVMe directory.
            pointwise_bytes_per_s: bytes a GELU reads and writes per second on this CPU.
            source: where the figures come from.

        Example:
            >>> hw = HardwareModel.cpu_only(
            ...     copy_bytes_per_s=10e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=2e9)
            >>> hw.copies_overlap_compute, hw.duplex_bytes_per_s == hw.h2d_bytes_per_s
            (False, True)
        """
        return cls(
            h2d_bytes_per_s=copy_bytes_per_s,
            d2h_bytes_per_s=copy_bytes_per_s,
            duplex_bytes_per_s=copy_bytes_per_s,
            disk_write_bytes_per_s=disk_write_bytes_per_s,
            disk_read_bytes_per_s=disk_read_bytes_per_s,
            pointwise_bytes_per_s=pointwise_bytes_per_s,
            copies_overlap_compute=False,
            device_name="cpu",
            link="host memcpy",
            source=source,
        )

    # -- persistence -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; an ideal (infinite) rate is written as the string ``"inf"``."""
        out: dict[str, Any] = {"format": _FORMAT, "schema_version": HARDWARE_SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = "inf" if isinstance(value, float) and math.isinf(value) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareModel:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: not an offload hardware model, another schema version, a missing or
                unknown field, or a value the constructor rejects.
        """
        check_header(data, fmt=_FORMAT, version=HARDWARE_SCHEMA_VERSION, what="hardware model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"format", "schema_version"})
        if unknown:
            raise ValueError(f"hardware model has unknown fields {unknown}; known: {sorted(known)}")
        missing = [name for name in _REQUIRED_RATES if name not in data]
        if missing:
            raise ValueError(f"hardware model lacks {missing}")
        kwargs = {k: v for k, v in data.items() if k in known}
        for name in _RATES:
            if kwargs.get(name) == "inf":
                kwargs[name] = math.inf
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"hardware model has a field of the wrong type: {e}") from e

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model as JSON to ``path`` (atomically: a temp file, then a rename).

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "hardware.json")
            >>> HardwareModel.h200().save(path)
            >>> HardwareModel.load(path) == HardwareModel.h200()
            True
        """
        write_json(path, self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HardwareModel:
        """Read a model written by :meth:`save`.

        Raises:
            TypeError: ``path`` is not a str or ``os.PathLike``.
            FileNotFoundError: ``path`` does not exist.
            ValueError: the file is not JSON, not an offload hardware model, or has another
                schema version.
        """
        return cls.from_dict(read_json(path))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
