"""The arguments the commands share, and how a command reports a bad one.

The planning options of ``offload plan`` and ``offload profile --gpu-budget``:
:func:`add_plan_options` declares them and :func:`check_plan_options` validates what can be
checked before a trace exists (:class:`PlanOptions`); ``offload info`` takes its sizes with
:func:`positive_size`.

Exit status (``offload plan`` and ``offload profile``): 0 success; 2 bad arguments (a missing or
unreadable trace or hardware file, an unparsable size, an unknown tier, an output path or
standard output that cannot be written);
3 the budget cannot be met (:data:`EXIT_INFEASIBLE`; the message gives the smallest feasible
budget); 1 anything else that failed (measuring the hardware, the profiled script).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from offload._info import NvmeDirError, check_nvme_dir
from offload._probe import QUICK_DISK_PROBE_BYTES
from offload.lifecycle import HardwareModel
from offload.lifecycle._units import format_bytes, parse_bytes

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_ARGS = 2
EXIT_INFEASIBLE = 3

DEFAULT_MIN_OFFLOAD = "1MiB"  # the manager's min_offload_bytes
_TIERS = ("cpu", "nvme")
# Planning options other than --gpu-budget, as (option, attribute): `offload profile` refuses them
# without a budget.
_PLANNING_OPTIONS = (
    ("--hardware", "hardware"),
    ("--tiers", "tiers"),
    ("--cpu-budget", "cpu_budget"),
    ("--nvme-bytes", "nvme_bytes"),
    ("--nvme-dir", "nvme_dir"),
    ("--min-offload-bytes", "min_offload_bytes"),
    ("--margin", "margin"),
)


class UsageError(Exception):
    """A bad argument found after parsing: printed as ``PROG: error: MESSAGE``, exit status 2."""


# -- argument types ---------------------------------------------------------------------------


def _parse_size(text: str) -> int:
    """``parse_bytes(text)``, its error an ``ArgumentTypeError`` whose message does not start
    with ``value=`` (argparse names the option)."""
    try:
        return parse_bytes(text.strip())
    except ValueError as e:  # not a size, a fraction of a byte, more than 2**63 - 1 bytes
        raise argparse.ArgumentTypeError(str(e).removeprefix("value=")) from None


def _size(*, allow_auto: bool = False) -> Callable[[str], int | None]:
    """An argparse ``type`` parsing a byte size (``8GiB``, ``512MB``, ``1048576``), or ``auto``
    (None) with ``allow_auto``."""

    def parse(text: str) -> int | None:
        if allow_auto and text.strip().lower() == "auto":
            return None
        return _parse_size(text)

    return parse


def positive_size(text: str) -> int:
    """An argparse ``type`` parsing a byte size of more than 0 bytes (``--probe-bytes``)."""
    # argparse names the option ("argument --probe-bytes: ..."): the message does not again.
    n = _parse_size(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes; got {text!r}")
    return n


def _budget(text: str) -> int | str:
    """``--gpu-budget``: bytes (an int), or a percentage kept as text until the device is known.

    Example:
        >>> _budget("1.5GiB"), _budget(" 85% ")
        (1610612736, '85%')
    """
    text = text.strip()
    if text.endswith("%"):
        try:
            parse_bytes(text, total=100)  # checks the form and the range; the total comes later
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a percentage in (0, 100] like 85%"
            ) from None
        return text
    try:
        n = _parse_size(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(
            f"{e}, or a percentage of device memory like 85%"
        ) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"the budget must be more than 0 bytes; got {text!r}")
    return n


def _tiers(text: str) -> tuple[str, ...]:
    """``--tiers``: a comma-separated list of ``cpu`` and ``nvme``, each at most once.

    Example:
        >>> _tiers("cpu, nvme")
        ('cpu', 'nvme')
    """
    tiers = tuple(t.strip().lower() for t in text.split(","))
    bad = [t for t in tiers if t not in _TIERS]
    if bad or len(set(tiers)) != len(tiers):
        what = f"unknown tier {bad[0]!r}" if bad else f"a tier is repeated in {text!r}"
        raise argparse.ArgumentTypeError(
            f"{what}; use cpu, nvme, cpu,nvme or nvme,cpu (the order is the spill order)"
        )
    return tiers


# -- options ----------------------------------------------------------------------------------


def add_plan_options(p: argparse.ArgumentParser, *, budget_required: bool) -> None:
    """The planning options of ``offload plan`` and ``offload profile``."""
    g = p.add_argument_group("planning")
    g.add_argument(
        "--gpu-budget",
        metavar="SIZE",
        type=_budget,
        required=budget_required,
        help="device memory the step may use, weights, gradients and optimizer state included: "
        "bytes or a size such as 8GiB or 512MB, or a percentage such as 85%% of the memory of "
        "the trace's CUDA device on this machine (CUDA traces only)"
        + ("" if budget_required else "; with it the last recorded step is also planned"),
    )
    g.add_argument(
        "--hardware",
        metavar="FILE",
        default=None,
        help="a HardwareModel saved as JSON (HardwareModel.save, e.g. from "
        "offload.probe_hardware() on the training machine) with the link and disk bandwidths "
        "to plan with (default: measure this machine with offload.probe_hardware(), cached on "
        "disk; a CUDA trace on a machine without CUDA needs this option)",
    )
    g.add_argument(
        "--tiers",
        metavar="LIST",
        type=_tiers,
        default=None,
        help="where activations may wait, in spill order: cpu, nvme, cpu,nvme or nvme,cpu "
        "(default: cpu)",
    )
    g.add_argument(
        "--cpu-budget",
        metavar="SIZE",
        type=_size(),
        default=None,
        help="host (pinned) bytes the plan may hold at once (default: no limit)",
    )
    g.add_argument(
        "--nvme-bytes",
        metavar="SIZE",
        type=_size(),
        default=None,
        help="NVMe bytes the plan may hold at once, with nvme in --tiers (default: no limit)",
    )
    g.add_argument(
        "--nvme-dir",
        metavar="DIR",
        default=None,
        help="with nvme in --tiers: measure the disk in DIR (a "
        f"{format_bytes(QUICK_DISK_PROBE_BYTES)} probe file, removed afterwards) and plan with "
        "its rates instead of the datasheet figures (those of one NVMe Gen4 drive) or those of "
        "--hardware",
    )
    g.add_argument(
        "--min-offload-bytes",
        metavar="SIZE",
        type=_size(),
        default=None,
        help="activations smaller than this stay on the device, as the manager's "
        f"min_offload_bytes (default: {DEFAULT_MIN_OFFLOAD}; 0 plans every activation)",
    )
    g.add_argument(
        "--margin",
        metavar="SIZE",
        type=_size(allow_auto=True),
        default=None,
        help="a size, or auto: room left under the budget for what a trace cannot show "
        "(allocator rounding, workspaces); the plan's predicted peak stays at or below budget - "
        "margin (default: "
        "auto: on a CUDA trace max(5%% of the budget, 256MiB) plus the trace's excess of "
        "reserved over allocated memory, on a CPU trace 5%% of the budget)",
    )


@dataclass(frozen=True)
class PlanOptions:
    """The planning options, checked: what :func:`plan_and_write` needs besides a trace."""

    gpu_budget: int | str
    hardware: HardwareModel | None  # None: probe this machine
    tiers: tuple[str, ...]
    cpu_budget: int | None
    nvme_bytes: int | None
    min_offload_bytes: int
    margin: int | None
    nvme_dir: str | None = None  # measure the disk there


def check_plan_options(args: argparse.Namespace, *, cuda_expected: bool | None) -> PlanOptions:
    """The options of ``args`` as :class:`PlanOptions`; loads the ``--hardware`` file.

    Args:
        args: parsed arguments with the options of :func:`add_plan_options`.
        cuda_expected: whether the trace will be a CUDA one (``offload profile`` knows it before
            the script runs); ``None`` when unknown yet (``offload plan`` checks percentages
            once the trace is read).

    Raises:
        UsageError: the message names the option.
    """
    if isinstance(args.gpu_budget, str) and cuda_expected is False:
        raise UsageError(percent_needs_cuda(args.gpu_budget))
    tiers = args.tiers or ("cpu",)
    if args.nvme_bytes is not None and "nvme" not in tiers:
        raise UsageError(
            f"--nvme-bytes applies only with nvme in --tiers (the tiers are {','.join(tiers)}: "
            "nothing goes to NVMe)"
        )
    if args.nvme_dir is not None:
        if "nvme" not in tiers:
            raise UsageError(
                f"--nvme-dir applies only with nvme in --tiers (the tiers are {','.join(tiers)}: "
                "no disk rate is used)"
            )
        try:
            check_nvme_dir(args.nvme_dir)
        except NvmeDirError as e:
            raise UsageError(f"--nvme-dir {e.path!r}: {e.problem}") from None
    hardware = None
    if args.hardware is not None:
        try:
            hardware = HardwareModel.load(args.hardware)
        except FileNotFoundError:
            raise UsageError(f"--hardware {args.hardware!r}: file not found") from None
        except (OSError, ValueError) as e:
            raise UsageError(f"--hardware {args.hardware!r}: {reason(e)}") from None
    return PlanOptions(
        gpu_budget=args.gpu_budget,
        hardware=hardware,
        tiers=tiers,
        cpu_budget=args.cpu_budget,
        nvme_bytes=args.nvme_bytes,
        min_offload_bytes=(
            parse_bytes(DEFAULT_MIN_OFFLOAD)
            if args.min_offload_bytes is None
            else args.min_offload_bytes
        ),
        margin=args.margin,
        nvme_dir=args.nvme_dir,
    )


def planning_options_given(args: argparse.Namespace) -> list[str]:
    """The planning options other than ``--gpu-budget`` that ``args`` sets."""
    return [opt for opt, attr in _PLANNING_OPTIONS if getattr(args, attr) is not None]


def percent_needs_cuda(budget: str, recorded_on: str | None = None) -> str:
    where = (
        f"the trace was recorded on {recorded_on!r}"
        if recorded_on and not recorded_on.startswith("cuda")
        else "this machine has no CUDA device"
    )
    return (
        f"--gpu-budget {budget}: a percentage of device memory needs a CUDA device and {where}; "
        "give bytes or a size such as 8GiB"
    )


# -- reporting --------------------------------------------------------------------------------


def reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


def fail(prog: str, msg: str, code: int = EXIT_BAD_ARGS) -> int:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return code


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links and symlinks too
    except OSError:  # one is not there yet: compare where the names lead
        return os.path.realpath(a) == os.path.realpath(b)
