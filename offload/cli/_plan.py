"""``offload plan``: plan where a recorded step's activations wait so it fits a memory budget.

The planning options are shared with ``offload profile --gpu-budget``: :func:`add_plan_options`
declares them, :func:`check_plan_options` validates what can be checked before a trace exists,
and :func:`plan_and_write` plans, prints and writes the plan JSON and PNG for both commands.

Exit status (both commands): 0 success; 2 bad arguments (a missing or unreadable trace or
hardware file, an unparsable size, an unknown tier, an output path or standard output that
cannot be written);
3 the budget cannot be met (:data:`EXIT_INFEASIBLE`; the message gives the smallest feasible
budget); 1 anything else that failed (measuring the hardware, the profiled script).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offload._errors import BudgetInfeasibleError
from offload._info import NvmeDirError, check_nvme_dir
from offload._planning import plan, resolve_budget, trace_device
from offload._probe import (
    QUICK_DISK_PROBE_BYTES,
    cached_hardware,
    probe_hardware,
    with_measured_disk,
)
from offload.lifecycle import HardwareModel, Plan, Trace
from offload.lifecycle._export import write_plan_png
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


def add_parser(sub: Any) -> None:
    """Add the ``plan`` subcommand to the ``offload`` subparsers ``sub``."""
    p = sub.add_parser(
        "plan",
        help="plan where a traced step's activations wait so that it fits a memory budget",
        description=(
            "Plan, for the last recorded step of TRACE (trace.json from `offload profile` or "
            "Trace.save), where each activation waits (kept on the device, pinned host memory, "
            "NVMe, recomputed, or rebuilt from its input) so that the step fits --gpu-budget at "
            "the smallest predicted step time. Prints the plan with its predicted peak and step time next to keeping "
            "everything, offloading everything and checkpointing every block; writes the plan "
            "as JSON (Plan.load reads it) and a PNG of the planned device memory against keeping "
            "everything. Exit status: 0 success; 2 bad arguments (missing or unreadable TRACE "
            "or --hardware file, an unparsable size, an unknown tier, an output that cannot be "
            "written or is the same file as an input or the other output); "
            f"{EXIT_INFEASIBLE} the budget cannot be met (the message gives the "
            "smallest feasible budget); 1 measuring this machine failed."
        ),
    )
    p.add_argument("trace", metavar="TRACE", help="a trace JSON file (trace.json)")
    add_plan_options(p, budget_required=True)
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="where to write the plan JSON (default: plan.json in TRACE's directory)",
    )
    png = out.add_mutually_exclusive_group()
    png.add_argument(
        "--png",
        metavar="FILE",
        default=None,
        help="where to write the planned-memory PNG (default: the --out path with .png in place "
        "of .json); needs matplotlib (pip install 'offload[plot]'), skipped with a note without",
    )
    png.add_argument("--no-png", action="store_true", help="do not write the PNG")
    p.set_defaults(run=run)


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
        raise UsageError(_percent_needs_cuda(args.gpu_budget))
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
            raise UsageError(f"--hardware {args.hardware!r}: {_reason(e)}") from None
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


def _percent_needs_cuda(budget: str, recorded_on: str | None = None) -> str:
    where = (
        f"the trace was recorded on {recorded_on!r}"
        if recorded_on and not recorded_on.startswith("cuda")
        else "this machine has no CUDA device"
    )
    return (
        f"--gpu-budget {budget}: a percentage of device memory needs a CUDA device and {where}; "
        "give bytes or a size such as 8GiB"
    )


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


# -- planning ---------------------------------------------------------------------------------


def plan_and_write(
    trace: Trace,
    options: PlanOptions,
    *,
    plan_path: str,
    png_path: str | None,
    prog: str,
) -> int:
    """Plan the last step of ``trace``, print the plan, write it (and the PNG); the exit status.

    Errors are printed as ``PROG: error: ...`` on stderr.
    """
    device = trace_device(trace)
    recorded_on = str(trace.metadata.get("device", "") or device)
    try:
        budget = _budget_bytes(options.gpu_budget, device, recorded_on)
        hardware = _hardware(options.hardware, device, recorded_on)
    except UsageError as e:
        return _fail(prog, str(e))
    except Exception as e:  # the probe: a driver or OS failure, reported, not a traceback
        return _fail(
            prog,
            f"measuring this machine's copy links failed ({type(e).__name__}: {e}); pass "
            "--hardware FILE",
            EXIT_FAILED,
        )
    if options.nvme_dir is not None:
        print(
            f"offload: measuring the disk in {options.nvme_dir} "
            f"({format_bytes(QUICK_DISK_PROBE_BYTES)} written and read back)",
            file=sys.stderr,
            flush=True,
        )
        try:
            hardware = with_measured_disk(hardware, options.nvme_dir)
        except (OSError, ValueError) as e:  # a full disk, EIO; the directory removed since
            return _fail(
                prog,
                f"measuring the disk in {options.nvme_dir!r} failed ({type(e).__name__}: {e})",
                EXIT_FAILED,
            )
    print(f"hardware: {describe_hardware(hardware)}")
    try:
        p = _plan(trace, budget, hardware, options)
    except BudgetInfeasibleError as e:
        _fail(prog, str(e), EXIT_INFEASIBLE)
        _hint_feasible(trace, e, hardware, options, prog)
        return EXIT_INFEASIBLE
    except (TypeError, ValueError) as e:  # e.g. a trace without a step
        return _fail(prog, f"cannot plan this trace: {e}")
    except (ArithmeticError, LookupError, RuntimeError) as e:
        # A trace that loads but that the planner or the simulator cannot take (the loader
        # checks each field, not every relation between them): said with what failed, not a
        # traceback.
        return _fail(prog, f"cannot plan this trace: {type(e).__name__}: {e}")
    print(p.summary())
    try:
        p.save(plan_path)
    except OSError as e:
        return _fail(prog, f"cannot write the plan to {plan_path!r}: {_reason(e)}")
    except ValueError as e:  # a NaN or an infinity in the plan: JSON has no such numbers
        return _fail(prog, f"cannot write the plan to {plan_path!r}: {e}")
    print(f"wrote {plan_path}")
    if png_path is not None:
        _write_png(trace, p, png_path, prog)
    return EXIT_OK


def _plan(trace: Trace, budget: int, hardware: HardwareModel, options: PlanOptions) -> Plan:
    return plan(
        trace,
        budget,
        hardware,
        tiers=options.tiers,
        cpu_budget=options.cpu_budget,
        nvme_bytes=options.nvme_bytes,
        min_offload_bytes=options.min_offload_bytes,
        margin=options.margin,
    )


def _hint_feasible(
    trace: Trace,
    e: BudgetInfeasibleError,
    hardware: HardwareModel,
    options: PlanOptions,
    prog: str,
) -> None:
    """Print the smallest budget that plans with these options, and what else would help."""
    need = e.min_feasible_bytes
    if options.margin is None:
        # The error's figure adds the margin of the budget asked for, but the auto margin grows
        # with the budget (5% of it): check the figure and step up; each retry closes all but 5%
        # of the gap, and an infeasible plan fails fast (before any simulation).
        for _ in range(4):
            try:
                _plan(trace, need, hardware, options)
                break
            except BudgetInfeasibleError as again:
                need = max(need + 1, again.min_feasible_bytes)
            except ValueError:  # past 2**63 - 1 bytes, the largest budget there is
                break
    others = []
    if options.margin != 0:
        others.append("a smaller --margin")
    if options.min_offload_bytes > 0:
        others.append("a smaller --min-offload-bytes (smaller activations may move too)")
    if options.cpu_budget is not None or options.nvme_bytes is not None:
        others.append("more host or NVMe room (--cpu-budget, --nvme-bytes, --tiers)")
    auto = " (the auto margin included)" if options.margin is None else ""
    print(
        f"{prog}: the smallest budget that can be planned with these options is about "
        f"{need} bytes ({format_bytes(need)}){auto}: try --gpu-budget {_round_up_size(need)}"
        + (f", or {' or '.join(others)}" if others else ""),
        file=sys.stderr,
    )


def _budget_bytes(budget: int | str, device: torch.device, recorded_on: str) -> int:
    if isinstance(budget, int):
        return budget
    if device.type != "cuda":
        raise UsageError(_percent_needs_cuda(budget, recorded_on))
    return resolve_budget(budget, device)


def _hardware(
    hardware: HardwareModel | None, device: torch.device, recorded_on: str
) -> HardwareModel:
    if hardware is not None:
        return hardware
    if recorded_on.startswith("cuda") and device.type != "cuda":
        raise UsageError(
            f"the trace was recorded on {recorded_on} and this machine has no CUDA device to "
            "measure: pass --hardware FILE (a HardwareModel saved on the training machine, e.g. "
            "offload.probe_hardware().save('hardware.json'))"
        )
    cached = cached_hardware(device)
    if cached is not None:
        return cached
    print(
        f"offload: no --hardware given: measuring this machine's copy links on {device} "
        "(offload.probe_hardware(); cached after the first run)",
        file=sys.stderr,
        flush=True,
    )
    return probe_hardware(device=device)


def _write_png(trace: Trace, p: Plan, path: str, prog: str) -> None:
    try:
        write_plan_png(trace, p, path)
    except ImportError as e:
        print(f"offload: skipped {path}: {e}", file=sys.stderr)
        return
    except OSError as e:  # the plan is written: a missing picture is not a failed command
        print(f"{prog}: warning: cannot write {path!r}: {_reason(e)}", file=sys.stderr)
        return
    except ValueError as e:  # the plan and the trace disagree, say: the plan is still written
        print(f"{prog}: warning: cannot draw {path!r}: {e}", file=sys.stderr)
        return
    print(f"wrote {path}")


def describe_hardware(hw: HardwareModel) -> str:
    """One line: the device, its link, and the rates the plan assumes.

    Example:
        >>> describe_hardware(HardwareModel.h200())  # doctest: +NORMALIZE_WHITESPACE
        'NVIDIA H200, PCIe Gen5 x16: H2D 54.5 GB/s, D2H 55.2 GB/s, both at once 84.6 GB/s;
        disk write 4.3 GB/s, read 6.8 GB/s (assumed)'
    """

    def rate(x: float) -> str:
        return "unlimited" if math.isinf(x) else f"{x / 1e9:.1f} GB/s"

    name = ", ".join(s for s in (hw.device_name or "unnamed device", hw.link) if s)
    overlap = "" if hw.copies_overlap_compute else "; copies do not overlap compute"
    return (
        f"{name}: H2D {rate(hw.h2d_bytes_per_s)}, D2H {rate(hw.d2h_bytes_per_s)}, both at once "
        f"{rate(hw.duplex_bytes_per_s)}; disk write {rate(hw.disk_write_bytes_per_s)}, read "
        f"{rate(hw.disk_read_bytes_per_s)}{overlap} ({hw.source})"
    )


def _round_up_size(n: int) -> str:
    """A size string at least ``n`` bytes, with 3 significant digits, for a hint.

    Example:
        >>> _round_up_size(1_000_000), _round_up_size(123), _round_up_size(5 << 30)
        ('977KiB', '123', '5GiB')
        >>> _round_up_size(100 << 20), _round_up_size(1_509_052)
        ('100MiB', '1.44MiB')
    """
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            digits = max(0, 2 - int(math.log10(n / size)))
            step = 10**-digits
            value = math.ceil(n / size / step - 1e-9) * step
            text = f"{value:.{digits}f}"
            if "." in text:  # only a fraction's trailing zeros ('1MiB' was 100 MiB's hint)
                text = text.rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return str(n)


def _fail(prog: str, msg: str, code: int = EXIT_BAD_ARGS) -> int:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return code


# -- offload plan -----------------------------------------------------------------------------


def _default_out(trace_path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(trace_path)), "plan.json")


def _png_beside(plan_path: str) -> str:
    root, ext = os.path.splitext(plan_path)
    return (root if ext.lower() == ".json" else plan_path) + ".png"


def _check_writable(path: str, option: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{option} {path!r}: cannot create {parent!r}: {_reason(e)}") from None
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path!r}: directory {parent!r} is not writable")


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links and symlinks too
    except OSError:  # one is not there yet: compare where the names lead
        return os.path.realpath(a) == os.path.realpath(b)


def _check_distinct(
    *, outputs: list[tuple[str, str | None]], inputs: list[tuple[str, str | None]]
) -> None:
    """Raise ``UsageError`` when an output is the same file as an input or as another output
    (``--png`` = TRACE would replace the trace with a picture), naming both options."""
    given_outputs = [(opt, path) for opt, path in outputs if path is not None]
    others = given_outputs + [(opt, path) for opt, path in inputs if path is not None]
    for i, (opt, path) in enumerate(given_outputs):
        for other_opt, other in others[i + 1 :]:
            if same_file(path, other):
                raise UsageError(
                    f"{opt} {path!r} is the same file as {other_opt} {other!r}; give "
                    f"{opt} another file"
                )


def run(args: argparse.Namespace) -> int:
    """``offload plan``; the exit status."""
    prog = "offload plan"
    try:
        options = check_plan_options(args, cuda_expected=None)
        if not os.path.exists(args.trace):
            raise UsageError(f"trace file {args.trace!r} not found")
        plan_path = args.out or _default_out(args.trace)
        png_path = None if args.no_png else (args.png or _png_beside(plan_path))
        _check_writable(plan_path, "--out")
        if png_path is not None:
            _check_writable(png_path, "--png")
        _check_distinct(
            outputs=[("--out", plan_path), ("--png", png_path)],
            inputs=[("TRACE", args.trace), ("--hardware", args.hardware)],
        )
        try:
            trace = Trace.load(args.trace)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read trace {args.trace!r}: {_reason(e)}") from None
    except UsageError as e:
        return _fail(prog, str(e))
    print(
        f"trace: {args.trace}: {trace.steps} step(s), {len(trace.records)} saved tensors; "
        f"planning the last step"
    )
    return plan_and_write(trace, options, plan_path=plan_path, png_path=png_path, prog=prog)
