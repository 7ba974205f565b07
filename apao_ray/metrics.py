"""Ranking metrics (SPEC §4): pure functions of id tensors, no model.

Conventions, shared by every function here:

* A ranked list is (B, R) int ids, best first, padded with -1 (fewer than R results). Its
  order is the ranking: items with equal scores keep the order the decoder returned them in
  (``torch.topk``'s), so no metric looks at scores.
* The rank of a target is the 1-based position of its FIRST occurrence in the list as given.
  A duplicate later in the list does not count twice (recall stays <= 1); a duplicate of
  another id still takes up its slot (positions are not compacted).
* A target that is absent, or only appears beyond position k, scores 0. A k larger than the
  list means the whole list (a list of R < k items is not padded with imaginary hits).
* Every metric averages over the B users, one target each.

The per-user metrics of a target's rank (Recall, NDCG, MRR at K) are registered in ``rank_metrics``, which every
report reads; the functions here score ranked lists with them.

Inputs may be torch tensors or numpy arrays; outputs are Python floats.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import torch

from .rank_metrics import ndcg_from_ranks, recall_from_ranks

ArrayLike = torch.Tensor | np.ndarray


def _as_tensor(values: ArrayLike, name: str, ndim: int) -> torch.Tensor:
    tensor = torch.as_tensor(values).cpu().long()
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    return tensor


def target_ranks(ranked: ArrayLike, targets: ArrayLike) -> torch.Tensor:
    """1-based position of each target's first occurrence in its ranked list.

    Args:
        ranked: (B, R) ids, best first, -1 padding.
        targets: (B,) target ids (>= 0).

    Returns:
        (B,) int64 ranks, 0 where the target is absent.
    """
    ranked = _as_tensor(ranked, "ranked", 2)
    targets = _as_tensor(targets, "targets", 1)
    if ranked.shape[0] != targets.shape[0]:
        raise ValueError(f"ranked has {ranked.shape[0]} rows but targets has {targets.shape[0]}")
    if (targets < 0).any():
        raise ValueError(f"targets must be >= 0 (-1 is padding), got min {int(targets.min())}")
    is_hit = ranked == targets.unsqueeze(1)                                   # (B, R)
    first = is_hit.long().argmax(dim=1)                                      # first True, 0 if none
    return torch.where(is_hit.any(dim=1), first + 1, 0)


def _mean(values: ArrayLike) -> float:
    values = torch.as_tensor(values)
    if values.numel() == 0:
        raise ValueError("no users to average over (empty batch)")
    return float(values.double().mean())


def recall_at_k(ranked: ArrayLike, targets: ArrayLike, k: int) -> float:
    """Recall@K with one target per user (SPEC §4): share of users whose target is in the top k.

    Args:
        ranked: (B, R) ids, best first, -1 padding; R may be smaller than k.
        targets: (B,) target ids.
        k: cutoff, >= 1.
    """
    return _mean(recall_from_ranks(target_ranks(ranked, targets), k))


def ndcg_at_k(ranked: ArrayLike, targets: ArrayLike, k: int) -> float:
    """NDCG@K with one target per user (SPEC §4): mean of 1/log2(rank+1) if rank <= k, else 0.

    With a single relevant item the ideal DCG is 1, so no normalisation is needed.

    Args:
        ranked: (B, R) ids, best first, -1 padding; R may be smaller than k.
        targets: (B,) target ids.
        k: cutoff, >= 1.
    """
    return _mean(ndcg_from_ranks(target_ranks(ranked, targets), k))


def prefix_hits(prefix_nodes_per_depth: Sequence[ArrayLike], target_prefix_nodes: ArrayLike) -> torch.Tensor:
    """(B, T) bool: is the target's length-m prefix node among the beam's nodes after step m.

    Args:
        prefix_nodes_per_depth: T arrays; entry m-1 is (B, K_m) node ids at depth m, -1 padding
            (``BeamResult.prefix_nodes``).
        target_prefix_nodes: (B, T+1) node ids of the target's prefixes at depths 0..T
            (``catalog.leaf_prefix_nodes[target_sem]``).
    """
    targets = _as_tensor(target_prefix_nodes, "target_prefix_nodes", 2)
    if targets.shape[1] != len(prefix_nodes_per_depth) + 1:
        raise ValueError(f"target_prefix_nodes has {targets.shape[1]} columns; expected T+1 = "
                         f"{len(prefix_nodes_per_depth) + 1} for {len(prefix_nodes_per_depth)} depths")
    columns = []
    for m, nodes in enumerate(prefix_nodes_per_depth, start=1):
        nodes = _as_tensor(nodes, f"prefix_nodes_per_depth[{m - 1}]", 2)
        columns.append((nodes == targets[:, m:m + 1]).any(dim=1))             # (B,)
    return torch.stack(columns, dim=1)                                        # (B, T)


def prefix_recall(prefix_nodes_per_depth: Sequence[ArrayLike], target_prefix_nodes: ArrayLike) -> list[float]:
    """Prefix-level Recall@K, m = 1..T (SPEC §4): share of users whose target's length-m
    prefix is among the beam's prefixes after step m. K is the beam width that produced the
    nodes. Returns T floats, depth 1 first."""
    hits = prefix_hits(prefix_nodes_per_depth, target_prefix_nodes)
    return [_mean(hits[:, m]) for m in range(hits.shape[1])]


def retention_per_user(beam_ids: ArrayLike, full_sort_ids: ArrayLike) -> torch.Tensor:
    """(B,) share of each row's distinct full-sort ids (ignoring -1) that the beam returned."""
    beam_ids = _as_tensor(beam_ids, "beam_ids", 2)
    full_sort_ids = _as_tensor(full_sort_ids, "full_sort_ids", 2)
    if beam_ids.shape[0] != full_sort_ids.shape[0]:
        raise ValueError(f"beam_ids has {beam_ids.shape[0]} rows, full_sort_ids {full_sort_ids.shape[0]}")
    reference = full_sort_ids.sort(dim=1).values                              # (B, K)
    is_first = torch.ones_like(reference, dtype=torch.bool)
    is_first[:, 1:] = reference[:, 1:] != reference[:, :-1]                   # count duplicates once
    is_counted = is_first & (reference >= 0)
    is_found = (reference.unsqueeze(2) == beam_ids.unsqueeze(1)).any(dim=2)   # (B, K)
    num_counted = is_counted.sum(dim=1)
    if (num_counted == 0).any():
        raise ValueError("every full_sort_ids row needs at least one id >= 0")
    return (is_found & is_counted).sum(dim=1).double() / num_counted


def beam_retention(beam_ids: ArrayLike, full_sort_ids: ArrayLike) -> float:
    """Beam retention (SPEC §4, paper Fig. 1c): mean over users of the share of the full-sort
    top-K ids that the beam also returns, regardless of position.

    Args:
        beam_ids: (B, K) ids returned by the beam, -1 padding.
        full_sort_ids: (B, K) the exact top-K ids (``topk_from_scores``).
    """
    return _mean(retention_per_user(beam_ids, full_sort_ids))


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def metric_name(name: str, k: int | None = None, m: int | None = None) -> str:
    """MLflow-safe metric name (no '@'): ``recall_at_10``, ``prefix_recall_at_20_m2``.

    Args:
        name: base name of letters, digits and underscores (``recall``, ``ndcg``,
            ``prefix_recall``, ``beam_retention``, ``num_users``).
        k: cutoff / beam width, appended as ``_at_{k}``.
        m: prefix depth (1-based), appended as ``_m{m}``; needs ``k``.
    """
    if not _SAFE_NAME.match(name):
        raise ValueError(f"metric name {name!r} must use only letters, digits and '_'")
    if m is not None and k is None:
        raise ValueError(f"metric {name!r}: depth m={m} needs a cutoff k")
    for label, value in (("k", k), ("m", m)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"metric {name!r}: {label} must be a positive int, got {value!r}")
    return name + (f"_at_{k}" if k is not None else "") + (f"_m{m}" if m is not None else "")
