"""The study's wall-clock arithmetic: durations, per-method costs, makespans and the fit of a study
to a budget, whose goal is a comparison at equal epochs (``fit_budget``: which methods run, how many
epochs and trials, which are deferred, whether the budget protocol's batch applies). Pure, unit-tested;
:mod:`.plan` measures the costs and prints the result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..spec.duration import format_duration

# fixed costs the probe does not see (measured on this 2-CPU machine while loaded: rough)
RAY_START_S = 10.0        # ray.init of a local cluster
TRIAL_START_S = 10.0      # a trial actor's start + torch import + end: 7.0 s (bench_trial_overhead.py) + data load
MIN_TRAIN_SAMPLES = 1024  # the smallest training subset a budget may cut an epoch to
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
    fixed: bool = False  # a tuned loss whose every knob the study fixes (a range of one value): nothing to search

    @property
    def searched(self) -> bool:
        """Whether the method's knobs are searched (it takes the trials per tuned method; else one trial)."""
        return not (self.is_baseline or self.fixed)

    def trials(self, trials_per_tuned: int) -> int:
        return trials_per_tuned if self.searched else 1

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
    return [m.trial_s(epochs) for m in methods for _ in range(m.trials(trials_per_tuned))]


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


DEFAULT_MIN_EPOCHS = 3      # the fewest epochs a fitted trial runs: one epoch compares nothing
HEAVY_CUT = 4               # fitted passes over the data <= asked epochs / 4: the budget protocol's batch
BUDGET_EFFECTIVE_BATCH = 256  # learns several times faster per epoch than 1024 (benchmarks/REPRODUCTION.md)
FILL_MAX_SEEDS = 3          # seeds a fill may reach in all (the product's budget evidence used 3)


@dataclass(frozen=True)
class Deferral:
    """A method left out of a fitted study: one trial of ``min_epochs`` does not fit the budget."""

    backbone: str
    loss: str
    needs_s: float   # one trial of min_epochs alone, Ray's start included
    epoch_s: float
    min_epochs: int

    @property
    def reason(self) -> str:
        return (f"deferred: needs ~{format_duration(self.needs_s)} here (~{format_duration(self.epoch_s)} per epoch) "
                f"for one trial of {self.min_epochs} epochs; run --backbones {self.backbone} --losses {self.loss} "
                f"--budget {budget_flag(self.needs_s)}, or on a GPU")


def budget_flag(seconds: float) -> str:
    """The ``--budget`` value that covers ``seconds``: whole minutes under 2 h, else whole hours."""
    return f"{math.ceil(seconds / 60)}m" if seconds < 7200 else f"{math.ceil(seconds / 3600)}h"


@dataclass(frozen=True)
class Fit:
    """What a study runs: the asked-for schedule, or the one fitted to a budget."""

    epochs: int
    trials_per_tuned: int
    asha_grace_period: int
    estimate_s: float
    changes: tuple[str, ...] = ()   # e.g. "epochs 20 -> 8": empty when nothing had to change
    train_samples: int | None = None  # a training subset per epoch (the last resort of a budget); None: all
    deferred: tuple[Deferral, ...] = ()  # methods left out: rows without trials
    added_seeds: int = 0  # seeds the fill added after the asked ones (time a slot would sit idle)
    effective_batch_size: int | None = None  # the budget protocol's optimizer batch; None: as asked


def fit_budget(methods: list[MethodCost], epochs: int, trials_per_tuned: int, grace: int, slots: int,
               budget_s: float | None, num_repeats: int = 0, min_epochs: int = DEFAULT_MIN_EPOCHS,
               effective_batch_size: int | None = None, micro_batch: int = 1) -> Fit:
    """The study that answers most within ``budget_s``: its methods compared at equal epochs.

    A study that fits is left as asked. Otherwise the methods whose one trial of ``min_epochs`` (or the
    asked epochs, if fewer) does not fit beside the cheaper ones are deferred (cheapest kept first; when
    fewer than two remain, a fixed random training subset, the same for every method, may keep two). For
    the kept methods: epochs down to half the asked number, then trials per tuned method down to 1, then
    epochs down to ``min_epochs``. Time a slot would then sit idle goes to more Optuna trials (up to the
    asked number), then to more seeds (up to ``FILL_MAX_SEEDS``), then to more trials. When the fitted
    passes over the data are at most a ``HEAVY_CUT``-th of the asked epochs, the optimizer batch drops to
    ``BUDGET_EFFECTIVE_BATCH`` (not below ``micro_batch``): the budget protocol. ASHA's grace period becomes
    a quarter of the fitted epochs (at most the asked one), so its rungs stay inside the run.

    Raises:
        ValueError: when not one method's trial of ``min_epochs`` fits, even on the smallest subset.
    """
    asked = study_seconds(methods, epochs, trials_per_tuned, slots, num_repeats)
    if budget_s is None or asked <= budget_s:
        return Fit(epochs, trials_per_tuned, grace, asked)
    floor = max(1, min(min_epochs, epochs))
    kept, samples = _kept_methods(methods, floor, slots, budget_s, num_repeats)
    capped = [m.with_train_samples(samples) for m in kept]
    half = max(floor, math.ceil(epochs / 2))
    candidates = [(n, e) for n in range(trials_per_tuned, 0, -1) for e in range(epochs, half - 1, -1)]
    candidates += [(1, e) for e in range(half - 1, floor - 1, -1)]
    trials, fitted_epochs = next((n, e) for n, e in candidates
                                 if study_seconds(capped, e, n, slots, num_repeats) <= budget_s)
    trials, added = _fill(capped, fitted_epochs, trials, trials_per_tuned, slots, budget_s, num_repeats)
    new_grace = fitted_epochs + 1 if grace > epochs else min(grace, max(1, fitted_epochs // 4))
    changes = [f"{label} {before} -> {after}" for label, before, after in (
        ("epochs", epochs, fitted_epochs), ("trials per tuned method", trials_per_tuned, trials),
        ("ASHA grace period", grace, new_grace)) if before != after]
    if added:
        changes.append(f"seeds {1 + num_repeats} -> {1 + num_repeats + added} (time a slot would sit idle)")
    if samples is not None:
        changes.append(f"training samples per epoch {methods[0].train_samples:,} -> {samples:,} (a fixed random "
                       "subset, the same for every method: not the paper's protocol)")
    passes = fitted_epochs * (samples / kept[0].train_samples if samples else 1.0)
    budget_batch = max(BUDGET_EFFECTIVE_BATCH, micro_batch)
    protocol_batch = None
    if effective_batch_size and budget_batch < effective_batch_size and passes * HEAVY_CUT <= epochs:
        protocol_batch = budget_batch
        changes.append(f"effective batch {effective_batch_size} -> {budget_batch} (budget protocol, not the paper's: "
                       "a short run learns several times faster per epoch at 256; benchmarks/REPRODUCTION.md)")
    deferred = tuple(Deferral(m.backbone, m.loss, RAY_START_S + m.trial_s(floor), m.epoch_s, floor)
                     for m in methods if m not in kept)
    estimate = study_seconds(capped, fitted_epochs, trials, slots, num_repeats + added)
    return Fit(fitted_epochs, trials, new_grace, estimate, tuple(changes), samples, deferred, added, protocol_batch)


def _kept_methods(methods: list[MethodCost], epochs: int, slots: int, budget_s: float,
                  num_repeats: int) -> tuple[list[MethodCost], int | None]:
    """The largest cheapest-first set of methods whose one trial each of ``epochs`` fits, and the training
    subset it needs (None: all samples). Two methods on a subset beat one on all the data: a comparison.

    Raises:
        ValueError: not even the cheapest method's trial fits on ``MIN_TRAIN_SAMPLES``.
    """
    by_cost = sorted(methods, key=lambda m: m.trial_s(epochs))

    def how_many(costs: list[MethodCost]) -> int:
        return next((k for k in range(len(costs), 0, -1)
                     if study_seconds(costs[:k], epochs, 1, slots, num_repeats) <= budget_s), 0)

    count = how_many(by_cost)
    for wanted in range(min(2, len(methods)), count, -1):  # two on a subset, else one on all the data or a subset
        samples = largest_subset(by_cost[:wanted], slots, budget_s, num_repeats, epochs)
        if samples is not None:
            return by_cost[:how_many([m.with_train_samples(samples) for m in by_cost])], samples
    if count:
        return by_cost[:count], None
    cheapest = by_cost[0]
    smallest = study_seconds([cheapest.with_train_samples(MIN_TRAIN_SAMPLES)], epochs, 1, slots, num_repeats)
    subset = f" on {MIN_TRAIN_SAMPLES:,} training samples" if cheapest.train_samples > MIN_TRAIN_SAMPLES else ""
    raise ValueError(f"budget {format_duration(budget_s)} is too small for {epochs} epoch{'s' if epochs > 1 else ''} of "
                     f"any method: one trial of the cheapest, {cheapest.backbone}/{cheapest.loss}{subset}, is estimated "
                     f"at {format_duration(smallest)} on this machine; give --budget {math.ceil(smallest / 60)}m or "
                     "more, fewer --min-epochs, or a smaller study (--quick)")


def _fill(methods: list[MethodCost], epochs: int, trials: int, asked_trials: int, slots: int, budget_s: float,
          num_repeats: int) -> tuple[int, int]:
    """(trials per tuned method, seeds added) once the time a slot would sit idle is used: more Optuna trials
    up to the asked number answer the asked search, then seeds the comparison's spread, then more search."""
    has_tuned, added = any(m.searched for m in methods), 0
    while True:
        options = []
        if has_tuned and trials < asked_trials:
            options.append((trials + 1, added))
        if 1 + num_repeats + added < FILL_MAX_SEEDS:
            options.append((trials, added + 1))
        if has_tuned:
            options.append((trials + 1, added))
        chosen = next(((n, a) for n, a in options
                       if study_seconds(methods, epochs, n, slots, num_repeats + a) <= budget_s), None)
        if chosen is None:
            return trials, added
        trials, added = chosen


def largest_subset(methods: list[MethodCost], slots: int, budget_s: float, num_repeats: int = 0,
                   epochs: int = 1) -> int | None:
    """The most training samples per epoch (a multiple of 256, >= ``MIN_TRAIN_SAMPLES``) with which
    ``epochs`` of one trial per method fit ``budget_s``; None when even the smallest does not fit."""
    total = min(m.train_samples for m in methods)
    if total <= MIN_TRAIN_SAMPLES:
        return None

    def fits(samples: int) -> bool:
        return study_seconds([m.with_train_samples(samples) for m in methods], epochs, 1, slots, num_repeats) <= budget_s

    low, high = MIN_TRAIN_SAMPLES // 256, total // 256   # in units of 256 samples; fits(low) decides
    if not fits(low * 256):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * 256) else (low, middle - 1)
    return low * 256
