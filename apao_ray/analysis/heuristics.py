"""Training-free baselines, scored by the metric code on the same test users as a trained model.

A model generates semantic IDs and is scored on the target's semantic ID (a generated ID equal to the target's is
a hit, SPEC §1), so the heuristics count and rank semantic IDs too; with no code collisions that is the same as
items. Both read only the training split: its targets are every training position's next item.

* ``popularity``: the K semantic IDs most often a training target, the same list for every user.
* ``last_item``: the semantic IDs that most often followed the user's last item in training (the last item of
  the test history, i.e. the validation target), most frequent first, ties broken by popularity, then by id;
  filled up with the popularity list when the last item has fewer than K successors (or none). The training-free
  heuristic of the sequential-recommendation audit (arXiv 2605.07125) built on the last item alone.
"""
from __future__ import annotations

from typing import Any, Callable
import json

import numpy as np
import pandas as pd

from ..rank_metrics import PER_USER_CUTOFFS, PER_USER_METRICS, metric_label, rank_metric_values
from .paper import field_table
from ..data import load_dataset

HEURISTIC_CUTOFF = max(PER_USER_CUTOFFS)  # the longest list a per-user metric reads (at 20)


def popularity_order(sem_targets: np.ndarray, num_sem: int) -> np.ndarray:
    """(U,) every semantic ID, most often a training target first (ties: lower id first)."""
    return np.argsort(-np.bincount(sem_targets, minlength=num_sem), kind="stable")


def popularity_ranking(splits: dict[str, Any], item_sem: np.ndarray, split: str = "test",
                       k: int = HEURISTIC_CUTOFF) -> np.ndarray:
    """(S, k) semantic IDs: the popularity list for every user of ``split``."""
    top = popularity_order(item_sem[splits["train"].targets], int(item_sem.max()) + 1)[:k]
    return np.tile(top, (len(splits[split]), 1))


def last_item_ranking(splits: dict[str, Any], item_sem: np.ndarray, split: str = "test",
                      k: int = HEURISTIC_CUTOFF) -> np.ndarray:
    """(S, k) semantic IDs: the successors of each user's last item in training, then popularity (module doc)."""
    train, evaluated = splits["train"], splits[split]
    num_sem = int(item_sem.max()) + 1
    counts = np.bincount(item_sem[train.targets], minlength=num_sem)
    popular = np.argsort(-counts, kind="stable")[:k]                          # popularity_order, from these counts
    has_previous = train.histories[:, -1] >= 0                               # every training sample has one
    previous = item_sem[train.histories[has_previous, -1]]                    # (P,)
    following = item_sem[train.targets[has_previous]]                         # (P,)
    pairs, pair_counts = np.unique(previous * num_sem + following, return_counts=True)
    after, succ = pairs // num_sem, pairs % num_sem                           # grouped by ``after``, ascending
    # within each previous ID: most frequent successor first, then the more popular, then the lower id
    order = np.lexsort((succ, -counts[succ], -pair_counts, after))
    after, succ = after[order], succ[order]
    starts = np.searchsorted(after, np.arange(num_sem), side="left")
    ends = np.searchsorted(after, np.arange(num_sem), side="right")

    lists: dict[int, np.ndarray] = {}

    def ranked_after(sem: int) -> np.ndarray:
        if sem not in lists:
            successors = succ[starts[sem]:min(ends[sem], starts[sem] + k)]
            backfill = popular[~np.isin(popular, successors)][:k - len(successors)]
            lists[sem] = np.concatenate([successors, backfill])
        return lists[sem]

    last = evaluated.histories[:, -1]
    return np.stack([ranked_after(int(item_sem[item])) if item >= 0 else popular for item in last])


HEURISTICS: dict[str, Callable[..., np.ndarray]] = {"popularity": popularity_ranking, "last_item": last_item_ranking}
HEURISTIC_LABELS = {"popularity": "popularity (training-free)", "last_item": "last-item transitions (training-free)"}


def heuristic_per_user(dataset: Any, name: str, split: str = "test") -> pd.DataFrame:
    """The per-user table (``user``, ``rank``, each of ``PER_USER_METRICS``) of heuristic ``name`` on ``split``,
    one row per user sorted by user index, as a trained model's ``per_user_test.csv.gz``."""
    from ..metrics import target_ranks  # lazy: metrics imports torch

    if name not in HEURISTICS:
        raise ValueError(f"unknown training-free baseline {name!r}; choose from {sorted(HEURISTICS)}")
    item_sem = dataset.catalog.item_sem
    evaluated = dataset.splits[split]
    ranked = HEURISTICS[name](dataset.splits, item_sem, split)                # (S, k)
    ranks = target_ranks(ranked, item_sem[evaluated.targets])                 # (S,)
    order = np.argsort(evaluated.users, kind="stable")
    ranks = ranks[order]
    table: dict[str, Any] = {"user": np.asarray(dataset.user_ids, dtype=object)[evaluated.users[order]],
                             "rank": np.where(ranks.numpy() > 0, ranks.numpy(), -1)}
    table.update(rank_metric_values(ranks, PER_USER_CUTOFFS))  # every registered metric, as a trained model's
    return pd.DataFrame(table)


def recorded_datasets(exports: list[Any]) -> dict[str, dict[str, str] | None]:
    """Dataset name -> the file checksums the exports' studies recorded (their parent runs' ``dataset_checksums``
    tag; None where none did), for ``training_free_table``; every trial's dataset is named."""
    found: dict[str, dict[str, str] | None] = {}
    for export in exports:
        for trial in export.trials:
            name = trial.get("params", {}).get("base.data.dataset") or trial.get("tags", {}).get("dataset")
            if name and name != "synthetic":
                found.setdefault(name.lower(), None)
    for export in exports:
        for parent in export.record.get("parents", []):
            tags, params = parent.get("tags", {}), parent.get("params", {})
            name = (tags.get("dataset") or params.get("base.data.dataset") or "").lower()
            if name and name != "synthetic":
                checksums = tags.get("dataset_checksums")
                found[name] = json.loads(checksums) if checksums else found.get(name)
    return found


def training_free_table(datasets: dict[str, dict[str, str] | None], data_dir: str | None = None) -> list[str]:
    """Markdown: each heuristic's test metrics on each dataset (loaded from ``data_dir`` or the usual places, never
    downloaded), or a line saying why a dataset's could not be computed. ``datasets`` maps a dataset name to the
    file checksums its studies recorded (None: not recorded); different files here are said so."""
    header = ["dataset", "baseline", *map(metric_label, PER_USER_METRICS), "users"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for name, recorded in sorted(datasets.items()):
        try:
            dataset = load_dataset(name, data_dir, allow_download=False)
        except (FileNotFoundError, ValueError) as error:
            notes.append(f"- {name}: not computed, its files are not here ({str(error).splitlines()[0]}); give "
                         "`--data-dir`")
            continue
        if recorded and dataset.checksums and recorded != dataset.checksums:
            notes.append(f"- {name}: the files here differ from those its studies recorded (checksums): its "
                         "baselines below are of these files")
        for heuristic in HEURISTICS:
            table = heuristic_per_user(dataset, heuristic)
            means = [f"{table[name].mean():.4f}" for name in PER_USER_METRICS]
            lines.append("| " + " | ".join([name, HEURISTIC_LABELS[heuristic], *means, str(len(table))]) + " |")
    return (lines if len(lines) > 2 else []) + notes


def baseline_sections(datasets: dict[str, dict[str, str] | None], data_dir: str | None) -> list[str]:
    """The training-free baselines and the published numbers on ``datasets``, as report and grid sections."""
    lines = []
    baselines = training_free_table(datasets, data_dir)
    if baselines:
        lines += ["## Training-free baselines (test, the same users and metric code, no training)", "",
                  "Popularity: the 20 semantic IDs most often a training target, for everyone. Last-item transitions: "
                  "those that most often followed the user's last item in training, then popularity. A trained "
                  "model that does not beat them has learned little (`apao_ray/analysis/heuristics.py`).", "",
                  *baselines, ""]
    published = field_table(list(datasets))
    if published:
        lines += ["## The field: published numbers on these datasets (`apao_ray/analysis/field.csv`)", "",
                  "Each figure as its source printed it; the notes say where its split, semantic IDs or protocol "
                  "differ from ours, so only the APAO paper's rows compare directly (at the full protocol).", "",
                  *published, ""]
    return lines
