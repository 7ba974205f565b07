"""This machine's CPUs: what the CPU is called and which instruction sets it has (the plan's probe cache,
benchmark tables, CodeCarbon) and how many this process may use."""
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


# the instruction sets that decide how fast (and in what precision) training runs here: machines of one model
# name differ ("AMD EPYC" with and without AVX-512), so every benchmark names these beside the model
NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_features(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> tuple[str, ...]:
    """Which of ``NOTABLE_FLAGS`` this CPU has (Linux's ``flags`` line), in that order; () where unknown."""
    try:
        line = next(line for line in Path(cpuinfo).read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ()
    flags = set(line.split(":", 1)[1].split())
    return tuple(flag for flag in NOTABLE_FLAGS if flag in flags)


def cpu_description() -> str:
    """The CPU's model and notable instruction sets, e.g. ``AMD EPYC (avx2, avx512f, avx512_bf16)``: what a
    benchmark's table and JSON name."""
    features = cpu_features()
    return f"{cpu_model()} ({', '.join(features) if features else 'flags unknown'})"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's or taskset's), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
