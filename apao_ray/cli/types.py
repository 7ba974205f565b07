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
