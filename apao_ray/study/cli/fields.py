"""Flags built from ``StudySpec``'s table (``spec/fields.py``): each field's flag, type, bounds, default and help come
from its one declaration, so ``sweep`` (every field), ``train`` (the ``trial`` group) and the API cannot drift."""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, Field
from typing import Any, Callable

from ...cli.types import bounded_number
from ..spec.duration import parse_duration
from ..spec.fields import flag_of, table


def parse_range(text: str, cast: type = float) -> tuple:
    """'LOW:HIGH' (or one value) -> (low, high)."""
    parts = text.split(":")
    try:
        values = tuple(cast(float(p)) if cast is int else cast(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW:HIGH numbers") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} must be LOW:HIGH")
    return values


def comma_list(text: str) -> tuple[str, ...]:
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    if not items:
        raise argparse.ArgumentTypeError("give at least one name")
    return items


def seed_list(text: str) -> tuple[int, ...]:
    """'0,1,2' -> (0, 1, 2)."""
    try:
        return tuple(int(t) for t in comma_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integer seeds, e.g. 0,1,2") from None


def duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def knob_range(text: str) -> tuple[str, tuple[float, float]]:
    """'NAME=LOW:HIGH' (or NAME=VALUE) -> (name, (low, high)); the knob and its scale are checked by the spec."""
    name, equals, bounds = text.partition("=")
    if not equals or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} must be NAME=LOW:HIGH, e.g. gamma=0.01:0.3")
    return name.strip(), parse_range(bounds)


def number(low: float, integer: bool, above: bool) -> Callable[[str], Any]:
    """An argparse type for a bounded number (the spec checks again; the flag's message names the flag)."""
    def parse(text: str) -> Any:
        try:
            value = bounded_number(text, int if integer else float, low)
        except argparse.ArgumentTypeError:
            if not above:
                raise
            value = low  # below the bound: said as "> low" below
        if above and value <= low:
            raise argparse.ArgumentTypeError(f"{text!r} must be {'an integer' if integer else 'a number'} > {low:g}")
        return value

    parse.__name__ = f"{'integer' if integer else 'number'} {'>' if above else '>='} {low:g}"
    return parse


GROUP_TITLES = {"trial": "what each trial trains on, and how (the flags `train` shares)",
                "study": "the study: methods, search, budget, resources, records"}
KIND_TYPES: dict[str, Callable[[str], Any]] = {
    "names": comma_list, "range": parse_range, "int_range": lambda text: parse_range(text, int), "seeds": seed_list,
    "duration": duration, "knobs": knob_range}


def registry_names(registry: str) -> list[str]:
    """The names ``registry`` (``"losses"``, or ``"knobs"``: every registered loss's) holds now, plugins included."""
    from ...losses import LOSSES  # imports torch: only when a command builds its flags, not with the spec
    from ..spec.space import knob_names

    if registry not in ("losses", "knobs"):
        raise ValueError(f"unknown registry {registry!r}; choose from ['knobs', 'losses']")
    return sorted(LOSSES) if registry == "losses" else list(knob_names())


def registered_names(registry: str) -> str:
    """The names ``registry`` holds now, as ``--help`` lists them."""
    return ", ".join(registry_names(registry))


def add_field_argument(parser: Any, entry: Field, default: Any = MISSING) -> None:
    """``entry``'s flag on ``parser`` (dest: the field's name), with ``default`` in place of the field's if given."""
    meta = entry.metadata
    if default is MISSING:
        default = entry.default if entry.default is not MISSING else None
        if meta["env"]:
            default = os.environ.get(meta["env"], default)
    text = meta["help"] if meta["lists"] is None else meta["help"].replace("%(names)s", registered_names(meta["lists"]))
    options: dict[str, Any] = {"dest": entry.name, "help": text, "default": default}
    kind = meta["kind"]
    if kind == "switch":
        options["action"] = "store_true"
    elif kind == "toggle":
        options["action"] = argparse.BooleanOptionalAction
    elif kind == "knobs":
        options.update(action="append", type=KIND_TYPES[kind], default=[])
    elif kind is not None:
        options["type"] = KIND_TYPES[kind]
    elif meta["choices"] is not None:
        options["choices"] = meta["choices"]
    elif meta["low"] is not None:
        options["type"] = number(meta["low"], meta["integer"], meta["above"])
    if meta["metavar"]:
        options["metavar"] = meta["metavar"]
    parser.add_argument(flag_of(entry), **options)


def add_field_arguments(parser: Any, cls: type, group: str | None = None, defaults: dict[str, Any] | None = None) -> None:
    """The flags of ``cls``'s table (only ``group``'s when given), except those a command writes itself
    (``cli=False``); ``defaults`` replace the fields' own (``train``: the paper's 200 epochs, patience 20)."""
    defaults = defaults or {}
    sections = {name: parser.add_argument_group(title) for name, title in GROUP_TITLES.items()} if group is None \
        else {group: parser}  # every group: under its title in --help; one group: among the command's own flags
    for entry in table(cls):
        if entry.metadata["cli"] and entry.metadata["group"] in sections:
            add_field_argument(sections[entry.metadata["group"]], entry, defaults.get(entry.name, MISSING))


def field_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of ``cls``'s fields that ``args`` holds (the knob ranges as a dict)."""
    values = {entry.name: getattr(args, entry.name) for entry in table(cls) if hasattr(args, entry.name)}
    if "knob_ranges" in values:
        values["knob_ranges"] = dict(values["knob_ranges"])
    return values
