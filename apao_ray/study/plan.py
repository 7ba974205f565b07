"""A study's plan before any trial: trials per method, epochs, and its cost on this hardware.

The cost comes from a short probe of the real model and loss (~8 s of optimizer steps and one
validation batch, in a subprocess so that its peak memory is its own), cached per hardware and
config in ``~/.cache/apao_ray/probes.json``. With a wall-clock budget the study is fitted to it
(:mod:`.budget`: the pure, unit-tested arithmetic of that fit).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..hardware import cpu_model
from ..training.memory import allocator_env, find_tcmalloc
from .budget import (MIN_TRAIN_SAMPLES, RAY_START_S, TRIAL_START_S, Fit, MethodCost, asha_rungs,  # noqa: F401
                     fit_budget, format_duration, largest_subset, makespan, parse_duration, study_seconds,
                     trial_durations)

PROBE_STEPS = 3           # timed optimizer steps at least (after one warm-up step)
PROBE_SECONDS = 8.0       # ... and timed training for at least this long (a sustained rate: 3 steps read ~5% fast)
PROBE_MAX_STEPS = 50      # ... but no more steps than this (nor more than one epoch): tiny models stop early
PROBE_TRIAL_SHARE = 0.05  # ... nor, once one step is timed, more samples than this share of the trial's training
PROBE_VERSION = 2         # in the cache key: probes measured another way are not reused
PROBE_CACHE_FILE = "probes.json"
PROBE_CACHE_ENV = "APAO_PROBE_CACHE"
# a probe trains alone; trials side by side on one machine share its caches and memory bandwidth. Measured
# (benchmarks/RESULTS.md, session 15): two Grocery trials at once trained at 105 samples/s each against their
# probe's 125 (Intel Xeon, 2 vCPUs, 1 thread per trial), 1.19x. Applied to probed (not observed) rates when
# a study runs more than one trial at a time on this machine.
SIDE_BY_SIDE_SLOWDOWN = 1.2
MEMORY_WARNING_FRACTION = 0.8  # of the machine's memory, for the plan's peak (Ray's monitor kills at 0.95)


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
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": threads, "gpu": use_gpu, "python": platform.python_version()}


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
    from ..paths import user_cache_dir

    return Path(os.environ.get(PROBE_CACHE_ENV) or user_cache_dir() / PROBE_CACHE_FILE)


def probe(config_dict: dict[str, Any], threads: int, use_cache: bool = True) -> tuple[Probe, bool]:
    """The probe of one trial config, from the cache or a fresh subprocess; returns (probe, was_cached)."""
    path, key = probe_cache_path(), probe_key(config_dict, threads)
    cache = _read_cache(path)
    if use_cache and key in cache and _long_enough(cache[key], config_dict["train"]):
        return _with_observed(cache[key]), True
    env = {**os.environ, **allocator_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}  # the allocator a trial's worker gets (runner.init_ray)
    done = subprocess.run([sys.executable, "-m", "apao_ray.study.probe", json.dumps(config_dict), str(threads)],
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


def method_config(base: Any, backbone: str, loss: str) -> dict[str, Any]:
    """The trial config a method is probed with (and its cache entry's key is made of), as plain JSON."""
    config = base.replace(model=base.model.replace(backbone=backbone).to_dict(),
                          loss=base.loss.replace(name=loss).to_dict())
    return json.loads(json.dumps(config.to_dict()))


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


@dataclass
class Plan:
    """The printed plan and the schedule the study will run."""

    dataset: str
    protocol: str
    precision: str
    slots: int
    methods: list[MethodCost]
    asked_epochs: int
    asked_trials_per_tuned: int
    fit: Fit
    budget_s: float | None = None
    probes_cached: int = 0
    probes_observed: int = 0  # methods whose rates come from finished trials on this machine (record_observed)
    allocator: str = ""  # the probes' memory allocator, what this machine's trials get
    notes: list[str] = field(default_factory=list)
    repeat_seeds: tuple[int, ...] = ()  # --seeds after the first: each method's best configuration again
    threads: int = 1  # torch threads per worker (the CPU-seconds estimate)
    workers: int = 1  # data-parallel workers per trial (--workers-per-trial)
    machine_bytes: int = 0  # this machine's memory when the study runs on it (0: a cluster, not checked)
    start_order: tuple[tuple[str, str], ...] = ()  # (backbone, loss) by decreasing epoch time: trials start so
    side_by_side: float = 1.0  # the factor on probed rates for trials running side by side (SIDE_BY_SIDE_SLOWDOWN)

    @property
    def num_trials(self) -> int:
        return sum(1 if m.is_baseline else self.fit.trials_per_tuned for m in self.methods) + \
            len(self.methods) * len(self.repeat_seeds)

    @property
    def fitted_methods(self) -> list[MethodCost]:
        """The methods' costs with the fitted training subset (a budget's last resort), if any."""
        return [m.with_train_samples(self.fit.train_samples) for m in self.methods]

    def cost_estimates(self) -> dict[tuple[str, str], dict[str, float]]:
        """Per (backbone, loss), the figures each trial records (``training/cost.py``), summed over the
        method's trials as the study table sums them: wall and CPU seconds (wall x threads: an upper
        bound, threads are not always busy), peak RSS in MB (the probe's) and, where earlier trials of the method
        measured it here, energy in kWh (their energy per CPU-second times the CPU seconds)."""
        estimates = {}
        for m in self.fitted_methods:
            count = (1 if m.is_baseline else self.fit.trials_per_tuned) + len(self.repeat_seeds)
            wall = count * m.trial_s(self.fit.epochs)
            cpu = wall * self.threads * self.workers
            estimates[(m.backbone, m.loss)] = {"cost/wall_seconds": wall, "cost/cpu_seconds": cpu,
                                               "cost/peak_rss_mb": m.peak_bytes / 2**20}
            if m.energy_kwh_per_cpu_s:
                estimates[(m.backbone, m.loss)]["cost/energy_kwh"] = cpu * m.energy_kwh_per_cpu_s
        return estimates

    @property
    def peak_bytes(self) -> int:
        peaks = sorted((m.peak_bytes for m in self.methods
                        for _ in range(1 if m.is_baseline else self.fit.trials_per_tuned)), reverse=True)
        return sum(peaks[:self.slots])

    def text(self) -> str:
        fit, gib = self.fit, 2 ** 30
        allocator = f", allocator {self.allocator}" if self.allocator else ""
        workers = f"{self.workers} data-parallel workers x " if self.workers > 1 else ""
        lines = [f"plan: {self.num_trials} trials on {self.dataset}, protocol {self.protocol}, precision "
                 f"{self.precision}{allocator}, {self.slots} at a time, {workers}{self.threads} thread"
                 f"{'s' if self.threads > 1 else ''} each"]
        estimates = self.cost_estimates()
        for m in self.fitted_methods:
            count = 1 if m.is_baseline else fit.trials_per_tuned
            kind = "baseline, runs to the end" if m.is_baseline else "Optuna TPE + ASHA"
            cost = estimates[(m.backbone, m.loss)]
            lines.append(f"  {m.backbone}/{m.loss:<16} {count} trial{'s' if count > 1 else ' '}  {fit.epochs} epoch{'s' if fit.epochs > 1 else ' '}  "
                         f"epoch ~{format_duration(m.epoch_s)}  trial ~{format_duration(m.trial_s(fit.epochs))}  "
                         f"peak ~{m.peak_bytes / gib:.1f} GiB  all its trials ~{format_duration(cost['cost/wall_seconds'])} "
                         f"wall, ~{format_duration(cost['cost/cpu_seconds'])} CPU  ({kind})")
        if self.repeat_seeds:
            lines.append(f"  then the best configuration of each method again on seeds {list(self.repeat_seeds)}: "
                         f"{len(self.methods) * len(self.repeat_seeds)} trials of {fit.epochs} epochs")
        rungs = asha_rungs(fit.asha_grace_period, fit.epochs)
        lines.append(f"  ASHA compares each tuned method's trials at epochs {rungs}" if rungs else
                     f"  ASHA prunes nothing (grace {fit.asha_grace_period} epochs >= {fit.epochs} epochs)")
        if len(self.start_order) > 1:
            lines.append(f"  trials start slowest method first: {', '.join(f'{b}/{l}' for b, l in self.start_order)}")
        at_once = "1 trial" if self.slots == 1 else f"{self.slots} trials"
        lines.append(f"  study ~{format_duration(fit.estimate_s)} wall, peak memory ~{self.peak_bytes / gib:.1f} GiB "
                     f"({at_once} at once), for full-length trials; ASHA pruning and early stopping shorten it")
        source = "cached" if self.probes_cached == len(self.methods) else "measured now"
        if self.probes_observed:
            source += (f"; training and validation rates of {self.probes_observed} of {len(self.methods)} methods from "
                       "finished trials of earlier studies here")
        side = (f"; probed rates x{self.side_by_side:g} for trials running side by side"
                if self.side_by_side != 1.0 else "")
        lines.append(f"  (from a probe of ~{PROBE_SECONDS:.0f} s of training (<= {PROBE_TRIAL_SHARE:.0%} of a trial's) + 1 "
                     "validation batch per method on this "
                     f"machine, {source}{side}; cache {probe_cache_path()})")
        if self.budget_s is not None:
            if fit.changes:
                asked = study_seconds(self.methods, self.asked_epochs, self.asked_trials_per_tuned, self.slots,
                                      len(self.repeat_seeds))
                lines.append(f"budget {format_duration(self.budget_s)}: the study as asked (~{format_duration(asked)}) "
                             f"exceeds it; fitted: {', '.join(fit.changes)} (~{format_duration(fit.estimate_s)})")
            else:
                lines.append(f"budget {format_duration(self.budget_s)}: the study fits")
        if self.machine_bytes and self.peak_bytes > MEMORY_WARNING_FRACTION * self.machine_bytes:
            lines.append(f"  warning: ~{self.peak_bytes / gib:.1f} GiB at peak is over {MEMORY_WARNING_FRACTION:.0%} of this "
                         f"machine's {self.machine_bytes / gib:.1f} GiB; Ray's memory monitor kills workers at 95%: "
                         "lower --max-concurrent or leave out the largest method")
        return "\n".join(lines + self.notes)


def machine_memory_bytes() -> int:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def validation_users(base: Any, splits: dict[str, Any]) -> int:
    """Users a trial validates on each epoch (``eval_max_users`` caps the split)."""
    return min(len(splits["valid"]), base.train.eval_max_users or len(splits["valid"]))


def trial_threads(cpus_per_trial: float) -> int:
    """The torch threads of a trial's worker: its CPUs, at least one."""
    return max(1, int(round(cpus_per_trial)))


def make_plan(spec: Any, slots: int, use_cache: bool = True) -> Plan:
    """Probes each (backbone, loss) of a checked ``StudySpec`` and fits the study to its budget.

    Raises:
        ValueError: the budget is too small for one epoch (naming the estimate).
    """
    from .space import is_baseline

    base, dataset, search = spec.resolved["base"], spec.resolved["dataset"], spec.resolved["search"]
    splits = dataset.splits
    train_samples = min(len(splits["train"]), base.train.max_train_samples or len(splits["train"]))
    valid_users = validation_users(base, splits)
    threads = trial_threads(spec.trial_cpus)
    # a slot no trial can fill neither runs a trial side by side nor holds memory: a one-trial study runs alone
    num_methods = len({(b, l) for b, l, _ in search.allocation()})
    slots = max(1, min(slots, max(search.num_trials, num_methods * len(spec.repeat_seeds))))
    methods, cached, observed, precisions, devices, allocators = [], 0, 0, set(), set(), set()
    side_by_side = SIDE_BY_SIDE_SLOWDOWN if slots > 1 and not spec.address else 1.0
    for backbone, loss, _ in search.allocation():
        if any((m.backbone, m.loss) == (backbone, loss) for m in methods):
            continue
        measured, was_cached = probe(method_config(base, backbone, loss), threads, use_cache)
        cached += was_cached
        observed += measured.observed_trials > 0
        precisions.add(measured.precision)
        devices.add(measured.device)
        allocators.add(measured.allocator)
        # rates that finished trials measured here already ran beside others; a probe ran alone
        slowdown = 1.0 if measured.observed_trials else side_by_side
        train_s, eval_s_per_user = train_samples * measured.train_s_per_sample * slowdown, measured.eval_s_per_user * slowdown
        methods.append(MethodCost(
            backbone, loss, is_baseline(loss), epoch_s=train_s + valid_users * eval_s_per_user,
            fixed_s=TRIAL_START_S + len(splits["test"]) * eval_s_per_user, peak_bytes=measured.peak_bytes,
            train_samples=train_samples, train_epoch_s=train_s, energy_kwh_per_cpu_s=measured.energy_kwh_per_cpu_s))
    fit = fit_budget(methods, base.train.epochs, search.trials_per_tuned, spec.asha_grace_period, slots,
                     spec.budget_s, len(spec.repeat_seeds))
    # the slowest method's trials start first: the makespan estimate (longest first) is then what Tune does,
    # and the longest trials never start last to overrun a budget
    start_order = tuple((m.backbone, m.loss) for m in sorted(methods, key=lambda m: -m.epoch_s))
    notes = []
    if spec.gpus_per_trial > 0 and "cuda" not in devices:
        notes.append("  note: probed on this machine's CPU (no GPU here): trials on GPUs will be faster")
    if spec.workers_per_trial > 1:
        notes.append(f"  note: epoch times are one worker's; {spec.workers_per_trial} workers train an epoch in up to "
                     f"1/{spec.workers_per_trial} of that (validation stays on one; docs/parallelism.md)")
    if "cuda" not in devices and "glibc-cached" in allocators and find_tcmalloc() is None:
        notes.append("  note: tcmalloc is not installed here; with it (Debian/Ubuntu: apt-get install "
                     "libtcmalloc-minimal4) CPU training ran ~1.1x faster than on glibc (benchmarks/RESULTS.md)")
    return Plan(dataset=base.data.dataset, protocol=spec.protocol, precision="/".join(sorted(precisions)), slots=slots,
                methods=methods, asked_epochs=base.train.epochs, asked_trials_per_tuned=search.trials_per_tuned,
                fit=fit, budget_s=spec.budget_s, probes_cached=cached, probes_observed=observed, notes=notes,
                repeat_seeds=spec.repeat_seeds, allocator="/".join(sorted(a for a in allocators if a)),
                threads=threads, workers=spec.workers_per_trial,
                machine_bytes=0 if spec.address else machine_memory_bytes(),
                start_order=start_order,
                side_by_side=side_by_side if observed < len(methods) else 1.0)


def cost_summary(plan: Plan, actual: dict[tuple[str, str], dict[str, float]]) -> str:
    """The end-of-study lines: per method, the plan's estimate next to what its trials recorded.

    Args:
        plan: the plan printed before the study.
        actual: per (backbone, loss), the summed ``cost/*`` of its trials (``seeds.cost_totals``).
    """
    def pair(estimate: float | None, value: float | None, scale: float, digits: int) -> str:
        shown = lambda v: "-" if v is None else f"{v / scale:.{digits}f}"  # noqa: E731
        return f"{shown(estimate)} / {shown(value)}"

    def shown_energy(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    lines = ["cost per method, estimate / actual (estimates are for full-length trials, from a short probe: pruning "
             "and early stopping shorten trials, whole epochs in a worker run slower than the probe):",
             "  method                  wall min       CPU min        peak RSS MB    energy kWh"]
    estimates = plan.cost_estimates()
    for method in sorted(set(estimates) | set(actual)):
        est, got = estimates.get(method, {}), actual.get(method, {})
        lines.append(f"  {'/'.join(method):<23} {pair(est.get('cost/wall_seconds'), got.get('cost/wall_seconds'), 60, 1):<14} "
                     f"{pair(est.get('cost/cpu_seconds'), got.get('cost/cpu_seconds'), 60, 1):<14} "
                     f"{pair(est.get('cost/peak_rss_mb'), got.get('cost/peak_rss_mb'), 1, 0):<14} "
                     f"{shown_energy(est.get('cost/energy_kwh'))} / {shown_energy(got.get('cost/energy_kwh'))}")
    return "\n".join(lines)
