"""Validation/test of a model on one split: beam metrics, CE loss, beam retention, and the
per-user test table that paired significance tests read (``per_user_test.csv.gz``)."""
from __future__ import annotations

import csv
import gzip
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import TrainConfig
from ..data import CatalogTensors, Dataset, iter_batches
from ..data.transitions import transition_flags
from .. import metrics as metric_fns
from ..rank_metrics import FULL_SORT, PER_USER_CUTOFFS, rank_metric_values
from ..decoding import PerUser, evaluate_per_user
from ..decoding.evaluate import summarize
from ..decoding.scoring import VOCABULARY_SCORING, StepScoring
from .precision import autocast_dtype


def select_users(num_samples: int, max_samples: int | None, seed: int) -> np.ndarray | None:
    """A fixed random subset (sorted) of ``max_samples`` sample indices, or None for all."""
    if max_samples is None or max_samples >= num_samples:
        return None
    return np.sort(np.random.default_rng([seed, 7919]).choice(num_samples, size=max_samples, replace=False))


def tests_full_sort(train: TrainConfig, device: torch.device) -> bool:
    """Whether the kept epoch's test pass also ranks every user by the exact full sort (``train.full_sort_test``):
    ``auto`` does on a GPU. On a CPU it costs ~0.5 s per user at 1 thread for Office's 2,415 items (paper-size
    TIGER), ~40 min for its 4,905 test users, so ``auto`` leaves it off there."""
    return train.full_sort_test == "on" or (train.full_sort_test == "auto" and device.type == "cuda")


def evaluate_split(model: nn.Module, dataset: Dataset, split_name: str, tensors: CatalogTensors,
                   train: TrainConfig, device: torch.device, indices: np.ndarray | None,
                   scoring: StepScoring = VOCABULARY_SCORING) -> dict[str, float]:
    """``{split}/<metric>`` of every registered rank metric (``recall_at_k``, ...), prefix recall and ``loss_ce``
    on a user subset; beam retention (a full sort of every semantic ID for ``train.retention_users`` users:
    costly) on the test split, and on validation only when ``train.validate_retention``."""
    return evaluate_split_per_user(model, dataset, split_name, tensors, train, device, indices, scoring)[0]


def evaluate_split_per_user(model: nn.Module, dataset: Dataset, split_name: str, tensors: CatalogTensors,
                            train: TrainConfig, device: torch.device, indices: np.ndarray | None,
                            scoring: StepScoring = VOCABULARY_SCORING, full_sort: bool = False,
                            ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """:func:`evaluate_split`'s metrics and, from the same beam pass, :func:`per_user_table`. With ``full_sort``
    every user is also ranked by the exact full sort (``full_sort_<metric>``, e.g. ``full_sort_ndcg_at_10``: how
    much of a metric the beam's pruning costs) and the beam retention covers every user, not a subset."""
    prefix = "val" if split_name == "valid" else split_name
    split = dataset.splits[split_name]
    topk = tuple(k for k in train.topk if k <= train.beam_size)
    # users sorted by history length: each batch pads to a similar length (the means do not depend on order)
    order = np.arange(len(split)) if indices is None else np.asarray(indices)
    order = order[np.argsort(split.history_lengths[order], kind="stable")]
    batches = iter_batches(dataset.catalog, split, train.eval_batch_size, indices=order)
    amp_dtype = autocast_dtype(train.precision)  # evaluation runs in the training precision
    per_user = evaluate_per_user(model, batches, tensors, topk=topk, beam_size=train.beam_size, device=device,
                                 amp_dtype=amp_dtype, scoring=scoring, with_label_log_probs=True,
                                 with_full_sort=full_sort)
    metrics = summarize(per_user.ranks, per_user.prefix_hits, per_user.retention, topk, train.beam_size)
    if full_sort:
        metrics.update({f"{FULL_SORT}{name}": float(values.mean())
                        for name, values in rank_metric_values(per_user.full_ranks, topk, train.beam_size).items()})
    elif train.retention_users and (split_name != "valid" or train.validate_retention):
        subset = select_users(len(split), train.retention_users, train.seed + 1)
        retention_batches = iter_batches(dataset.catalog, split, min(train.eval_batch_size, 64), indices=subset)
        retained = evaluate_per_user(model, retention_batches, tensors, topk=topk, beam_size=train.beam_size,
                                     with_full_sort=True, device=device, amp_dtype=amp_dtype, scoring=scoring)
        metrics[metric_fns.metric_name("beam_retention", train.beam_size)] = float(retained.retention.mean())
    metrics["loss_ce"] = float(-per_user.label_log_probs.double().mean())  # the targets' mean token CE
    named = {f"{prefix}/{name}": float(value) for name, value in metrics.items()}
    # the test table carries what training holds of each case, for the report's memorization/generalization split
    labels = transition_flags(dataset.splits, split_name) if split_name == "test" else {}
    return named, per_user_table(per_user, dataset.user_ids, split.users, labels=labels)


def per_user_table(per_user: PerUser, user_ids: tuple[str, ...], split_users: np.ndarray,
                   cutoffs: tuple[int, ...] = PER_USER_CUTOFFS,
                   labels: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One row per evaluated user, sorted by user index: ``user`` (external id), ``rank`` (1-based rank
    of the target's semantic ID in the beam, -1 when absent), every registered rank metric
    (``rank_metrics.rank_metrics_at(cutoffs)``: ``recall_at_{k}``, ``ndcg_at_{k}``, ``mrr_at_10``) and
    ``prefix_hit_m{m}``, whose means are the split's metrics (SPEC §4); each of ``labels`` (per sample of the
    split, e.g. ``data.transitions.transition_flags``) as a 0/1 column."""
    user_index = split_users[per_user.sample_index.numpy()]
    order = np.argsort(user_index, kind="stable")
    ranks = per_user.ranks[torch.as_tensor(order)]
    table: dict[str, np.ndarray] = {"user": np.asarray(user_ids, dtype=object)[user_index[order]],
                                    "rank": np.where(ranks.numpy() > 0, ranks.numpy(), -1)}
    table.update(rank_metric_values(ranks, cutoffs))
    if per_user.full_ranks is not None:  # the exact ranking's, beside the beam's
        full_ranks = per_user.full_ranks[torch.as_tensor(order)]
        table.update({f"{FULL_SORT}{name}": values for name, values in rank_metric_values(full_ranks, cutoffs).items()})
    for m in range(1, per_user.prefix_hits.shape[1] + 1):
        table[f"prefix_hit_m{m}"] = per_user.prefix_hits[torch.as_tensor(order), m - 1].numpy().astype(np.int8)
    samples = per_user.sample_index.numpy()[order]
    for name, flags in (labels or {}).items():
        table[name] = np.asarray(flags)[samples].astype(np.int8)
    return table


def write_per_user(path: str | os.PathLike, table: dict[str, np.ndarray]) -> Path:
    """Writes a per-user table as gzip CSV (a few tens of KB for Office's 4,905 test users)."""
    path = Path(path)
    columns = list(table)
    with gzip.open(path, "wt", newline="", compresslevel=9) as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row in zip(*(table[c] for c in columns)):
            writer.writerow([f"{v:.6g}" if isinstance(v, (float, np.floating)) else v for v in row])
    return path
