"""The README's Python examples run as written (the mechanism: tests/doc_blocks.py)."""

from __future__ import annotations

import pytest
from doc_blocks import ROOT, python_blocks, run

README = ROOT / "README.md"
BLOCKS = python_blocks(README)


def test_readme_has_examples() -> None:
    assert len([b for b in BLOCKS if b.info == "python"]) >= 2


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_readme_example_runs(block, tmp_path, monkeypatch) -> None:
    if block.info != "python":
        pytest.skip(f"{block.name} is a sketch (```{block.info}): shown, not run")
    monkeypatch.chdir(tmp_path)  # examples may write files
    run(block)
