"""The docs hold: their examples run, their links and citations point at what exists.

What a citation is, for these tests:
- of the design: ``docs/design.md`` followed by a quoted section (``docs/design.md "Budget"``,
  ``docs/design.md, "The physics"``, ``docs/design.md: "Never newly broken"``), by an unquoted
  one after a comma or colon (``docs/design.md, Keys and signatures``: checked when it starts
  with a capital letter, since a lowercase phrase there is prose quoting the design), by
  ``docs/design.md §Aliases``, by a link to ``design.md#budget``, or ``"The physics" in
  docs/design.md``, or ``docs/design.md's Public API section``. A trailing ``rule N`` or step
  number is not part of the name. The name must be a heading of docs/design.md (or the end of
  one: "API" for "Public API").
- of a NOTE block: the word NOTE, then the block's name in square brackets with a space either
  side, anywhere (code, tests, docs; a name may wrap over comment lines). It is defined by a line
  of a ``.py`` file that begins with it (after indentation and an optional ``#``), followed by
  nothing or by a colon, or by a Markdown heading or line of a doc that begins with it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from doc_blocks import ROOT, RUN, SKETCH, blocks, python_blocks, run

README = ROOT / "README.md"
DOCS = ROOT / "docs"
DESIGN_MD = DOCS / "design.md"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [README, ROOT / "CHANGELOG.md", *PAGES]
README_MAX_LINES = 260


def _files() -> list[Path]:
    """The repository's text files: tracked, and new ones git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    out = []
    for name in names:
        path = ROOT / name
        if not path.is_file() or path.is_symlink():
            continue
        try:
            path.read_text()
        except UnicodeDecodeError:
            continue
        out.append(path)
    return out


FILES = _files()


def _flat(text: str) -> str:
    """Text with line breaks, and the comment markers after them (``#``, ``# --``), as single
    spaces."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#[ \t]*(?:--[ \t]*)?)?", " ", text)


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)


def _headings(path: Path) -> list[str]:
    return [
        m.group(1).strip()
        for m in re.finditer(r"^#{1,6} (.+)$", _without_fences(path.read_text()), re.M)
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the docs' examples -------------------------------------------------------------------------

DOC_BLOCKS = [b for page in PAGES for b in python_blocks(page)]


def test_docs_have_examples_and_few_sketches() -> None:
    ran = [b for b in DOC_BLOCKS if b.info == RUN]
    sketches = [b.name for b in DOC_BLOCKS if b.info == SKETCH]
    assert len(ran) >= 5 and len(sketches) <= 4, sketches


def test_python_blocks_say_whether_they_run() -> None:
    """A block of Python code is ``python`` (runs) or ``python sketch`` (shown): no ``py``,
    ``python3`` or other spelling that the runner would pass over without a word."""
    odd = [
        f"{b.name}: {b.info!r}"
        for path in MARKDOWN
        for b in blocks(path)
        if b.info.lower().startswith("py") and b.info not in (RUN, SKETCH)
    ]
    assert not odd, odd


@pytest.mark.parametrize("block", DOC_BLOCKS, ids=lambda b: b.name)
def test_doc_example_runs(block, tmp_path, monkeypatch) -> None:
    if block.info != RUN:
        pytest.skip(f"{block.name} is a sketch (```{block.info}): shown, not run")
    # A trainer package (the `integrations` extra) absent: its pages' blocks are skipped.
    for name in re.findall(
        r"^(?:from|import) (accelerate|transformers|lightning)\b", block.code, re.M
    ):
        pytest.importorskip(name)
    monkeypatch.chdir(tmp_path)  # examples may write files
    run(block)


# -- the README ---------------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the reference goes in docs/"


def test_readme_links_docs_pages_that_exist() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    to_docs = [link.split("#")[0] for link in links if link.startswith("docs/")]
    assert to_docs, "the README's map of docs/ links its pages"
    assert not [link for link in to_docs if not (ROOT / link).is_file()]
    mapped = {Path(link).name for link in to_docs}
    assert mapped >= {page.name for page in PAGES}, "every docs page is in the README's map"


@pytest.mark.parametrize("path", MARKDOWN, ids=_rel)
def test_relative_links_and_anchors_exist(path: Path) -> None:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", _without_fences(path.read_text())):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        dest = (path.parent / target).resolve() if target else path
        missing_anchor = (
            anchor and dest.suffix == ".md" and anchor not in map(_slug, _headings(dest))
        )
        if not dest.exists() or missing_anchor:
            broken.append(link)
    assert not broken, broken


# -- citations of the design --------------------------------------------------------------------

_D = r"docs/design\.md"
_STOP = r"[^\"`()\[\];.:,]+"
_QUOTED = [
    re.compile(_D + r"(?:,|:)?\s*\"([^\"]+)\""),
    re.compile(r"\"([^\"]+)\"\s+in\s+" + _D),
    re.compile(_D + r"\s*§\s*(" + _STOP + ")"),
    re.compile(_D + r"'s\s+(.+?)\s+section"),
]
_UNQUOTED = re.compile(_D + r"\s*[,:]\s*(" + _STOP + ")")


def _names_a_heading(name: str, headings: list[str]) -> bool:
    name = re.sub(r"\s+(rule\s+\S+|\d+)$", "", name.strip()).lower()
    return any(h == name or h.endswith(" " + name) for h in (h.lower() for h in headings))


def _design_citations() -> list[tuple[str, str, bool]]:
    """(file, cited name, strict) for every citation of a design section."""
    found = []
    for path in FILES:
        text = _flat(path.read_text())
        for pattern in _QUOTED:
            found += [(_rel(path), m.group(1), True) for m in pattern.finditer(text)]
        for m in _UNQUOTED.finditer(text):
            name = m.group(1).strip()
            if name and not name.startswith(("NOTE", '"')):
                found.append((_rel(path), name, name[0].isupper()))
        for link in re.findall(r"\]\(([^)\s]*design\.md)#([^)\s]+)\)", path.read_text()):
            found.append((_rel(path), "#" + link[1], True))
    return found


def test_design_citations_name_headings_that_exist() -> None:
    headings = _headings(DESIGN_MD)
    slugs = set(map(_slug, headings))
    citations = _design_citations()
    assert len(citations) >= 15, citations
    missing = [
        (where, name)
        for where, name, strict in citations
        if not (name[1:] in slugs if name.startswith("#") else _names_a_heading(name, headings))
        and strict
    ]
    assert not missing, f"cited sections docs/design.md has no heading for: {missing}"


def test_the_founding_design_file_is_cited_nowhere() -> None:
    """Citations say docs/design.md; the old name (upper case, at the top level, with or
    without its suffix) names a file the repository does not have."""
    old = re.compile(r"(?<![\w/])" + "DESI" + r"GN(?:\.md)?\b")
    stale = [
        f"{_rel(path)}:{i}"
        for path in FILES
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert not stale, stale


# -- NOTE blocks --------------------------------------------------------------------------------

_CITED = re.compile(r"NOTE \[ (.+?) \]")
_DEFINED_PY = re.compile(r"^[ \t]*(?:#[ \t]*)?NOTE \[ (.+?) \][ \t]*(?::|$)", re.M)
_DEFINED_MD = re.compile(r"^(?:#{1,6} )?NOTE \[ (.+?) \]", re.M)


def test_every_cited_note_is_defined() -> None:
    defined: set[str] = set()
    cited: dict[str, str] = {}
    for path in FILES:
        text = path.read_text()
        pattern = _DEFINED_PY if path.suffix == ".py" else _DEFINED_MD
        if path.suffix in (".py", ".md"):
            defined |= set(pattern.findall(text))
        for name in _CITED.findall(_flat(text)):
            cited.setdefault(name, _rel(path))
    assert len(defined) >= 40 and len(cited) >= 40
    undefined = {name: where for name, where in cited.items() if name not in defined}
    assert not undefined, f"cited but defined nowhere: {undefined}"


# -- facts the docs state that the code decides -------------------------------------------------


def test_offloading_page_lists_every_stats_field_and_no_other() -> None:
    """The paragraph on ``mgr.stats`` names each field of ``StepStats.as_dict()``, and only those
    (``records_offloaded_*`` stands for the cpu and nvme fields)."""
    from offload._stats import StepStats

    text = (DOCS / "offloading.md").read_text()
    start = text.index("`mgr.stats.last` / `mgr.stats.total`")
    paragraph = text[start : text.index("\n\n", start)]
    listed: set[str] = set()
    for name in re.findall(r"`([a-z0-9_*]+)`", paragraph):
        stem = name.removesuffix("*")
        listed |= {stem + tier for tier in ("cpu", "nvme")} if name.endswith("*") else {name}
    assert listed == set(StepStats().as_dict())


def test_cli_page_command_lines_match_the_parser() -> None:
    """The synopsis names each option of each subcommand, and only those; the example command
    lines of the CLI page and the README parse (running them takes 20 s: tests/test_cli_*.py run
    the same commands)."""
    import argparse
    import shlex

    from offload.cli._main import build_parser

    bash = [b.code for path in (DOCS / "profiling-and-cli.md", README) for b in blocks(path)]
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    synopsis = next(b for b in bash if b.startswith("offload profile ["))
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
    examples = [line for b in bash for line in b.splitlines() if line.startswith("offload ")]
    examples = [line for line in examples if "[" not in line]
    assert len(examples) >= 3
    for line in examples:
        parser.parse_args(shlex.split(line)[1:])


def test_design_lists_every_lifecycle_point() -> None:
    from offload._points import POINTS

    text = DESIGN_MD.read_text()
    start = text.index("### Lifecycle points")
    section = text[start : text.index("\n## ", start)]
    assert set(re.findall(r"`([a-z_]+)`", section)) >= POINTS


def test_several_pairs_in_one_block_go_unplanned_as_the_docs_say() -> None:
    """docs/budgets-and-plans.md (Gradient accumulation): four forward/backward pairs of the
    budget example's 4-block MLP in one block leave 39 of the 80 records per step unplanned; one
    block per pair, none. Counts, not timings: the plan's keys decide them."""
    import contextlib

    import torch

    import offload

    text = " ".join((DOCS / "budgets-and-plans.md").read_text().split())
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


def test_design_names_every_product_module() -> None:
    """docs/design.md's module table names every product module (a new one is added to it)."""
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [
        f"{root}/{path.name}"
        for root in ("offload", "offload/cli", "lifecycle", "storage")
        for path in sorted((ROOT / root).glob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
        and f"`{root}/{path.name}`" not in design
        and not (root == "offload/cli" and "`offload/cli/`" in design)
    ]
    assert not missing, missing
