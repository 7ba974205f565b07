"""One table for a study's inputs: every ``StudySpec`` field is declared with :func:`option`, which holds its default,
its help, its bounds or choices and how a command line writes it. The spec checks values against the bounds
(``check_bounds``), ``sweep`` and ``train`` build their flags from the same entries (``study/cli/fields.py``), and
``StudySpec``'s docstring lists them (``document``): a new field is one edit, and the CLI, the API and ``--help``
cannot drift.

Kinds (how a flag's text becomes the value; the CLI owns the parsing): ``None`` a plain value (int / float / str by
the default's type and ``integer``), ``"names"`` a comma list, ``"range"`` / ``"int_range"`` ``LOW:HIGH``,
``"seeds"`` a comma list of integers, ``"duration"`` 3h / 90m / seconds, ``"knobs"`` repeatable ``NAME=LOW:HIGH``,
``"switch"`` a flag that turns it on, ``"toggle"`` ``--x`` / ``--no-x``.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, Field, field, fields
from typing import Any

KINDS = (None, "names", "range", "int_range", "seeds", "duration", "knobs", "switch", "toggle")


def option(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, kind: str | None = None,
           flag: str | None = None, metavar: str | None = None, low: float | None = None, above: bool = False,
           integer: bool = False, choices: tuple | None = None, env: str | None = None, cli: bool = True,
           group: str = "study", lists: str | None = None) -> Any:
    """A ``StudySpec`` field with its entry in the table.

    Args:
        default, factory: the field's default (``factory`` for a mutable one).
        help: one text for ``--help`` and the docstring; ``%(default)s`` is the default (the command's own, where
            a command gives another).
        kind: how a command line writes it (module docstring).
        flag: the flag, when not ``--<name with dashes>``; metavar: its placeholder.
        low, above, integer: a number's bounds (``>= low``, or ``> low`` with ``above``), whole when ``integer``;
            ``None`` passes where the default is ``None``.
        choices: the allowed values.
        env: the command line's default comes from this environment variable (the API's stays ``default``).
        cli: False where a command writes it through flags of its own (the protocol knobs, ``--tracking-uri``).
        group: ``trial`` for the flags ``train`` shares (data, schedule, model, compute), ``study`` for the rest.
        lists: a registry (``"losses"``) whose names ``%(names)s`` in ``help`` stands for, read when a command's
            flags are built (so plugins loaded by then are listed).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; choose from {KINDS}")
    metadata = {"help": help, "kind": kind, "flag": flag, "metavar": metavar, "low": low, "above": above,
                "integer": integer, "choices": choices, "env": env, "cli": cli, "group": group,
                "lists": lists}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def table(cls: type) -> list[Field]:
    """The fields of ``cls`` declared with :func:`option`, in declaration order."""
    return [f for f in fields(cls) if "kind" in f.metadata]


def flag_of(entry: Field) -> str:
    return entry.metadata["flag"] or "--" + entry.name.replace("_", "-")


def check_bounds(spec: Any) -> None:
    """Each field's value against its bounds and choices; the error names the field, the value and what is allowed."""
    for entry in table(type(spec)):
        meta, value = entry.metadata, getattr(spec, entry.name)
        if value is None and entry.default is None:
            continue
        if meta["choices"] is not None and value not in meta["choices"]:
            raise ValueError(f"{entry.name}={value!r}; choose from {list(meta['choices'])}")
        if meta["low"] is None:
            continue
        kind = "an integer" if meta["integer"] else "a number"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > meta["low"] if meta["above"] else value >= meta["low"])
        if not ok or (meta["integer"] and not float(value).is_integer()):
            raise ValueError(f"{entry.name}={value!r} must be {kind} {'>' if meta['above'] else '>='} {meta['low']:g}")


def document(cls: type) -> str:
    """The table as a docstring's ``Args:`` section (``%(default)s`` written out)."""
    lines = ["", "    Args:"]
    for entry in table(cls):
        default = entry.default if entry.default is not MISSING else entry.default_factory()
        text = entry.metadata["help"].replace("%(default)s", str(default)).replace("%(names)s",
                                                                                    f"the registered {entry.metadata['lists']}")
        lines.append(f"        {entry.name}: {text}")
    return "\n".join(lines) + "\n"
