"""This machine's CPUs: what the CPU is called (the plan's probe cache, benchmark tables, CodeCarbon) and how
many this process may use."""
from __future__ import annotations

import os
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


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's or taskset's), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
