"""The fenced code blocks of the Markdown docs, for the tests that run them.

A block whose info string is ``python`` runs as written (tests/test_readme.py for README.md,
tests/test_docs.py for docs/*.md), in a fresh namespace, in a temporary directory. A block that
cannot run on a CPU in a few seconds (it needs your trainer's objects, several processes or a
GPU) says so with the info string ``python sketch``: it is shown, never run. Keep those few.
Every other info string (``bash``, none) is text to these tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = "python"
SKETCH = "python sketch"
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    text = path.read_text()
    return [
        Block(path, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2))
        for m in _FENCE.finditer(text)
    ]


def python_blocks(path: Path) -> list[Block]:
    """The blocks of ``path`` that run (``python``) or are shown only (``python sketch``)."""
    return [b for b in blocks(path) if b.info in (RUN, SKETCH)]


def run(block: Block) -> None:
    """Run a ``python`` block as a script of its own (the caller chdirs to a scratch folder)."""
    assert block.info == RUN, block.name
    exec(compile(block.code, block.name, "exec"), {"__name__": "__doc_block__"})
