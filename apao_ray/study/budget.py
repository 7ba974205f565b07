"""The study's wall-clock arithmetic: durations, per-method costs, makespans and the fit of a study
to a budget (fewer epochs first, down to half, then fewer trials per tuned method, then fewer epochs
again, and last a fixed random subset of the training samples, the same for every method). Pure,
unit-tested; :mod:`.plan` measures the costs and prints the result.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

# fixed costs the probe does not see (measured on this 2-CPU machine while loaded: rough)
RAY_START_S = 10.0        # ray.init of a local cluster
TRIAL_START_S = 10.0      # a trial actor's start + torch import + end: 7.0 s (bench_trial_overhead.py) + data load
MIN_TRAIN_SAMPLES = 1024  # the smallest training subset a budget may cut an epoch to
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


@dataclass(frozen=True)
class MethodCost:
    """The cost of one (backbone, loss): seconds per epoch and per trial outside epochs, peak memory;
    ``train_samples`` and ``train_epoch_s``: the epoch's training samples and their share of ``epoch_s``
    (0: unknown, the epoch cannot be cut to a subset)."""

    backbone: str
    loss: str
    is_baseline: bool
    epoch_s: float
    fixed_s: float
    peak_bytes: int = 0
    train_samples: int = 0
    train_epoch_s: float = 0.0
    energy_kwh_per_cpu_s: float | None = None  # measured by earlier trials of this method here (plan.record_observed)

    def trial_s(self, epochs: int) -> float:
        return self.fixed_s + epochs * self.epoch_s

    def with_train_samples(self, samples: int | None) -> "MethodCost":
        """The cost with an epoch cut to ``samples`` training samples (None or all: unchanged)."""
        if samples is None or not self.train_samples or samples >= self.train_samples:
            return self
        saved = self.train_epoch_s * (1 - samples / self.train_samples)
        return replace(self, epoch_s=self.epoch_s - saved, train_samples=samples,
                       train_epoch_s=self.train_epoch_s - saved)


def makespan(durations: list[float], slots: int) -> float:
    """Wall time of running ``durations`` on ``slots`` parallel slots, longest first, each to the
    slot that frees first (what Tune does with a fixed trial order, to within the longest trial)."""
    ends = [0.0] * max(1, slots)
    for duration in sorted(durations, reverse=True):
        ends[ends.index(min(ends))] += duration
    return max(ends)


def trial_durations(methods: list[MethodCost], epochs: int, trials_per_tuned: int) -> list[float]:
    return [m.trial_s(epochs) for m in methods for _ in range(1 if m.is_baseline else trials_per_tuned)]


def study_seconds(methods: list[MethodCost], epochs: int, trials_per_tuned: int, slots: int,
                  num_repeats: int = 0) -> float:
    """Ray's start, the search, then (``--seeds``) ``num_repeats`` trials per method at full length: the
    repeat phase starts when the search has ended."""
    repeats = [m.trial_s(epochs) for m in methods for _ in range(num_repeats)]
    return RAY_START_S + makespan(trial_durations(methods, epochs, trials_per_tuned), slots) + makespan(repeats, slots)


def asha_rungs(grace: int, epochs: int, reduction_factor: int = 4) -> list[int]:
    """Epochs at which ASHA compares a method's trials (grace * rf^k below the last epoch)."""
    rungs, rung = [], grace
    while rung < epochs:
        rungs.append(rung)
        rung *= reduction_factor
    return rungs


@dataclass(frozen=True)
class Fit:
    """What a study runs: the asked-for schedule, or the one fitted to a budget."""

    epochs: int
    trials_per_tuned: int
    asha_grace_period: int
    estimate_s: float
    changes: tuple[str, ...] = ()   # e.g. "epochs 20 -> 8": empty when nothing had to change
    train_samples: int | None = None  # a training subset per epoch (the last resort of a budget); None: all


def fit_budget(methods: list[MethodCost], epochs: int, trials_per_tuned: int, grace: int, slots: int,
               budget_s: float | None, num_repeats: int = 0) -> Fit:
    """The largest schedule whose estimate fits ``budget_s``.

    Order of sacrifice: epochs down to half the asked number, then trials per tuned method down to 1
    (each at the most epochs in [half, all] that fit), then epochs down to 1, then the training samples
    of that epoch down to ``MIN_TRAIN_SAMPLES`` (the largest fixed subset that fits, the same for every
    method, so they stay comparable). ASHA's grace period becomes a quarter of the fitted epochs (at
    most the asked one), so its rungs stay inside the run.

    Raises:
        ValueError: when one epoch of the smallest subset does not fit, naming the estimate and the
            slowest method.
    """
    asked = study_seconds(methods, epochs, trials_per_tuned, slots, num_repeats)
    if budget_s is None or asked <= budget_s:
        return Fit(epochs, trials_per_tuned, grace, asked)
    half = max(1, math.ceil(epochs / 2))
    candidates = [(n, e) for n in range(trials_per_tuned, 0, -1) for e in range(epochs, half - 1, -1)]
    candidates += [(1, e) for e in range(half - 1, 0, -1)]

    def fitted(e: int, n: int, estimate: float, samples: int | None = None) -> Fit:
        # a grace past the last epoch (--quick) means no pruning: kept so
        new_grace = e + 1 if grace > epochs else min(grace, max(1, e // 4))
        changes = [f"{label} {before} -> {after}" for label, before, after in (
            ("epochs", epochs, e), ("trials per tuned method", trials_per_tuned, n),
            ("ASHA grace period", grace, new_grace)) if before != after]
        if samples is not None:
            changes.append(f"training samples per epoch {methods[0].train_samples:,} -> {samples:,} (a fixed random "
                           "subset, the same for every method: not the paper's protocol)")
        return Fit(e, n, new_grace, estimate, tuple(changes), samples)

    for n, e in candidates:
        estimate = study_seconds(methods, e, n, slots, num_repeats)
        if estimate <= budget_s:
            return fitted(e, n, estimate)
    samples = largest_subset(methods, slots, budget_s, num_repeats)
    if samples is not None:
        capped = [m.with_train_samples(samples) for m in methods]
        return fitted(1, 1, study_seconds(capped, 1, 1, slots, num_repeats), samples)
    smallest = study_seconds([m.with_train_samples(MIN_TRAIN_SAMPLES) for m in methods], 1, 1, slots, num_repeats)
    slowest = max(methods, key=lambda m: m.epoch_s)
    subset = f" on {MIN_TRAIN_SAMPLES:,} training samples" if any(m.train_samples > MIN_TRAIN_SAMPLES for m in methods) else ""
    raise ValueError(f"budget {format_duration(budget_s)} is too small for one epoch: one trial per method for one "
                     f"epoch{subset} is estimated at {format_duration(smallest)} on this machine; give --budget "
                     f"{math.ceil(smallest / 60)}m or more, or a smaller study (--quick, or leave out the slowest "
                     f"method, {slowest.backbone}/{slowest.loss} at ~{format_duration(slowest.epoch_s)} per full epoch)")


def largest_subset(methods: list[MethodCost], slots: int, budget_s: float, num_repeats: int = 0) -> int | None:
    """The most training samples per epoch (a multiple of 256, >= ``MIN_TRAIN_SAMPLES``) with which one
    epoch of one trial per method fits ``budget_s``; None when even the smallest does not fit."""
    total = min(m.train_samples for m in methods)
    if total <= MIN_TRAIN_SAMPLES:
        return None

    def fits(samples: int) -> bool:
        return study_seconds([m.with_train_samples(samples) for m in methods], 1, 1, slots, num_repeats) <= budget_s

    low, high = MIN_TRAIN_SAMPLES // 256, total // 256   # in units of 256 samples; fits(low) decides
    if not fits(low * 256):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * 256) else (low, middle - 1)
    return low * 256
