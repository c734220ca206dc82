"""``offload profile`` end to end on the example training script and small scripts: in a
subprocess where the process itself is what a test is about (the entry points, exit statuses,
tracebacks, standard output, file size limits), else through ``main(argv)`` in this process
(the same command, without a second interpreter importing torch: about 3 s a test)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_cli_plan import assert_anchors_printed

from offload.lifecycle import HardwareModel, Plan, Trace

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_gpt.py"


def offload_cli(
    *args: str, cwd: Path | None = None, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "offload", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=env,
        timeout=timeout,
    )


def offload_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``offload ARGS`` run by ``main`` in this process: its exit status, stdout and stderr."""
    from offload.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's errors
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def test_profile_example_script(tmp_path: Path) -> None:
    out = tmp_path / "prof"
    r = offload_cli(
        "profile", "--steps", "2", "--out", str(out), str(TRAIN), "--steps", "6", "--layers", "2"
    )
    assert r.returncode == 0, r.stderr
    for name in ("trace.json", "trace.perfetto.json", "memory.png"):
        assert (out / name).is_file(), name
    trace = Trace.load(out / "trace.json")
    assert trace.steps == 2
    assert trace.metadata["source"] == "offload profile"
    mods = {r.module for r in trace.records}
    assert {"GPT.blocks.0.attn", "GPT.blocks.1.mlp.fc1"} <= mods
    per_step = [[r.key for r in trace.records if r.step == s] for s in (0, 1)]
    assert per_step[0] == per_step[1] and per_step[0]
    assert "peak live saved bytes" in r.stdout
    assert "recorded step 2/2" in r.stderr
    # The script stopped after the recorded steps: it asked for 6, the profiler needed 3.
    assert "step     6" not in r.stdout


def test_the_profile_command_in_the_script_docstring(tmp_path: Path) -> None:
    """train_gpt.py's docstring said to profile it with ``offload profile
    examples/train_gpt.py --steps 2``: that ``--steps 2`` goes to the script (everything after
    SCRIPT does), so the profiler recorded its default 1 step, not the 2 a reader would take it
    for. The command shown sets the profiler's options before the script, none of the same name
    after it, and run as shown it records the steps it asks for."""
    import ast
    import shlex

    from offload.cli._main import build_parser

    doc = ast.get_docstring(ast.parse(TRAIN.read_text())) or ""
    line = next(s.strip() for s in doc.splitlines() if s.strip().startswith("offload profile"))
    argv = shlex.split(line)[1:]
    args = build_parser().parse_args(argv)
    ours = argv[: argv.index(args.script)]
    assert "--steps" in ours and "--steps" not in args.script_args, line
    assert (ROOT / args.script).resolve() == TRAIN
    argv[argv.index(args.script)] = str(TRAIN)  # run from a directory of the test's own
    r = offload_cli(*argv, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert Trace.load(tmp_path / args.out / "trace.json").steps == args.steps


def test_script_args_after_double_dash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = offload_main(
        capsys, "profile", "--warmup", "0", "--out", str(tmp_path), str(TRAIN), "--", "--steps", "1"
    )
    assert code == 0, err
    assert Trace.load(tmp_path / "trace.json").steps == 1


def test_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = offload_main(
        capsys, "profile", "--out", str(tmp_path), str(tmp_path / "nope.py")
    )
    assert code == 2
    assert "nope.py" in err and "not found" in err
    assert "Traceback" not in err


def test_no_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from offload.cli import main

    with pytest.raises(SystemExit) as e:
        main(["profile", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "the following arguments are required: script\n" in err  # not "script, script_args"


def test_unwritable_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = offload_main(capsys, "profile", "--out", str(blocker / "sub"), str(TRAIN))
    assert code == 2
    assert "output directory" in err and str(blocker) in err


def test_bad_step_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = offload_main(
        capsys, "profile", "--steps", "0", "--out", str(tmp_path), str(TRAIN)
    )
    assert code == 2 and "--steps" in err
    code, _, err = offload_main(
        capsys, "profile", "--warmup", "-1", "--out", str(tmp_path), str(TRAIN)
    )
    assert code == 2 and "--warmup" in err


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "script.py"
    p.write_text(textwrap.dedent(body))
    return p


def test_script_that_raises_keeps_completed_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        for i in range(10):
            if i == 3:
                m(torch.randn(4, 32))  # a forward of the broken step
                raise ValueError("broken batch")
            m(torch.randn(4, 32)).sum().backward()
        """,
    )
    out = tmp_path / "out"
    code, _, err = offload_main(
        capsys, "profile", "--warmup", "1", "--steps", "5", "--out", str(out), str(script)
    )
    assert code == 1
    assert "broken batch" in err and "2 completed step" in err
    trace = Trace.load(out / "trace.json")
    assert trace.steps == 2
    # The broken step's forward was thrown away.
    assert {r.step for r in trace.records} == {0, 1}


def test_script_without_backward(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        m = torch.nn.Linear(8, 8)
        with torch.no_grad():
            m(torch.randn(2, 8))
        print("inference done")
        """,
    )
    code, _, err = offload_main(capsys, "profile", "--out", str(tmp_path / "o"), str(script))
    assert code == 1
    assert "no backward pass ran" in err
    assert not (tmp_path / "o" / "trace.json").exists()


def test_script_sys_exit_zero_is_success(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        """
        import sys, torch
        m = torch.nn.Linear(8, 8)
        for _ in range(3):
            m(torch.randn(2, 8)).sum().backward()
        sys.exit(0)
        """,
    )
    code, _, err = offload_main(
        capsys, "profile", "--steps", "5", "--out", str(tmp_path / "o"), str(script)
    )
    assert code == 0, err
    assert Trace.load(tmp_path / "o" / "trace.json").steps == 2  # 3 backward passes, 1 warm-up
    # Fewer steps than --steps asked for: said, not silent.
    assert "ended after 2 of the 5 step(s)" in err


@pytest.mark.parametrize(
    "entry", [["-m", "offload"], ["-c", "from offload.cli import main; raise SystemExit(main())"]]
)
def test_help(entry: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, *entry, "profile", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0
    assert "SCRIPT" in r.stdout or "script" in r.stdout


# The example at its defaults saves 9 MiB of activations per step on CPU (batch 8 x 64 tokens,
# 2 blocks of width 128): a 6 MiB budget needs a plan that moves some of them.
BUDGET = 6 << 20


def test_profile_with_budget_plans_the_last_step(tmp_path: Path) -> None:
    hardware = tmp_path / "hardware.json"
    HardwareModel.h200().save(hardware)
    out = tmp_path / "prof"
    r = offload_cli(
        "profile",
        "--quiet",
        "--steps",
        "2",
        "--out",
        str(out),
        "--gpu-budget",
        "6MiB",
        "--hardware",
        str(hardware),
        "--min-offload-bytes",
        "0",
        "--margin",
        "0",
        str(TRAIN),
        "--steps",
        "4",
    )
    assert r.returncode == 0, r.stderr
    trace = Trace.load(out / "trace.json")
    assert trace.steps == 2 and trace.peak_memory_bytes > BUDGET
    plan = Plan.load(out / "plan.json")
    assert plan.gpu_budget_bytes == BUDGET
    assert plan.predicted_peak_bytes <= BUDGET < plan.anchors["keep_all"].peak_bytes
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert "peak live saved bytes" in r.stdout  # the trace summary, then the plan's
    assert "this plan" in r.stdout
    assert_anchors_printed(r.stdout, plan, trace)
    assert f"wrote {out / 'plan.json'}" in r.stdout


def test_profile_infeasible_budget_keeps_the_trace(tmp_path: Path) -> None:
    hardware = tmp_path / "hardware.json"
    HardwareModel.h200().save(hardware)
    out = tmp_path / "prof"
    out.mkdir()
    (out / "plan.json").write_text("{}")  # an earlier run's: it must not outlive its trace
    r = offload_cli(
        "profile",
        "--quiet",
        "--out",
        str(out),
        "--gpu-budget",
        "1KiB",
        "--hardware",
        str(hardware),
        str(TRAIN),
        "--steps",
        "3",
    )
    assert r.returncode == 3, r.stderr
    assert "cannot be met" in r.stderr and "try --gpu-budget" in r.stderr
    assert "Traceback" not in r.stderr
    assert Trace.load(out / "trace.json").steps == 1
    assert not (out / "plan.json").exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--margin", "0"], "--margin"),  # a planning option without a budget
        (["--gpu-budget", "lots"], "--gpu-budget"),
        (["--gpu-budget", "1GiB", "--hardware", "missing.json"], "--hardware"),
        (["--gpu-budget", "1GiB", "--tiers", "disk"], "--tiers"),
        (["--gpu-budget", "1GiB", "--nvme-bytes", "1GiB"], "--nvme-bytes applies only with nvme"),
    ],
)
def test_profile_bad_planning_arguments(
    tmp_path: Path, args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from offload.cli import main

    # Refused before the script runs.
    script = _script(tmp_path, "raise SystemExit('the script must not run')")
    try:
        code = main(["profile", "--out", str(tmp_path / "o"), *args, str(script)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err and "must not run" not in err
    assert not (tmp_path / "o").exists()


def test_profile_percentage_budget_needs_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from offload.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine takes a percentage of its device memory")
    script = _script(tmp_path, "raise SystemExit('the script must not run')")
    code = main(["profile", "--out", str(tmp_path / "o"), "--gpu-budget", "85%", str(script)])
    err = capsys.readouterr().err
    assert code == 2 and "--gpu-budget 85%" in err and "CUDA" in err


_TINY = """
    import os, torch
    {chdir}
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    for _ in range(3):
        m(torch.randn(2, 8)).sum().backward()
"""


def test_script_that_changes_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A relative --out means relative to where the command started, whatever directory the
    script moves to; the command's own directory is back when it returns."""
    from offload.cli import main

    (tmp_path / "data").mkdir()
    script = _script(tmp_path, _TINY.format(chdir="os.chdir('data')"))
    monkeypatch.chdir(tmp_path)
    code = main(["profile", "--quiet", "--out", "prof", str(script)])
    assert code == 0, capsys.readouterr().err
    assert os.getcwd() == str(tmp_path)
    assert Trace.load(tmp_path / "prof" / "trace.json").steps == 1
    assert not (tmp_path / "data" / "prof").exists()


def test_profile_without_budget_removes_an_earlier_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An earlier run's plan belongs to the trace this run replaces: without --gpu-budget
    there is no new plan, and the old one must not stay beside the new trace."""
    from offload.cli import main

    out = tmp_path / "prof"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    (out / "plan.png").write_bytes(b"\x89PNG")
    script = _script(tmp_path, _TINY.format(chdir=""))
    code = main(["profile", "--quiet", "--out", str(out), str(script)])
    assert code == 0, capsys.readouterr().err
    assert Trace.load(out / "trace.json").steps == 1
    assert not (out / "plan.json").exists() and not (out / "plan.png").exists()


@pytest.mark.parametrize("name", ["plan.json", "trace.json"])
def test_a_hardware_model_inside_out_where_an_output_goes_is_refused(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--hardware OUT/plan.json`` was read, then removed as an earlier run's plan (and
    ``OUT/trace.json`` overwritten by the trace); refused before the script runs."""
    from offload.cli import main

    out = tmp_path / "prof"
    out.mkdir()
    hw = out / name
    HardwareModel.cpu_only(
        copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    ).save(hw)
    before = hw.read_bytes()
    script = _script(tmp_path, "raise SystemExit('the script must not run')")
    code = main(
        ["profile", "--out", str(out), "--gpu-budget", "1MiB", "--hardware", str(hw), str(script)]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--hardware" in err and name in err and "must not run" not in err
    assert hw.read_bytes() == before


def _profile_with_file_size_limit(
    tmp_path: Path, out: Path, nbytes: int
) -> subprocess.CompletedProcess:
    from conftest import limit_file_size

    script = _script(tmp_path, _TINY.format(chdir=""))
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "offload", "profile", "--quiet", "--out", str(out), str(script)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=240,
        preexec_fn=lambda: limit_file_size(nbytes),
    )  # fmt: skip


def test_outputs_that_cannot_be_written(tmp_path: Path) -> None:
    """A disk that fills up (here a file-size limit: the same EFBIG from the kernel) is reported
    as an error with exit 2, not a traceback, and leaves no half-written or temp file."""
    out = tmp_path / "prof"
    r = _profile_with_file_size_limit(tmp_path, out, 200)
    assert r.returncode == 2, r.stderr
    assert f"offload profile: error: cannot write {str(out / 'trace.json')!r}" in r.stderr
    assert "Traceback" not in r.stderr
    assert list(out.iterdir()) == []


def test_output_directory_that_takes_no_byte(tmp_path: Path) -> None:
    """The writability check fails on a full disk at its write (or the close that flushes it)
    and removes its probe file all the same."""
    out = tmp_path / "prof"
    r = _profile_with_file_size_limit(tmp_path, out, 0)
    assert r.returncode == 2, r.stderr
    assert f"output directory {str(out)!r} is not writable" in r.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    ("blocked", "message"),
    [
        ("trace.perfetto.json", "cannot write"),
        ("memory.png", "cannot write"),
        ("plan.json", "cannot remove"),  # an earlier run's plan, of the trace being replaced
    ],
)
def test_a_directory_where_an_output_goes(
    tmp_path: Path, blocked: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from offload.cli import main

    if blocked.endswith(".png"):
        pytest.importorskip("matplotlib")
    out = tmp_path / "prof"
    (out / blocked).mkdir(parents=True)
    script = _script(tmp_path, _TINY.format(chdir=""))
    code = main(["profile", "--quiet", "--out", str(out), str(script)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"offload profile: error: {message} {str(out / blocked)!r}" in err
    assert Trace.load(out / "trace.json").steps == 1  # written before
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


def test_standard_output_that_cannot_be_written(tmp_path: Path) -> None:
    """``offload profile ... > /dev/full``: the summary cannot be printed; the command says so in
    one line and exits with 2, as ``plan`` and ``info`` do, after writing the trace files."""
    script = _script(tmp_path, _TINY.format(chdir=""))
    out = tmp_path / "prof"
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "offload", "profile", "--quiet", "--out", str(out), str(script)],
            stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=240,
            env=dict(os.environ, PYTHONWARNINGS="ignore"),
        )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr == "offload: error: cannot write to standard output: No space left on device\n"
    assert Trace.load(out / "trace.json").steps == 1


@pytest.mark.parametrize(
    ("exit_call", "message"),
    [
        ("sys.exit(3)", "offload profile: {script} exited with status 3\n"),
        ("sys.exit('fatal: bad config')", "offload profile: {script} exited: fatal: bad config\n"),
    ],
)
def test_script_that_exits_with_an_error_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], exit_call: str, message: str
) -> None:
    """``sys.exit(3)`` in the script is its exit status, not an exception: one line, no
    traceback, and the completed steps are written."""
    from offload.cli import main

    script = _script(tmp_path, _TINY.format(chdir="import sys") + f"    {exit_call}\n")
    code = main(["profile", "--quiet", "--steps", "5", "--out", str(tmp_path / "o"), str(script)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err and "SystemExit" not in err, err
    assert message.format(script=script) in err
    assert "wrote the trace of the 2 completed step(s)" in err
    assert Trace.load(tmp_path / "o" / "trace.json").steps == 2


def test_traceback_of_the_script_starts_in_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's own exception keeps its traceback, from the script's first frame, as
    ``python script.py`` prints it (not from offload's or runpy's frames)."""
    from offload.cli import main

    script = _script(tmp_path, "def f():\n    raise KeyError('boom')\n\nf()\n")
    code = main(["profile", "--quiet", "--out", str(tmp_path / "o"), str(script)])
    err = capsys.readouterr().err
    assert code == 1, err
    tb = err.split("Traceback (most recent call last):\n", 1)[1]
    assert tb.startswith(f'  File "{script}", line 4, in <module>'), err
    assert "KeyError: 'boom'" in tb and "runpy" not in tb and "_cli_profile" not in tb


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_output_or_script_of_the_wrong_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    from offload.cli import main

    script = _script(tmp_path, _TINY.format(chdir=""))
    if kind == "file":  # --out names an existing file
        code = main(["profile", "--out", str(script), str(script)])
        expected = f"output path {str(script)!r} exists and is not a directory"
    else:  # SCRIPT names a directory
        code = main(["profile", "--out", str(tmp_path / "o"), str(tmp_path)])
        expected = f"script {str(tmp_path)!r} is a directory; give a Python file"
    assert code == 2
    assert capsys.readouterr().err == f"offload profile: error: {expected}\n"
