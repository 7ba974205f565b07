"""The docs the code points at exist: every ``SPEC §N`` cited in the repo is a section of docs/SPEC.md."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "SPEC.md"
# "SPEC §3", "SPEC §3-4", "SPEC §3, §5"; a sentence's full stop after the number is not a subsection
CITATION = re.compile(r"SPEC\s*§\s*(\d+(?:\.\d+)*)(?:\s*-\s*(\d+(?:\.\d+)*))?((?:\s*,\s*§\s*\d+(?:\.\d+)*)*)")
SEARCHED = ("apao_ray", "studies", "benchmarks", "tests", "docs")


def spec_sections(text: str) -> set[str]:
    """The numbers of the markdown headings ``## 3. Losses`` / ``### 3.2 ...``."""
    return set(re.findall(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", text, flags=re.MULTILINE))


def cited_sections(text: str) -> set[str]:
    found = set()
    for first, last, more in CITATION.findall(text):
        found.add(first)
        if last:  # a range of whole sections
            found.update(str(n) for n in range(int(first.split(".")[0]), int(last.split(".")[0]) + 1))
        found.update(re.findall(r"\d+(?:\.\d+)*", more))
    return found


def test_citation_parser_reads_ranges_lists_and_sentence_ends():
    text = "(SPEC §3-4) ... SPEC §2. ... (SPEC §3, §5) ... SPEC § 6.1 ... paper §4.3"
    assert cited_sections(text) == {"2", "3", "4", "5", "6.1"}
    assert spec_sections("# title\n## 1. Data\n## 6. Numbers\n### 6.1 Table\n") == {"1", "6", "6.1"}


def test_every_cited_spec_section_exists_in_docs_spec():
    sections = spec_sections(SPEC.read_text())
    assert {"1", "2", "3", "4", "5", "6"} <= sections, sections
    cited: dict[str, set[str]] = {}
    for folder in SEARCHED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md") and path != SPEC and path != Path(__file__):
                for number in cited_sections(path.read_text(errors="replace")):
                    cited.setdefault(number, set()).add(str(path.relative_to(ROOT)))
    assert len(cited) >= 5, f"found too few SPEC citations to trust the search: {cited}"
    missing = {number: sorted(paths) for number, paths in cited.items() if number not in sections}
    assert not missing, f"SPEC sections cited but absent from docs/SPEC.md (sections {sorted(sections)}): {missing}"


def _cli_reference():
    spec = importlib.util.spec_from_file_location("make_cli_reference", ROOT / "docs" / "make_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_the_cli_help():
    """docs/cli.md is what ``python -m apao_ray <command> --help`` prints now, for every command."""
    reference = _cli_reference()
    committed = (ROOT / "docs" / "cli.md").read_text()
    if f"on {reference.PYTHON} " not in committed:
        pytest.skip(f"docs/cli.md was generated on another Python than {reference.PYTHON}, whose argparse lays help out differently")
    assert committed == reference.render(), "docs/cli.md is stale: run ./apao python docs/make_cli_reference.py"
    from apao_ray.cli import PASS_THROUGH, build_parser

    commands = {" ".join(c) for c in reference._commands(build_parser(), [])}
    assert set(PASS_THROUGH) | {"data stats", "serve", "report"} <= commands, commands
    for command in commands:
        assert f"\n## python -m apao_ray {command}\n" in committed
        assert f"usage: python -m apao_ray {command}" in committed, command


# a citation of this project's own tracker: the word issue(s) before a number, or a "#" number followed by item,
# part, asks or 's; an external project's ("ray-project/ray#41364", "pytest-xdist#1386", "cornac PR #715") and a
# queue position ("queued #3") are not (the examples in the test below are split so this file passes too)
INTERNAL_ISSUE = re.compile(r"(?i)\bissues?\s+#?\d+|(?<![\w.-])#\d+(?:\s+(?:item|part|asks)\b|'s\b)")
UNSEARCHED = ("benchmarks/results/",)  # committed exports of finished studies: their data stays as recorded


def internal_issue_citations(text: str) -> list[str]:
    return [match.group(0) for match in INTERNAL_ISSUE.finditer(text)]


def test_issue_pattern_finds_internal_citations_and_passes_external_ones():
    cited = "issue " + "#12; see issues " + "#8, #17 and #47" + " item 3 as #17" + "'s probe found; #9" + " part 1"
    assert internal_issue_citations(cited) == [f"issue {n}" for n in ("#12",)] + [f"issues {n}" for n in ("#8",)] + \
        [f"#{n}" for n in ("47 item", "17's", "9 part")]
    external = ("ray-project/ray#41364 pytest-xdist#1386's fix, PreferredAI/cornac PR #715, queued #3: seeds 0, "
                "colour #ff0000, step 3 of 4")
    assert internal_issue_citations(external) == []


def test_no_tracked_text_cites_an_internal_issue():
    """The code, docs and benchmarks name the behaviour, never a ticket of the project's own tracker."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    paths = [name for name in listed.stdout.split("\0") if name and not name.startswith(UNSEARCHED)]
    assert len(paths) > 100, paths
    found = {}
    for name in paths:
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or deleted in the working tree
        citations = internal_issue_citations(text)
        if citations:
            found[name] = citations
    assert not found, f"internal issue numbers (name the behaviour instead): {found}"
