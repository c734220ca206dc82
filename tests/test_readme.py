"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples may write files
    exec(
        compile(BLOCKS[index], f"README.md[python block {index}]", "exec"),
        {"__name__": "__readme__"},
    )


def test_readme_lists_every_stats_field_and_no_other() -> None:
    """The paragraph on ``mgr.stats`` names each field of ``StepStats.as_dict()``, and only those
    (``records_offloaded_*`` stands for the cpu and nvme fields)."""
    from offload._stats import StepStats

    text = README.read_text()
    start = text.index("`mgr.stats.last` / `mgr.stats.total`")
    paragraph = text[start : text.index("\n\n", start)]
    listed: set[str] = set()
    for name in re.findall(r"`([a-z0-9_*]+)`", paragraph):
        stem = name.removesuffix("*")
        listed |= {stem + tier for tier in ("cpu", "nvme")} if name.endswith("*") else {name}
    assert listed == set(StepStats().as_dict())


BASH = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_command_lines_match_the_parser() -> None:
    """The synopsis names each option of each subcommand, and only those; the example command
    lines parse (running them takes 20 s: tests/cli/test_cli_*.py run the same commands)."""
    import argparse
    import shlex

    from offload.cli._main import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    synopsis = next(b for b in BASH if b.startswith("offload profile ["))
    lines = dict(re.findall(r"^offload (\w+) (.*?)(?=^offload |\Z)", synopsis, re.S | re.M))
    assert set(lines) == set(subs.choices)
    for command, options in lines.items():
        named = set(re.findall(r"--[a-z][a-z-]*", options))
        if command == "profile":  # "[--gpu-budget SIZE [planning options]]": those of plan
            planning = set(re.findall(r"--[a-z][a-z-]*", lines["plan"]))
            named |= planning - {"--out", "--png", "--no-png"}
        sub = subs.choices[command]
        real = {s for a in sub._actions for s in a.option_strings if s.startswith("--")}
        assert named == real - {"--help"}, command
    examples = [line for b in BASH for line in b.splitlines() if line.startswith("offload ")]
    examples = [line for line in examples if "[" not in line]
    assert len(examples) >= 2
    for line in examples:
        parser.parse_args(shlex.split(line)[1:])


def test_several_pairs_in_one_block_go_unplanned_as_the_readme_says() -> None:
    """README (One forward and its backward per `with mgr:` block): four forward/backward pairs
    of the budget example's 4-block MLP in one block leave 39 of the 80 records per step
    unplanned; one block per pair, none. Counts, not timings: the plan's keys decide them."""
    import contextlib

    import torch

    import offload

    text = " ".join(README.read_text().split())
    assert "39 of the 80 records per step went unplanned" in text
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(
                torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
            )
            for _ in range(4)
        ]
    )
    for blocks_per_step in (1, 4):
        mgr = offload.ActivationOffloader(
            model,
            gpu_budget="6MiB",
            min_offload_bytes=0,
            hardware=offload.HardwareModel.h200(),
        )
        with contextlib.closing(mgr):
            for _ in range(3):  # profiled, planned (and refined), planned
                for _ in range(blocks_per_step):
                    with mgr:
                        for _ in range(4 // blocks_per_step):
                            model(torch.randn(64, 512)).pow(2).mean().backward()
            records = mgr.stats.last.records
            unplanned = mgr.stats.last.unplanned_records
        if blocks_per_step == 1:
            assert (unplanned, records) == (39, 80)
        else:
            assert (unplanned, records) == (0, 20)
