"""``offload profile``: record the saved tensors of an unmodified training script."""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from offload.cli import _args, _plan
from offload.lifecycle import MonotonicClock, Recorder, Trace, write_memory_png, write_perfetto


class _ProfileComplete(BaseException):
    """Raised into the script at its next module call once the requested steps are recorded.

    A BaseException so that a script's ``except Exception`` does not swallow it.
    """


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="record when each saved tensor of a training script is created and used",
        description=(
            "Run SCRIPT (a normal training script, unmodified) with global module hooks and "
            "saved-tensor hooks; one backward pass is one step. Writes trace.json, a Perfetto "
            "trace and a memory-timeline PNG into --out and prints a summary. With --gpu-budget "
            "it also plans the last recorded step as `offload plan` does, prints the plan and "
            "writes plan.json and plan.png into --out. Options go before SCRIPT; everything "
            "after SCRIPT is passed to it. Exit status: 0 success; 1 the script failed (the "
            "completed steps are still written and planned) or no step completed; 2 bad "
            "arguments or an output that cannot be written; "
            f"{_args.EXIT_INFEASIBLE} the budget cannot be met (the trace is "
            "written; the message gives the smallest feasible budget)."
        ),
    )
    p.add_argument(
        "--steps", type=int, default=1, help="steps (backward passes) to record (default 1)"
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="steps to run before recording (default 1)"
    )
    p.add_argument(
        "--out", default="offload-profile", help="output directory (default ./offload-profile)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    _args.add_plan_options(p, budget_required=False)
    p.add_argument("script", help="the training script to run")
    rest = p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    # argparse marks a REMAINDER positional required, and without SCRIPT said "required: script,
    # script_args"; the script's arguments may be none.
    rest.required = False
    p.set_defaults(run=run)


def _fail(msg: str, code: int = _args.EXIT_BAD_ARGS) -> int:
    return _args.fail("offload profile", msg, code)


def _prepare_out(out: str) -> str | None:
    """Create ``out`` and check it is writable; return an error message or None."""
    if os.path.exists(out) and not os.path.isdir(out):  # makedirs would say "File exists"
        return f"output path {out!r} exists and is not a directory"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        return f"cannot create output directory {out!r}: {e.strerror or e}"
    probe = os.path.join(out, f".offload-write-test-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("x")
    except OSError as e:  # the write, or the close that flushes it on a full disk
        return f"output directory {out!r} is not writable: {e.strerror or e}"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def _clock_and_probe() -> tuple[Any, Any, str]:
    # The script's device is unknown until it runs; on a CUDA machine time with CUDA events and
    # read the allocator (the script will use CUDA anyway); elsewhere the host clock.
    if torch.cuda.is_available():
        from offload._device import clock_and_probe

        return clock_and_probe(torch.device("cuda", torch.cuda.current_device()))
    return MonotonicClock(), None, "cpu"


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        return _fail(f"--steps must be >= 1; got {args.steps}")
    if args.warmup < 0:
        return _fail(f"--warmup must be >= 0; got {args.warmup}")
    script = args.script
    if os.path.isdir(script):
        return _fail(f"script {script!r} is a directory; give a Python file")
    if not os.path.isfile(script):
        return _fail(f"script {script!r} not found")
    plan_options = None
    try:
        if args.gpu_budget is not None:
            plan_options = _args.check_plan_options(args, cuda_expected=torch.cuda.is_available())
        elif given := _args.planning_options_given(args):
            raise _args.UsageError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with "
                "--gpu-budget (without a budget there is nothing to plan)"
            )
    except _args.UsageError as e:
        return _fail(str(e))
    err = _prepare_out(args.out)
    if err:
        return _fail(err)
    hardware = getattr(args, "hardware", None)
    if hardware is not None:
        # The outputs replace (or, a plan of an earlier run, remove) these files.
        for name in _OUTPUTS:
            if _args.same_file(hardware, os.path.join(args.out, name)):
                return _fail(
                    f"--hardware {hardware!r} is the {name} this run writes into --out; "
                    "keep the hardware model outside --out"
                )
    # The script may change directory (os.chdir to its data, say): write where --out named
    # when the command started.
    out = os.path.abspath(args.out)
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]

    clock, probe, device = _clock_and_probe()
    rec = Recorder(
        clock=clock,
        memory_probe=probe,
        boundary="backward",
        max_steps=args.steps,
        warmup_steps=args.warmup,
    )
    t0 = time.perf_counter()

    def progress(done: int, warmup: bool) -> None:
        if args.quiet:
            return
        elapsed = time.perf_counter() - t0
        if warmup:
            print(f"offload: warm-up step done ({elapsed:.1f} s)", file=sys.stderr, flush=True)
        else:
            print(
                f"offload: recorded step {done}/{args.steps} ({elapsed:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    rec.on_step_end(progress)

    def stop_when_done(module: nn.Module, inputs: Any) -> None:
        if rec.done:
            raise _ProfileComplete

    if not args.quiet:
        print(
            f"offload: profiling {script} (warm-up {args.warmup}, recording {args.steps} step(s); "
            "one backward pass = one step)",
            file=sys.stderr,
            flush=True,
        )
    failure: BaseException | None = None
    old_argv, old_path0, old_cwd = sys.argv, sys.path[0] if sys.path else None, os.getcwd()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    stop = nn.modules.module.register_module_forward_pre_hook(stop_when_done)
    # The saved-tensor hooks below are this thread's: so are the steps (module calls of the
    # script's other threads are not recorded).
    rec.begin_step(thread=threading.get_ident())
    try:
        with rec.attach_global(), rec.hooks(), script_stdout():
            runpy.run_path(script, run_name="__main__")
    except _ProfileComplete:
        pass
    except SystemExit as e:
        if e.code not in (None, 0):
            failure = e
    except BaseException as e:  # the script's own failure: still write what was recorded
        failure = e
    finally:
        stop.remove()
        os.chdir(old_cwd)
        sys.argv = old_argv
        if sys.path and sys.path[0] != old_path0:
            sys.path.pop(0)

    trace = rec.trace(
        {
            "device": device,
            "script": script,
            "warmup_steps": args.warmup,
            "source": "offload profile",
        }
    )
    if trace.steps == 0:
        if failure is not None:
            _describe_failure(script, failure)
            return _fail("the script failed before any step completed; no trace written", 1)
        return _fail(
            f"no backward pass ran in {script} after {args.warmup} warm-up step(s); nothing to "
            "record (does the script call loss.backward()? lower --warmup?)",
            1,
        )
    if trace.steps < args.steps and failure is None:
        print(
            f"offload profile: warning: the script ended after {trace.steps} of the "
            f"{args.steps} step(s) asked for (--steps); the trace holds those",
            file=sys.stderr,
        )
    plan_path, png_path = os.path.join(out, "plan.json"), os.path.join(out, "plan.png")
    try:
        paths = _write_outputs(trace, out, stale=(plan_path, png_path))
    except _OutputError as e:
        if failure is not None:
            _describe_failure(script, failure)
        return _fail(str(e))
    print(trace.summary())
    for p in paths:
        print(f"wrote {p}")
    status = 0
    if plan_options is not None:
        print()
        status = _plan.plan_and_write(
            trace, plan_options, plan_path=plan_path, png_path=png_path, prog="offload profile"
        )
    if failure is not None:
        _describe_failure(script, failure)
        return _fail(
            f"the script failed; wrote the trace of the {trace.steps} completed step(s)", 1
        )
    return status


@contextlib.contextmanager
def script_stdout() -> Iterator[None]:
    """Give the script the standard output stream itself, not :func:`offload.cli.main`'s
    wrapper, and put the wrapper back after it (whatever the script left in ``sys.stdout``):
    the script's failed writes are its own, the summary's are the command's (exit status 2)."""
    ours = sys.stdout
    sys.stdout = getattr(ours, "stream", ours)
    try:
        yield
    finally:
        sys.stdout = ours


def _describe_failure(script: str, exc: BaseException) -> None:
    import traceback

    if isinstance(exc, SystemExit):  # an exit status, not an error: as Python reports it
        if isinstance(exc.code, int):
            print(f"offload profile: {script} exited with status {exc.code}", file=sys.stderr)
        else:
            print(f"offload profile: {script} exited: {exc.code}", file=sys.stderr)
        return
    # From the script's first frame, as `python SCRIPT` prints it: this module's and runpy's
    # frames come first (none of them, for a script that does not compile).
    tb = exc.__traceback__
    while tb is not None and _is_runner_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    print(f"offload profile: {script} raised:", file=sys.stderr)
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _is_runner_frame(filename: str) -> bool:
    return filename == __file__ or os.path.basename(filename) in ("runpy.py", "<frozen runpy>")


class _OutputError(Exception):
    """An output file that could not be written or removed; the message names it."""


_OUTPUTS = ("trace.json", "trace.perfetto.json", "memory.png", "plan.json", "plan.png")


def _write_outputs(trace: Trace, out: str, *, stale: tuple[str, ...]) -> list[str]:
    """Write the trace into ``out``, remove the files ``stale``, then write the trace's Perfetto
    export and memory PNG; each file atomically. Returns the paths written.

    Raises:
        _OutputError: naming the first file that cannot be written or removed (a full disk, a
            directory in its place).
    """
    trace_path = os.path.join(out, "trace.json")
    _write(Trace.save, trace, trace_path)
    # A plan left by an earlier run belongs to the trace just replaced: never leave it beside
    # this one (a run without --gpu-budget, or with an infeasible one, writes none).
    for path in stale:
        _remove(path)
    paths = [trace_path, os.path.join(out, "trace.perfetto.json")]
    _write(write_perfetto, trace, paths[1])
    png = os.path.join(out, "memory.png")
    try:
        _write(write_memory_png, trace, png)
        paths.append(png)
    except ImportError as e:
        print(f"offload: skipped {png}: {e}", file=sys.stderr)
    return paths


def _write(write: Callable[[Trace, str], None], trace: Trace, path: str) -> None:
    try:
        write(trace, path)
    except OSError as e:
        raise _OutputError(f"cannot write {path!r}: {e.strerror or e}") from e


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise _OutputError(
            f"cannot remove {path!r}, left by an earlier run: {e.strerror or e}"
        ) from e
