"""Training-step time and memory of the offload runtime against its anchors, in one run.

Run (CPU, the default without CUDA; about a minute on 2 cores):
    python benchmarks/bench_step.py [--config cpu-tiny] [--steps 9] [--warmup 2]
        [--max-inflight-bytes 8MiB] [--nvme-dir DIR] [--out benchmarks/results/cpu]
Run (GPU, bf16 autocast; see benchmarks/gpu_check.sh):
    python benchmarks/bench_step.py --config h2048 --nvme-dir /path/on/nvme --out DIR

One GPT-style model (``examples/gpt.py``, identical weights for every variant) runs the same
batch, round robin (the first variant rotates each round, to cancel drift), through ``none``
(plain forward and backward, the reference), ``checkpoint`` (every block under non-reentrant
``torch.utils.checkpoint``), ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu``, pinned only
with CUDA), ``offload_cpu`` and ``offload_nvme`` (``offload.ActivationOffloader`` with one tier,
min-memory mode; ``--max-inflight-bytes`` bounds the copies in flight and the reload look-ahead).

Per variant: step time (median, min, max of --steps timed steps after --warmup; on GPU between
``torch.cuda.synchronize`` calls), ratio to ``none``, forward and backward time, peak memory,
the runtime's StepStats, and whether the gradients after steps 1 and 2 are bitwise equal to
``none``'s (reported, not asserted). Peak memory: on CUDA ``max_memory_allocated`` minus the
allocation at the step's start; on CPU the peak bytes of tensors allocated during one extra,
untimed step and alive at once (a ``TorchDispatchMode``; host-pool regions are not allocated by
the step). The no-offload saved bytes come from ``offload.profile``.

Raw limits, measured in the same run. CUDA: pinned H2D, D2H and both at once (``offload info``'s
probe), giving the transfer bound ``max(T_fwd, bytes / B_d2h) + max(T_bwd, bytes / B_h2d)``
(``T_*`` of ``none``, ``bytes`` of ``offload_cpu``). Every machine: ``measure_disk_bandwidth``
on the NVMe directory, interleaved with ``storage.NvmeTier`` writing and reading the record sizes
of the last warm-up NVMe step from 4 KiB-aligned host regions, checksums on. With O_DIRECT
neither fsyncs (like for like); in buffered mode the raw probe fsyncs and drops the cache, the
tier does neither. The tier sends a record in requests of up to 16 MiB (4 checksum chunks),
smaller where that would idle one of its I/O threads; the raw probe runs at its default request
size and, where it differs, at the byte-weighted median of the tier's requests. The issue's
target: the tier >= 80% of raw both ways into a fresh file (as the raw probe writes a new,
preallocated one); later steps reuse written ranges, reported alongside.

Writes ``<stem>.json`` and ``<stem>.md`` into --out (default ``benchmarks/results/cpu`` or
``benchmarks/results/<gpu name>``; stem ``step`` for cpu-tiny, else ``step-<config>``, then
``-custom`` when a shape flag changed it and ``-window<size>`` with --max-inflight-bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import inspect
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import storage
from offload._info import _filesystem_of, _measure_pcie_unchecked, _nvml_info, _torch_gpus
from offload._live import LiveBytes
from offload.lifecycle._units import parse_bytes
from offload.storage._nvme import _pieces  # the tier's request split, to size the raw comparison
from offload.storage._units import round_up

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30

# cpu-tiny keeps a 2-core run near a minute, with saved activations of 1 MiB and more (the
# default min_offload_bytes applies); h2048 / h4096 are sized for one H200 under bf16.
CONFIGS: dict[str, dict[str, int]] = {
    "cpu-tiny": dict(vocab=256, layers=4, heads=4, d_model=128, seq=256, batch=8),
    "h2048": dict(vocab=32768, layers=8, heads=16, d_model=2048, seq=2048, batch=2),
    "h4096": dict(vocab=32768, layers=4, heads=32, d_model=4096, seq=2048, batch=2),
}
LABELS = {"none": "no offload", "checkpoint": "checkpoint every block",
    "save_on_cpu": "torch save_on_cpu", "offload_cpu": "offload, tiers=('cpu',)",
    "offload_nvme": "offload, tiers=('nvme',)"}  # fmt: skip
VARIANTS = tuple(LABELS)


def _default(fn: Callable[..., Any], name: str) -> Any:
    return inspect.signature(fn).parameters[name].default


NVME_IO_THREADS = _default(storage.NvmeTier, "io_threads")
RAW_CHUNK_BYTES = _default(storage.measure_disk_bandwidth, "chunk_bytes")
DEFAULT_MIN_OFFLOAD = _default(offload.ActivationOffloader, "min_offload_bytes")
TARGET_TIER_SHARE = 0.80  # the target: NVMe tier >= 80% of the raw disk bandwidth
OFFLOAD_STATS = ("bytes_offloaded_cpu", "bytes_offloaded_nvme", "records_offloaded_cpu",
    "records_offloaded_nvme", "records", "records_kept", "records_deduplicated", "reloads",
    "stalls", "stall_s", "prefetch_lead_s_p50", "backpressure_waits")  # fmt: skip
ZERO_IN_STEADY_STATE = ("fallbacks", "host_allocations", "unplanned_records")  # summed
CONFIG_ARGS = ("autocast", "warmup", "steps", "variants", "min_offload_bytes",
    "max_inflight_bytes", "nvme_base")  # fmt: skip
IoLog = dict[str, list[tuple[int, float, list[float]]]]  # (bytes, submitted, [completed])

# ---------------------------------------------------------------------------------------------
# Variants and one step


class CheckpointedBlock(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


@dataclass
class Variant:
    name: str
    model: GPT
    context: Callable[[], contextlib.AbstractContextManager[Any]]  # the offloaders use `mgr`
    mgr: offload.ActivationOffloader | None = None
    times: list[tuple[float, float, float]] = field(default_factory=list)  # fwd, bwd, step
    peaks: list[int] = field(default_factory=list)  # CUDA: above the step's start; CPU: live
    stats: list[dict[str, Any]] = field(default_factory=list)
    exact: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    total_stats: dict[str, Any] | None = None


def build_variants(args: argparse.Namespace, base: GPT, nvme_dir: str) -> list[Variant]:
    out = []
    for name in args.variants:
        model = copy.deepcopy(base)  # identical weights; the tied head stays tied
        ctx: Callable[[], Any] = contextlib.nullcontext
        mgr = None
        if name == "checkpoint":
            model.blocks = nn.ModuleList(CheckpointedBlock(b) for b in model.blocks)
        elif name == "save_on_cpu":
            pin = args.device.type == "cuda"
            ctx = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=pin)
        elif name.startswith("offload_"):
            nvme = name == "offload_nvme"
            mgr = offload.ActivationOffloader(
                model, tiers=("nvme",) if nvme else ("cpu",), nvme_dir=nvme_dir if nvme else None,
                min_offload_bytes=args.min_offload_bytes,
                max_inflight_bytes=args.max_inflight_bytes,
            )  # fmt: skip
        out.append(Variant(name, model, ctx, mgr))
    return out


def run_step(
    args: argparse.Namespace, v: Variant, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, float, float, int]:
    """One training step: (fwd_s, bwd_s, step_s, CUDA peak above the step's start).

    On CUDA the step is bracketed by ``synchronize`` and timed on the host (host waits count);
    forward and backward are split by CUDA events, which never synchronise mid-step.
    """
    cuda = args.device.type == "cuda"
    v.model.zero_grad(set_to_none=True)
    amp: Any = contextlib.nullcontext()
    if args.autocast == "bf16":
        amp = torch.autocast(args.device.type, dtype=torch.bfloat16)
    if cuda:
        torch.cuda.reset_peak_memory_stats(args.device)
        base = torch.cuda.memory_allocated(args.device)
        torch.cuda.synchronize(args.device)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
    t0 = time.perf_counter()
    with v.mgr if v.mgr is not None else v.context(), amp:
        loss = v.model.loss(*batch)
    t1 = time.perf_counter()
    if cuda:
        ev[1].record()
    loss.backward()
    if cuda:
        ev[2].record()
        torch.cuda.synchronize(args.device)
    t2 = time.perf_counter()
    v.losses.append(loss.item())
    if not cuda:
        return t1 - t0, t2 - t1, t2 - t0, 0
    peak = torch.cuda.max_memory_allocated(args.device) - base
    return ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3, t2 - t0, peak


def compare_grads(
    ref: list[torch.Tensor | None], model: nn.Module, names: list[str]
) -> dict[str, Any]:
    """Bitwise comparison of ``model``'s gradients with ``ref`` (parameters in the same order)."""
    diffs: dict[str, float] = {}  # parameter name -> max |difference|
    for name, r, p in zip(names, ref, model.parameters(), strict=True):
        if r is None or p.grad is None:
            if (r is None) != (p.grad is None):
                diffs[name] = math.inf
        elif not torch.equal(r, p.grad):
            diffs[name] = (r.double() - p.grad.double()).abs().max().item()
    return dict(
        bitwise_equal=not diffs, mismatched_tensors=len(diffs), first_mismatched=list(diffs)[:3],
        max_abs_diff=max(diffs.values(), default=0.0),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Raw limits


class TierProbe:
    """Writes then reads ``sizes`` through ``storage.NvmeTier`` from 4 KiB-aligned regions of a
    host pool (as the GPU path hands it staging regions), checksums on, no fsync. ``fresh=True``
    opens a new tier, so the writes land in new file space (its growth, ``posix_fallocate``, is
    timed, as in a first step); ``fresh=False`` reuses the ranges written, as later steps do."""

    def __init__(self, directory: str, sizes: list[int]) -> None:
        self.directory, self.nbytes = directory, sum(sizes)
        padded = sum(round_up(n) for n in sizes)
        self.pool = storage.HostPool(2 * padded + 2 * max(sizes) + (512 << 20), pin_memory=False)
        self.tier: storage.NvmeTier | None = None
        gen = torch.Generator().manual_seed(2)
        pattern = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8, generator=gen)
        self.sources = [self.pool.allocate(n) for n in sizes]
        for r, n in zip(self.sources, sizes, strict=True):
            r.tensor.copy_(pattern[:n])
        self.dests = [self.pool.allocate(n) for n in sizes]
        self.round_trip_exact = True

    def run(self, *, fresh: bool) -> tuple[float, float]:
        """(write_s, read_s) of one round trip of every record."""
        if fresh or self.tier is None:
            if self.tier is not None:
                self.tier.close()
            self.tier = storage.NvmeTier(self.directory, pool=self.pool)
        tier = self.tier
        t0 = time.perf_counter()
        handles = [tier.write(r) for r in self.sources]
        for h in handles:
            h.wait()
        t1 = time.perf_counter()
        for t in [tier.read(h, d) for h, d in zip(handles, self.dests, strict=True)]:
            t.wait()
        t2 = time.perf_counter()
        for h in handles:
            tier.free(h)
        for s, d in zip(self.sources, self.dests, strict=True):
            self.round_trip_exact &= torch.equal(s.tensor, d.tensor)
            d.tensor.zero_()
        return t1 - t0, t2 - t1

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        self.pool.close()  # releases the regions too


@contextlib.contextmanager
def record_nvme_io() -> Iterator[IoLog]:
    """Log every ``storage.NvmeTier`` write and read made inside (patches the class meanwhile)."""
    log: IoLog = {"write": [], "read": []}
    write, read = storage.NvmeTier.write, storage.NvmeTier.read

    def spy(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def logged(self: storage.NvmeTier, *args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            result = fn(self, *args, **kw)  # write -> StoredHandle, read(handle, ...) -> Transfer
            handle, done = (result, result.written) if kind == "write" else (args[0], result)
            entry: tuple[int, float, list[float]] = (handle.nbytes, t0, [])
            done.add_done_callback(lambda _t: entry[2].append(time.perf_counter()))
            log[kind].append(entry)
            return result

        return logged

    storage.NvmeTier.write, storage.NvmeTier.read = spy("write", write), spy("read", read)  # type: ignore[method-assign]
    try:
        yield log
    finally:
        storage.NvmeTier.write, storage.NvmeTier.read = write, read  # type: ignore[method-assign]


def io_rate(entries: list[tuple[int, float, list[float]]]) -> dict[str, Any] | None:
    """Bytes / (last completion - first submission) of logged tier I/O."""
    done = [e for e in entries if e[2]]
    if not done:
        return None
    span = max(e[2][0] for e in done) - min(e[1] for e in done)
    n = sum(e[0] for e in done)
    return {"records": len(done), "nbytes": n, "span_s": span, "gbps": n / max(span, 1e-9) / 1e9}


def weighted_median(sizes: list[int]) -> int:
    """The size that the byte-weighted median byte moves in."""
    acc = 0
    for n in sorted(sizes):
        acc += n
        if 2 * acc >= sum(sizes):
            return n
    return 0


def _rates(samples: list[dict[str, Any]]) -> dict[str, Any]:
    w, r = [s["write_gbps"] for s in samples], [s["read_gbps"] for s in samples]
    return dict(
        chunk_bytes=samples[0]["chunk_bytes"], write_gbps=statistics.median(w),
        read_gbps=statistics.median(r), write_gbps_samples=w, read_gbps_samples=r,
    )  # fmt: skip


def measure_limits(
    args: argparse.Namespace, variants: list[Variant], nvme_dir: str, nvme_log: IoLog | None
) -> dict[str, Any]:
    """PCIe (CUDA), raw disk and NVMe-tier bandwidth, sized from the last warm-up step."""
    oc = next((v for v in variants if v.name == "offload_cpu"), None)
    step_cpu_bytes = oc.stats[-1]["bytes_offloaded_cpu"] if oc else 0
    out: dict[str, Any] = {"pcie": None, "nvme_tier": None}
    if args.device.type == "cuda":  # no empty_cache after: the variants' cached blocks stay
        nbytes = min(max(step_cpu_bytes, 64 * MiB), args.pcie_max_bytes)
        out["pcie"] = _measure_pcie_unchecked(args.device.index, nbytes)

    sizes = [e[0] for e in nvme_log["write"]] if nvme_log else []
    out["nvme_step_records"] = dict(
        records=len(sizes), nbytes=sum(sizes), largest_bytes=max(sizes, default=0),
        smallest_bytes=min(sizes, default=0),
        in_step_write=io_rate(nvme_log["write"]) if nvme_log else None,
        in_step_read=io_rate(nvme_log["read"]) if nvme_log else None,
    )  # fmt: skip
    # The probe replays the step's records, repeated up to the floor and cut at the cap.
    probe_sizes: list[int] = []
    for n in sizes * max(1, -(-args.probe_min_bytes // max(1, sum(sizes)))):
        if probe_sizes and sum(probe_sizes) + n > args.disk_max_bytes:
            break
        probe_sizes.append(n)
    disk_bytes = sum(probe_sizes) or min(
        max(step_cpu_bytes, args.probe_min_bytes), args.disk_max_bytes
    )
    requests = [
        e - s for n in probe_sizes for _, s, _, e in _pieces(n, round_up(n), NVME_IO_THREADS)
    ]
    tier_chunk = weighted_median(requests) if requests else RAW_CHUNK_BYTES

    raw_probe = functools.partial(
        storage.measure_disk_bandwidth, nvme_dir, nbytes=disk_bytes, threads=NVME_IO_THREADS
    )
    raw, raw_at_tier, fresh, reused = [], [], [], []  # type: ignore[var-annotated]
    probe = TierProbe(nvme_dir, probe_sizes) if probe_sizes else None

    def tier_round() -> None:  # into a new file, then over the ranges it wrote
        fresh.append(probe.run(fresh=True))
        reused.append(probe.run(fresh=False))

    runs = [lambda: raw.append(raw_probe(chunk_bytes=RAW_CHUNK_BYTES))]
    if tier_chunk != RAW_CHUNK_BYTES:
        runs.append(lambda: raw_at_tier.append(raw_probe(chunk_bytes=tier_chunk)))
    runs += [tier_round] if probe is not None else []
    try:  # interleaved and rotated, so drift in the disk's speed hits every figure alike
        for i in range(args.io_repeats):
            for run_one in runs[i % len(runs) :] + runs[: i % len(runs)]:
                run_one()
        direct_io = probe.tier.direct_io if probe and probe.tier else None
    finally:
        if probe is not None:
            probe.close()
    keys = ("nbytes", "io_mode", "direct_io", "direct_io_note", "threads")
    disk = out["disk_raw"] = {
        **{k: raw[0][k] for k in keys},
        **_rates(raw),
        "at_tier_request_size": _rates(raw_at_tier or raw),
    }
    if probe is None:
        return out
    at_tier = disk["at_tier_request_size"]

    def summary(times: list[tuple[float, float]]) -> dict[str, Any]:
        w = [probe.nbytes / t[0] / 1e9 for t in times]
        r = [probe.nbytes / t[1] / 1e9 for t in times]
        wm, rm = statistics.median(w), statistics.median(r)
        return dict(
            write_gbps=wm, read_gbps=rm, write_gbps_samples=w, read_gbps_samples=r,
            write_share_of_raw=wm / disk["write_gbps"], read_share_of_raw=rm / disk["read_gbps"],
            write_share_of_raw_at_tier_request_size=wm / at_tier["write_gbps"],
            read_share_of_raw_at_tier_request_size=rm / at_tier["read_gbps"],
        )  # fmt: skip

    out["nvme_tier"] = dict(
        records=len(probe_sizes), nbytes=probe.nbytes, direct_io=direct_io,
        io_threads=NVME_IO_THREADS, requests=len(requests), request_bytes_min=min(requests),
        request_bytes_max=max(requests), request_bytes_weighted_median=tier_chunk,
        round_trip_exact=probe.round_trip_exact, fresh_file=summary(fresh),
        reused_ranges=summary(reused),
    )  # fmt: skip
    return out


def machine(args: argparse.Namespace) -> dict[str, Any]:
    """CPU, GPU (torch + NVML via ``offload info``'s helpers), the NVMe directory's disk, load."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    target = os.path.realpath(args.nvme_base)
    fs = _filesystem_of(Path(target)) or {}
    usage = psutil.disk_usage(target)
    disk: dict[str, Any] = dict(
        path=target, filesystem=fs.get("type"), device=fs.get("device"),
        mountpoint=fs.get("mountpoint"), free_bytes=usage.free, total_bytes=usage.total,
    )  # fmt: skip
    sys_block = f"/sys/class/block/{os.path.basename(os.path.realpath(fs.get('device', '-')))}"
    if os.path.exists(f"{sys_block}/partition"):
        sys_block = os.path.dirname(os.path.realpath(sys_block))
    disk["block_device"] = os.path.basename(sys_block)
    for key, rel in (("model", "device/model"), ("rotational", "queue/rotational")):
        with contextlib.suppress(OSError), open(f"{sys_block}/{rel}") as f:
            disk[key] = f.read().strip()
    gpu = None
    if args.device.type == "cuda":
        gpu = {**_torch_gpus()[args.device.index], "cuda": torch.version.cuda}
        nvml = _nvml_info([gpu["uuid"]])
        gpu.update(driver=nvml.get("driver_version"), nvml_error=nvml.get("error"))
        gpu["pcie"] = (nvml.get("devices") or [{}])[0].get("pcie")
    affinity = getattr(os, "sched_getaffinity", None)
    # Other work on the machine skews every figure: the load at the start and at the end.
    return dict(
        cpu=cpu, cores=os.cpu_count(),
        usable_cores=len(affinity(0)) if affinity else os.cpu_count(),
        torch_threads=torch.get_num_threads(), ram_bytes=psutil.virtual_memory().total,
        python=platform.python_version(), torch=torch.__version__, platform=platform.platform(),
        device=str(args.device), gpu=gpu, nvme_dir=disk, load_average_start=args.load_start,
        load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
    )  # fmt: skip


def runtime_version() -> dict[str, Any]:
    """The checkout's commit, and whether the runtime's packages differ from it."""
    git = functools.partial(subprocess.check_output, cwd=_ROOT, text=True)
    out: dict[str, Any] = {"offload": getattr(offload, "__version__", None)}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        dirty = git(["git", "status", "--porcelain", "--", "offload", "lifecycle", "storage"])
        out.update(
            commit=git(["git", "rev-parse", "--short", "HEAD"]).strip(),
            runtime_modified=bool(dirty.strip()),
        )
    return out


# ---------------------------------------------------------------------------------------------
# Driver


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add, size = ap.add_argument, parse_bytes  # sizes as bytes or like "8MiB"
    add("--config", choices=sorted(CONFIGS), default=None)
    add("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    for name in ("vocab", "layers", "heads", "d-model", "seq", "batch"):
        add(f"--{name}", type=int, default=None, help="override the config's value")
    add("--autocast", choices=("bf16", "off"), default=None, help="default: bf16 on CUDA")
    add("--steps", type=int, default=None, help="timed steps per variant (9 CPU, 5 CUDA)")
    add("--warmup", type=int, default=2, help="untimed steps per variant (>= 1)")
    add("--variants", default=",".join(VARIANTS), help="comma list; 'none' always runs")
    add("--min-offload-bytes", type=size, default=DEFAULT_MIN_OFFLOAD, help="e.g. 1MiB")
    add("--max-inflight-bytes", type=size, default=None, help="e.g. 8MiB (default: the runtime's)")
    add("--nvme-dir", default=None, help="NVMe tier directory (default: tempfile.gettempdir())")
    add("--pcie-max-bytes", type=size, default=2 * GiB, help="cap on the PCIe probe's buffer")
    add("--disk-max-bytes", type=size, default=1 * GiB, help="cap on the disk and tier probes")
    add("--probe-min-bytes", type=size, default=256 * MiB, help="floor of the disk/tier probes")
    add("--io-repeats", type=int, default=None, help="disk probe rounds (9 CPU, 3 CUDA)")
    add("--out", default=None)
    args = ap.parse_args(argv)

    cuda, overridden = resolve_device_and_shape(ap, args, CONFIGS, "h2048")
    args.stem = "step" if args.config == "cpu-tiny" else f"step-{args.config}"
    args.stem += "-custom" if overridden else ""
    if (n := args.max_inflight_bytes) is not None:
        args.stem += f"-window{n // MiB}m" if n % MiB == 0 else f"-window{n}"
    args.autocast = args.autocast or ("bf16" if cuda else "off")
    args.steps = (5 if cuda else 9) if args.steps is None else args.steps
    args.io_repeats = (3 if cuda else 9) if args.io_repeats is None else args.io_repeats
    if min(args.io_repeats, args.warmup, args.steps) < 1:
        ap.error("--io-repeats, --warmup and --steps must be >= 1")
    chosen = {v.strip() for v in args.variants.split(",") if v.strip()}
    if chosen - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(chosen - set(VARIANTS))}; choose from {VARIANTS}")
    args.variants = ["none", *[v for v in VARIANTS[1:] if v in chosen]]
    if args.out is None:
        args.out = default_results_dir(args.device)
    return args


def default_results_dir(device: torch.device) -> str:
    """``benchmarks/results/cpu``, or ``benchmarks/results/<gpu name>`` on CUDA."""
    sub = "cpu"
    if device.type == "cuda":
        sub = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return os.path.join(_ROOT, "benchmarks", "results", sub)


def resolve_device_and_shape(
    ap: argparse.ArgumentParser,
    args: argparse.Namespace,
    configs: dict[str, dict[str, int]],
    cuda_config: str,
) -> tuple[bool, bool]:
    """Resolve ``--device`` and ``--config`` (with its per-field overrides) in ``args``: sets
    ``args.device``, ``args.config`` and ``args.shape``; returns (on CUDA, a field overridden)."""
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        ap.error(f"--device must be cpu or cuda[:i], with CUDA available; got {args.device!r}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    args.device, cuda = dev, dev.type == "cuda"
    args.config = args.config or (cuda_config if cuda else "cpu-tiny")
    args.shape = dict(configs[args.config])
    overridden = False
    for key, default in configs[args.config].items():
        value = getattr(args, key)
        if value is not None:
            overridden |= value != default
            args.shape[key] = value
    return cuda, overridden


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    args.nvme_given = args.nvme_dir is not None
    args.nvme_base = os.path.abspath(args.nvme_dir or tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="bench_step-", dir=args.nvme_base) as nvme_dir:
        result = run(args, nvme_dir)
    md = markdown(result)
    os.makedirs(args.out, exist_ok=True)
    for ext, text in (("json", json.dumps(result, indent=2)), ("md", md)):
        Path(args.out, f"{args.stem}.{ext}").write_text(text)
    print(md)
    return result


def run(args: argparse.Namespace, nvme_dir: str) -> dict[str, Any]:
    t_start = args.t_start = time.perf_counter()
    args.nvme_dir_private = nvme_dir
    device, s = args.device, args.shape
    cfg = GPTConfig(
        vocab_size=s["vocab"], n_layer=s["layers"], n_head=s["heads"], d_model=s["d_model"],
        seq_len=s["seq"], dropout=0.0, bias=True,
    )  # fmt: skip
    base = GPT(cfg, seed=0).to(device)
    names = [n for n, _ in base.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (s["batch"], cfg.seq_len + 1), generator=gen)
    batch = (idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device))
    variants = build_variants(args, base, nvme_dir)
    del base
    print(f"bench_step: {args.config} {s} on {device}, autocast={args.autocast}, {args.warmup} "
          f"warm-up + {args.steps} timed steps per variant, nvme dir {nvme_dir}", flush=True)  # fmt: skip

    # Round robin; `none` runs first in round 0 and gives the reference gradients of steps 1, 2.
    ref: list[torch.Tensor | None] | None = None
    nvme_log: IoLog | None = None
    limits: dict[str, Any] = {}
    rounds = args.warmup + args.steps
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        timed = r >= args.warmup
        for v in order:
            spy = v.name == "offload_nvme" and r == args.warmup - 1
            with record_nvme_io() if spy else contextlib.nullcontext(None) as log:
                fwd_s, bwd_s, step_s, peak = run_step(args, v, batch)
            nvme_log = log or nvme_log
            if v.mgr is not None:
                v.stats.append(v.mgr.stats.last.as_dict())
            if r == 0 and v.name == "none":
                ref = [None if p.grad is None else p.grad.clone() for p in v.model.parameters()]
            elif r < 2:  # every step 2, `none`'s included, must equal `none`'s step 1 too
                assert ref is not None
                v.exact.append(compare_grads(ref, v.model, names))
            if timed:
                v.times.append((fwd_s, bwd_s, step_s))
                v.peaks.append(peak)
            v.model.zero_grad(set_to_none=True)
        ref = ref if r < 1 else None  # the reference gradients are not needed after round 2
        phase = "timed" if timed else "warm-up"
        print(
            f"  round {r + 1}/{rounds} ({phase}) {time.perf_counter() - t_start:.1f} s", flush=True
        )
        if r == args.warmup - 1:
            limits = measure_limits(args, variants, nvme_dir, nvme_log)
            print(f"  raw limits measured {time.perf_counter() - t_start:.1f} s", flush=True)

    none = variants[0]
    trace = offload.profile(lambda: run_step(args, none, batch), none.model, warmup_steps=0)
    none.model.zero_grad(set_to_none=True)
    if device.type == "cpu":  # one more, untimed step per variant under the live-bytes counter
        for v in variants:
            with LiveBytes() as counter:
                run_step(args, v, batch)
            v.model.zero_grad(set_to_none=True)
            v.peaks = [counter.peak]
    for v in variants:
        if v.mgr is not None:
            v.total_stats = v.mgr.stats.total.as_dict()
            v.mgr.close()
    return assemble(args, variants, trace, limits)


# ---------------------------------------------------------------------------------------------
# Results


def assemble(args: argparse.Namespace, variants: list[Variant], trace: offload.Trace,
             limits: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    med = statistics.median
    none_med = med(t[2] for t in variants[0].times)
    rows: dict[str, Any] = {}
    for v in variants:
        steps = [t[2] for t in v.times]
        row = rows[v.name] = dict(
            label=LABELS[v.name], step_s_median=med(steps), step_s_min=min(steps),
            step_s_max=max(steps), step_s_all=steps, ratio_to_none=med(steps) / none_med,
            fwd_s_median=med(t[0] for t in v.times), bwd_s_median=med(t[1] for t in v.times),
            peak_bytes=med(v.peaks), exactness=v.exact, loss_first_step=v.losses[0],
        )  # fmt: skip
        if v.mgr is not None:
            timed = v.stats[-len(v.times) :]
            o = row["offload"] = {key: med(s[key] for s in timed) for key in OFFLOAD_STATS}
            o.update({f"{k}_timed_total": sum(s[k] for s in timed) for k in ZERO_IN_STEADY_STATE})
            o["stats_total"] = v.total_stats

    derived: dict[str, Any] = {}
    if "offload_nvme" in rows:
        nv = rows["offload_nvme"]
        b = nv["offload"]["bytes_offloaded_nvme"]
        derived["nvme_step_average_gbps"] = b / nv["step_s_median"] / 1e9
    if limits.get("nvme_tier"):  # judged into a fresh file, as the raw probe writes a new one
        ff = limits["nvme_tier"]["fresh_file"]
        share = min(ff["write_share_of_raw"], ff["read_share_of_raw"])
        derived["nvme_tier_meets_target"] = share >= TARGET_TIER_SHARE
    for name in ("offload_cpu", "offload_nvme"):
        if name in rows and trace.saved_bytes:
            o = rows[name]["offload"]
            moved = o["bytes_offloaded_cpu"] + o["bytes_offloaded_nvme"]
            derived[f"{name}_moved_over_saved"] = moved / trace.saved_bytes
    pcie = limits.get("pcie")
    if pcie and "offload_cpu" in rows:
        oc = rows["offload_cpu"]
        b, step = oc["offload"]["bytes_offloaded_cpu"], oc["step_s_median"]
        t_fwd, t_bwd = rows["none"]["fwd_s_median"], rows["none"]["bwd_s_median"]
        d2h_s, h2d_s = b / (pcie["d2h_gb_per_s"] * 1e9), b / (pcie["h2d_gb_per_s"] * 1e9)
        bound = max(t_fwd, d2h_s) + max(t_bwd, h2d_s)
        derived["transfer_bound"] = dict(
            bytes=b, t_fwd_s=t_fwd, t_bwd_s=t_bwd, d2h_s=d2h_s, h2d_s=h2d_s, bound_s=bound,
            offload_cpu_step_s=step, offload_cpu_over_bound=step / bound,
        )  # fmt: skip
    if "offload_cpu" in rows and "save_on_cpu" in rows:
        oc_s, soc_s = (rows[k]["step_s_median"] for k in ("offload_cpu", "save_on_cpu"))
        derived["offload_cpu_beats_save_on_cpu"] = oc_s < soc_s
    params = list(variants[0].model.parameters())
    saved = dict(
        peak_saved_bytes=trace.peak_saved_bytes, saved_bytes=trace.saved_bytes,
        records=len(trace.activation_records),
    )  # fmt: skip
    return {
        "benchmark": "bench_step",
        "version": runtime_version(),
        "command": "python " + " ".join([os.path.relpath(__file__, _ROOT), *sys.argv[1:]]),
        "machine": machine(args),
        "config": {
            "name": args.config,
            **args.shape,
            "parameters": sum(p.numel() for p in params),
            "param_dtype": str(params[0].dtype),
            **{k: getattr(args, k) for k in CONFIG_ARGS},
            "nvme_dir_source": "--nvme-dir" if args.nvme_given else "tempfile.gettempdir()",
            "nvme_dir": args.nvme_dir_private,
        },
        "trace": saved,
        "variants": rows,
        "limits": limits,
        "derived": derived,
        "target_nvme_tier_share": TARGET_TIER_SHARE,
        "wall_s": time.perf_counter() - args.t_start,
    }


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:.1f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _yn(x: bool) -> str:
    return "yes" if x else "no"


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _gbps(s: dict[str, Any], way: str) -> str:
    xs = s.get(f"{way}_gbps_samples") or []
    spread = f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else ""
    return f"{s[f'{way}_gbps']:.2f}{spread}"


def markdown(res: dict[str, Any]) -> str:
    m, c, lim, der, tr = (res[k] for k in ("machine", "config", "limits", "derived", "trace"))
    cuda, disk, ver = m["gpu"] is not None, m["nvme_dir"], res["version"]
    runtime = f"commit {ver['commit']}" if "commit" in ver else f"offload {ver.get('offload')}"
    runtime += " + local changes" if ver.get("runtime_modified") else ""
    load = [f"{a[0]:.2f}" if a else "-" for a in (m["load_average_start"], m["load_average_end"])]
    gpu = "GPU: none (no CUDA)."
    if cuda:
        g, link = m["gpu"], m["gpu"].get("pcie") or {}
        gpu = (
            f"GPU: {g['name']} ({g['total_memory_bytes'] / GiB:.0f} GiB, sm {g['capability']}, "
            f"CUDA {g['cuda']}, driver {g.get('driver')}; PCIe max Gen{link.get('max_generation')}"
            f" x{link.get('max_width')}, {link.get('max_theoretical_gb_per_s') or 0:.1f} GB/s)."
        )
    window = f"{_mib(c['max_inflight_bytes'])} MiB" if c["max_inflight_bytes"] else "default"
    out = [
        f"# Training step: offload runtime vs anchors ({c['name']}, benchmarks/bench_step.py)",
        "",
        f"Command: `{res['command']}` (runtime at {runtime})",
        "",
        f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['torch_threads']} torch "
        f"threads, {m['ram_bytes'] / GiB:.0f} GiB RAM, torch {m['torch']}; load average (1 min) "
        f"{load[0]} at start, {load[1]} at end. {gpu} NVMe dir: {c['nvme_base']} "
        f"({c['nvme_dir_source']}), {disk['filesystem']} on {disk['device']} (model "
        f"{disk.get('model') or 'unknown'}, rotational {disk.get('rotational', '?')}).",
        "",
        f"Model: GPT (examples/gpt.py), {c['layers']} layers, d_model {c['d_model']}, "
        f"{c['heads']} heads, seq {c['seq']}, batch {c['batch']}, vocab {c['vocab']}, "
        f"{c['parameters'] / 1e6:.1f} M parameters ({c['param_dtype']}), autocast "
        f"{c['autocast']}; {c['warmup']} warm-up + {c['steps']} timed steps per variant, round "
        f"robin, the same batch. Offload: min_offload_bytes {c['min_offload_bytes']}, "
        f"max_inflight_bytes {window}. Saved activations without offload (offload.profile): peak "
        f"{_mib(tr['peak_saved_bytes'])} MiB, {tr['records']} records.",
        "",
        f"| variant | step median (ms) | min-max (ms) | x none | fwd (ms) | bwd (ms) | "
        f"{'peak above step start' if cuda else 'live peak in step'} (MiB) | offloaded/step cpu "
        "(MiB) | offloaded/step nvme (MiB) | records moved | stalls (stall ms) | grads bitwise = "
        "none (step 1, step 2) |",
        "|---" * 12 + "|",
    ]
    for name, r in res["variants"].items():
        o = r.get("offload")
        exact = ", ".join(_yn(e["bitwise_equal"]) for e in r["exactness"])
        if name == "none":
            exact = f"reference; step 2 = step 1: {exact or '-'}"
        moved = "- | - | - | -"
        if o:
            n = o["records_offloaded_cpu"] + o["records_offloaded_nvme"]
            moved = f"{_mib(o['bytes_offloaded_cpu'])} | {_mib(o['bytes_offloaded_nvme'])} | {n}"
            moved += f" | {o['stalls']} ({o['stall_s'] * 1e3:.1f})"
        times = [_ms(r[f"{k}_s_median"]) for k in ("step", "fwd", "bwd")]
        spread = f"{_ms(r['step_s_min'])}-{_ms(r['step_s_max'])}"
        ratio, peak = f"{r['ratio_to_none']:.2f}", _mib(r["peak_bytes"])
        out.append(_row(r["label"], times[0], spread, ratio, *times[1:], peak, moved, exact))

    d, t, rec = lim["disk_raw"], lim.get("nvme_tier"), lim["nvme_step_records"]
    ds = d["at_tier_request_size"]
    out += [
        "",
        f"Disk, median of {len(d['write_gbps_samples'])} interleaved, rotated rounds of "
        f"{_mib(d['nbytes'])} MiB, {d['threads']} threads (GB/s = 1e9 B/s). Raw: "
        f"storage.measure_disk_bandwidth into a new preallocated file, {d['io_mode']}"
        + (", no fsync." if d["direct_io"] else "; the tier neither fsyncs nor drops the cache.")
        + " In brackets: the share of raw at the tier's byte-weighted median request size.",
        "",
        "| path | request size (MiB) | write GB/s (min-max) | read GB/s (min-max) | write / raw "
        "| read / raw |",
        "|---" * 6 + "|",
    ]
    tier_rows = [("raw disk", _mib(d["chunk_bytes"]), d, "", "")]
    if ds["chunk_bytes"] != d["chunk_bytes"]:
        tier_rows.append(("raw disk", _mib(ds["chunk_bytes"]), ds, "", ""))
    for label in ("fresh file", "reused ranges") if t else ():
        s = t[label.replace(" ", "_")]
        w, rd = (f"{s[f'{k}_share_of_raw']:.0%} ({s[f'{k}_share_of_raw_at_tier_request_size']:.0%})"
                 for k in ("write", "read"))  # fmt: skip
        size = f"{_mib(t['request_bytes_min'])}-{_mib(t['request_bytes_max'])}"
        tier_rows.append((f"NVMe tier, {label}", size, s, w, rd))
    iw, ir = rec.get("in_step_write"), rec.get("in_step_read")
    if iw and ir:
        step = {"write_gbps": iw["gbps"], "read_gbps": ir["gbps"]}
        tier_rows.append(("NVMe inside the step (lower bound)", "", step, "", ""))
    for label, size, s, w, rd in tier_rows:
        out.append(_row(label, size, _gbps(s, "write"), _gbps(s, "read"), w, rd))

    notes = []
    if t:
        met = "met" if der.get("nvme_tier_meets_target") else "not met"
        notes.append(
            f"NVMe tier: storage.NvmeTier ({'O_DIRECT' if t['direct_io'] else 'buffered'}, no "
            f"fsync, {t['io_threads']} I/O threads, crc32 on) replayed the last warm-up step's "
            f"{rec['records']} records ({_mib(rec['nbytes'])} MiB, {_mib(rec['smallest_bytes'])}-"
            f"{_mib(rec['largest_bytes'])} MiB each) as {t['records']} records in {t['requests']} "
            f"requests. Target >= {res['target_nvme_tier_share']:.0%} of raw both ways into a "
            f"fresh file: {met}. Bytes read back equal bytes written: {_yn(t['round_trip_exact'])}."
        )
    if iw and ir:
        notes.append(
            f"Inside the step: first submission to last completion, idle gaps included (writes "
            f"over {iw['span_s'] * 1e3:.0f} ms, reads over {ir['span_s'] * 1e3:.0f} ms); timed "
            f"steps averaged {der['nvme_step_average_gbps']:.2f} GB/s written (bytes / step time)."
        )
    p, tb = lim.get("pcie"), der.get("transfer_bound")
    if p:
        notes.append(
            f"PCIe, pinned, {_mib(p['probe_bytes'])} MiB, best of {p['repeats']}: H2D "
            f"{p['h2d_gb_per_s']:.1f} GB/s, D2H {p['d2h_gb_per_s']:.1f} GB/s, both at once "
            f"{p['both_gb_per_s']:.1f} GB/s total."
        )
    if tb:
        notes.append(
            f"Transfer bound for offload_cpu ({_mib(tb['bytes'])} MiB each way): max(T_fwd "
            f"{_ms(tb['t_fwd_s'])}, D2H {_ms(tb['d2h_s'])}) + max(T_bwd {_ms(tb['t_bwd_s'])}, "
            f"H2D {_ms(tb['h2d_s'])}) = {_ms(tb['bound_s'])} ms; offload_cpu took "
            f"{_ms(tb['offload_cpu_step_s'])} ms = {tb['offload_cpu_over_bound']:.2f} x the bound."
        )
    notes += [
        f"{name} moved {der[f'{name}_moved_over_saved']:.2f} x the no-offload trace's saved "
        f"bytes ({_mib(tr['saved_bytes'])} MiB, each alias family counted once)."
        for name in ("offload_cpu", "offload_nvme")
        if f"{name}_moved_over_saved" in der
    ]
    if "offload_cpu_beats_save_on_cpu" in der:
        beats = _yn(der["offload_cpu_beats_save_on_cpu"])
        notes.append(f"offload_cpu faster than save_on_cpu (median step): {beats}.")
    if not cuda:
        notes.append(
            "On CPU, save_on_cpu moves nothing (its pack, `tensor.cpu()`, returns the CPU tensor "
            "itself) while the runtime copies out and back through its tiers: CPU step times "
            "show the runtime's overhead, not the GPU comparison. No PCIe, no transfer bound."
        )
    peak = (
        " between torch.cuda.synchronize calls (fwd/bwd split by CUDA events). Peak: "
        "max_memory_allocated minus memory_allocated at the step's start, median of timed steps."
        if cuda
        else ". Peak (CPU): bytes of tensors allocated during one extra, untimed step and alive "
        "at once (host-pool regions excluded); the tiers share that RAM, so it shows what the "
        "runtime would keep on a device, not a RAM saving."
    )
    columns = (
        f"Columns: step times are wall seconds of forward + backward{peak} Offloaded/records/"
        "stalls: the runtime's StepStats, median of timed steps. Exactness: every parameter's "
        "gradient compared with torch.equal to no offload's after steps 1 and 2; reported, not "
        "asserted."
    )
    return "\n".join([*out, "", *(f"- {n}" for n in notes), "", columns, ""])


if __name__ == "__main__":
    main()
