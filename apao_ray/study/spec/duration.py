"""Durations as a user writes them (``--budget 3h``) and as the plan prints them."""
from __future__ import annotations

import math
import re

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str | float | int) -> float:
    """``'90m'``, ``'3h'``, ``'1h30m'``, ``'45s'`` or plain seconds (``'5400'``) -> seconds (> 0).

    Raises:
        ValueError: naming the text and the accepted forms.
    """
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        cleaned = str(text).strip().lower().replace(" ", "")
        try:
            seconds = float(cleaned)
        except ValueError:
            match = _DURATION.match(cleaned)
            if not cleaned or match is None:
                raise ValueError(f"budget {text!r} is not a duration; give seconds (5400) or hours/minutes/seconds "
                                 "like 3h, 90m, 1h30m, 45s") from None
            hours, minutes, secs = (float(g) if g else 0.0 for g in match.groups())
            seconds = hours * 3600 + minutes * 60 + secs
    if not 0 < seconds < math.inf:
        raise ValueError(f"budget {text!r} must be a duration > 0 (e.g. 3h, 90m, 1h30m or seconds)")
    return seconds


def format_duration(seconds: float) -> str:
    """``3725`` -> ``'1h02m'``; ``95`` -> ``'1.6 min'``; ``12`` -> ``'12 s'``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours}h{minutes:02d}m"
