"""``offload plan``: plan where a recorded step's activations wait so it fits a memory budget.

:func:`plan_and_write` plans, prints and writes the plan JSON and PNG for ``offload plan`` and
for ``offload profile --gpu-budget``; the options both take are in :mod:`offload.cli._args`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch

from offload._errors import BudgetInfeasibleError
from offload._planning import plan, resolve_budget, trace_device
from offload._probe import (
    QUICK_DISK_PROBE_BYTES,
    cached_hardware,
    probe_hardware,
    with_measured_disk,
)
from offload.cli._args import (
    EXIT_FAILED,
    EXIT_INFEASIBLE,
    EXIT_OK,
    PlanOptions,
    UsageError,
    add_plan_options,
    check_plan_options,
    fail,
    percent_needs_cuda,
    reason,
    same_file,
)
from offload.lifecycle import HardwareModel, Plan, Trace
from offload.lifecycle._export import write_plan_png
from offload.lifecycle._units import format_bytes


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
        return fail(prog, str(e))
    except Exception as e:  # the probe: a driver or OS failure, reported, not a traceback
        return fail(
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
            return fail(
                prog,
                f"measuring the disk in {options.nvme_dir!r} failed ({type(e).__name__}: {e})",
                EXIT_FAILED,
            )
    print(f"hardware: {describe_hardware(hardware)}")
    try:
        p = _plan(trace, budget, hardware, options)
    except BudgetInfeasibleError as e:
        fail(prog, str(e), EXIT_INFEASIBLE)
        _hint_feasible(trace, e, hardware, options, prog)
        return EXIT_INFEASIBLE
    except (TypeError, ValueError) as e:  # e.g. a trace without a step
        return fail(prog, f"cannot plan this trace: {e}")
    except (ArithmeticError, LookupError, RuntimeError) as e:
        # A trace that loads but that the planner or the simulator cannot take (the loader
        # checks each field, not every relation between them): said with what failed, not a
        # traceback.
        return fail(prog, f"cannot plan this trace: {type(e).__name__}: {e}")
    print(p.summary())
    try:
        p.save(plan_path)
    except OSError as e:
        return fail(prog, f"cannot write the plan to {plan_path!r}: {reason(e)}")
    except ValueError as e:  # a NaN or an infinity in the plan: JSON has no such numbers
        return fail(prog, f"cannot write the plan to {plan_path!r}: {e}")
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
        raise UsageError(percent_needs_cuda(budget, recorded_on))
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
        print(f"{prog}: warning: cannot write {path!r}: {reason(e)}", file=sys.stderr)
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
        raise UsageError(f"{option} {path!r}: cannot create {parent!r}: {reason(e)}") from None
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path!r}: directory {parent!r} is not writable")


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
            raise UsageError(f"cannot read trace {args.trace!r}: {reason(e)}") from None
    except UsageError as e:
        return fail(prog, str(e))
    print(
        f"trace: {args.trace}: {trace.steps} step(s), {len(trace.records)} saved tensors; "
        f"planning the last step"
    )
    return plan_and_write(trace, options, plan_path=plan_path, png_path=png_path, prog=prog)
