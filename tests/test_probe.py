"""study/plan/probe.py and probe_cache.py: the probe that times a trial's sustained training rate, its cache read
per hardware and config, finished trials' rates replacing the probes', and two studies writing the cache at once (no
study run; the fitting arithmetic that uses the rates: test_budget.py)."""
from __future__ import annotations

import json

import pytest

from apao_ray.study.plan.budget import MethodCost, fit_budget
from apao_ray.study.plan.make import cost_summary
from apao_ray.study.plan.plan import Plan
from apao_ray.study.plan.probe_cache import probe, probe_key


def test_probe_cache_is_read_per_hardware_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("APAO_PROBE_CACHE", str(tmp_path / "apao_ray" / "probes.json"))
    from apao_ray.config import TrialConfig

    config = json.loads(json.dumps(TrialConfig().to_dict()))
    key = probe_key(config, 2)
    assert key == probe_key(json.loads(json.dumps(config)), 2) != probe_key(config, 1)
    other = json.loads(json.dumps(TrialConfig().replace(loss={"name": "apao_pairwise"}).to_dict()))
    assert probe_key(other, 2) != key
    epochs_only = json.loads(json.dumps(TrialConfig().replace(train={"epochs": 3}).to_dict()))
    assert probe_key(epochs_only, 2) == key  # the schedule does not change a step's cost
    # one CPU model name, two instruction sets (AVX2 alone, or native bf16): not one machine's rates
    from apao_ray.study.plan import probe_cache

    monkeypatch.setattr(probe_cache, "cpu_features", lambda: ("avx2", "avx512f", "avx512_bf16"))
    bf16 = probe_key(config, 2)
    monkeypatch.setattr(probe_cache, "cpu_features", lambda: ("avx2",))
    assert bf16 != probe_key(config, 2)
    monkeypatch.undo()
    monkeypatch.setenv("APAO_PROBE_CACHE", str(tmp_path / "apao_ray" / "probes.json"))
    saved = {"train_s_per_sample": 0.02, "eval_s_per_user": 0.01, "peak_bytes": 123, "precision": "fp32",
             "threads": 2, "device": "cpu"}
    (tmp_path / "apao_ray").mkdir()
    (tmp_path / "apao_ray" / "probes.json").write_text(json.dumps({key: saved}))
    measured, was_cached = probe(config, 2)
    assert was_cached and measured.train_s_per_sample == 0.02 and measured.peak_bytes == 123


def test_the_probe_times_a_sustained_rate_not_the_first_steps(one_torch_thread):
    """At least ``steps`` timed steps; with a time floor it goes on past them until the floor, the step cap or
    the end of the epoch (the synthetic dataset's tiny model takes milliseconds a step)."""
    from apao_ray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.study.plan.probe_cache import PROBE_MAX_STEPS
    from apao_ray.study.plan.probe import run_probe

    config = TrialConfig(DataConfig(dataset="synthetic"), ModelConfig(d_model=32, num_layers=1, num_heads=2, head_dim=16,
                                                                      d_ff=64),
                         train=TrainConfig(batch_size=16, eval_batch_size=8, precision="fp32"))
    config = json.loads(json.dumps(config.to_dict()))
    burst = run_probe(config, 1, steps=3, min_seconds=0.0)
    assert burst["timed_samples"] == 3 * 16
    # a floor of ~4x the burst's 3 steps (~10 ms a step when idle, a few times that on a loaded machine) ends it
    floor = 4 * burst["train_s_per_sample"] * burst["timed_samples"]
    sustained = run_probe(config, 1, steps=3, min_seconds=floor)
    assert 3 * 16 < sustained["timed_samples"] <= PROBE_MAX_STEPS * 16
    # the floor reached, or the step cap first (when the burst's steps ran slower than the later ones, under load)
    assert (sustained["train_s_per_sample"] * sustained["timed_samples"] >= floor
            or sustained["timed_samples"] == PROBE_MAX_STEPS * 16)
    capped = run_probe(config, 1, steps=3, min_seconds=1e6)  # 4,262 training samples: the step cap ends it
    assert capped["timed_samples"] == PROBE_MAX_STEPS * 16


def test_a_probe_costs_a_short_trial_little_and_is_not_reused_for_a_longer_one(tmp_path, monkeypatch, one_torch_thread):
    """A trial of 1 epoch on 320 samples: 5% is 16 samples, one step of 16 after the warm-up (however long the
    time floor). Its cache entry serves a trial no longer than that; a longer trial is probed again."""
    monkeypatch.setenv("APAO_PROBE_CACHE", str(tmp_path / "probes.json"))
    from apao_ray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.study.plan.probe import run_probe

    def config(epochs: int, samples: int | None) -> dict:
        return json.loads(json.dumps(TrialConfig(
            DataConfig(dataset="synthetic"), ModelConfig(d_model=32, num_layers=1, num_heads=2, head_dim=16, d_ff=64),
            train=TrainConfig(batch_size=16, eval_batch_size=8, precision="fp32", epochs=epochs,
                              max_train_samples=samples)).to_dict()))

    short = run_probe(config(1, 320), 1, steps=3, min_seconds=1e6)
    assert short["timed_samples"] == 16 and short["cut_for"] == [1, 320]
    assert run_probe(config(200, None), 1, steps=3, min_seconds=0.0)["cut_for"] is None
    key = probe_key(config(1, 320), 1)
    assert key == probe_key(config(4, None), 1)  # one cache entry for both trials
    (tmp_path / "probes.json").write_text(json.dumps({key: {**short, "train_s_per_sample": 123.0}}))
    assert probe(config(1, 320), 1)[1] and probe(config(1, 160), 1)[1]  # cached: as short or shorter
    remeasured, was_cached = probe(config(4, None), 1)
    assert not was_cached and remeasured.train_s_per_sample != 123.0 and remeasured.timed_samples > 16


def test_finished_trials_rates_replace_the_probes_in_the_next_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("APAO_PROBE_CACHE", str(tmp_path / "probes.json"))
    from apao_ray.config import TrialConfig
    from apao_ray.study.plan.plan import method_config
    from apao_ray.study.plan.probe_cache import record_observed

    config = method_config(TrialConfig(), "tiger", "ce")
    trials = [{"perf/samples_per_second": 100.0, "valid_s_per_user": 0.008, "cost/peak_rss_mb": 3000.0,
               "cost/energy_kwh": 0.02, "cost/cpu_seconds": 1000.0},
              {"perf/samples_per_second": 125.0, "valid_s_per_user": None, "cost/peak_rss_mb": 4000.0},
              {"perf/samples_per_second": None}]  # a trial that never reported a rate
    assert not record_observed(config, 2, trials)  # nothing probed on this machine yet: nothing to correct
    saved = {"train_s_per_sample": 1 / 150, "eval_s_per_user": 0.006, "peak_bytes": 2**30, "precision": "bf16",
             "threads": 2, "device": "cpu", "timed_samples": 1280}
    (tmp_path / "probes.json").write_text(json.dumps({probe_key(config, 2): saved}))
    assert record_observed(config, 2, trials)
    measured, was_cached = probe(config, 2)
    assert was_cached and measured.observed_trials == 2
    assert measured.train_s_per_sample == pytest.approx(1 / 112.5)  # the median trial rate, not the probe's 150
    assert measured.eval_s_per_user == 0.008 and measured.peak_bytes == 4000 * 2**20  # the larger peak
    assert measured.timed_samples == 1280 and measured.energy_kwh_per_cpu_s == pytest.approx(2e-5)
    # the plan estimates energy from it: CPU seconds (wall x threads) x kWh per CPU-second
    cost = MethodCost("tiger", "ce", True, epoch_s=100.0, fixed_s=20.0, energy_kwh_per_cpu_s=2e-5)
    plan = Plan(dataset="office", protocol="paper", precision="bf16", slots=1, methods=[cost], asked_epochs=2,
                asked_trials_per_tuned=1, fit=fit_budget([cost], 2, 1, 5, 1, None), threads=2)
    assert plan.cost_estimates()[("tiger", "ce")]["cost/energy_kwh"] == pytest.approx(220 * 2 * 2e-5)
    assert "0.0088 / 0.01" in cost_summary(plan, {("tiger", "ce"): {"cost/energy_kwh": 0.01}})
    assert not record_observed(config, 1, trials)  # another thread count is another entry


_WRITER = """
import sys
from pathlib import Path
from apao_ray.study.plan.probe_cache import _write_cache
for n in range(300):
    _write_cache(Path(sys.argv[1]), {sys.argv[2]: n})
"""


def test_two_studies_writing_the_probe_cache_at_once_never_fail_or_leave_half_a_file(tmp_path):
    """Two sweeps on one machine (or two test workers) probe and write the shared cache at the same time."""
    import subprocess
    import sys

    path = tmp_path / "probes.json"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name], stderr=subprocess.PIPE, text=True)
               for name in ("a", "b")]
    errors = [writer.communicate(timeout=120)[1] for writer in writers]
    assert [writer.returncode for writer in writers] == [0, 0], errors
    assert list(json.loads(path.read_text()).values()) == [299]  # the last write of one of them, whole
    assert [p.name for p in tmp_path.iterdir()] == ["probes.json"]  # no temporary file left behind


def test_cpu_features_name_the_instruction_sets_from_the_flags_line(tmp_path):
    from apao_ray.hardware import cpu_features

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n")
    assert cpu_features(info) == ("avx2", "avx512f", "avx512_bf16")
    info.write_text("model name\t: Intel Xeon\nflags\t: avx2 amx_bf16 amx_tile avx512f\n")
    assert cpu_features(info) == ("avx2", "avx512f", "amx_bf16")
    info.write_text("model name\t: some CPU\n")
    assert cpu_features(info) == () and cpu_features(tmp_path / "absent") == ()
