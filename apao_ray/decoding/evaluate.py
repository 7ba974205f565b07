"""Evaluation of a model on batches of users: beam search, then the SPEC §4 metrics.

Per-user quantities (target rank, prefix hits, retention) are collected on the CPU and
averaged once at the end, so the figures are exact means over users whatever the batching.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
from torch import nn

from .. import metrics
from ..data.batches import Batch
from ..data.catalog import CatalogTensors
from ..rank_metrics import rank_metric_values
from .beam import beam_search, check_beam_size
from .full_sort import full_sort, topk_from_scores
from .scoring import VOCABULARY_SCORING, StepScoring


class PerUser(NamedTuple):
    """Per-user outcomes of one evaluation pass, in batch order.

    Attributes:
        sample_index: (U,) index of each user's sample in its split (``Batch.sample_index``).
        ranks: (U,) 1-based rank of the target's semantic ID in the beam, 0 when absent.
        prefix_hits: (U, T) bool, the target's length-m prefix survived step m of the beam.
        retention: (U,) beam retention per user, or None without ``with_full_sort``.
        label_log_probs: (U, T) float32 log-probability of each code of the user's target, teacher
            forced, or None without ``with_label_log_probs``.
        full_ranks: (U,) 1-based rank of the target's semantic ID in the exact full sort's top ``beam_size``,
            0 when absent: the ranking the beam approximates, or None without ``with_full_sort``.
    """

    sample_index: torch.Tensor
    ranks: torch.Tensor
    prefix_hits: torch.Tensor
    retention: torch.Tensor | None
    label_log_probs: torch.Tensor | None = None
    full_ranks: torch.Tensor | None = None


def evaluate(model: nn.Module, batches: Iterable[Batch], catalog: CatalogTensors,
             topk: tuple[int, ...] = (5, 10, 20), beam_size: int = 20, with_full_sort: bool = False,
             device: torch.device | str | None = None, amp_dtype: torch.dtype | None = None,
             scoring: StepScoring = VOCABULARY_SCORING) -> dict[str, float]:
    """Recall@K / NDCG@K, prefix recall and (optionally) beam retention (SPEC §4).

    A hit is a generated semantic ID equal to the target's semantic ID (``Batch.target_sem``),
    the paper's convention: with a code collision, every item sharing the target's ID counts.
    Sets ``model.eval()`` for the pass and restores the previous mode afterwards.

    Args:
        model: a :class:`~apao_ray.models.base.Backbone`.
        batches: evaluation batches (e.g. ``iter_batches(catalog, split, 256)``; ordering the
            split by history length there cuts padding and speeds this up).
        catalog: trie tables on ``device``.
        topk: cutoffs K, each <= ``beam_size``.
        beam_size: beam width; the beam's ranked list is what is scored.
        with_full_sort: also score every semantic ID exactly and report beam retention at
            ``beam_size`` (costly: U candidates per user).
        device: where to run; default the model's parameters' device.
        amp_dtype: run the model under ``torch.autocast(dtype=amp_dtype)`` (e.g.
            ``torch.bfloat16``: 1.6x faster beams on CPUs with AMX, top-20 lists agree with
            fp32 on ~98-99% of items); None (default) runs in the model's own precision.
            Scores are normalised in float32 (or the logits' wider dtype).
        scoring: the trained loss's step-score rule (``apao_ray.protocol.decoding_scoring``);
            the beam, its prefix recall, the full sort and retention all use it.

    Returns:
        every registered rank metric (``rank_metrics``: ``recall_at_{k}``, ``ndcg_at_{k}`` for each k,
        ``mrr_at_10``), ``prefix_recall_at_{K}_m{m}`` for
        m = 1..T, ``beam_retention_at_{K}`` when ``with_full_sort``, and ``num_users``.

    Raises:
        ValueError: a cutoff above ``beam_size``, a bad ``beam_size``, or no users.
    """
    per_user = evaluate_per_user(model, batches, catalog, topk, beam_size, with_full_sort, device, amp_dtype, scoring)
    return summarize(per_user.ranks, per_user.prefix_hits, per_user.retention, topk, beam_size)


def evaluate_per_user(model: nn.Module, batches: Iterable[Batch], catalog: CatalogTensors,
                      topk: tuple[int, ...] = (5, 10, 20), beam_size: int = 20, with_full_sort: bool = False,
                      device: torch.device | str | None = None, amp_dtype: torch.dtype | None = None,
                      scoring: StepScoring = VOCABULARY_SCORING, with_label_log_probs: bool = False) -> PerUser:
    """What :func:`evaluate` averages, per user (same arguments and errors): the paired tests of
    ``apao_ray.analysis.stats`` compare two models on these, user by user. ``with_label_log_probs``
    adds each target's teacher-forced code log-probabilities, decoded from the beam's own encoding of
    the history (the split's CE at the cost of one short decode, not a second pass)."""
    check_beam_size(beam_size, catalog.leaf_prefix_nodes.shape[0])
    bad = [k for k in topk if not isinstance(k, int) or not 1 <= k <= beam_size]
    if bad:
        raise ValueError(f"topk cutoffs {bad} must be ints in [1, beam_size={beam_size}]")
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)

    def precision() -> torch.autocast:
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    samples, ranks, prefix_hits, retention, label_logp, full_ranks = [], [], [], [], [], []
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            batch = batch.to(device)
            with precision():
                result = beam_search(model, batch.history_ids, batch.history_mask, catalog, beam_size,
                                     scoring=scoring, labels=batch.labels if with_label_log_probs else None)
            samples.append(batch.sample_index.cpu())
            if with_label_log_probs:
                label_logp.append(result.label_log_probs.float().cpu())
            ranks.append(metrics.target_ranks(result.sem_ids, batch.target_sem).cpu())
            target_nodes = catalog.leaf_prefix_nodes[batch.target_sem]          # (B, T+1)
            prefix_hits.append(metrics.prefix_hits(result.prefix_nodes, target_nodes).cpu())
            if with_full_sort:
                with precision():
                    scores = full_sort(model, batch.history_ids, batch.history_mask, catalog, scoring=scoring)
                exact_ids, _ = topk_from_scores(scores, beam_size)
                retention.append(metrics.retention_per_user(result.sem_ids, exact_ids).cpu())
                full_ranks.append(metrics.target_ranks(exact_ids, batch.target_sem).cpu())
    finally:
        model.train(was_training)
    if not ranks:
        raise ValueError("evaluate got no batches")
    return PerUser(torch.cat(samples), torch.cat(ranks), torch.cat(prefix_hits),
                   torch.cat(retention) if with_full_sort else None,
                   torch.cat(label_logp) if with_label_log_probs else None,
                   torch.cat(full_ranks) if with_full_sort else None)


def summarize(ranks: torch.Tensor, prefix_hits: torch.Tensor, retention: torch.Tensor | None,
              topk: tuple[int, ...], beam_size: int) -> dict[str, float]:
    """Per-user (U,) ranks, (U, T) prefix hits and (U,) retention -> the named means (every registered rank
    metric at the cutoffs ``topk``, or at its own cutoffs up to ``beam_size``)."""
    results = {name: float(values.mean()) for name, values in rank_metric_values(ranks, topk, beam_size).items()}
    for m in range(1, prefix_hits.shape[1] + 1):
        name = metrics.metric_name("prefix_recall", beam_size, m)
        results[name] = float(prefix_hits[:, m - 1].double().mean())
    if retention is not None:
        results[metrics.metric_name("beam_retention", beam_size)] = float(retention.mean())
    results["num_users"] = float(ranks.shape[0])
    return results
