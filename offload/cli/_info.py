"""``offload info``: what this node offers the offloader (GPU, PCIe, host memory, disk, kvikio)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from offload.cli._args import EXIT_FAILED, fail, positive_size
from offload.lifecycle._units import format_bytes

DEFAULT_PROBE = "256MiB"
_PROG = "offload info"


def _dir(text: str) -> str:
    if not text.strip():  # an empty name would measure the current directory
        raise argparse.ArgumentTypeError("give a directory; got an empty name")
    return text


def add_parser(sub: Any) -> None:
    """Add the ``info`` subcommand to the ``offload`` subparsers ``sub``."""
    p = sub.add_parser(
        "info",
        help="show the GPU, PCIe link, host memory, disk and kvikio this node offers",
        description=(
            "Report torch/CUDA, GPUs, the PCIe link (NVML) and measured pinned copy bandwidth, "
            "host memory and the default pinned-pool budget (psutil and cgroups), NVMe free "
            "space and bandwidth (with --nvme-dir), which gds extra fits, and the start-up costs "
            "to expect. Works without a GPU. Exit status: 0 on success, 1 when a requested disk "
            "measurement failed, 2 for bad arguments, a bad LOCAL_WORLD_SIZE or standard output "
            "that cannot be written."
        ),
    )
    p.add_argument(
        "--nvme-dir",
        metavar="DIR",
        type=_dir,
        default=None,
        help="directory on the disk an NVMe tier would use: report its free space and measure "
        "write/read bandwidth with a probe file that is removed afterwards (default: no disk "
        "measurement)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--probe-bytes",
        metavar="SIZE",
        type=positive_size,
        default=positive_size(DEFAULT_PROBE),
        help=f"size of each bandwidth probe, PCIe copies and disk file, e.g. 64MiB "
        f"(default {DEFAULT_PROBE})",
    )
    p.add_argument(
        "--save-hardware",
        metavar="FILE",
        default=None,
        help="also write, as JSON, the HardwareModel that offload plan and the manager plan "
        "with on this machine (offload.probe_hardware(): copy links, elementwise rate and, "
        "with --nvme-dir, that disk; read from its cache when it has one), for "
        "offload plan --hardware FILE or HardwareModel.load",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Collect and print; the exit status."""
    from offload._info import NvmeDirError
    from offload.cli._node_report import collect_info, format_info

    if args.save_hardware is not None and (problem := _unwritable(args.save_hardware)):
        return fail(_PROG, f"--save-hardware {args.save_hardware!r}: {problem}")
    try:
        info = collect_info(nvme_dir=args.nvme_dir, probe_bytes=args.probe_bytes)
    except NvmeDirError as e:
        return fail(_PROG, f"--nvme-dir {e.path}: {e.problem}")
    except ValueError as e:  # LOCAL_WORLD_SIZE that is not a positive integer
        return fail(_PROG, str(e))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
        if args.nvme_dir is None:
            print(
                f"\n(--nvme-dir DIR measures a disk with a {format_bytes(args.probe_bytes)} file)"
            )
    nvme = info.get("nvme")
    failed = nvme is not None and "error" in nvme
    if args.save_hardware is not None and not failed:
        return _save_hardware(args.save_hardware, args.nvme_dir, json_out=args.json)
    return 1 if failed else 0


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot take the hardware file, checked before anything is measured."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory; give a file name"
    if not os.path.isdir(parent):
        return f"directory {parent!r} does not exist"
    if not os.access(parent, os.W_OK):
        return f"directory {parent!r} is not writable"
    return None


def _save_hardware(path: str, nvme_dir: str | None, *, json_out: bool) -> int:
    from offload._probe import probe_hardware

    try:
        hw = probe_hardware(nvme_dir=nvme_dir)
    except Exception as e:  # a driver or OS failure, reported, not a traceback
        return fail(_PROG, f"measuring for --save-hardware failed ({e})", EXIT_FAILED)
    try:
        hw.save(path)
    except OSError as e:
        return fail(_PROG, f"--save-hardware {path!r}: {e}", EXIT_FAILED)
    # With --json, standard output holds the JSON object alone.
    print(f"wrote {path} ({hw.source})", file=sys.stderr if json_out else sys.stdout)
    return 0
