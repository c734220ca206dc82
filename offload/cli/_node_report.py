"""What this node offers the offloader: ``offload info`` collects it, as plain JSON-able data,
and lays it out as a table.

Nothing here runs at import. ``collect_info`` touches CUDA only when ``torch.cuda.is_available()``
(then it measures the PCIe link, which creates a context on the current device); NVML (from
nvidia-ml-py) and kvikio are imported lazily and their absence is reported, not raised. Disk is
measured only in a directory the caller names, with one probe file that is removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

from offload._info import _filesystem_of, _measure_pcie, _nvml_info, _torch_gpus, check_nvme_dir
from offload.lifecycle._units import format_bytes, parse_bytes, plural
from offload.storage import (
    ALIGNMENT_BYTES,
    cgroup_memory,
    local_world_size,
    measure_disk_bandwidth,
    rank_share_bytes,
)

SCHEMA_VERSION = 1
DEFAULT_PROBE_BYTES = 256 << 20
# Pinned (page-locked) host allocation cost, measured on an H200 host (notes/design-review.md).
PINNED_ALLOC_S_PER_GIB_REFERENCE = 0.4
SMALL_CPU_BUDGET_BYTES = 4 << 30
_GIB = 1 << 30


# ---------------------------------------------------------------------------------------------
# Collection


def collect_info(
    nvme_dir: str | os.PathLike[str] | None = None,
    probe_bytes: int | str = DEFAULT_PROBE_BYTES,
) -> dict[str, Any]:
    """Describe this node for the offloader: software, GPUs, PCIe, host memory, disk, kvikio.

    Args:
        nvme_dir: a directory on the disk an NVMe tier would use; when given, its free space is
            read and a probe file of ``probe_bytes`` is written and read back (then removed).
            None measures nothing on disk.
        probe_bytes: size of each bandwidth probe (PCIe copies and the disk file), bytes or a
            string like ``"64MiB"``; rounded up to 4 KiB.

    Returns:
        A dict of plain JSON types (``schema`` names its version). Measurements that failed
        carry an ``"error"`` string instead of numbers.

    Raises:
        NvmeDirError: ``nvme_dir`` does not exist, is not a directory or is not writable.
        ValueError: ``probe_bytes`` is not a positive size, or ``LOCAL_WORLD_SIZE`` is set but is
            not a positive integer (the offloader would refuse it too).

    Example:
        >>> info = collect_info()
        >>> info["host_memory"]["default_cpu_budget_bytes"] > 0
        True
    """
    nbytes = parse_bytes(probe_bytes, name="probe_bytes", positive=True)
    nbytes = -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES  # as the disk probe rounds it
    directory = check_nvme_dir(nvme_dir) if nvme_dir is not None else None
    # Read before anything is measured: a bad value fails fast, as it would in the offloader.
    local_ranks = local_world_size()
    ranks_source = (
        "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in os.environ else "LOCAL_WORLD_SIZE unset"
    )

    # torch.cuda.is_available() asks the driver for a device count; it creates no context and
    # leaves torch.cuda.is_initialized() False. Everything else CUDA waits for a True here.
    cuda_available = torch.cuda.is_available()
    gpus: list[dict[str, Any]] = []
    gpus_error = None
    if cuda_available:
        try:
            gpus = _torch_gpus()
        except Exception as e:  # a driver that counts devices but cannot open them
            gpus_error = f"{type(e).__name__}: {e}"
    if gpus:
        pcie = _measure_pcie(nbytes)
    elif cuda_available:
        pcie = {"skipped": f"CUDA devices could not be read ({gpus_error})"}
    else:
        pcie = {"skipped": "CUDA is not available"}
    info: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda_available,
        "gpus": gpus,
        "gpus_error": gpus_error,
        # With torch's devices known, NVML's list is theirs, in torch's order (looked up by
        # UUID); otherwise it is every GPU NVML sees.
        "nvml": _nvml_info([g["uuid"] for g in gpus] if gpus else None),
        "pcie_measured": pcie,
    }
    info["host_memory"] = _host_memory(local_ranks, ranks_source)
    info["nvme"] = _nvme_info(directory, nbytes, local_ranks) if directory is not None else None
    info["kvikio"] = _kvikio_info(cuda_available)
    info["startup"] = _startup(info)
    info["warnings"] = _warnings(info)
    return info


def _host_memory(local_ranks: int, ranks_source: str) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    cgroup = cgroup_memory()
    # The same min as storage.default_cpu_budget_bytes, on the numbers shown next to it.
    headroom = int(vm.available)
    limited_by = "available RAM"
    if (
        cgroup is not None
        and cgroup.headroom_bytes is not None
        and cgroup.headroom_bytes < headroom
    ):
        headroom = cgroup.headroom_bytes
        limited_by = "cgroup limit - usage"
    return {
        "total_bytes": int(vm.total),
        "available_bytes": int(vm.available),
        "used_percent": float(vm.percent),
        "cgroup": None if cgroup is None else dataclasses.asdict(cgroup),
        "headroom_bytes": headroom,
        "headroom_limited_by": limited_by,
        "local_ranks": local_ranks,
        "local_ranks_source": ranks_source,
        # docs/design.md "Host and disk resources belong to the node".
        "default_cpu_budget_bytes": rank_share_bytes(headroom, local_ranks),
    }


def _nvme_info(directory: Path, nbytes: int, local_ranks: int) -> dict[str, Any]:
    usage = psutil.disk_usage(str(directory))
    out: dict[str, Any] = {
        "path": str(directory),
        "free_bytes": int(usage.free),
        "total_bytes": int(usage.total),
        "filesystem": _filesystem_of(directory),
        "local_ranks": local_ranks,
        # Split like host memory (docs/design.md "Host and disk resources belong to the node").
        "default_nvme_bytes": rank_share_bytes(usage.free, local_ranks),
    }
    try:
        r = measure_disk_bandwidth(directory, nbytes)
    except OSError as e:  # StorageFullError (too little free space), EIO, ...
        out["error"] = f"disk probe failed: {e.strerror or e}"
        return out
    if r["nbytes"] < r["requested_nbytes"]:
        out["probe_note"] = (
            f"probe shrunk from {format_bytes(r['requested_nbytes'])} to fit the free space"
        )
    out.update(
        io_mode=r["io_mode"],
        o_direct=r["direct_io"],
        o_direct_note=r["direct_io_note"],
        probe_bytes=r["nbytes"],
        io_threads=r["threads"],
        write_gb_per_s=r["write_gbps"],
        read_gb_per_s=r["read_gbps"],
    )
    return out


def _kvikio_info(cuda_available: bool) -> dict[str, Any]:
    cuda = torch.version.cuda
    major = int(cuda.split(".")[0]) if cuda else None
    extra = {12: "gds-cu12", 13: "gds-cu13"}.get(major) if major is not None else None
    python_ok = sys.version_info >= (3, 11)
    if cuda is None:
        extra_note = "none: this torch is a CPU build, and kvikio needs CUDA"
    elif extra is None:
        extra_note = f"none: no extra for CUDA {cuda} (gds-cu12 and gds-cu13 exist)"
    elif not python_ok:
        extra_note = f"{extra}, but it needs Python >= 3.11 (this is {platform.python_version()})"
    else:
        extra_note = f"{extra}: pip install 'offload[{extra}]' (needs Python >= 3.11)"
    out: dict[str, Any] = {
        "importable": False,
        "version": None,
        "usable": False,
        "gds_available": None,
        "compat_mode": None,
        "error": None,
        "extra": extra,
        "extra_note": extra_note,
        "python_ok": python_ok,
    }
    try:
        import kvikio
    except Exception as e:  # not installed, or libcufile missing (DynamicLibNotFoundError)
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["importable"] = True
    out["version"] = str(getattr(kvikio, "__version__", "unknown"))
    # Reads and writes need the CUDA driver even in compat mode (notes/integration-facts.md 1.2).
    out["usable"] = cuda_available
    try:
        out["gds_available"] = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception as e:
        out["gds_available_error"] = f"{type(e).__name__}: {e}"
    with contextlib.suppress(Exception):
        out["compat_mode"] = str(kvikio.defaults.get("compat_mode"))
    return out


def _startup(info: dict[str, Any]) -> dict[str, Any]:
    budget = info["host_memory"]["default_cpu_budget_bytes"]
    measured = info["pcie_measured"].get("pinned_alloc_s_per_gib")
    per_gib = measured if measured is not None else PINNED_ALLOC_S_PER_GIB_REFERENCE
    return {
        "pinned_alloc_s_per_gib_reference": PINNED_ALLOC_S_PER_GIB_REFERENCE,
        "pinned_alloc_reference": "measured on an H200 host",
        "pinned_alloc_s_per_gib_measured": measured,
        "default_pool_alloc_s": per_gib * budget / _GIB,
        "notes": [
            "The pinned pool is allocated once, at first use (a log line says so), in "
            "power-of-two slabs; a pool as large as the default budget would take about "
            f"{per_gib * budget / _GIB:.1f} s.",
            "The first step of each new input signature is a profile step: it runs in "
            "min-memory mode (everything eligible is offloaded, in-flight copies bounded) and is "
            "slower than a normal step; the plan is refined once from the next steps.",
            "probe_hardware() measures the PCIe link once per process (cached) unless a "
            "HardwareModel is given.",
        ],
    }


def _warnings(info: dict[str, Any]) -> list[str]:
    out = []
    host = info["host_memory"]
    budget = host["default_cpu_budget_bytes"]
    if budget < SMALL_CPU_BUDGET_BYTES:
        out.append(
            f"the default pinned-pool budget is only {format_bytes(budget)} per rank "
            f"({host['headroom_limited_by']}, {host['local_ranks']} local rank(s)): little can "
            "wait in host memory; free host memory, raise the container's limit, or add the "
            "'nvme' tier"
        )
    if host["used_percent"] > 60:
        out.append(f"host memory is {host['used_percent']:.0f}% used before any pinning")
    nvme = info["nvme"]
    if nvme is not None:
        if "error" in nvme:
            out.append(f"NVMe probe in {nvme['path']}: {nvme['error']}")
        elif not nvme.get("o_direct"):
            out.append(
                f"O_DIRECT {nvme.get('o_direct_note')} in {nvme['path']}: bandwidth was "
                "measured through the page cache"
            )
    kv = info["kvikio"]
    if kv["error"] and "No module named" not in kv["error"]:
        out.append(f"kvikio is installed but does not import: {kv['error']}")
    pcie = info["pcie_measured"]
    if "error" in pcie:
        out.append(f"PCIe measurement on {pcie['device']} failed: {pcie['error']}")
    return out


# ---------------------------------------------------------------------------------------------
# Text


def _gb(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f} GB/s"


def _link(generation: int | None, width: int | None) -> str:
    return f"Gen{generation or '?'} x{width or '?'}"


def format_info(info: dict[str, Any]) -> str:
    """The dict from :func:`collect_info` as an aligned two-column table."""
    rows: list[tuple[str, str] | str] = []

    def section(title: str) -> None:
        rows.append(title)

    def row(label: str, value: object) -> None:
        rows.append((label, str(value)))

    section("Software")
    row("python", info["python"])
    row("torch", info["torch"])
    row("CUDA build", info["cuda_build"] or "none (CPU build of torch)")
    row("CUDA available", "yes" if info["cuda_available"] else "no")
    nvml = info["nvml"]
    if nvml.get("available"):
        driver = nvml.get("driver_version")
        if nvml.get("driver_cuda_version"):
            driver = f"{driver} (CUDA {nvml['driver_cuda_version']})"
        row("NVIDIA driver", driver)

    section("GPUs")
    if info["gpus"]:
        for g in info["gpus"]:
            row(
                f"cuda:{g['index']}",
                f"{g['name']}, {format_bytes(g['total_memory_bytes'])}, sm {g['capability']}",
            )
    else:
        row("devices", info.get("gpus_error") or "none visible to torch")
        if nvml.get("available") and nvml.get("devices"):
            row("NVML sees", f"{len(nvml['devices'])} GPU(s), which this torch cannot use")

    section("PCIe link (NVML)")
    if not nvml.get("available"):
        row("link", f"no NVML ({nvml.get('error')})")
    else:
        devices = nvml.get("devices", [])
        if not devices:
            row("link", "no devices")
        for i, d in enumerate(devices):
            label = f"cuda:{i}" if info["gpus"] else f"nvml:{i}"
            p = d.get("pcie")
            if p is None:
                row(label, d.get("error", "unknown"))
                continue
            row(
                label,
                f"{_link(p['current_generation'], p['current_width'])} now, "
                f"{_link(p['max_generation'], p['max_width'])} max: "
                f"{_gb(p['max_theoretical_gb_per_s'])} per direction (theoretical)",
            )

    section("PCIe measured (pinned copies)")
    m = info["pcie_measured"]
    if "skipped" in m:
        row("copies", f"not measured: {m['skipped']}")
    elif "error" in m:
        row(m["device"], f"failed: {m['error']}")
    else:
        row("device", f"{m['device']}, {format_bytes(m['probe_bytes'])} best of {m['repeats']}")
        row("host -> device", _gb(m["h2d_gb_per_s"]))
        row("device -> host", _gb(m["d2h_gb_per_s"]))
        row("both at once", f"{_gb(m['both_gb_per_s'])} total")

    section("Host memory")
    h = info["host_memory"]
    row("total", format_bytes(h["total_bytes"]))
    row("available", f"{format_bytes(h['available_bytes'])} ({h['used_percent']:.0f}% used)")
    cg = h["cgroup"]
    if cg is None:
        row("cgroup", "none found")
    else:
        limit = (
            "no limit" if cg["limit_bytes"] is None else f"limit {format_bytes(cg['limit_bytes'])}"
        )
        usage = "" if cg["usage_bytes"] is None else f", usage {format_bytes(cg['usage_bytes'])}"
        row("cgroup", f"v{cg['version']} {limit}{usage}")
    row("local ranks", f"{h['local_ranks']} ({h['local_ranks_source']})")
    row(
        "pinned pool budget",
        f"{format_bytes(h['default_cpu_budget_bytes'])} per rank "
        "(0.5 x min(available, cgroup headroom) / local ranks)",
    )

    section("NVMe directory")
    n = info["nvme"]
    if n is None:
        row("disk", "not measured (pass --nvme-dir DIR to measure free space and bandwidth)")
    else:
        row("path", n["path"])
        fs = n.get("filesystem")
        if fs:
            row("file system", f"{fs['type']} on {fs['device']} ({fs['mountpoint']})")
        row("free", f"{format_bytes(n['free_bytes'])} of {format_bytes(n['total_bytes'])}")
        row(
            "default budget",
            f"{format_bytes(n['default_nvme_bytes'])} per rank (0.5 x free / local ranks)",
        )
        if "probe_note" in n:
            row("probe", n["probe_note"])
        if "error" in n:
            row("bandwidth", n["error"])
        else:
            od = "yes" if n["o_direct"] else f"no, {n['o_direct_note']}"
            row("O_DIRECT", od)
            row(
                "write",
                f"{_gb(n['write_gb_per_s'])} ({format_bytes(n['probe_bytes'])}, {n['io_mode']}, "
                f"{plural(n['io_threads'], 'thread')})",
            )
            row("read", _gb(n["read_gb_per_s"]))

    section("kvikio (GPU-direct storage)")
    kv = info["kvikio"]
    if kv["importable"]:
        row("installed", f"yes, {kv['version']}")
        row("usable", "yes" if kv["usable"] else "no: CUDA is not available")
        gds = kv["gds_available"]
        row("GDS available", "unknown" if gds is None else ("yes" if gds else "no (compat mode)"))
        if kv.get("compat_mode"):
            row("compat mode", kv["compat_mode"])
    else:
        err = kv["error"] or ""
        row("installed", "no" if "No module named" in err else f"no: {err}")
    row("extra that fits", kv["extra_note"])

    section("Start-up costs to expect")
    s = info["startup"]
    pin = f"about {s['pinned_alloc_s_per_gib_reference']} s per GiB ({s['pinned_alloc_reference']})"
    if s["pinned_alloc_s_per_gib_measured"] is not None:
        pin += f"; {s['pinned_alloc_s_per_gib_measured']:.2f} s per GiB here"
    row("pinned pool", pin)
    row("default pool", f"about {s['default_pool_alloc_s']:.1f} s to pin the whole default budget")
    row("profile step", "each new input signature's first step is slower (min-memory mode)")

    if info["warnings"]:
        section("Warnings")
        for w in info["warnings"]:
            rows.append(f"  ! {w}")

    width = max(len(r[0]) for r in rows if isinstance(r, tuple)) + 2
    lines = []
    for r in rows:
        if isinstance(r, tuple):
            lines.append(f"  {r[0]:<{width}}{r[1]}")
        else:
            if lines and not r.startswith("  "):
                lines.append("")
            lines.append(r)
    return "\n".join(lines)
