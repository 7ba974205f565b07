"""data/splits.py: leave-one-out splits, checked against hand-computed and brute-force values, and the datasets'
counts."""
from __future__ import annotations

import numpy as np
import pytest

from apao_ray.data import build_splits, load_dataset
from datasets_helpers import SHARED_DATASETS, needs_shared


SEQUENCES = [np.array([0, 1, 2, 3, 4, 5, 6]), np.array([7, 6, 5]), np.array([2, 4, 6, 0])]


@pytest.fixture(scope="module")
def splits():
    return build_splits(SEQUENCES, max_history=3)


def test_exact_samples_on_a_hand_made_sequence(splits):
    train, valid, test = splits["train"], splits["valid"], splits["test"]
    # user 0 = 0..6: train positions 1..4 of items[:-2] = [0, 1, 2, 3, 4]; user 1 (length 3) has
    # no training sample; user 2 = [2, 4, 6, 0]: position 1 only
    np.testing.assert_array_equal(train.targets, [1, 2, 3, 4, 4])
    np.testing.assert_array_equal(train.users, [0, 0, 0, 0, 2])
    np.testing.assert_array_equal(train.histories, [[-1, -1, 0], [-1, 0, 1], [0, 1, 2], [1, 2, 3], [-1, -1, 2]])
    np.testing.assert_array_equal(train.history_lengths, [1, 2, 3, 3, 1])
    np.testing.assert_array_equal(valid.targets, [5, 6, 6])
    np.testing.assert_array_equal(valid.histories, [[2, 3, 4], [-1, -1, 7], [-1, 2, 4]])
    np.testing.assert_array_equal(valid.history_lengths, [3, 1, 2])
    np.testing.assert_array_equal(test.targets, [6, 5, 0])
    np.testing.assert_array_equal(test.histories, [[3, 4, 5], [-1, 7, 6], [2, 4, 6]])
    np.testing.assert_array_equal(test.history_lengths, [3, 2, 3])
    np.testing.assert_array_equal(valid.users, [0, 1, 2])
    np.testing.assert_array_equal(test.users, [0, 1, 2])
    assert [s.name for s in splits.values()] == ["train", "valid", "test"]
    assert all(s.histories.dtype == np.int64 and s.targets.dtype == np.int64 for s in splits.values())


def reference_splits(sequences, max_history):
    """The README's definition, one sample at a time."""
    out = {"train": [], "valid": [], "test": []}
    for user, items in enumerate(sequences):
        items = list(items)
        for i in range(1, len(items) - 2):
            out["train"].append((user, items[:i][-max_history:], items[i]))
        out["valid"].append((user, items[:-2][-max_history:], items[-2]))
        out["test"].append((user, items[:-1][-max_history:], items[-1]))
    return out


@pytest.mark.parametrize("max_history", [1, 4, 20])
def test_splits_match_the_definition_on_random_sequences(max_history):
    rng = np.random.default_rng(max_history)
    sequences = [rng.integers(0, 50, size=rng.integers(3, 30)) for _ in range(40)]
    got, expected = build_splits(sequences, max_history=max_history), reference_splits(sequences, max_history)
    for name, samples in expected.items():
        split = got[name]
        assert len(split) == len(samples)
        assert split.histories.shape == (len(samples), max_history)
        for k, (user, history, target) in enumerate(samples):
            assert split.users[k] == user and split.targets[k] == target
            assert split.history_lengths[k] == len(history)
            row = split.histories[k]
            assert row[max_history - len(history):].tolist() == history
            assert (row[:max_history - len(history)] == -1).all()


def test_too_short_sequences_are_rejected():
    with pytest.raises(ValueError, match="at least 3 interactions"):
        build_splits([np.array([0, 1, 2]), np.array([3, 4])])
    with pytest.raises(ValueError, match="at least 3 interactions"):
        build_splits([])


def test_subset(splits):
    part = splits["train"].subset(np.array([4, 0]))
    np.testing.assert_array_equal(part.targets, [4, 1])
    np.testing.assert_array_equal(part.histories, [[-1, -1, 2], [-1, -1, 0]])
    assert part.name == "train" and len(part) == 2


@needs_shared
@pytest.mark.parametrize("name, users, items, interactions, distinct", [
    ("office", 4905, 2420, 53258, 2415),
    ("grocery", 14681, 8713, 151254, 8683),
    ("Beauty", 22363, 12101, 198502, 12089),
])
def test_dataset_counts_from_the_readme(name, users, items, interactions, distinct):
    dataset = load_dataset(name, data_dir=SHARED_DATASETS, allow_download=False)
    stats = dataset.stats()
    assert (stats["users"], stats["items"], stats["interactions"]) == (users, items, interactions)
    assert stats["distinct_semantic_ids"] == distinct
    assert stats["train_samples"] == interactions - 3 * users
    assert stats["valid_samples"] == stats["test_samples"] == users
    assert stats["density"] == pytest.approx(interactions / (users * items))
    train = dataset.splits["train"]
    assert train.histories.shape[1] == 20 and train.history_lengths.max() == 20
    assert train.history_lengths.min() == 1 and train.targets.max() < items
