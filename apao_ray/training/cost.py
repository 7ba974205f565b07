"""What a trial cost: wall time, CPU seconds, peak memory and, with CodeCarbon
installed (``pip install apao_ray[energy]``), estimated energy, measured in the process that trains.

The figures add up over the segments of a resumed trial: each checkpoint stores the totals so far
(``state["cost"]``) and the next segment starts from them. Peak memory is the largest of the segments.
"""
from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..hardware import proc_cpu_model
from ..names import CPU, ENERGY, ENERGY_METHOD_KEY, GPU_MEMORY, RSS, WALL
# CodeCarbon's CPU modes that read a power counter; any other mode is its estimate from the CPU model's TDP
MEASURED_CPU_MODES = ("intel_rapl", "intel_power_gadget", "apple_powermetrics")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process (torch's intra-op pool too)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def _cpu_model_from_proc() -> Iterator[None]:
    """While CodeCarbon starts, py-cpuinfo names the CPU from ``/proc/cpuinfo`` (Linux) instead of a second
    Python process that reads CPUID: that process cost 1.1 CPU-s and ~1.1 s of every trial's start on 2 CPUs
    (the start 1.47 -> 0.33 s wall). CodeCarbon reads only the name (``brand_raw``) from it, once per process."""
    model = proc_cpu_model()
    try:  # lazy: py-cpuinfo comes with CodeCarbon, an optional extra
        import cpuinfo
    except ImportError:
        model = None
    if model is None:
        yield
        return
    original = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = lambda: {"brand_raw": model}
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = original


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


class CostMeter:
    """Measures this process from construction on; :meth:`totals` adds what earlier segments recorded.

    Args:
        device: the trial's device (peak GPU memory is read on CUDA).
        previous: ``totals()`` of the earlier segments of a resumed trial (from its checkpoint).
        measure_energy: start CodeCarbon's offline tracker when it is installed.
    """

    def __init__(self, device: torch.device, previous: dict[str, Any] | None = None, measure_energy: bool = True) -> None:
        self.device = device
        self.previous = {k: v for k, v in (previous or {}).items()}
        self.started_wall, self.started_cpu = time.perf_counter(), _cpu_seconds()
        self.energy_tracker: Any = None
        self.energy_method = "not measured: CodeCarbon is not installed (pip install codecarbon)"
        if measure_energy:
            self._start_energy()

    def _start_energy(self) -> None:
        try:  # lazy: CodeCarbon, an optional extra
            from codecarbon import OfflineEmissionsTracker
        except ImportError:
            return
        logging.getLogger("codecarbon").setLevel(logging.ERROR)  # before it starts: its start-up INFO/WARNING lines
        try:  # offline: no network; the country only picks a carbon intensity, energy does not depend on it
            self.energy_tracker = OfflineEmissionsTracker(country_iso_code="USA", output_methods=[], log_level="error",
                                                          tracking_mode="process", measure_power_secs=30)
            with _cpu_model_from_proc():
                self.energy_tracker.start()
        except Exception as error:  # noqa: BLE001 - energy is optional: a failure is stated, never fatal
            self.energy_tracker = None
            self.energy_method = f"not measured: CodeCarbon failed to start ({type(error).__name__}: {error})"[:300]

    def _energy_kwh(self) -> float | None:
        """Energy so far in this segment (flushes CodeCarbon's measurement without stopping it)."""
        if self.energy_tracker is None:
            return None
        try:
            self.energy_tracker.flush()
            data = self.energy_tracker._prepare_emissions_data()  # what stop() would report, tracker kept running
            modes = [getattr(h, "_mode", None) for h in getattr(self.energy_tracker, "_hardware", [])
                     if type(h).__name__ == "CPU"]
            how = ("CPU power read from its counters" if modes and modes[0] in MEASURED_CPU_MODES else
                   f"CPU power estimated by CodeCarbon from the CPU model ({data.cpu_model}) and load, not measured")
            self.energy_method = f"CodeCarbon offline: {how}; RAM and GPU by CodeCarbon's own rules"
            return float(data.energy_consumed)
        except Exception as error:  # noqa: BLE001
            self.energy_method = f"not measured: CodeCarbon failed ({type(error).__name__}: {error})"[:300]
            return None

    def totals(self) -> dict[str, Any]:
        """Cost of the trial so far: this segment plus the earlier ones."""
        totals: dict[str, Any] = {
            WALL: self.previous.get(WALL, 0.0) + time.perf_counter() - self.started_wall,
            CPU: self.previous.get(CPU, 0.0) + _cpu_seconds() - self.started_cpu,
            RSS: max(self.previous.get(RSS, 0.0), _peak_rss_mb()),
        }
        if self.device.type == "cuda":
            totals[GPU_MEMORY] = max(self.previous.get(GPU_MEMORY, 0.0), torch.cuda.max_memory_allocated(self.device) / 2**20)
        energy = self._energy_kwh()
        if energy is not None:
            totals[ENERGY] = self.previous.get(ENERGY, 0.0) + energy
        totals[ENERGY_METHOD_KEY] = self.energy_method
        return totals

    def stop(self) -> dict[str, Any]:
        totals = self.totals()
        if self.energy_tracker is not None:
            try:
                self.energy_tracker.stop()
            except Exception:  # noqa: BLE001 - the figures are taken already
                pass
        return totals
