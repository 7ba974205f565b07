"""study/spec/duration.py: a budget's duration text parsed, and what it refuses."""
from __future__ import annotations

import pytest

from apao_ray.study.spec.duration import parse_duration


@pytest.mark.parametrize("text, seconds", [("90m", 5400), ("3h", 10800), ("1h30m", 5400), ("45s", 45), ("5400", 5400),
                                           ("1.5h", 5400), ("2h0m30s", 7230), (" 10M ", 600), (120, 120)])
def test_durations_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "3x", "h", "1m30h", "-5", "0", "0m", "inf", "nan", "3 hours"])
def test_bad_durations_are_named(text):
    with pytest.raises(ValueError, match=f"budget {text!r} (is not a duration|must be a duration > 0)"):
        parse_duration(text)
