"""The probe cache: what a short probe (probe.py) or finished trials measured per hardware and trial config,
in ``~/.cache/apao_ray/probes.json`` (``$APAO_PROBE_CACHE`` in the tests)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...hardware import cpu_features, cpu_model
from ...training.memory import allocator_env
from ...paths import user_cache_dir

PROBE_STEPS = 3           # timed optimizer steps at least (after one warm-up step)
PROBE_SECONDS = 8.0       # ... and timed training for at least this long (a sustained rate: 3 steps read ~5% fast)
PROBE_MAX_STEPS = 50      # ... but no more steps than this (nor more than one epoch): tiny models stop early
PROBE_TRIAL_SHARE = 0.05  # ... nor, once one step is timed, more samples than this share of the trial's training
PROBE_VERSION = 2         # in the cache key: probes measured another way are not reused
PROBE_CACHE_FILE = "probes.json"
PROBE_CACHE_ENV = "APAO_PROBE_CACHE"
# a probe trains alone; trials side by side on one machine share its caches and memory bandwidth. Measured
# (benchmarks/RESULTS.md, 2026-11-25): two Grocery trials at once trained at 105 samples/s each against their
# probe's 125 (Intel Xeon, 2 vCPUs, 1 thread per trial), 1.19x. Applied to probed (not observed) rates when
# a study runs more than one trial at a time on this machine.
SIDE_BY_SIDE_SLOWDOWN = 1.2

@dataclass(frozen=True)
class Probe:
    """Measured on this hardware: seconds per training sample and per validation user, peak memory."""

    train_s_per_sample: float
    eval_s_per_user: float
    peak_bytes: int
    precision: str
    threads: int
    device: str
    timed_samples: int = 0  # training samples the rate was measured on (after the warm-up step)
    observed_trials: int = 0  # finished study trials whose measured rates replaced the probe's (record_observed)
    energy_kwh_per_cpu_s: float | None = None  # CodeCarbon's energy per CPU-second in those trials
    allocator: str = ""  # the memory allocator the probe ran on (training/memory.py)
    # ended by PROBE_TRIAL_SHARE: the (epochs, max_train_samples) of the short trial it was cut for, else None
    cut_for: list | None = None


def hardware_key(threads: int, use_gpu: bool) -> dict[str, Any]:
    # the instruction sets too: one model name covers machines with and without AVX-512 / native bf16
    return {"cpu": cpu_model(), "features": list(cpu_features()), "cpus": os.cpu_count(), "threads": threads,
            "gpu": use_gpu, "python": platform.python_version()}


def probe_key(config_dict: dict[str, Any], threads: int) -> str:
    """Cache key: the hardware and what sets the cost (model, loss, batch, precision, data, eval)."""
    train = config_dict["train"]
    relevant = {"probe": PROBE_VERSION, "hw": hardware_key(threads, bool(train.get("use_gpu"))),
                "model": config_dict["model"],
                "loss": {k: config_dict["loss"].get(k) for k in ("name", "num_negatives")},
                "data": config_dict["data"], "protocol": config_dict.get("protocol"), "allocator": allocator_env(),
                "train": {k: train.get(k) for k in ("batch_size", "precision", "eval_batch_size", "beam_size",
                                                    "group_by_length")}}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:20]


def probe_cache_path() -> Path:
    """``$APAO_PROBE_CACHE`` (the test suite's own), else ``probes.json`` in the user cache."""
    return Path(os.environ.get(PROBE_CACHE_ENV) or user_cache_dir() / PROBE_CACHE_FILE)


def probe(config_dict: dict[str, Any], threads: int, use_cache: bool = True) -> tuple[Probe, bool]:
    """The probe of one trial config, from the cache or a fresh subprocess; returns (probe, was_cached)."""
    path, key = probe_cache_path(), probe_key(config_dict, threads)
    cache = _read_cache(path)
    if use_cache and key in cache and _long_enough(cache[key], config_dict["train"]):
        return _with_observed(cache[key]), True
    env = {**os.environ, **allocator_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[3]) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}  # the allocator a trial's worker gets (runner.init_ray)
    done = subprocess.run([sys.executable, "-m", "apao_ray.study.plan.probe", json.dumps(config_dict), str(threads)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"timing probe of {config_dict['model'].get('backbone')}/{config_dict['loss']['name']} "
                           f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    result = Probe(**json.loads(done.stdout.strip().splitlines()[-1]))
    cache[key] = result.__dict__
    _write_cache(path, cache)
    return result, False


def _long_enough(entry: dict[str, Any], train: dict[str, Any]) -> bool:
    """Whether a cached probe was timed long enough for this trial: one cut short for a smaller trial (fewer
    epochs or training samples) is measured again."""
    if not entry.get("cut_for"):
        return True
    epochs, samples = entry["cut_for"]
    return train["epochs"] <= epochs and (train.get("max_train_samples") or math.inf) <= (samples or math.inf)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}  # a damaged cache is re-measured, not an error


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: two studies probing at once
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: never half a file


def _with_observed(entry: dict[str, Any]) -> Probe:
    """A cache entry as a Probe: the rates that finished trials measured win over the probe's short run,
    the larger peak memory wins."""
    entry = dict(entry)
    observed = entry.pop("observed", None)
    measured = Probe(**entry)
    if not observed:
        return measured
    return replace(measured, train_s_per_sample=observed["train_s_per_sample"],
                   eval_s_per_user=observed.get("eval_s_per_user") or measured.eval_s_per_user,
                   peak_bytes=max(measured.peak_bytes, int(observed.get("peak_bytes") or 0)),
                   observed_trials=int(observed["trials"]),
                   energy_kwh_per_cpu_s=observed.get("energy_kwh_per_cpu_s"))


def record_observed(config_dict: dict[str, Any], threads: int, trials: list[dict[str, Any]]) -> bool:
    """Stores what finished trials of one method measured (``perf/samples_per_second``, validation seconds per
    user, ``cost/peak_rss_mb``, CodeCarbon's ``cost/energy_kwh`` per ``cost/cpu_seconds``) in the probe cache
    entry of their config, so the next plan on this machine uses real epochs instead of the probe's few
    steps. Only an entry that exists is updated; returns whether one was."""
    rates = [t["perf/samples_per_second"] for t in trials if (t.get("perf/samples_per_second") or 0) > 0]
    if not rates:
        return False
    path, key = probe_cache_path(), probe_key(config_dict, threads)
    cache = _read_cache(path)
    if key not in cache:
        return False
    valid = [t["valid_s_per_user"] for t in trials if (t.get("valid_s_per_user") or 0) > 0]
    peaks = [t["cost/peak_rss_mb"] for t in trials if (t.get("cost/peak_rss_mb") or 0) > 0]
    energy = [t["cost/energy_kwh"] / t["cost/cpu_seconds"] for t in trials
              if (t.get("cost/energy_kwh") or 0) > 0 and (t.get("cost/cpu_seconds") or 0) > 0]
    cache[key]["observed"] = {"train_s_per_sample": 1.0 / statistics.median(rates), "trials": len(rates),
                              "eval_s_per_user": statistics.median(valid) if valid else None,
                              "peak_bytes": int(max(peaks) * 2**20) if peaks else None,
                              "energy_kwh_per_cpu_s": statistics.median(energy) if energy else None}
    _write_cache(path, cache)
    return True
