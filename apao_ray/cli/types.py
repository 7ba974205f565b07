"""argparse value types shared by the CLIs: each names the bad value and the allowed range."""
from __future__ import annotations

import argparse
from typing import Any


def bounded_number(text: str, cast: type, low: float) -> Any:
    """``text`` as ``cast`` (int or float), finite and >= ``low``; argparse names the flag with the message."""
    kind = "an integer" if cast is int else "a number"
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}; give {kind} >= {low:g}") from None
    if not low <= value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text!r} must be {kind} >= {low:g}")
    return value


def int_at_least(low: int) -> Any:
    """An argparse type: an integer >= ``low`` (``--codes``: at least 2)."""
    def parse(text: str) -> int:
        return bounded_number(text, int, low)

    parse.__name__ = f"integer >= {low}"  # argparse names the type in its messages
    return parse


def positive_int(text: str) -> int:
    return bounded_number(text, int, 1)


def non_negative_int(text: str) -> int:
    return bounded_number(text, int, 0)


def non_negative_float(text: str) -> float:
    return bounded_number(text, float, 0)


class OneOf(argparse.Action):
    """A flag whose value is one of ``names()``, a registry read only when ``--help`` shows it or the flag is
    given: the loss registry imports torch, which a command that never reads it should not pay for. ``%(names)s``
    in the help becomes the names; a value outside them is refused in one line naming it and the names."""

    def __init__(self, option_strings: list[str], dest: str, names: Any = None, **kwargs: Any) -> None:
        if names is None:
            raise ValueError(f"{option_strings}: OneOf needs names=, a function returning the allowed values")
        self.names = names
        super().__init__(option_strings, dest, **kwargs)

    @property
    def help(self) -> str | None:
        return None if self._help is None else self._help.replace("%(names)s", ", ".join(self.names()))

    @help.setter
    def help(self, text: str | None) -> None:
        self._help = text

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        allowed = list(self.names())
        if value not in allowed:
            parser.error(f"argument {option_string}: {value!r} is not one of {', '.join(allowed)}")
        setattr(namespace, self.dest, value)
