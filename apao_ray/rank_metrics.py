"""The registry of per-user ranking metrics (SPEC §4): each is one entry of ``RANK_METRICS``, and evaluation, the
per-user tables, ``protocol.select_by``, the training-free baselines, the report, the grid, ``best`` and the
MLflow columns all read it. Adding a metric is adding an entry here.

A metric is a function of the rank of each user's target (``metrics.target_ranks``: 1-based, best first; 0 or
-1 for a target that is absent from the list, which every metric scores as beyond any cutoff), vectorised over
the (U,) rank array and averaged over users. It is named ``<kind>_at_<k>`` (MLflow-safe, ``metrics.metric_name``).

numpy only, no torch: the report, the driver's callbacks and ``best`` read the names without loading torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

PER_USER_CUTOFFS = (10, 20)  # the cutoffs of the per-user tables (whatever the run's topk)
FULL_SORT = "full_sort_"  # a metric's prefix where it scores the exact full sort's ranking instead of the beam's


def _hits(ranks: Any, k: int) -> np.ndarray:
    ranks = np.asarray(ranks)
    return (ranks >= 1) & (ranks <= k)


def recall_from_ranks(ranks: Any, k: int) -> np.ndarray:
    """(U,) ranks (< 1: absent) -> (U,) float64 1 where the target is in the top k, else 0 (Recall@K)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return _hits(ranks, k).astype(np.float64)


def ndcg_from_ranks(ranks: Any, k: int) -> np.ndarray:
    """(U,) ranks -> (U,) 1/log2(rank+1) within the top k, else 0 (NDCG@K: one relevant item, ideal DCG 1)."""
    ranks = np.asarray(ranks, dtype=np.float64)
    return recall_from_ranks(ranks, k) / np.log2(np.maximum(ranks, 1.0) + 1.0)


def mrr_from_ranks(ranks: Any, k: int) -> np.ndarray:
    """(U,) ranks -> (U,) 1/rank within the top k, else 0 (MRR@K, the reciprocal rank of the one target)."""
    ranks = np.asarray(ranks, dtype=np.float64)
    return recall_from_ranks(ranks, k) / np.maximum(ranks, 1.0)


@dataclass(frozen=True)
class RankMetric:
    """One ranking metric.

    Attributes:
        per_user: ``(ranks (U,), k) -> (U,) float64`` values whose mean over users is the metric.
        label: short display name; the cutoff follows it (``N`` -> ``N@10``).
        cutoffs: the cutoffs it is reported at; None: every cutoff a run evaluates (``train.topk`` up to the beam
            width; ``PER_USER_CUTOFFS`` in the per-user tables). A fixed cutoff is reported where the beam is at
            least that wide, and in the per-user tables up to their longest cutoff (20).
        is_higher_better: whether a larger value is better.
        is_selectable: whether ``protocol.select_by`` (the kept epoch) and ``--metric`` (the best trial) may name it.
    """

    per_user: Callable[[Any, int], np.ndarray]
    label: str
    cutoffs: tuple[int, ...] | None = None
    is_higher_better: bool = True
    is_selectable: bool = True


RANK_METRICS: dict[str, RankMetric] = {
    "recall": RankMetric(recall_from_ranks, "R"),
    "ndcg": RankMetric(ndcg_from_ranks, "N"),
    "mrr": RankMetric(mrr_from_ranks, "MRR", cutoffs=(10,)),
}


def rank_metrics_at(cutoffs: Iterable[int], longest: int | None = None) -> dict[str, tuple[RankMetric, int]]:
    """Name (``recall_at_10``) -> (metric, k) of every registered metric a run with ``cutoffs`` reports, in
    registry order, then by cutoff. ``longest``: the longest list ranked (the beam width; default the largest of
    ``cutoffs``): a metric with its own cutoffs is reported at those up to it."""
    cutoffs = sorted(set(cutoffs))
    longest = max(cutoffs, default=0) if longest is None else longest
    found: dict[str, tuple[RankMetric, int]] = {}
    for kind, metric in RANK_METRICS.items():
        for k in cutoffs if metric.cutoffs is None else [k for k in metric.cutoffs if k <= longest]:
            found[f"{kind}_at_{k}"] = (metric, k)
    return found


def rank_metric_values(ranks: Any, cutoffs: Iterable[int], longest: int | None = None) -> dict[str, np.ndarray]:
    """Name -> (U,) per-user values of every metric ``rank_metrics_at(cutoffs, longest)`` names, from (U,) ranks."""
    ranks = np.asarray(ranks)
    return {name: metric.per_user(ranks, k) for name, (metric, k) in rank_metrics_at(cutoffs, longest).items()}


def metric_label(name: str) -> str:
    """``R@10``, ``MRR@10``: a registered metric's display label (any other name as given)."""
    kind, _, k = name.rpartition("_at_")
    return f"{RANK_METRICS[kind].label}@{k}" if kind in RANK_METRICS and k.isdigit() else name


PER_USER_METRICS = tuple(rank_metrics_at(PER_USER_CUTOFFS))  # the metric columns of every per-user table
AT_10_METRICS = tuple(name for name, (_, k) in rank_metrics_at(PER_USER_CUTOFFS).items() if k == 10)
