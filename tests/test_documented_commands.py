"""Every command the README and docs/*.md quote (``./apao ...``, ``python -m apao_ray ...``, ``studies/*.py``)
parses with the command's own parser, so a documented command that no longer parses fails the suite.
Parsing only: nothing is run."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# how a command starts, and the subcommand it names; studies/*.py are the same parsers as their subcommands
PREFIXES = (("./apao", None), ("python -m apao_ray", None), ("python studies/sweep.py", "sweep"),
            ("studies/sweep.py", "sweep"), ("python studies/train.py", "train"), ("python studies/best.py", "best"))
NOT_PARSED = {"test", "python", "help"}  # pytest's and Python's own flags, the command list
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def _candidate_lines(text: str) -> list[str]:
    """Lines of fenced code blocks (continuations joined) and inline code spans that hold a command."""
    lines, in_block, pending = [], False, ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if in_block:
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            lines.append(line)
        else:
            lines += re.findall(r"`([^`]+)`", raw)
    return lines


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, the command as written, [subcommand, *args]) for every quoted command."""
    found = []
    for path in DOCS:
        if path.name == "cli.md":  # generated from --help: usage lines, not commands
            continue
        for line in _candidate_lines(path.read_text()):
            line = line.split(" # ")[0].strip().removeprefix("$ ")
            try:
                words = shlex.split(line)
            except ValueError:  # an unbalanced quote: not a command line
                continue
            while words and ENV_ASSIGNMENT.match(words[0]):
                words = words[1:]
            text = " ".join(words)
            for prefix, subcommand in PREFIXES:
                if text == prefix or text.startswith(prefix + " "):
                    argv = words[len(prefix.split()):]
                    if subcommand:
                        argv = [subcommand, *argv]
                    # a placeholder (<run_id>, [--optional], a|b, ...) or a shell construct makes it a sketch
                    if argv and argv[0] not in NOT_PARSED and not any(
                            w in ("...", ";", "&&", ">", "2>&1") or "|" in w or w.startswith(("<", "["))
                            for w in argv):
                        found.append((f"{path.relative_to(ROOT)}", line, argv))
                    break
    return found


def parse(argv: list[str]) -> None:
    """Parses ``argv`` as ``python -m apao_ray`` would, without running it (SystemExit on a refusal)."""
    from apao_ray.cli import PASS_THROUGH, build_parser
    from apao_ray.study.cli import sweep, train

    parsers = {"sweep": sweep.build_parser, "train": train.build_parser, "best": sweep.build_best_parser}
    assert set(parsers) == set(PASS_THROUGH)
    if "--help" in argv or "-h" in argv:
        return
    (parsers[argv[0]]() if argv[0] in parsers else build_parser()).parse_args(argv[1:] if argv[0] in parsers
                                                                                else argv)


def test_the_docs_quote_commands_and_the_finder_sees_them():
    commands = documented_commands()
    assert len(commands) > 30, commands
    assert any(argv[0] == "sweep" and "--dry-run" in argv for _, _, argv in commands)
    assert any(argv[0] == "report" for _, _, argv in commands)


def test_a_command_that_no_longer_parses_is_caught():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse(["sweep", "--no-such-flag"])
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse(["report", "--grid", "--exports"])  # --exports needs a value


@pytest.mark.parametrize("where, line, argv", documented_commands(), ids=lambda value: str(value)[:60])
def test_every_documented_command_parses(where, line, argv):
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parse(argv)
    except SystemExit as stop:
        assert stop.code == 0, f"{where}: `{line}` no longer parses: {errors.getvalue().strip().splitlines()[-1:]}"
