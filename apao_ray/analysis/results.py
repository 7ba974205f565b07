"""Finished trials of several studies, grouped into methods with their seeds (what the report shows).

A method is (dataset, backbone, loss, knobs); its seeds are the trials of that method across the
given studies (one study per seed) and, in a study run with ``--seeds``, the repeats of its best
configuration on the other seeds. Their paired comparisons: ``comparisons``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, TypeVar

import numpy as np
import pandas as pd

from ..names import CONVERGED_TAG, REPEATS_TAG, counted
from ..protocol import Selection
from .export import StudyExport
from .outcome import Outcome, best_trial
from .paper import table1
from ..rank_metrics import PER_USER_METRICS

# shown beside a trial without test metrics (how far its validation got); never what picks the best (Selection)
SELECTION_METRIC = "best/val/ndcg_at_10"
T = TypeVar("T")
# how a method's label abbreviates the paper's knobs (first, in this order); any other knob goes by its name
KNOB_LABELS = {"beta": "b", "eta": "eta", "num_negatives": "N"}
CHOICES = ("backbone", "loss")  # a trial's choices that are not knobs


def recorded_knobs(params: dict[str, str]) -> dict[str, str]:
    """The knobs a child run recorded, as text: every choice param besides backbone and loss (its params are its
    choices and the ``base.*`` config), whatever loss registry is loaded."""
    return {k: v for k, v in params.items() if "." not in k and k not in CHOICES and v != "None"}
TEST_METRICS = tuple(f"test/{name}" for name in PER_USER_METRICS)
TRIAL_CHOICES = ("best", "all")
VALIDATION_CURVE = "val/ndcg_at_10"
# a validation curve whose last epoch still added more than this share of its value has not levelled off: a
# short budget's run (on 2026-11-25 five epochs at batch 1024 moved validation NDCG@10 by ~10% an epoch) is early
# learning, not a converged model
STEEP_LAST_GAIN = 0.10
EARLY_LEARNING = "early learning (not converged)"
# the two reasons a method has not converged, each in its own words (docs/results.md, "converged")
STILL_RISING = "still rising"  # its validation curve had not levelled off when training ended
NO_BETTER_THAN_POPULARITY = "no better than popularity"  # its test metric is not clearly above popularity's
ONE_EPOCH = "one epoch only"  # a single validation epoch: no slope to read
NOT_CONVERGED = (STILL_RISING, NO_BETTER_THAN_POPULARITY, ONE_EPOCH, "not converged")  # the last: older studies' tags


def convergence(curve: list[float]) -> str:
    """``converged``, ``still rising: ...`` or ``one epoch only: ...`` for a validation curve (one value per epoch,
    in order): one epoch shows no slope; a last epoch that added more than ``STEEP_LAST_GAIN`` of the value was
    still rising steeply."""
    if not curve:
        return "unknown: no validation curve"
    if len(curve) < 2:
        return f"{ONE_EPOCH}: 1 validation epoch, no slope to read"
    last, before = curve[-1], curve[-2]
    gain = (last - before) / last if last > 0 else 0.0
    if gain > STEEP_LAST_GAIN:
        return f"{STILL_RISING}: {VALIDATION_CURVE} +{gain:.0%} at its last epoch ({len(curve)})"
    return "converged"


def joined_verdicts(verdicts: Iterable[str]) -> str:
    """``converged`` when every verdict is, else each distinct reason once, ``; ``-joined (a method can be still
    rising and no better than popularity at once)."""
    parts = [part for verdict in verdicts for part in verdict.split("; ") if part != "converged"]
    return "; ".join(dict.fromkeys(parts)) or "converged"


def pooled_test_values(method: "Method", metric: str = "ndcg_at_10") -> np.ndarray:
    """The method's per-user test ``metric``, its seeds' tables pooled (empty without per-user tables)."""
    tables = [t for t in (trial.per_user() for trial in method.trials) if t is not None and metric in t]
    return np.concatenate([t[metric].to_numpy(float) for t in tables]) if tables else np.array([])


def standing(values: np.ndarray, other: np.ndarray) -> str:
    """``below`` / ``within noise of`` when ``values``' mean is under ``other``'s by more than two standard errors
    of the difference / above it by less than two; ``""`` when clearly above (or too few values to say)."""
    if values.size < 2 or other.size < 2:
        return ""
    error = math.sqrt(values.var(ddof=1) / values.size + other.var(ddof=1) / other.size)
    gap = values.mean() - other.mean()
    if gap < 2 * error:
        return "below" if gap < -2 * error else "within noise of"
    return ""


def popularity_check(method: "Method", popularity: np.ndarray, metric: str = "ndcg_at_10") -> str:
    """``no better than popularity: ...`` when the method's per-user test ``metric`` (its seeds pooled) is above the
    popularity baseline's by less than two standard errors of the difference ("within noise of" it, or "below" it
    by more than two), else ``""`` (also without per-user tables)."""
    values = pooled_test_values(method, metric)
    where = standing(values, popularity)
    if where:
        return f"{NO_BETTER_THAN_POPULARITY}: test {metric} {values.mean():.4f} {where} popularity's {popularity.mean():.4f}"
    return ""


def is_early_learning(*statuses: str) -> bool:
    """Whether a comparison involves a method that had not converged (its figure is one of early learning)."""
    return any(status.startswith(NOT_CONVERGED) for status in statuses)


@dataclass
class Trial(Outcome):
    """A trial of a study export: how it ended and what it measured (``Outcome``), its choices and its curves."""

    export: StudyExport
    record: dict[str, Any]

    @property
    def params(self) -> dict[str, str]:
        return self.record["params"]

    @property
    def run_id(self) -> str:
        return self.record["run_id"]

    @property
    def seed(self) -> int:
        return int(float(self.params.get("base.train.seed", 0)))

    @property
    def dataset(self) -> str:
        return self.params.get("base.data.dataset") or self.tags.get("dataset", "?")

    @property
    def backbone(self) -> str:
        return self.tags.get("backbone") or self.params.get("backbone", "?")

    @property
    def loss(self) -> str:
        return self.tags.get("loss") or self.params.get("loss", "?")

    @property
    def knobs(self) -> dict[str, float]:
        """The knobs the trial ran with, as its run recorded them (``recorded_knobs``)."""
        return {k: float(v) for k, v in recorded_knobs(self.params).items()}

    @property
    def method(self) -> str:
        """``loss`` and its knobs, e.g. ``apao_pointwise b=0.3 eta=0.0001``, ``focal gamma=2``: trials that differ
        in any knob are different methods."""
        return " ".join(filter(None, [self.loss, knobs_label(self.knobs)]))

    def history(self, key: str) -> pd.Series:
        return self.export.history(self.run_id, key)

    def per_user(self, split: str = "test") -> pd.DataFrame | None:
        return self.export.per_user(self.record, split)


@dataclass
class Method:
    dataset: str
    backbone: str
    loss: str
    label: str
    trials: list[Trial] = field(default_factory=list)  # one per seed, sorted by seed

    @property
    def seeds(self) -> list[int]:
        return [trial.seed for trial in self.trials]

    def values(self, key: str) -> list[float]:
        return [trial.metrics[key] for trial in self.trials if key in trial.metrics]

    def mean_std(self, key: str) -> tuple[float, float] | None:
        values = self.values(key)
        if not values:
            return None
        return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")

    def tag_values(self, key: str, default: str = "?") -> str:
        return ", ".join(sorted({trial.tags.get(key, default) for trial in self.trials}))

    @property
    def is_paper_protocol(self) -> bool:
        """Trained as paper Table 1 was: protocol ``paper`` and the paper's schedule (200 epochs, patience 20)."""
        return all(trial.tags.get("apao.protocol", "paper") == "paper" and trial.tags.get("apao.schedule") == "paper"
                   for trial in self.trials)

    @property
    def convergence(self) -> str:
        """Over its seeds: every reason it had not converged (``joined_verdicts``) among the verdicts its study's end
        recorded (``CONVERGED_TAG``, which also compared it with popularity) and its trials' validation curves."""
        recorded = [trial.tags[CONVERGED_TAG] for trial in self.trials if trial.tags.get(CONVERGED_TAG)]
        curves = [convergence(list(trial.history(VALIDATION_CURVE).sort_index())) for trial in self.trials]
        return joined_verdicts(recorded + curves)

    @property
    def paper(self) -> tuple[float, float] | None:
        return table1(self.dataset, self.backbone, self.loss)


def seeds_text(seeds: str | Iterable[int], count: int | None = None) -> str:
    """``7 (1 seed)``, ``0,1,2 (3 seeds)``: which seeds and how many (a bare ``7`` reads as a count); ``count``
    where it differs from the seeds listed (a seed trained twice), ``-`` for none."""
    listed = seeds if isinstance(seeds, str) else ",".join(map(str, seeds))
    if not listed:
        return "-"
    count = count or len(listed.split(","))
    return f"{listed} ({counted(count, 'seed')})"


def knobs_label(knobs: dict[str, float]) -> str:
    """``b=0.3 eta=0.0001 N=100``: the paper's knobs first (``KNOB_LABELS``), then any other by name, 3 digits."""
    order = [*(k for k in KNOB_LABELS if k in knobs), *sorted(set(knobs) - set(KNOB_LABELS))]
    return " ".join(f"{KNOB_LABELS.get(k, k)}={_knob_text(float(knobs[k]))}" for k in order)


def _knob_text(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) >= 1 else f"{value:.3g}"


def unknown_knobs(trials: list[Trial]) -> dict[str, list[str]]:
    """Per loss, the knobs its trials recorded that no loss loaded here declares (a plugin not imported): they
    still label and group the methods, but nothing here knows their ranges or meaning."""
    from ..losses import LOSSES  # lazy: the registry imports torch

    declared = {k.name for loss in LOSSES.values() for k in loss.knobs}
    unknown: dict[str, set[str]] = {}
    for trial in trials:
        missing = set(trial.knobs) - declared
        if missing or (trial.loss not in LOSSES and trial.knobs):
            unknown.setdefault(trial.loss, set()).update(missing or trial.knobs)
    return {loss: sorted(names) for loss, names in sorted(unknown.items())}


def selection_of(export: Any) -> Selection:
    """The selection a study recorded (``StudyExport.selection``; the default for a source that recorded none)."""
    return getattr(export, "selection", None) or Selection()


def finished_trials(exports: list[StudyExport], which: str = "best") -> list[Trial]:
    """Finished, tested trials; with ``best`` only the best per (study, backbone, loss) by that study's selection
    (``protocol.Selection``, recorded with the study)."""
    if which not in TRIAL_CHOICES:
        raise ValueError(f"unknown trial selection {which!r}; choose from {list(TRIAL_CHOICES)}")
    trials = [trial for export in exports for trial in (Trial(export, record) for record in export.trials)
              if trial.finished]
    if which == "all":
        return trials
    groups: dict[tuple[str, str, str], list[Trial]] = {}
    for trial in trials:  # a repeat on another seed is not a candidate: its configuration's trial is
        if not trial.is_repeat:
            groups.setdefault((trial.export.name, trial.backbone, trial.loss), []).append(trial)
    best = [best_trial(group, selection_of(group[0].export), lambda t: t.record) for group in groups.values()]
    return with_repeats(best, trials)


def with_repeats(chosen: list[Trial], trials: list[Trial]) -> list[Trial]:
    """The chosen trials, each followed by the finished repeats of its configuration on other seeds
    (``--seeds``: tag ``apao.repeats`` = the chosen trial's run id)."""
    repeats: dict[str, list[Trial]] = {}
    for trial in trials:
        if trial.tags.get(REPEATS_TAG):
            repeats.setdefault(trial.tags[REPEATS_TAG], []).append(trial)
    return [each for trial in chosen for each in [trial, *sorted(repeats.get(trial.run_id, []), key=lambda t: t.seed)]]


def unfinished_trials(exports: list[StudyExport]) -> list[Trial]:
    """Trials that trained at least one epoch but have no test metrics (still running, interrupted,
    pruned or failed): the report shows how far their validation curves got."""
    return [Trial(export, record) for export in exports for record in export.trials
            if not Outcome(record).finished and "val/ndcg_at_10" in record["metrics"]]


def group_methods(trials: list[Trial]) -> list[Method]:
    """Trials grouped by (dataset, backbone, method); two trials of one method with the same seed
    (the same configuration run twice) both stay, the later study's second."""
    methods: dict[tuple[str, str, str], Method] = {}
    for trial in trials:
        key = (trial.dataset, trial.backbone, trial.method)
        methods.setdefault(key, Method(trial.dataset, trial.backbone, trial.loss, trial.method)).trials.append(trial)
    for method in methods.values():
        method.trials.sort(key=lambda t: t.seed)
    return sorted(methods.values(), key=lambda m: (m.dataset, m.backbone, m.loss != "ce", m.label))


def prefix_keys(metrics: dict[str, float], split: str = "test") -> list[str]:
    """``{split}/prefix_recall_at_{K}_m{m}`` keys in order of m."""
    pattern = re.compile(rf"^{split}/prefix_recall_at_\d+_m(\d+)$")
    return sorted((k for k in metrics if pattern.match(k)), key=lambda k: int(pattern.match(k).group(1)))
