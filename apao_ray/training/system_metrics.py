"""What the machine did while a trial trained, sampled once per epoch in the process that trains: CPU use (the
machine's and the trial's own), memory (the machine's and the trial's resident set) and, on CUDA, the GPU's
utilisation and memory.

The keys start with ``system/``, which MLflow files under a run's System metrics tab; the machine-wide ones carry
the names MLflow's own system-metrics monitor gives them (``mlflow.system_metrics``), so a study's charts read
like any MLflow user's. MLflow's monitor cannot be used as it is: it samples the process that holds the MLflow
run, the study's driver, while the trial trains in a Ray worker (a run's metrics reach MLflow through the
driver, ``study/record/mlflow_callback.py``).
"""
from __future__ import annotations

import time

import psutil
import torch

PREFIX = "system/"
CPU_PERCENT = f"{PREFIX}cpu_utilization_percentage"  # the machine's, as MLflow's CPUMonitor names it
MEMORY_MB = f"{PREFIX}system_memory_usage_megabytes"
MEMORY_PERCENT = f"{PREFIX}system_memory_usage_percentage"
PROCESS_CPU_PERCENT = f"{PREFIX}process_cpu_utilization_percentage"  # the trial's: 100 per busy core
PROCESS_RSS_MB = f"{PREFIX}process_rss_megabytes"


class SystemSampler:
    """Each :meth:`sample` gives the CPU use since the previous one (or since construction) and memory now.

    Args:
        device: the trial's device; on CUDA the GPU's utilisation and memory are sampled too.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.process = psutil.Process()
        psutil.cpu_percent(None)  # starts the machine's interval: the first sample covers the first epoch
        self._cpu_seconds, self._tick = self._process_cpu_seconds(), time.perf_counter()

    def _process_cpu_seconds(self) -> float:
        times = self.process.cpu_times()  # every thread of this process (torch's intra-op pool too)
        return times.user + times.system

    def sample(self) -> dict[str, float]:
        cpu_seconds, tick = self._process_cpu_seconds(), time.perf_counter()
        wall = max(tick - self._tick, 1e-9)
        memory = psutil.virtual_memory()
        metrics = {CPU_PERCENT: psutil.cpu_percent(None), MEMORY_MB: memory.used / 1e6, MEMORY_PERCENT: memory.percent,
                   PROCESS_CPU_PERCENT: 100.0 * (cpu_seconds - self._cpu_seconds) / wall,
                   PROCESS_RSS_MB: self.process.memory_info().rss / 1e6}
        self._cpu_seconds, self._tick = cpu_seconds, tick
        if self.device.type == "cuda":
            metrics.update(gpu_metrics(self.device))
        return metrics


def gpu_metrics(device: torch.device) -> dict[str, float]:
    """``system/gpu_<i>_...`` of the trial's GPU, named as MLflow's GPUMonitor names them: memory used on the device
    (every process's, as nvidia-smi shows it), its share of the total, and what this trial's PyTorch holds;
    utilisation where NVML answers (``torch.cuda.utilization`` needs the ``nvidia-ml-py`` package)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    name = f"{PREFIX}gpu_{index}"
    metrics = {f"{name}_memory_usage_megabytes": (total - free) / 1e6,
               f"{name}_memory_usage_percentage": 100.0 * (total - free) / total,
               f"{name}_process_memory_reserved_megabytes": torch.cuda.memory_reserved(index) / 1e6}
    try:
        metrics[f"{name}_utilization_percentage"] = float(torch.cuda.utilization(index))
    except Exception:  # no NVML (ModuleNotFoundError, or its own errors): utilisation is left out, not guessed
        pass
    return metrics
