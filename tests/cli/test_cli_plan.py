"""``offload plan`` end to end on a trace of the example training script: the main paths in a
subprocess, as a user runs it; argument errors through ``offload.cli.main`` in this process
(the same code, without paying for a Python start and a torch import per case)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from offload.cli import main
from offload.lifecycle import HardwareModel, Plan, Prediction, Trace, predict_anchors
from offload.lifecycle._units import format_bytes

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_gpt.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Tiny CPU activations: plan every one, and hold the budget exactly.
SMALL = ("--min-offload-bytes", "0", "--margin", "0")


def run_cli(
    *args: str, cache_dir: Path, entry: tuple[str, ...] = ("-m", "offload"), timeout: float = 240
) -> subprocess.CompletedProcess:
    # A private probe cache: no test reads or writes the user's.
    env = dict(os.environ, PYTHONWARNINGS="ignore", OFFLOAD_CACHE_DIR=str(cache_dir))
    return subprocess.run(
        [sys.executable, *entry, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def run_main(*args: str, capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """``offload ARGS`` in this process, as a CompletedProcess (argparse errors exit with 2)."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["offload", *args], code, out, err)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with trace.json (one profiled step of the example) and hardware.json (H200)."""
    d = tmp_path_factory.mktemp("cli_plan")
    # In this process (``main``, as run_main): a second interpreter importing torch took 3 s.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_CACHE_DIR", str(d / "cache"))  # no test touches the user's cache
        code = main(["profile", "--quiet", "--out", str(d), str(TRAIN), "--steps", "3"])
    assert code == 0
    HardwareModel.h200().save(d / "hardware.json")
    return d


@pytest.fixture(scope="module")
def peak(work: Path) -> int:
    """Device bytes the traced step peaks at when everything is kept."""
    return Trace.load(work / "trace.json").peak_memory_bytes


def plan_cli(work: Path, *args: str, trace: Path | None = None) -> subprocess.CompletedProcess:
    return run_cli(
        "plan",
        str(trace or work / "trace.json"),
        "--hardware",
        str(work / "hardware.json"),
        *args,
        cache_dir=work / "cache",
    )


def test_plan_fits_budget_and_writes_json_and_png(
    work: Path, peak: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = peak // 2
    out = tmp_path / "p.json"
    r = plan_main(work, "--gpu-budget", str(budget), *SMALL, "--out", str(out), capsys=capsys)
    assert r.returncode == 0, r.stderr
    plan = Plan.load(out)
    assert plan.gpu_budget_bytes == budget and plan.margin_bytes == 0
    assert plan.predicted_peak_bytes <= budget < plan.anchors["keep_all"].peak_bytes
    assert plan.tiers == ("cpu",)
    # The summary, with the plan next to the three anchors: what running each alternative
    # gives, as lifecycle.predict_anchors simulates it (NOTE [ Anchors ]), in the JSON too.
    assert "this plan" in r.stdout
    assert_anchors_printed(r.stdout, plan, Trace.load(work / "trace.json"))
    assert "NVIDIA H200" in r.stdout  # the hardware it planned with
    png = tmp_path / "p.png"  # default: beside --out
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {out}" in r.stdout and f"wrote {png}" in r.stdout
    assert "Traceback" not in r.stderr


def assert_anchors_printed(stdout: str, plan: Plan, trace: Trace) -> None:
    """The plan's anchors are predict_anchors' (min_offload_bytes 0, the H200 model), and the
    summary prints each one's peak and step time. The plan's offload_all was a planned
    move-everything, not the manager's min-memory mode."""
    want = predict_anchors(trace, HardwareModel.h200(), min_offload_bytes=0)
    assert dict(plan.anchors) == {
        k: Prediction(peak_bytes=s.peak_bytes, step_s=s.step_s) for k, s in want.items()
    }
    for k, s in want.items():
        row = rf"^  {k} +{re.escape(format_bytes(s.peak_bytes))} +{s.step_s * 1e3:.2f}ms "
        assert re.search(row, stdout, re.M), (k, stdout)


def test_default_outputs_beside_the_trace_and_size_strings(
    work: Path, peak: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    shutil.copy(work / "trace.json", trace)
    budget_kib = peak * 3 // 4 // 1024
    r = plan_main(work, "--gpu-budget", f"{budget_kib}KiB", *SMALL, trace=trace, capsys=capsys)
    assert r.returncode == 0, r.stderr
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.gpu_budget_bytes == budget_kib * 1024
    assert plan.predicted_peak_bytes <= budget_kib * 1024
    assert (tmp_path / "plan.png").read_bytes()[:8] == PNG_MAGIC


def plan_main(
    work: Path, *args: str, capsys: pytest.CaptureFixture[str], trace: Path | None = None
) -> subprocess.CompletedProcess:
    return run_main(
        "plan",
        str(trace or work / "trace.json"),
        "--hardware",
        str(work / "hardware.json"),
        *args,
        capsys=capsys,
    )


def test_a_plan_of_the_cli_runs_on_the_scripts_model_with_every_record_planned(
    work: Path,
    peak: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's flow: ``offload profile`` a script, ``offload plan`` its trace, then give the
    plan to the script's manager. The CLI names modules from the root's class (``GPT.blocks.0``),
    the manager from its model: before, no key matched (every stored record unplanned, all of
    them offloaded); now every record is planned and the plan's bytes are the ones moved."""
    import torch

    import offload

    spec = importlib.util.spec_from_file_location("_gpt_example", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpt)  # its dataclasses look their module up
    spec.loader.exec_module(gpt)
    out = tmp_path / "p.json"
    r = plan_main(
        work, "--gpu-budget", str(peak // 2), *SMALL, "--out", str(out), "--no-png", capsys=capsys
    )
    assert r.returncode == 0, r.stderr
    plan = Plan.load(out)
    assert plan.metadata["root_modules"] == ["GPT"]
    model = gpt.GPT(gpt.GPTConfig(), seed=0)  # examples/train_gpt.py's defaults
    tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    mgr = offload.ActivationOffloader(model, plan=str(out), min_offload_bytes=0)
    with mgr:
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    stats = mgr.stats.last
    mgr.close()
    assert stats.unplanned_records == 0
    cpu = [e for e in plan.entries if e.placement.value == "cpu"]
    assert stats.records_offloaded_cpu == len(cpu) > 0


def test_tiers_and_host_room(
    work: Path, peak: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    r = plan_main(
        work,
        "--gpu-budget",
        str(peak // 2),
        *SMALL,
        "--tiers",
        "cpu,nvme",
        "--cpu-budget",
        "1MiB",
        "--nvme-bytes",
        "1GiB",
        "--out",
        str(out),
        "--no-png",
        capsys=capsys,
    )
    assert r.returncode == 0, r.stderr
    plan = Plan.load(out)
    assert plan.tiers == ("cpu", "nvme")
    assert plan.predicted_peak_bytes <= peak // 2
    assert plan.bytes_by_placement()["cpu"] <= 1 << 20
    assert not (tmp_path / "plan.png").exists()


def test_default_margin_and_min_offload_bytes(
    work: Path, peak: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    r = plan_main(work, "--gpu-budget", str(peak), "--out", str(out), "--no-png", capsys=capsys)
    assert r.returncode == 0, r.stderr
    plan = Plan.load(out)
    assert abs(plan.margin_bytes - peak * 0.05) <= 1  # a CPU trace: 5% of the budget
    assert plan.predicted_peak_bytes <= plan.target_bytes


def test_infeasible_budget(work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    r = plan_main(work, "--gpu-budget", "1KiB", *SMALL, "--out", str(out), capsys=capsys)
    assert r.returncode == 3, r.stderr
    assert "cannot be met" in r.stderr
    assert "smallest budget that can be planned" in r.stderr and "try --gpu-budget" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_a_suggested_size_parses_to_at_least_what_is_needed() -> None:
    """The hint's figure: 3 significant digits, rounded up. '1.44MiB' was refused as not whole
    bytes (1623 of 2000 random needs), and whole figures lost their zeros ('100MiB' was '1MiB')."""
    from offload.cli._plan import _round_up_size
    from offload.lifecycle._units import parse_bytes

    rng = random.Random(0)
    needs = [100 << 20, 200 << 30, 777_777, 1_509_052, 1023, 1024, 10 << 10]
    needs += [rng.randrange(1 << 20, 64 << 30) for _ in range(500)]
    for n in needs:
        text = _round_up_size(n)
        got = parse_bytes(text, name="--gpu-budget")
        assert n <= got <= n * 1.01 + 1, (n, text, got)


def test_suggested_budget_plans(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The hint accounts for the auto margin growing with the budget: its figure plans.
    r = plan_main(
        work, "--gpu-budget", "1KiB", "--no-png", "--out", str(tmp_path / "x.json"), capsys=capsys
    )
    assert r.returncode == 3
    suggested = r.stderr.split("try --gpu-budget ")[1].split(",")[0].split()[0]
    out = tmp_path / "plan.json"
    r = plan_main(work, "--gpu-budget", suggested, "--no-png", "--out", str(out), capsys=capsys)
    assert r.returncode == 0, r.stderr
    assert Plan.load(out).predicted_peak_bytes <= Plan.load(out).target_bytes


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--gpu-budget", "lots"], "--gpu-budget"),
        (["--gpu-budget", "0"], "--gpu-budget"),
        (["--gpu-budget", "120%"], "--gpu-budget"),
        (["--gpu-budget", "50%"], "--gpu-budget"),  # a CPU trace: no device to take 50% of
        (["--gpu-budget", "1GiB", "--tiers", "gpu"], "--tiers"),
        (["--gpu-budget", "1GiB", "--tiers", "cpu,cpu"], "--tiers"),
        (["--gpu-budget", "1GiB", "--margin", "-1"], "--margin"),
        (["--gpu-budget", "1GiB", "--cpu-budget", "x"], "--cpu-budget"),
        (["--gpu-budget", "1GiB", "--cpu-budget", "0.5"], "not a whole number of bytes"),
        (["--gpu-budget", "9" * 400], "too large"),  # an OverflowError traceback before
        (["--gpu-budget", "1GiB", "--nvme-bytes", "9" * 5000], "too large"),
        (["--gpu-budget", "1GiB", "--min-offload-bytes", "1 MiBs"], "--min-offload-bytes"),
        (["--gpu-budget", "1GiB", "--hardware", "missing.json"], "--hardware"),
        (["--gpu-budget", "1GiB", "--png", "x.png", "--no-png"], "--no-png"),
        (["--gpu-budget", "1GiB", "--nvme-bytes", "1GiB"], "--nvme-bytes applies only with nvme"),
        (["--gpu-budget", "1GiB", "--tiers", "cpu", "--nvme-bytes", "1GiB"], "--nvme-bytes"),
        ([], "--gpu-budget"),  # required
    ],
)
def test_bad_arguments(
    work: Path, args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = run_main(
        "plan", str(work / "trace.json"), *args, "--out", str(tmp_path / "plan.json"), capsys=capsys
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert named in r.stderr
    assert not (tmp_path / "plan.json").exists()


def test_bad_arguments_in_a_subprocess(work: Path, tmp_path: Path) -> None:
    # The console entry point reports and exits the same way (no traceback).
    r = plan_cli(work, "--gpu-budget", "lots", "--out", str(tmp_path / "plan.json"))
    assert r.returncode == 2
    assert "argument --gpu-budget" in r.stderr and "'lots' is not a size" in r.stderr
    assert "Traceback" not in r.stderr


def test_percentage_needs_cuda(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = plan_main(work, "--gpu-budget", "50%", "--out", str(tmp_path / "p.json"), capsys=capsys)
    assert r.returncode == 2
    assert "CUDA" in r.stderr and "8GiB" in r.stderr


def test_bad_trace_files(work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = plan_main(work, "--gpu-budget", "1GiB", trace=tmp_path / "nope.json", capsys=capsys)
    assert r.returncode == 2 and "nope.json" in r.stderr and "not found" in r.stderr
    out = str(tmp_path / "plan.json")
    r = plan_main(
        work, "--gpu-budget", "1GiB", "--out", out, trace=work / "hardware.json", capsys=capsys
    )
    assert r.returncode == 2 and "cannot read trace" in r.stderr
    # A trace's header over a body that is not a trace's: unreadable too, not a traceback.
    body = json.loads((work / "trace.json").read_text())
    body["records"][0]["pack_event"] = len(body["events"])
    spoiled = tmp_path / "spoiled.json"
    spoiled.write_text(json.dumps(body))
    r = plan_main(work, "--gpu-budget", "1GiB", "--out", out, trace=spoiled, capsys=capsys)
    assert r.returncode == 2 and "cannot read trace" in r.stderr and "pack_event" in r.stderr
    r = plan_main(work, "--gpu-budget", "1GiB", "--out", str(work / "trace.json"), capsys=capsys)
    assert r.returncode == 2 and "--out" in r.stderr
    assert Trace.load(work / "trace.json").steps == 1  # not overwritten


@pytest.mark.parametrize(
    ("out", "png", "named"),
    [
        ("plan.json", "trace.json", ("--png", "TRACE")),
        ("plan.json", "hardware.json", ("--png", "--hardware")),
        ("hardware.json", None, ("--out", "--hardware")),
        ("same.json", "same.json", ("--out", "--png")),
        ("sub/../trace.json", None, ("--out", "TRACE")),  # another name for it
        ("trace-link.json", None, ("--out", "TRACE")),  # a symbolic link to it
        ("trace-hardlink.json", None, ("--out", "TRACE")),  # a hard link to it
    ],
)
def test_outputs_that_are_inputs_or_each_other(
    work: Path,
    tmp_path: Path,
    out: str,
    png: str | None,
    named: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No output may replace an input or the other output (``--png TRACE`` wrote a PNG over
    the trace)."""
    trace, hardware = tmp_path / "trace.json", tmp_path / "hardware.json"
    shutil.copy(work / "trace.json", trace)
    shutil.copy(work / "hardware.json", hardware)
    (tmp_path / "sub").mkdir()
    (tmp_path / "trace-link.json").symlink_to(trace)
    os.link(trace, tmp_path / "trace-hardlink.json")
    png_args = ["--png", str(tmp_path / png)] if png else ["--no-png"]
    r = run_main(
        "plan", str(trace), "--hardware", str(hardware), "--gpu-budget", "1GiB",
        "--out", str(tmp_path / out), *png_args, capsys=capsys,
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert all(option in r.stderr for option in named), r.stderr
    assert "same file" in r.stderr
    assert Trace.load(trace).steps == 1 and HardwareModel.load(hardware) == HardwareModel.h200()
    assert not (tmp_path / "same.json").exists() and not (tmp_path / "plan.json").exists()


def _spoiled_trace(work: Path, tmp_path: Path, spoil: Callable[[dict], None]) -> Path:
    body = json.loads((work / "trace.json").read_text())
    spoil(body)
    path = tmp_path / "spoiled.json"
    path.write_text(json.dumps(body))
    return path


def test_traces_that_load_but_cannot_be_planned(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A field that holds nonsense is refused at load, naming it; a trace of well-formed
    fields that still cannot be planned is 'cannot plan this trace' or 'cannot write the plan',
    exit 2: never a traceback."""

    def nan_times(body: dict) -> None:
        for e in body["events"]:
            e["time_s"] = float("nan")

    def zigzag_times(body: dict) -> None:  # finite, but out of order
        for i, e in enumerate(body["events"]):
            e["time_s"] = 1e308 * (i % 2)

    def huge_times(body: dict) -> None:  # finite and in order: a step of 1e308 s is planned
        times = [1e308 * min(i, 1) for i in range(len(body["events"]))]
        for e, t in zip(body["events"], times, strict=True):
            e["time_s"] = t
        for r in body["records"]:
            r["pack_time_s"] = times[r["pack_event"]]
            r["unpack_times_s"] = [times[u] for u in r["unpack_events"]]

    def huge_sizes(body: dict) -> None:  # under 2**63 each, more than 2**63 together
        for r in body["records"]:
            r["nbytes"] = r["storage_nbytes"] = 2**62

    out = str(tmp_path / "plan.json")
    for spoil, code, message in (
        (nan_times, 2, "cannot read trace .* events\\[0\\]: field 'time_s' must be a finite"),
        # Before the order check it planned, then hit the simulator's own check (a RuntimeError)
        # or JSON's refusal of an infinite time.
        (zigzag_times, 2, "cannot read trace .* event 2: time_s 0.0 is before the event before"),
        (huge_times, 0, "^$"),
        (huge_sizes, 3, "cannot be met"),
    ):
        trace = _spoiled_trace(work, tmp_path, spoil)
        r = plan_main(work, "--gpu-budget", "6MiB", "--out", out, "--no-png", trace=trace,
                      capsys=capsys)  # fmt: skip
        assert r.returncode == code, r.stderr
        assert re.search(message, r.stderr), r.stderr


def test_unwritable_output(work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = plan_main(work, "--gpu-budget", "1GiB", "--out", str(blocker / "p.json"), capsys=capsys)
    assert r.returncode == 2 and "--out" in r.stderr and str(blocker) in r.stderr
    r = plan_main(
        work,
        "--gpu-budget",
        "1GiB",
        "--out",
        str(tmp_path / "p.json"),
        "--png",
        str(tmp_path),
        capsys=capsys,
    )
    assert r.returncode == 2 and "--png" in r.stderr


def test_probes_this_machine_without_hardware(
    work: Path,
    peak: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(cache))  # run_cli's private cache, in-process
    r = run_main(
        "plan",
        str(work / "trace.json"),
        "--gpu-budget",
        str(peak),
        "--out",
        str(tmp_path / "plan.json"),
        "--no-png",
        capsys=capsys,
    )
    assert r.returncode == 0, r.stderr
    assert "measuring this machine" in r.stderr
    assert Plan.load(tmp_path / "plan.json").hardware.device_name == "cpu"
    assert list(cache.glob("hardware-*.json"))  # cached for the next run
    # The next run reads the cache: it measures nothing, and says nothing of measuring (it
    # said "measuring this machine's copy links" whether it measured or not).
    again = run_main(
        "plan",
        str(work / "trace.json"),
        "--gpu-budget",
        str(peak),
        "--out",
        str(tmp_path / "again.json"),
        "--no-png",
        capsys=capsys,
    )
    assert again.returncode == 0, again.stderr
    assert "measuring" not in again.stderr, again.stderr
    hw = Plan.load(tmp_path / "again.json").hardware
    assert hw == Plan.load(tmp_path / "plan.json").hardware


def test_nvme_dir_measures_the_disk(
    work: Path, peak: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--nvme-dir measures the disk there and plans with its rates, in place of the datasheet
    figures (the H200 model's, of one NVMe Gen4 drive, about 3x the project VM's disk) that a
    probe without a directory or a --hardware file carries."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "plan.json"
    args = ("--gpu-budget", str(peak // 2), *SMALL, "--tiers", "cpu,nvme", "--no-png")
    r = plan_main(work, *args, "--nvme-dir", str(disk), "--out", str(out), capsys=capsys)
    assert r.returncode == 0, r.stderr
    assert f"measuring the disk in {disk} (64.00 MiB written and read back)" in r.stderr
    hw, h200 = Plan.load(out).hardware, HardwareModel.h200()
    assert hw.disk_write_bytes_per_s != h200.disk_write_bytes_per_s
    assert hw.disk_read_bytes_per_s != h200.disk_read_bytes_per_s
    assert hw.h2d_bytes_per_s == h200.h2d_bytes_per_s  # the links as --hardware gave them
    assert f"disk rates replaced, measured again: disk {disk.resolve()}: " in hw.source
    assert not any(disk.iterdir())  # the probe file is gone
    # A measured model without a disk: its datasheet note is replaced, not contradicted.
    from offload._probe import with_measured_disk

    probed = HardwareModel.cpu_only(
        copy_bytes_per_s=1e9,
        disk_write_bytes_per_s=h200.disk_write_bytes_per_s,
        disk_read_bytes_per_s=h200.disk_read_bytes_per_s,
        source="measured: host memcpy; disk not measured (no nvme_dir): assumed NVMe Gen4 "
        "datasheet figures (4.3 GB/s write, 6.8 GB/s read)",
    )
    measured = with_measured_disk(probed, disk, nbytes=1 << 20)
    assert measured.source.startswith(f"measured: host memcpy; disk {disk.resolve()}: 1.00 MiB")
    assert "datasheet" not in measured.source


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nvme-dir", "{disk}"], "--nvme-dir applies only with nvme in --tiers"),
        (["--tiers", "nvme", "--nvme-dir", "{disk}/missing"], "does not exist"),
        (["--tiers", "nvme", "--nvme-dir", ""], "is empty"),
    ],
)
def test_bad_nvme_dir(
    work: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    argv = [a.format(disk=tmp_path) for a in args]
    r = plan_main(work, "--gpu-budget", "1GiB", *argv, "--no-png", capsys=capsys)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--nvme-dir" in r.stderr and message in r.stderr, r.stderr


def test_png_skipped_without_matplotlib(work: Path, peak: int, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None\n"
        "from offload.cli import main; raise SystemExit(main(sys.argv[1:]))"
    )
    r = run_cli(
        "plan",
        str(work / "trace.json"),
        "--gpu-budget",
        str(peak // 2),
        *SMALL,
        "--hardware",
        str(work / "hardware.json"),
        "--out",
        str(out),
        cache_dir=work / "cache",
        entry=("-c", code),
    )
    assert r.returncode == 0, r.stderr
    assert Plan.load(out).predicted_peak_bytes <= peak // 2
    assert not (tmp_path / "plan.png").exists()
    assert "skipped" in r.stderr and "offload[plot]" in r.stderr


def test_png_whatever_the_file_name(
    work: Path, peak: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--png`` names a file; its extension does not choose the format (matplotlib refuses
    .txt, and a .jpg holding a PNG would be worse than either)."""
    pytest.importorskip("matplotlib")
    for name in ("picture.txt", "picture"):
        png = tmp_path / name
        out = str(tmp_path / "p.json")
        r = plan_main(
            work, "--gpu-budget", str(peak // 2), *SMALL, "--out", out, "--png", str(png),
            capsys=capsys,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert f"wrote {png}" in r.stdout


def test_png_that_cannot_be_drawn_is_a_warning(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan is written before its picture: a picture that cannot be drawn (here the plan is
    of another trace, whose families the simulator refuses) is a warning, not a traceback."""
    pytest.importorskip("matplotlib")
    from offload.cli._plan import _write_png
    from offload.lifecycle import plan, transformer_trace

    other = transformer_trace(layers=4, hidden=64, tokens=64)
    budget = other.peak_memory_bytes // 2
    p = plan(other, budget, HardwareModel.h200(), min_offload_bytes=0, margin=0)
    png = tmp_path / "plan.png"
    _write_png(Trace.load(work / "trace.json"), p, str(png), "offload plan")
    err = capsys.readouterr().err
    assert "offload plan: warning: cannot draw" in err and str(png) in err
    assert not png.exists()


def test_reader_that_goes_away_ends_the_command_quietly(
    work: Path, peak: int, tmp_path: Path
) -> None:
    """``offload plan ... | head``: when the reader of stdout is gone the command stops with
    status 1 and no traceback, as other command-line tools do."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first line is written: every write meets EPIPE
    env = dict(os.environ, PYTHONWARNINGS="ignore", OFFLOAD_CACHE_DIR=str(work / "cache"))
    trace, hardware = str(work / "trace.json"), str(work / "hardware.json")
    args = ["plan", trace, "--hardware", hardware, "--gpu-budget", str(peak // 2), *SMALL]
    try:
        r = subprocess.run(
            [sys.executable, "-m", "offload", *args, "--out", str(tmp_path / "p.json")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=240,
        )
    finally:
        os.close(write_end)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["plan", "info"])
def test_standard_output_that_cannot_be_written(
    work: Path, peak: int, tmp_path: Path, command: str
) -> None:
    """``offload plan ... > /dev/full``: the command says it cannot write its output and exits
    with 2, as for an output file, without a traceback."""
    args = ["info", "--probe-bytes", "1MiB"]
    if command == "plan":
        trace, hardware = str(work / "trace.json"), str(work / "hardware.json")
        args = ["plan", trace, "--hardware", hardware, "--gpu-budget", str(peak // 2), *SMALL]
        args += ["--out", str(tmp_path / "p.json"), "--no-png"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OFFLOAD_CACHE_DIR=str(work / "cache"))
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "offload", *args],
            stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=240,
        )  # fmt: skip
    assert r.returncode == 2
    assert "offload: error: cannot write to standard output: No space left on device" in r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_help(tmp_path: Path) -> None:
    r = run_cli("plan", "--help", cache_dir=tmp_path)
    assert r.returncode == 0
    flat = " ".join(r.stdout.split())  # argparse wraps at the terminal width
    for text in ("--gpu-budget", "--hardware", "--tiers", "--out", "--png", "Exit status"):
        assert text in flat, text
    assert "default: plan.json in TRACE's directory" in flat
