"""What this machine's CPU is called: for the plan's probe cache, benchmark tables and CodeCarbon."""
from __future__ import annotations

import platform
from pathlib import Path


def proc_cpu_model() -> str | None:
    """The CPU's model name as Linux's ``/proc/cpuinfo`` gives it, or None where there is none."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    return proc_cpu_model() or platform.processor() or platform.machine()
