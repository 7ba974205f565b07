"""Negative sampling and the per-depth mask of counted negatives."""
from __future__ import annotations

import pytest
import torch

from apao_ray.losses import counted_negatives_mask, sample_negatives


def test_never_samples_the_target():
    targets = torch.arange(7).repeat(300)                                    # every ID is a target
    negatives = sample_negatives(targets, 7, 40, torch.Generator().manual_seed(0))
    assert negatives.shape == (2100, 40) and negatives.dtype == torch.long
    assert (negatives != targets[:, None]).all()
    assert negatives.min() >= 0 and negatives.max() <= 6


def test_roughly_uniform_over_the_other_ids():
    num_ids, target = 10, 3
    draws = sample_negatives(torch.full((20_000,), target), num_ids, 5, torch.Generator().manual_seed(1))
    counts = torch.bincount(draws.flatten(), minlength=num_ids).double()
    assert counts[target] == 0
    others = torch.cat([counts[:target], counts[target + 1:]])             # 9 cells, 100k draws
    expected = draws.numel() / (num_ids - 1)
    chi_square = ((others - expected) ** 2 / expected).sum()
    assert chi_square < 30, chi_square                                     # 8 dof: P(> 30) ~ 2e-4
    assert counts[0] > 0 and counts[num_ids - 1] > 0                       # both ends reachable


def test_reproducible_from_the_seed():
    targets = torch.tensor([0, 5, 9, 2])
    first = sample_negatives(targets, 10, 8, torch.Generator().manual_seed(42))
    again = sample_negatives(targets, 10, 8, torch.Generator().manual_seed(42))
    other = sample_negatives(targets, 10, 8, torch.Generator().manual_seed(43))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_errors_name_the_values():
    with pytest.raises(ValueError, match="num_negatives=3.*num_semantic_ids=1"):
        sample_negatives(torch.zeros(2, dtype=torch.long), 1, 3)
    with pytest.raises(ValueError, match=r"\[0, 4\); got \[0, 4\]"):
        sample_negatives(torch.tensor([0, 4]), 4, 3)
    assert sample_negatives(torch.zeros(2, dtype=torch.long), 1, 0).shape == (2, 0)


def test_counted_mask_on_a_hand_made_case():
    # one row, T = 3; node ids per depth (depth 0 is the root). Candidate 0 is the positive.
    nodes = torch.tensor([[[0, 1, 4, 9],     # positive
                           [0, 1, 4, 8],     # shares the positive's length-1 and -2 prefixes
                           [0, 2, 5, 10],    # new at every depth
                           [0, 2, 5, 11],    # repeats candidate 2 at depths 1, 2
                           [0, 1, 6, 12],    # shares depth 1 with the positive
                           [0, 2, 5, 10]]])  # the same item as candidate 2
    expected = torch.tensor([[[1, 1, 1],
                              [0, 0, 1],
                              [1, 1, 1],
                              [0, 0, 1],
                              [0, 1, 1],
                              [0, 0, 0]]], dtype=torch.bool)
    torch.testing.assert_close(counted_negatives_mask(nodes), expected)
    # without de-duplication only the positive's own prefix is dropped
    expected_no_dedup = torch.tensor([[[1, 1, 1],
                                       [0, 0, 1],
                                       [1, 1, 1],
                                       [1, 1, 1],
                                       [0, 1, 1],
                                       [1, 1, 1]]], dtype=torch.bool)
    torch.testing.assert_close(counted_negatives_mask(nodes, mask_duplicates=False), expected_no_dedup)


def test_counted_mask_matches_a_loop_on_random_nodes():
    gen = torch.Generator().manual_seed(3)
    nodes = torch.randint(0, 3, (6, 9, 5), generator=gen)
    mask = counted_negatives_mask(nodes)
    for b in range(6):
        for m in range(4):
            seen = {int(nodes[b, 0, m + 1])}
            assert mask[b, 0, m]
            for j in range(1, 9):
                node = int(nodes[b, j, m + 1])
                assert bool(mask[b, j, m]) == (node not in seen)
                seen.add(node)
