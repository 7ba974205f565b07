"""The cost of a trial: CPU seconds, wall time, peak memory, energy; summed per method on the parent run."""
from __future__ import annotations

import time

import pytest
import torch

from apao_ray.training.cost import CPU, ENERGY, ENERGY_METHOD_KEY, RSS, WALL, CostMeter
from conftest import mlflow_sqlite


def _busy(seconds: float) -> None:
    """Burns ``seconds`` of this thread's CPU time (not wall time: on a loaded machine a wall-time loop
    may get almost no CPU)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(i * i for i in range(1000))


def test_cpu_and_wall_time_are_this_segment_plus_the_earlier_ones():
    meter = CostMeter(torch.device("cpu"), measure_energy=False)
    _busy(0.3)
    time.sleep(0.3)  # wall time, no CPU
    first = meter.stop()
    assert 0.55 <= first[WALL] < 60 and 0.25 < first[CPU] < first[WALL]
    assert first[RSS] > 50  # MB: a Python process with torch loaded
    assert first[ENERGY_METHOD_KEY].startswith("not measured") and ENERGY not in first
    resumed = CostMeter(torch.device("cpu"), previous={**first, RSS: 1e9}, measure_energy=False)
    second = resumed.stop()
    assert second[WALL] >= first[WALL] and second[CPU] >= first[CPU]  # totals over both segments
    assert second[RSS] == 1e9  # the largest peak of the segments


def test_energy_from_codecarbon_says_how_it_was_obtained():
    pytest.importorskip("codecarbon")
    meter = CostMeter(torch.device("cpu"))
    _busy(0.5)
    totals = meter.stop()
    assert totals[ENERGY] > 0, totals
    assert totals[ENERGY_METHOD_KEY].startswith("CodeCarbon offline: CPU power ")
    assert "estimated" in totals[ENERGY_METHOD_KEY] or "read from its counters" in totals[ENERGY_METHOD_KEY]


CODECARBON_START = """
import json, subprocess, sys, torch
started = []
popen_init = subprocess.Popen.__init__
def recording_init(self, args, *rest, **options):
    started.append(args if isinstance(args, str) else " ".join(map(str, args)))
    popen_init(self, args, *rest, **options)
subprocess.Popen.__init__ = recording_init
import cpuinfo
original = cpuinfo.get_cpu_info
from apao_ray.training.cost import CostMeter
totals = CostMeter(torch.device("cpu")).stop()
print(json.dumps({"started": started, "method": totals["energy_method"], "restored": cpuinfo.get_cpu_info is original}))
"""


def test_codecarbon_starts_without_a_second_python_for_the_cpu_name():
    """In a fresh process (CodeCarbon asks once per process): the name comes from /proc/cpuinfo, not from
    py-cpuinfo's subprocess, and py-cpuinfo is left as it was."""
    import json
    import subprocess
    import sys

    from apao_ray.hardware import proc_cpu_model
    from conftest import ROOT

    pytest.importorskip("codecarbon")
    if proc_cpu_model() is None:
        pytest.skip("no model name in /proc/cpuinfo: CodeCarbon asks py-cpuinfo as it would")
    result = subprocess.run([sys.executable, "-c", CODECARBON_START], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, check=True)
    seen = json.loads(result.stdout.splitlines()[-1])
    assert not [command for command in seen["started"] if "cpuinfo" in command], seen["started"]
    assert f"from the CPU model ({proc_cpu_model()})" in seen["method"] or "read from its counters" in seen["method"]
    assert seen["restored"]


def test_parent_run_sums_the_cost_of_its_children_per_method(tmp_path):
    from apao_ray.study.record.mlflow_callback import log_cost_per_method
    from apao_ray.tracking import Tracker

    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-test")
    parent = tracker.start_run("study", {"apao.role": "study"})
    for loss, cpu, rss in (("ce", 10.0, 300.0), ("ce", 5.0, 500.0), ("apao_pointwise", 7.0, 400.0)):
        child = tracker.start_run(loss, {"backbone": "tiger", "loss": loss}, parent_run_id=parent)
        tracker.log_metrics(child, {CPU: cpu, RSS: rss, ENERGY: cpu / 1000}, 3)
    totals = log_cost_per_method(tracker, parent)
    logged = tracker.client.get_run(parent).data.metrics
    assert logged["cost/tiger/ce/cpu_seconds"] == 15.0 and logged["cost/tiger/ce/peak_rss_mb"] == 500.0
    assert logged["cost/tiger/apao_pointwise/energy_kwh"] == pytest.approx(0.007)
    assert totals["tiger/ce"][CPU] == 15.0
