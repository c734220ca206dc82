"""``probe_hardware()``: measure this machine's copy links, elementwise kernel rate and disk into
a :class:`HardwareModel`.

The planner and the simulator take a :class:`~offload.lifecycle.HardwareModel`; this module fills one with
figures timed here, and keeps it in a small JSON cache so a process pays for the probe once per
machine, not once per run. Nothing runs at import: CUDA, NVML, files and the cache directory are
touched only when :func:`probe_hardware` is called.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import socket
import statistics
import time
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeAlias

import torch

from offload._info import _nvml_info, _torch_gpus, check_nvme_dir
from offload.lifecycle import HardwareModel
from offload.lifecycle._jsonfile import read_json
from offload.lifecycle._units import format_bytes, parse_bytes, plural
from offload.storage import measure_disk_bandwidth

log = logging.getLogger("offload")

# Probe sizes when ``nbytes`` is None. PCIe needs a large copy to reach its plateau (a few MiB
# still pay the per-copy launch latency); a host memcpy reaches memory bandwidth sooner. The disk
# default is measure_disk_bandwidth's own (smaller disk probes are noisy), shrunk there to a
# quarter of the directory's free space.
DEFAULT_CUDA_PROBE_BYTES = 256 << 20
DEFAULT_CPU_PROBE_BYTES = 64 << 20
DEFAULT_DISK_PROBE_BYTES = 256 << 20
# The GELU input on the CPU is the copy size capped here (the output is as large again): a float32
# GELU read and wrote 2 to 8 GB/s (busy to idle) on 2 threads of a shared 2-core VM, so the capped
# probe (a warm-up and PROBE_REPEATS timed) adds 0.05 to 0.25 s, and 32 MiB in and out is still
# past most last-level caches.
MAX_CPU_POINTWISE_BYTES = 16 << 20
# Each figure is the median of this many timed copies (or kernels), after one untimed warm-up.
PROBE_REPEATS = 5
# GELU launches per timed sample on CUDA: one on 256 MiB (in, and as much out) takes about 0.13 ms
# at HardwareModel.h200()'s 4.0e12, so a few microseconds of launch latency would otherwise be a
# few percent of the figure.
CUDA_POINTWISE_LAUNCHES = 10
CACHE_ENV = "OFFLOAD_CACHE_DIR"

_LOG_PREFIX = "offload::probe_hardware"
_DEVICE_ACCEPTED = (
    "None (the current CUDA device, else the CPU), 'cpu', 'cuda', 'cuda:N', an int N (cuda:N), "
    "or a torch.device of those"
)


# One timed copy: the stream it runs on, its destination and its source.
_Copy: TypeAlias = "tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]"


@dataclass(frozen=True)
class _Disk:
    """The disk half of a probe: the two rates and what to say about where they came from."""

    write_bytes_per_s: float
    read_bytes_per_s: float
    note: str
    measured: bool  # False: placeholder figures (no nvme_dir, or the probe failed)


def probe_hardware(
    *,
    device: torch.device | str | int | None = None,
    nvme_dir: str | os.PathLike[str] | None = None,
    cache: bool = True,
    refresh: bool = False,
    nbytes: int | str | None = None,
) -> HardwareModel:
    """Measure the copy links, elementwise kernels and disk of this machine, for the planner.

    On a CUDA device: pinned host-to-device copies alone, device-to-host alone, and both at once on
    two streams (``duplex_bytes_per_s`` is the total of both), each the median of
    ``PROBE_REPEATS`` copies timed with CUDA events; the cost of one pinned allocation (torch's
    host allocator, whose cache is emptied first so a real page-locking is timed); the device name
    from torch and the PCIe link from NVML (``"unknown link"`` without NVML). On the CPU: a
    ``copy_`` of one large tensor into another, timed on the host clock with torch's current
    thread count, as :meth:`HardwareModel.cpu_only` (copies do not overlap compute). The figures
    are for this process alone: ranks that copy at the same time share the links.

    ``pointwise_bytes_per_s`` (what rebuilding a GELU, SiLU or norm output from its input
    costs) is a
    GELU into a preallocated output, input plus output bytes per second, the median of
    ``PROBE_REPEATS`` after a warm-up: on CUDA in bf16 (what autocast runs) on a probe-sized
    input, timed with CUDA events over ``CUDA_POINTWISE_LAUNCHES`` launches; on the CPU in float32
    on the probe size capped at ``MAX_CPU_POINTWISE_BYTES``, with torch's current thread count.

    The disk is measured in ``nvme_dir`` with :func:`storage.measure_disk_bandwidth` (O_DIRECT
    where the file system allows it; the probe file is unlinked and takes at most a quarter of the
    free space). Without ``nvme_dir`` the disk is not measured: the disk rates are the datasheet
    figures of one NVMe Gen4 x4 drive (4.3 GB/s write, 6.8 GB/s read, as
    :meth:`HardwareModel.h200`) and ``source`` says so. If the disk probe fails (a full disk, an
    I/O error) the same placeholder is used, a warning is logged and nothing is cached.

    With ``cache``, the model is kept in one JSON file per host, device (name and UUID, or
    ``"cpu"``), torch version, ``nvme_dir`` (resolved) and ``nbytes`` as given, in
    ``$OFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/offload``, else ``~/.cache/offload`` (created
    with mode 0700), named ``hardware-<host>-<device>-<hash>.json``. A later call with the same
    key reads it instead of measuring; an unreadable or corrupt file is logged and replaced, and so
    is one written by an older probe that lacks a figure (a file without
    ``pointwise_bytes_per_s`` would otherwise load with an assumed rate). A cache that cannot be
    written is logged and skipped: the cache never makes the probe fail.

    Args:
        device: the device whose links are measured: None (the current CUDA device when CUDA is
            available, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int ``N`` (meaning
            ``cuda:N``) or a ``torch.device``.
        nvme_dir: an existing, writable directory on the disk the NVMe tier would use; None
            measures no disk (see above).
        cache: read the cached model if there is one, and write what was measured.
        refresh: measure even if a cached model exists, and overwrite it (when ``cache``).
        nbytes: bytes per probe, an int or a string like ``"64MiB"``: each copy, the GELU input
            (at most 16 MiB on the CPU), and the disk file (then rounded up to 4 KiB and shrunk to
            fit). None: 256 MiB on CUDA, 64 MiB for a CPU copy, 256 MiB on disk. Small probes are
            quick but noisy.

    Returns:
        A :class:`HardwareModel` whose ``source`` starts with ``"measured"`` and says when, how and
        whether the disk was measured.

    Raises:
        TypeError: an argument has the wrong type (the message names it).
        ValueError: ``device`` is not a CPU or CUDA device, names a CUDA device that does not
            exist or CUDA is not available; ``nvme_dir`` does not exist, is not a directory or is
            not writable; ``nbytes`` is not a positive size.
        torch.OutOfMemoryError: the device has no room for two probe buffers (pass a smaller
            ``nbytes``).

    Example:
        >>> import tempfile
        >>> hw = probe_hardware(
        ...     device="cpu", nvme_dir=tempfile.gettempdir(), nbytes=1 << 20, cache=False)
        >>> hw.device_name, hw.copies_overlap_compute, hw.source.startswith("measured")
        ('cpu', False, True)
        >>> hw.h2d_bytes_per_s > 0 and hw.pointwise_bytes_per_s > 0 and hw.disk_read_bytes_per_s > 0
        True
    """
    for name, flag in (("cache", cache), ("refresh", refresh)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool (True or False); got {flag!r}")
    dev = _resolve_device(device)
    if nbytes is None:
        size: int | None = None
    else:
        size = parse_bytes(nbytes, name="nbytes", positive=True, or_none="the default sizes")
    directory: Path | None = None
    if nvme_dir is not None:
        if not isinstance(nvme_dir, (str, os.PathLike)):
            raise TypeError(
                f"nvme_dir must be a str or os.PathLike naming a directory, or None; got "
                f"{type(nvme_dir).__name__}"
            )
        directory = check_nvme_dir(nvme_dir)  # NvmeDirError, a ValueError naming nvme_dir

    gpu = _torch_gpus()[dev.index] if dev.type == "cuda" else None
    path = None
    if cache:
        path = _cache_path(_device_key(dev, gpu), directory, size)
        if path is not None and not refresh:
            cached = _read_cache(path)
            if cached is not None:
                _log_figures(cached, f"read from {path}")
                return cached

    stamp = f"measured on {socket.gethostname()} at {_utc_now()}"
    if gpu is None:
        copy_bytes = size or DEFAULT_CPU_PROBE_BYTES
        copy_bytes_per_s = _measure_host_copy(copy_bytes)
        gelu_numel = max(1, min(copy_bytes, MAX_CPU_POINTWISE_BYTES) // 4)  # float32
        pointwise_bytes_per_s = _measure_host_pointwise(gelu_numel)
        disk = _measure_disk(directory, size)
        hw = HardwareModel.cpu_only(
            copy_bytes_per_s=copy_bytes_per_s,
            disk_write_bytes_per_s=disk.write_bytes_per_s,
            disk_read_bytes_per_s=disk.read_bytes_per_s,
            pointwise_bytes_per_s=pointwise_bytes_per_s,
            source=(
                f"{stamp}: host memcpy of {format_bytes(copy_bytes)} and float32 GELU of "
                f"{format_bytes(4 * gelu_numel)}, medians of {PROBE_REPEATS} "
                f"({plural(torch.get_num_threads(), 'torch thread')}); {disk.note}"
            ),
        )
    else:
        copy_bytes = size or DEFAULT_CUDA_PROBE_BYTES
        h2d, d2h, duplex, pin_s_per_byte = _measure_cuda(dev, copy_bytes)
        # Read after the copies: an idle link trains down, so NVML's current figure is right now.
        link = _link_text(gpu["uuid"])
        pointwise_bytes_per_s = _measure_cuda_pointwise(dev, max(1, copy_bytes // 2))  # bf16
        disk = _measure_disk(directory, size)
        hw = HardwareModel(
            h2d_bytes_per_s=h2d,
            d2h_bytes_per_s=d2h,
            duplex_bytes_per_s=duplex,
            disk_write_bytes_per_s=disk.write_bytes_per_s,
            disk_read_bytes_per_s=disk.read_bytes_per_s,
            pointwise_bytes_per_s=pointwise_bytes_per_s,
            pinned_alloc_s_per_byte=pin_s_per_byte,
            copies_overlap_compute=True,
            device_name=str(gpu["name"]),
            link=link,
            source=(
                f"{stamp}: {dev}, pinned copies and bf16 GELU of {format_bytes(copy_bytes)}, "
                f"medians of {PROBE_REPEATS}; {disk.note}"
            ),
        )
    note = "not cached"
    disk_failed = directory is not None and not disk.measured
    # A failed disk probe left placeholder figures: not worth keeping for the next process.
    if path is not None and not disk_failed:
        note = _write_cache(path, hw)
    _log_figures(hw, note)
    return hw


def cached_hardware(device: torch.device | str | int | None = None) -> HardwareModel | None:
    """What ``probe_hardware(device=device)`` would read from its cache, or None when it would
    measure (so a caller can say that it measures only when it does).

    Example:
        >>> hw = cached_hardware("cpu")  # None: probe_hardware(device="cpu") would measure
        >>> hw is None or hw.source.startswith("measured")
        True
    """
    dev = _resolve_device(device)
    gpu = _torch_gpus()[dev.index] if dev.type == "cuda" else None
    path = _cache_path(_device_key(dev, gpu), None, None)
    return None if path is None else _read_cache(path)


QUICK_DISK_PROBE_BYTES = 64 << 20
"""The disk probe of :func:`with_measured_disk`: a quarter of the default, for a command line
that measures the disk at every run (a few tenths of a second on one NVMe drive)."""


def with_measured_disk(
    hw: HardwareModel, nvme_dir: str | os.PathLike[str], nbytes: int = QUICK_DISK_PROBE_BYTES
) -> HardwareModel:
    """``hw`` with its disk rates measured in ``nvme_dir`` (a probe file of ``nbytes``, shrunk
    to fit, then removed) in place of what it had (datasheet figures when its probe had no
    ``nvme_dir``); ``source`` says so.

    Raises:
        NvmeDirError: ``nvme_dir`` does not exist, is not a directory or is not writable.
        OSError: the disk probe failed (too little free space, an I/O error).
    """
    directory = check_nvme_dir(nvme_dir)
    r = measure_disk_bandwidth(directory, nbytes)
    disk = _disk_of(directory, r)
    placeholder = _measure_disk(None, None).note
    source = (
        hw.source.replace(placeholder, disk.note)
        if placeholder in hw.source
        else f"{hw.source}; disk rates replaced, measured again: {disk.note}"
    )
    return dataclasses.replace(
        hw,
        disk_write_bytes_per_s=disk.write_bytes_per_s,
        disk_read_bytes_per_s=disk.read_bytes_per_s,
        source=source,
    )


# ---------------------------------------------------------------------------------------------
# Arguments


def _resolve_device(device: object) -> torch.device:
    """``device`` as ``cpu`` or ``cuda:N`` with N set, or a TypeError / ValueError saying why not."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, bool):  # an int to Python, never meant as a device index
        raise TypeError(f"device must be one of {_DEVICE_ACCEPTED}; got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0; got {device}")
        dev = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device must be one of {_DEVICE_ACCEPTED}; got {device!r}") from e
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(f"device must be one of {_DEVICE_ACCEPTED}; got {type(device).__name__}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(
            f"device {str(dev)!r} cannot be probed: only CPU and CUDA devices can; "
            f"device must be one of {_DEVICE_ACCEPTED}"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(dev)!r} is a CUDA device, but CUDA is not available here (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); pass device='cpu' or None"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"device {str(dev)!r} does not exist: this process sees {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


# ---------------------------------------------------------------------------------------------
# Measurements


def _measure_host_copy(nbytes: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` between two CPU tensors of ``nbytes``: the memcpy a
    CPU-only "offload to cpu" runs in the caller's thread."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # written now, so no page fault is timed
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / max(statistics.median(times), 1e-9)


def _measure_host_pointwise(numel: int) -> float:
    """Bytes per second a float32 GELU of ``numel`` elements on the CPU reads plus writes, on
    torch's current threads, into a preallocated output: the kernel, not the allocator's page
    faults."""
    x = torch.linspace(-4.0, 4.0, numel)  # GELU's curved range, not one value
    y = torch.empty_like(x)
    torch.ops.aten.gelu.out(x, out=y)  # warm-up; it also faults in the output's pages
    times = []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        torch.ops.aten.gelu.out(x, out=y)
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / max(statistics.median(times), 1e-9)


def _measure_cuda(dev: torch.device, nbytes: int) -> tuple[float, float, float, float]:
    """H2D alone, D2H alone and both at once (bytes per second, the last a total), and pinned
    allocation seconds per byte, on ``dev``. The same copies as ``offload info`` times
    (``offload._info._measure_pcie_unchecked``), with the median instead of the best."""
    with torch.cuda.device(dev):
        # Device buffers first: they create the CUDA context, which must not land in the timed
        # pinned allocation.
        dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dev_src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)
        # torch's host allocator keeps freed pinned blocks; a cached one would time as free.
        _empty_host_cache()
        start_alloc = time.perf_counter()
        host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pin_s = time.perf_counter() - start_alloc
        host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host_src.fill_(1)  # touch the pages so no first-use cost lands in a timed copy
        host_dst.fill_(0)
        compute = torch.cuda.current_stream(dev)
        h2d_stream = torch.cuda.Stream(dev)
        d2h_stream = torch.cuda.Stream(dev)

        def timed(copies: list[_Copy]) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(compute)
            done = []
            for stream, dst, src in copies:
                # The copy streams wait on `start` so that all copies begin together, and after
                # the device buffers' initialisation on the compute stream.
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)  # marks this copy's end, for `end` to wait on
                done.append(ev)
            for ev in done:
                compute.wait_event(ev)  # `end` is recorded after every copy has finished
            end.record(compute)
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        def median_s(copies: list[_Copy]) -> float:
            timed(copies)  # warm-up
            return max(statistics.median(timed(copies) for _ in range(PROBE_REPEATS)), 1e-9)

        h2d_s = median_s([(h2d_stream, dev_dst, host_src)])
        d2h_s = median_s([(d2h_stream, host_dst, dev_src)])
        both_s = median_s([(h2d_stream, dev_dst, host_src), (d2h_stream, host_dst, dev_src)])
        # The buffers were used on the side streams; every copy is complete after the
        # synchronize in timed(), so freeing them here (no record_stream) reuses nothing early.
        torch.cuda.synchronize(dev)
        del host_src, host_dst, dev_src, dev_dst
    # Give back what the probe held: 2 x nbytes on the device and 2 x nbytes pinned on the host.
    torch.cuda.empty_cache()
    _empty_host_cache()
    # torch pins a power of two at least as large as the request: that is what was paid for.
    pinned = 1 << max(0, nbytes - 1).bit_length()
    return nbytes / h2d_s, nbytes / d2h_s, 2 * nbytes / both_s, pin_s / pinned


def _measure_cuda_pointwise(dev: torch.device, numel: int) -> float:
    """Bytes per second a bf16 GELU of ``numel`` elements on ``dev`` reads plus writes, into a
    preallocated output so that no allocation is timed."""
    with torch.cuda.device(dev):
        x = torch.linspace(-4.0, 4.0, numel, dtype=torch.bfloat16, device=dev)
        y = torch.empty_like(x)
        stream = torch.cuda.current_stream(dev)

        def timed(x: torch.Tensor, y: torch.Tensor) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            # On the stream the kernels run on: after x's initialisation, before the first GELU.
            start.record(stream)
            for _ in range(CUDA_POINTWISE_LAUNCHES):
                torch.ops.aten.gelu.out(x, out=y)
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / CUDA_POINTWISE_LAUNCHES

        timed(x, y)  # warm-up: loads the kernel (CUDA loads modules lazily)
        seconds = max(statistics.median(timed(x, y) for _ in range(PROBE_REPEATS)), 1e-9)
        del x, y  # used only on `stream`, where all is complete after end.synchronize()
    torch.cuda.empty_cache()  # give back the input and output the probe held
    return 2 * numel * torch.bfloat16.itemsize / seconds


def _empty_host_cache() -> None:
    # Private, and absent from some builds: without it the allocation may time a cached block.
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _link_text(uuid: str) -> str:
    """``"PCIe Gen5 x16"`` from NVML (looked up by UUID: NVML ignores CUDA_VISIBLE_DEVICES), with
    the current link added when it runs below its maximum; ``"unknown link"`` without NVML."""
    if not uuid:
        return "unknown link"
    nvml = _nvml_info([uuid])
    devices = nvml.get("devices") or [{}]
    pcie = devices[0].get("pcie") or {}
    gen, width = pcie.get("max_generation"), pcie.get("max_width")
    if not nvml.get("available") or not gen or not width:
        return "unknown link"
    text = f"PCIe Gen{gen} x{width}"
    cur_gen, cur_width = pcie.get("current_generation"), pcie.get("current_width")
    if cur_gen and cur_width and (cur_gen, cur_width) != (gen, width):
        text += f" (Gen{cur_gen} x{cur_width} when probed)"
    return text


def _device_key(dev: torch.device, gpu: dict[str, Any] | None) -> str:
    return "cpu" if gpu is None else f"{gpu['name']} {gpu['uuid'] or dev}"


def _measure_disk(directory: Path | None, nbytes: int | None) -> _Disk:
    assumed = HardwareModel.h200()  # its disk figures: one NVMe Gen4 x4 drive's datasheet
    placeholder = (
        f"assumed NVMe Gen4 datasheet figures ({assumed.disk_write_bytes_per_s / 1e9:.1f} GB/s "
        f"write, {assumed.disk_read_bytes_per_s / 1e9:.1f} GB/s read)"
    )
    if directory is None:
        return _Disk(
            assumed.disk_write_bytes_per_s,
            assumed.disk_read_bytes_per_s,
            f"disk not measured (no nvme_dir): {placeholder}",
            measured=False,
        )
    try:
        r = measure_disk_bandwidth(directory, nbytes or DEFAULT_DISK_PROBE_BYTES)
    except OSError as e:  # StorageFullError (too little free space), EIO, ...
        log.warning(
            "%s: the disk probe in %s failed (%s); planning with %s",
            _LOG_PREFIX,
            directory,
            e,
            placeholder,
        )
        return _Disk(
            assumed.disk_write_bytes_per_s,
            assumed.disk_read_bytes_per_s,
            f"disk probe in {directory} failed ({type(e).__name__}): {placeholder}",
            measured=False,
        )
    return _disk_of(directory, r)


def _disk_of(directory: Path, r: dict[str, Any]) -> _Disk:
    """The rates of a :func:`storage.measure_disk_bandwidth` result, and how they were taken."""
    shrunk = " (shrunk to fit the free space)" if r["nbytes"] < r["requested_nbytes"] else ""
    return _Disk(
        r["write_gbps"] * 1e9,
        r["read_gbps"] * 1e9,
        f"disk {directory}: {format_bytes(r['nbytes'])}{shrunk}, {r['io_mode']}, "
        f"{plural(r['threads'], 'thread')}",
        measured=True,
    )


# ---------------------------------------------------------------------------------------------
# Cache


def _cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative path is invalid and ignored
        return Path(xdg) / "offload"
    return Path.home() / ".cache" / "offload"


def _cache_path(device_key: str, directory: Path | None, nbytes: int | None) -> Path | None:
    """The cache file for this key, or None (logged) when no cache directory can be named."""
    host = socket.gethostname()
    key = {
        "host": host,
        "device": device_key,
        "torch": torch.__version__,
        "nvme_dir": None if directory is None else os.path.realpath(directory),
        "nbytes": nbytes,  # a small probe's noisy figures must not stand in for a default one's
        # CPU copies are timed with torch's thread count: one thread's figures are not four's.
        "threads": torch.get_num_threads() if device_key == "cpu" else None,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    device_slug = "cpu" if device_key == "cpu" else device_key.rsplit(" ", 1)[0]
    name = f"hardware-{_slug(host)}-{_slug(device_slug)}-{digest}.json"
    try:
        return _cache_dir() / name
    except RuntimeError as e:  # Path.home(): no HOME and no passwd entry
        log.warning("%s: no cache directory (%s); set %s to cache", _LOG_PREFIX, e, CACHE_ENV)
        return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")[:40] or "x"


def _read_cache(path: Path) -> HardwareModel | None:
    try:
        data = read_json(path)
        hw = HardwareModel.from_dict(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:  # unreadable, not JSON, another schema, ...
        log.warning("%s: ignoring the cache file %s (%s); measuring again", _LOG_PREFIX, path, e)
        return None
    # HardwareModel.save writes every field, so a field the file lacks was added to the model
    # after an older probe wrote it, and from_dict filled it with an assumed figure (the
    # pointwise rate: 0.4e12 whatever the device). A cached model must be all measured.
    missing = sorted({f.name for f in fields(HardwareModel)} - set(data))
    if missing:
        log.info(
            "%s: the cache file %s was written by an older probe (no %s); measuring again",
            _LOG_PREFIX,
            path,
            ", ".join(missing),
        )
        return None
    return hw


def _write_cache(path: Path, hw: HardwareModel) -> str:
    """Write ``hw`` to ``path`` (atomically); a failure is logged, never raised. Returns a note."""
    try:
        # Only the last directory gets 0700 (os.makedirs applies the mode to it, the umask to
        # the parents): the cache names this host's hardware, nobody else's business.
        os.makedirs(path.parent, mode=0o700, exist_ok=True)
        hw.save(path)
    except OSError as e:
        log.warning("%s: could not write the cache file %s (%s)", _LOG_PREFIX, path, e)
        return "not cached"
    return f"cached in {path}"


# ---------------------------------------------------------------------------------------------
# Text


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gbps(rate: float) -> str:
    return "ideal" if math.isinf(rate) else f"{rate / 1e9:.2f} GB/s"


def _log_figures(hw: HardwareModel, note: str) -> None:
    if hw.copies_overlap_compute:
        links = (
            f"h2d {_gbps(hw.h2d_bytes_per_s)}, d2h {_gbps(hw.d2h_bytes_per_s)}, both "
            f"{_gbps(hw.duplex_bytes_per_s)} total, pinned alloc "
            f"{hw.pinned_alloc_s_per_byte * (1 << 30):.2f} s/GiB ({hw.link})"
        )
    else:
        links = f"host memcpy {_gbps(hw.h2d_bytes_per_s)}"
    log.info(
        "%s %s: %s; GELU %s (in + out); disk write %s, read %s; %s; %s",
        _LOG_PREFIX,
        hw.device_name,
        links,
        _gbps(hw.pointwise_bytes_per_s),
        _gbps(hw.disk_write_bytes_per_s),
        _gbps(hw.disk_read_bytes_per_s),
        note,
        hw.source,
    )
