"""What this machine's hardware is, asked of torch, NVML and the file system.

``probe_hardware`` (the GPU's name and link), the manager (``check_nvme_dir`` on ``nvme_dir``)
and ``offload info`` (:mod:`offload.cli._node_report`, which adds host memory, disk and kvikio)
ask here. Nothing here runs at import: CUDA is touched only by the functions that measure it, and
NVML (from nvidia-ml-py) is imported lazily and its absence is reported, not raised.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

PCIE_REPEATS = 3
_GIB = 1 << 30

# PCIe raw rate per lane in GT/s and line-code efficiency, by generation: 8b/10b for Gen1-2,
# 128b/130b for Gen3-5, FLIT mode (242 of 256 bytes carry data) for Gen6.
_PCIE_GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
_PCIE_ENCODING = {1: 8 / 10, 2: 8 / 10, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}


class NvmeDirError(ValueError):
    """``nvme_dir`` names no directory this process can write to.

    Attributes:
        path: the directory as given.
        problem: what is wrong with it, in words.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"nvme_dir {path!r}: {problem}; give an existing, writable directory")


def pcie_gb_per_s(generation: int | None, width: int | None) -> float | None:
    """Theoretical bytes per second in one direction, in GB/s: GT/s x lanes x encoding / 8.

    Example:
        >>> round(pcie_gb_per_s(5, 16), 1)
        63.0
    """
    if not generation or not width or generation not in _PCIE_GT_PER_S:
        return None
    return _PCIE_GT_PER_S[generation] * width * _PCIE_ENCODING[generation] / 8


def check_nvme_dir(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` resolved if it is an existing directory that accepts a new file.

    Raises:
        NvmeDirError: it does not exist, is not a directory, or a file cannot be created in it.
    """
    given = os.fspath(path)
    if not given.strip():
        # Path("") is the working directory: an empty setting would spill there.
        raise NvmeDirError(given, "is empty (an empty path is not taken for the working directory)")
    p = Path(given).expanduser()
    if not p.exists():
        raise NvmeDirError(given, "does not exist")
    if not p.is_dir():
        raise NvmeDirError(given, "is not a directory")
    # Creating a file is the real test: os.access says yes to root on a read-only mount.
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-info-check-", dir=p)
    except OSError as e:
        # ENOENT for an existing directory: a virtual file system (/proc, /sys) refuses files.
        virtual = "; a virtual file system such as /proc holds no files" * (e.errno == errno.ENOENT)
        code = errno.errorcode.get(e.errno or 0, "?")
        raise NvmeDirError(
            given,
            f"is not writable: creating a file in it failed ({code}: {e.strerror or e}{virtual})",
        ) from e
    os.close(fd)
    os.unlink(probe)
    return p.resolve()


def _torch_gpus() -> list[dict[str, Any]]:
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", "") or "")
        if uuid and not uuid.startswith(("GPU-", "MIG-")):
            uuid = "GPU-" + uuid  # torch prints the bare UUID; NVML wants the prefix
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "total_memory_bytes": int(p.total_memory),
                "capability": f"{p.major}.{p.minor}",
                "uuid": uuid,
            }
        )
    return gpus


def _nvml_info(uuids: list[str] | None) -> dict[str, Any]:
    """NVML's view: driver, and per device name, memory and PCIe link.

    ``uuids`` are torch's visible devices, looked up by UUID because NVML numbers every GPU of
    the node and ignores CUDA_VISIBLE_DEVICES; None lists all NVML devices (torch cannot use
    CUDA, but the node may still have GPUs, which is worth saying).
    """
    try:
        import pynvml
    except ImportError as e:
        return {"available": False, "error": f"nvidia-ml-py is not installed ({e})"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, any NVMLError, OSError
        return {"available": False, "error": str(e) or type(e).__name__}
    try:
        out: dict[str, Any] = {
            "available": True,
            "driver_version": _nvml_call(pynvml.nvmlSystemGetDriverVersion),
        }
        cuda_driver = _nvml_call(pynvml.nvmlSystemGetCudaDriverVersion)
        if isinstance(cuda_driver, int):
            out["driver_cuda_version"] = f"{cuda_driver // 1000}.{cuda_driver % 1000 // 10}"
        out["device_count"] = _nvml_call(pynvml.nvmlDeviceGetCount)
        devices = []
        if uuids is None:
            for i in range(out["device_count"] or 0):
                devices.append(
                    _nvml_device(pynvml, lambda i=i: pynvml.nvmlDeviceGetHandleByIndex(i))
                )
        else:
            for uuid in uuids:
                devices.append(
                    _nvml_device(pynvml, lambda u=uuid: pynvml.nvmlDeviceGetHandleByUUID(u))
                )
        out["devices"] = devices
        return out
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_call(fn: Any, *args: Any) -> Any:
    """One NVML query; None when the device or driver does not support it."""
    try:
        value = fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: one missing field, not a failure
        return None
    return value.decode() if isinstance(value, bytes) else value


def _nvml_device(pynvml: Any, get_handle: Any) -> dict[str, Any]:
    try:
        h = get_handle()
    except Exception as e:
        return {"error": f"NVML has no such device ({e})"}
    dev: dict[str, Any] = {
        "name": _nvml_call(pynvml.nvmlDeviceGetName, h),
        "uuid": _nvml_call(pynvml.nvmlDeviceGetUUID, h),
    }
    mem = _nvml_call(pynvml.nvmlDeviceGetMemoryInfo, h)
    if mem is not None:
        dev["memory_total_bytes"] = int(mem.total)
        dev["memory_used_bytes"] = int(mem.used)
    cur_gen = _nvml_call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
    cur_width = _nvml_call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h)
    max_gen = _nvml_call(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
    max_width = _nvml_call(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h)
    dev["pcie"] = {
        "current_generation": cur_gen,
        "current_width": cur_width,
        "max_generation": max_gen,
        "max_width": max_width,
        "gpu_max_generation": _nvml_call(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, h),
        # Links train down when idle, so the current figure can read low: the max is the one
        # to compare measurements with.
        "current_theoretical_gb_per_s": pcie_gb_per_s(cur_gen, cur_width),
        "max_theoretical_gb_per_s": pcie_gb_per_s(max_gen, max_width),
    }
    return dev


def _measure_pcie(nbytes: int) -> dict[str, Any]:
    """Pinned copies on the current device, timed with CUDA events: H2D alone, D2H alone, both
    at once (best of 3 after a warm-up)."""
    device = "cuda"
    try:
        index = torch.cuda.current_device()
        device = f"cuda:{index}"
        return _measure_pcie_unchecked(index, nbytes)
    except Exception as e:  # out of memory, a broken driver: report, keep the rest of the info
        return {"device": device, "error": f"{type(e).__name__}: {e}"}
    finally:
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def _measure_pcie_unchecked(device_index: int, nbytes: int) -> dict[str, Any]:
    dev = torch.device("cuda", device_index)
    with torch.cuda.device(dev):
        # Device buffers first: they create the CUDA context, whose start-up would otherwise be
        # timed as the pinned allocation's.
        dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dev_src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pin_s = time.perf_counter() - t0
        host_src.fill_(1)  # touch the pages so no first-use cost lands in a timed copy
        host_dst.fill_(0)
        compute = torch.cuda.current_stream(dev)
        h2d = torch.cuda.Stream(dev)
        d2h = torch.cuda.Stream(dev)

        def timed(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(compute)
            done = []
            for stream, dst, src in copies:
                # The copy streams wait on `start` so all copies begin together and after the
                # buffers' initialisation on the compute stream.
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                done.append(ev)
            for ev in done:
                compute.wait_event(ev)  # `end` comes after every copy
            end.record(compute)
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        def best(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> float:
            timed(copies)  # warm-up
            return min(timed(copies) for _ in range(PCIE_REPEATS))

        h2d_s = best([(h2d, dev_dst, host_src)])
        d2h_s = best([(d2h, host_dst, dev_src)])
        both_s = best([(h2d, dev_dst, host_src), (d2h, host_dst, dev_src)])
        # The buffers were used on the side streams; everything is complete after the
        # synchronize in timed(), so freeing them here reuses nothing early.
        torch.cuda.synchronize(dev)
        del host_src, host_dst, dev_src, dev_dst
    return {
        "device": str(dev),
        "probe_bytes": nbytes,
        "repeats": PCIE_REPEATS,
        "h2d_gb_per_s": nbytes / h2d_s / 1e9,
        "d2h_gb_per_s": nbytes / d2h_s / 1e9,
        "both_gb_per_s": 2 * nbytes / both_s / 1e9,
        "pinned_alloc_s_per_gib": pin_s / (2 * nbytes / _GIB),
    }


def _filesystem_of(directory: Path) -> dict[str, str] | None:
    """The mount holding ``directory`` (the longest mount point that is a prefix of it)."""
    try:
        parts = psutil.disk_partitions(all=True)
    except Exception:
        return None
    target = str(directory)

    def holds(mountpoint: str) -> bool:
        mp = mountpoint.rstrip("/")
        return mp == "" or target == mp or target.startswith(mp + "/")

    candidates = [p for p in parts if holds(p.mountpoint)]
    if not candidates:
        return None
    best = max(candidates, key=lambda p: len(p.mountpoint.rstrip("/")))
    return {"type": best.fstype, "device": best.device, "mountpoint": best.mountpoint}
