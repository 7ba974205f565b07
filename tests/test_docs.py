"""The docs the code points at exist: every ``SPEC §N`` cited in the repo is a section of docs/SPEC.md."""
from __future__ import annotations

import importlib.util
import re
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
