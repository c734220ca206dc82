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
