"""Test cases split by what training already holds: memorization against generalization.

A test case is *memorization* when the transition it asks for, the history's last item followed by the target,
occurs in training (some training sample has that last item and that target), and *generalization* when it does
not (arXiv 2603.19809, "How Well Does Generative Recommendation Generalize?": generative models are said to win
the second, item-ID and transition models the first). A second cut: whether the target was a training target at
all (``seen target``) or never (``unseen target``). The labels need no model: the dataset's splits hold them.

The report shows every method's test metrics at 10 (the registry's: ``rank_metrics.AT_10_METRICS``) on each subset beside the training-free baselines,
and each method's difference to the baseline on each subset with the report's intervals (``stats``; Holm over
the methods compared on one subset of one dataset).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..data.transitions import MEMORIZATION_COLUMN, SEEN_TARGET_COLUMN, transition_flags
from ..rank_metrics import AT_10_METRICS, metric_label
from .results import Method, seeds_text
from .stats import Comparison, seeds_comparison, with_holm
from ..data import load_dataset
from .heuristics import HEURISTIC_LABELS, heuristic_per_user

SUBSETS = {"memorization": MEMORIZATION_COLUMN, "generalization": f"~{MEMORIZATION_COLUMN}",
           "seen target": SEEN_TARGET_COLUMN, "unseen target": f"~{SEEN_TARGET_COLUMN}"}


def transition_labels(dataset: Any, split: str = "test") -> pd.DataFrame:
    """(``user``, ``is_memorization``, ``is_seen_target``) per user of ``split``, by item (module doc)."""
    return pd.DataFrame({"user": np.asarray(dataset.user_ids, dtype=object)[dataset.splits[split].users],
                         **transition_flags(dataset.splits, split)})


def stored_labels(tables: list[pd.DataFrame]) -> pd.DataFrame | None:
    """The labels the per-user tables hold (a trial writes them), one row per user; None when any table lacks
    them (written before they existed: the labels then come from the dataset's files)."""
    columns = ["user", MEMORIZATION_COLUMN, SEEN_TARGET_COLUMN]
    if not tables or any(c not in table for table in tables for c in columns[1:]):
        return None
    labels = pd.concat([table[columns] for table in tables]).drop_duplicates("user")
    return labels.astype({MEMORIZATION_COLUMN: bool, SEEN_TARGET_COLUMN: bool}).sort_values("user", kind="stable")


def _mask(labels: pd.DataFrame, subset: str) -> np.ndarray:
    column = SUBSETS[subset]
    return ~labels[column[1:]].to_numpy(bool) if column.startswith("~") else labels[column].to_numpy(bool)


def _on_subset(table: pd.DataFrame, labels: pd.DataFrame, subset: str) -> pd.DataFrame:
    """The rows of a per-user table whose user is in ``subset``, sorted by user."""
    users = labels.loc[_mask(labels, subset), ["user"]]
    return table.merge(users, on="user").sort_values("user", kind="stable")


def subset_difference(method: Method, baseline: Method, labels: pd.DataFrame, subset: str,
                      metric: str = "ndcg_at_10", num_resamples: int = 10_000) -> Comparison | None:
    """``method - baseline`` on the users of ``subset``, over the seeds both have (None without tables)."""
    by_seed = {trial.seed: trial for trial in baseline.trials}
    methods, baselines = [], []
    for trial in method.trials:
        ours = trial.per_user()
        theirs = by_seed[trial.seed].per_user() if trial.seed in by_seed else None
        if ours is None or theirs is None:
            continue
        joined = _on_subset(ours[["user", metric]].merge(theirs[["user", metric]], on="user",
                                                         suffixes=("", "_baseline")), labels, subset)
        if len(joined) < 2:
            return None
        methods.append(joined[metric].to_numpy(float))
        baselines.append(joined[f"{metric}_baseline"].to_numpy(float))
    if not methods:
        return None
    return seeds_comparison(methods, baselines, num_resamples=num_resamples)


def _mean_over_seeds(method: Method, labels: pd.DataFrame, subset: str, metric: str) -> str:
    values = [float(_on_subset(t, labels, subset)[metric].mean()) for t in
              (trial.per_user() for trial in method.trials) if t is not None and metric in t]
    return f"{np.mean(values):.4f}" if values else "-"


def _mean_of(rows: pd.DataFrame, metric: str) -> str:
    return f"{rows[metric].mean():.4f}" if metric in rows else "-"


def subset_table(methods: list[Method], labels: pd.DataFrame, heuristics: dict[str, pd.DataFrame],
                 baseline_loss: str = "ce", num_resamples: int = 10_000) -> list[str]:
    """Markdown rows for one dataset: per subset, its users, the heuristics' and each method's metrics (mean over
    seeds) and each method's N@10 difference to ``baseline_loss`` of its backbone (Holm over one subset)."""
    header = ["subset", "users", "method", "seeds", *map(metric_label, AT_10_METRICS), f"N@10 - {baseline_loss}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for subset in SUBSETS:
        count = int(_mask(labels, subset).sum())
        if count < 2:
            continue  # nothing to average or compare
        for name, table in heuristics.items():
            rows = _on_subset(table, labels, subset)
            means = " | ".join(_mean_of(rows, metric) for metric in AT_10_METRICS)
            lines.append(f"| {subset} | {count} | {name} | - | {means} | |")
        differences: dict[int, Comparison] = {}
        for index, method in enumerate(methods):
            baseline = next((m for m in methods if (m.backbone, m.loss) == (method.backbone, baseline_loss)), None)
            if baseline is not None and method is not baseline:
                found = subset_difference(method, baseline, labels, subset, num_resamples=num_resamples)
                if found is not None:
                    differences[index] = found
        verdicts = [i for i, c in differences.items() if c.has_verdict]
        for i, corrected in zip(verdicts, with_holm([differences[i] for i in verdicts],
                                                    f"N@10 on the {subset} users, one dataset")):
            differences[i] = corrected
        for index, method in enumerate(methods):
            shown = differences[index].text() if index in differences else (
                "baseline" if method.loss == baseline_loss else "-")
            means = " | ".join(_mean_over_seeds(method, labels, subset, metric) for metric in AT_10_METRICS)
            lines.append(f"| {subset} | {count} | {method.backbone}/{method.label} | "
                         f"{seeds_text(method.seeds)} | {means} | {shown} |")
    return lines


def method_labels(tables: list[pd.DataFrame], dataset: Any) -> tuple[pd.DataFrame, str] | None:
    """The labels of the users of per-user ``tables`` and where they came from: the tables' own (``stored_labels``),
    else computed from ``dataset`` (None: not here); None when neither, or the tables hold other users."""
    labels, source = stored_labels(tables), "read from the per-user tables"
    if labels is None:
        if dataset is None:
            return None
        labels, source = transition_labels(dataset), "computed from the dataset's files"
    if not tables or not set(tables[0]["user"]) & set(labels["user"]):
        return None  # tables of other users than these files'
    return labels, source


def subset_sections(methods: list[Method], data_dir: str | None, baseline_loss: str = "ce",
                    num_resamples: int = 10_000) -> list[str]:
    """The report's section: per dataset, :func:`subset_table` with the labels the per-user tables hold (a trial
    writes them), else computed from the dataset's files; the training-free baselines where those files are
    here. Nothing for a dataset with neither."""
    lines: list[str] = []
    for name in sorted({m.dataset.lower() for m in methods}):
        ours = [m for m in methods if m.dataset.lower() == name]
        tables = [t for m in ours for t in (trial.per_user() for trial in m.trials) if t is not None]
        if not tables:
            continue
        try:
            dataset = load_dataset(name, data_dir, allow_download=False)
        except (FileNotFoundError, ValueError):
            dataset = None  # the training-free section already says which datasets are not here
        found = method_labels(tables, dataset)
        if found is None:
            continue
        labels, source = found
        heuristics = {HEURISTIC_LABELS[h]: heuristic_per_user(dataset, h) for h in HEURISTIC_LABELS} \
            if dataset is not None else {}
        note = "" if dataset is not None else " (the training-free baselines need its files: give `--data-dir`)"
        lines += [f"### {name}", "", f"Labels {source}{note}.", "",
                  *subset_table(ours, labels, heuristics, baseline_loss, num_resamples), ""]
    if not lines:
        return []
    return ["## Memorization and generalization (test)", "",
            "A test case is `memorization` when its history's last item followed by its target occurs in training, "
            "`generalization` when it does not; `seen target` / `unseen target`: whether the target was ever a "
            "training target (`apao_ray/data/transitions.py`; a trial writes both labels into its per-user test "
            "table). Differences: intervals as above, Holm over the methods compared on one subset.", "", *lines]
