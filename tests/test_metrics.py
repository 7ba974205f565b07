"""Ranking metrics on hand-computed cases (SPEC §4)."""
from __future__ import annotations

import math

import pytest
import torch

from apao_ray.metrics import (beam_retention, metric_name, ndcg_at_k, prefix_recall, recall_at_k,
                              target_ranks)

# row 0: target at position 2; row 1: target absent; row 2: target first; row 3: target at 4
RANKED = torch.tensor([[7, 3, 9, 1], [4, 5, 6, -1], [2, 8, -1, -1], [5, 6, 0, 1]])
TARGETS = torch.tensor([3, 1, 2, 1])


def test_target_ranks():
    assert target_ranks(RANKED, TARGETS).tolist() == [2, 0, 1, 4]


@pytest.mark.parametrize("k, expected", [(1, 1 / 4), (2, 2 / 4), (3, 2 / 4), (4, 3 / 4), (50, 3 / 4)])
def test_recall(k, expected):
    assert recall_at_k(RANKED, TARGETS, k) == pytest.approx(expected)


@pytest.mark.parametrize("k, expected", [
    (1, 1 / 4),
    (2, (1 / math.log2(3) + 1) / 4),
    (4, (1 / math.log2(3) + 1 + 1 / math.log2(5)) / 4),
    (100, (1 / math.log2(3) + 1 + 1 / math.log2(5)) / 4),  # k beyond the list: the whole list
])
def test_ndcg(k, expected):
    assert ndcg_at_k(RANKED, TARGETS, k) == pytest.approx(expected)


def test_numpy_inputs_match_torch():
    assert ndcg_at_k(RANKED.numpy(), TARGETS.numpy(), 3) == ndcg_at_k(RANKED, TARGETS, 3)


def test_duplicates_count_once_and_keep_their_slot():
    ranked = torch.tensor([[5, 5, 5, 9], [8, 8, 9, 9]])
    targets = torch.tensor([5, 9])
    assert target_ranks(ranked, targets).tolist() == [1, 3]   # first occurrence; slots not compacted
    assert recall_at_k(ranked, targets, 4) == 1.0              # never above 1
    assert ndcg_at_k(ranked, targets, 4) == pytest.approx((1 + 1 / math.log2(4)) / 2)
    assert ndcg_at_k(ranked, targets, 2) == pytest.approx(0.5)


def test_all_absent_and_all_padding():
    ranked = torch.full((2, 3), -1)
    targets = torch.tensor([0, 4])
    assert recall_at_k(ranked, targets, 3) == 0.0
    assert ndcg_at_k(ranked, targets, 3) == 0.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        recall_at_k(RANKED, TARGETS, 0)
    with pytest.raises(ValueError, match="4 rows but targets has 3"):
        ndcg_at_k(RANKED, TARGETS[:3], 5)
    with pytest.raises(ValueError, match="targets must be >= 0"):
        recall_at_k(RANKED, torch.tensor([3, -1, 2, 1]), 5)
    with pytest.raises(ValueError, match="empty"):
        recall_at_k(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long), 5)


def test_prefix_recall():
    # 3 users, T = 2; target prefix nodes at depths 0..2
    targets = torch.tensor([[0, 1, 4], [0, 2, 7], [0, 0, 0]])
    depth1 = torch.tensor([[1, 3], [0, 1], [0, -1]])          # user 1 misses node 2 at depth 1
    depth2 = torch.tensor([[4, 5, 6], [7, 8, -1], [-1, -1, -1]])  # user 2: no beam kept
    assert prefix_recall([depth1, depth2], targets) == pytest.approx([2 / 3, 2 / 3])
    with pytest.raises(ValueError, match="expected T\\+1 = 3"):
        prefix_recall([depth1, depth2], targets[:, :2])


def test_beam_retention():
    full = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 2, 2]])
    beam = torch.tensor([[4, 9, 1, -1], [5, 6, 7, 8], [2, 3, 0, -1]])
    # row 0: {1, 4} of 4; row 1: all; row 2: duplicates count once -> {2} of {1, 2}
    assert beam_retention(beam, full) == pytest.approx((2 / 4 + 1 + 1 / 2) / 3)
    assert beam_retention(full, full) == 1.0
    assert beam_retention(torch.full_like(full, -1), full) == 0.0
    with pytest.raises(ValueError, match="at least one id"):
        beam_retention(beam, torch.full_like(full, -1))


def test_metric_names_are_mlflow_safe():
    assert metric_name("recall", 10) == "recall_at_10"
    assert metric_name("ndcg", k=20) == "ndcg_at_20"
    assert metric_name("prefix_recall", 20, 2) == "prefix_recall_at_20_m2"
    assert metric_name("beam_retention", 20) == "beam_retention_at_20"
    assert metric_name("num_users") == "num_users"
    with pytest.raises(ValueError, match="'recall@10'"):
        metric_name("recall@10")
    with pytest.raises(ValueError, match="needs a cutoff k"):
        metric_name("prefix_recall", m=2)
    with pytest.raises(ValueError, match="got 0"):
        metric_name("recall", 0)
