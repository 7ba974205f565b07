"""The training-free heuristics as the bar every ranking of methods is read against.

On Office the last-item heuristic (``heuristics``) reaches a higher test NDCG@10 than every trained model, so a
table that ranks methods without it ranks them against nothing. Every such table (``report``'s test metrics and
paired differences, the grid, the study's answer table and its MLflow description) lists popularity and the
last-item heuristic beside the methods, with the same metrics on the same test users, and a method whose
per-user test NDCG@10 (its seeds pooled) is below the last-item heuristic's by more than two standard errors of
the difference says so in its verdict (``below the last-item heuristic: ...``; ``within noise of`` when it is
above by less than two), as a method no better than popularity says ``no better than popularity`` (``results``).
"""
from __future__ import annotations

from typing import Any, Iterable

import pandas as pd

from .comparisons import Paired, holm_per_dataset
from .heuristics import HEURISTIC_LABELS, HEURISTICS, heuristic_per_user
from .per_user import PER_USER_METRICS
from .results import Method, pooled_test_values, standing
from .stats import paired_comparison, seeds_comparison
from ..data import load_dataset

BAR_HEURISTIC = "last_item"
BAR_METRIC = "ndcg_at_10"
TRAINING_FREE = "training-free"  # a heuristic's verdict: nothing trained, nothing to converge


def heuristic_tables(dataset: Any) -> dict[str, pd.DataFrame]:
    """Each heuristic's per-user test table on ``dataset``, by heuristic name."""
    return {name: heuristic_per_user(dataset, name) for name in HEURISTICS}


def dataset_heuristics(names: Iterable[str], data_dir: str | None) -> dict[str, dict[str, pd.DataFrame]]:
    """Lower-cased dataset name -> :func:`heuristic_tables`, for the datasets whose files are here (never
    downloaded; the training-free section of a report says which are not)."""
    found: dict[str, dict[str, pd.DataFrame]] = {}
    for name in sorted({n.lower() for n in names}):
        try:
            found[name] = heuristic_tables(load_dataset(name, data_dir, allow_download=False))
        except (FileNotFoundError, ValueError):
            continue
    return found


def bar_words(method: Method, heuristics: dict[str, pd.DataFrame] | None, metric: str = BAR_METRIC) -> str:
    """``below the last-item heuristic: test ndcg_at_10 0.0342 vs 0.0476`` (or ``within noise of``) for a method
    not clearly above the heuristic; ``""`` when it is, or without per-user tables or the heuristic."""
    if not heuristics or BAR_HEURISTIC not in heuristics:
        return ""
    table = heuristics[BAR_HEURISTIC]
    users = set(table["user"])
    if not any(t is not None and set(t["user"]) & users for t in (trial.per_user() for trial in method.trials)):
        return ""  # tables of other users than this dataset's files (another split, other files)
    bar = table[metric].to_numpy(float)
    values = pooled_test_values(method, metric)
    where = standing(values, bar)
    return f"{where} the last-item heuristic: test {metric} {values.mean():.4f} vs {bar.mean():.4f}" if where else ""


def with_bar(verdict: str, words: str) -> str:
    """The verdict with the bar's words added once (a verdict recorded at a study's end may hold them already)."""
    return verdict if not words or words in verdict else f"{verdict}; {words}"


def heuristic_method(dataset: str, backbone: str, name: str) -> Method:
    """A heuristic as a row of a method table: no trials, no seeds."""
    return Method(dataset, backbone, name, HEURISTIC_LABELS[name])


def metric_means(table: pd.DataFrame, metrics: Iterable[str] = PER_USER_METRICS) -> list[float]:
    return [float(table[metric].mean()) for metric in metrics]


def heuristic_paired(methods: list[Method], heuristics: dict[str, dict[str, pd.DataFrame]], baseline_loss: str = "ce",
                     metrics: tuple[str, ...] = PER_USER_METRICS, num_resamples: int = 10_000) -> list[Paired]:
    """Each heuristic against the ``baseline_loss`` method of every (dataset, backbone) whose dataset is in
    ``heuristics``: per baseline seed on the same users (a heuristic is the same every seed, so the spread over
    seeds is the baseline's), with the report's intervals; Holm per (dataset, metric) over these comparisons."""
    results: list[Paired] = []
    for baseline in (m for m in methods if m.loss == baseline_loss and m.dataset.lower() in heuristics):
        for name, table in heuristics[baseline.dataset.lower()].items():
            for metric in metrics:
                per_seed, pairs = {}, []
                for trial in baseline.trials:
                    theirs = trial.per_user()
                    if theirs is None:
                        continue
                    joined = table[["user", metric]].merge(theirs[["user", metric]], on="user",
                                                           suffixes=("", "_baseline")).sort_values("user", kind="stable")
                    if len(joined) < 2:
                        continue
                    ours, base = joined[metric].to_numpy(float), joined[f"{metric}_baseline"].to_numpy(float)
                    per_seed[trial.seed] = paired_comparison(ours, base, num_resamples=num_resamples, seed=trial.seed)
                    pairs.append((ours, base, tuple(joined["user"])))
                if not pairs:
                    continue
                over_seeds = seeds_comparison([p[0] for p in pairs], [p[1] for p in pairs],
                                              num_resamples=num_resamples) if len({p[2] for p in pairs}) == 1 else None
                results.append(Paired(heuristic_method(baseline.dataset, baseline.backbone, name), baseline, metric,
                                      over_seeds, per_seed))
    holm_per_dataset(results)
    return results

