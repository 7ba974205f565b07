"""Leave-one-out splits and batch collation, checked against hand-computed and brute-force values."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from apao_ray.data import (EOS_TOKEN, PAD_TOKEN, Catalog, ResidentSplit, build_splits, collate, iter_batches,
                           load_dataset)

SHARED_DATASETS = Path(os.environ.get("APAO_DATA_DIR") or Path(__file__).parents[1].parent / "shared" / "datasets")
needs_shared = pytest.mark.skipif(not (SHARED_DATASETS / "Office" / "Office.inter.json").is_file(),
                                  reason=f"shared datasets not found at {SHARED_DATASETS}")

# 8 items with distinct semantic IDs; level sizes (2, 2, 2, 2) -> token offsets 3, 5, 7, 9
ITEM_CODES = np.array([[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 1, 1],
                       [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1]])
SEQUENCES = [np.array([0, 1, 2, 3, 4, 5, 6]), np.array([7, 6, 5]), np.array([2, 4, 6, 0])]


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.from_codes([f"i{k}" for k in range(8)], ITEM_CODES)


@pytest.fixture(scope="module")
def splits():
    return build_splits(SEQUENCES, max_history=3)


# --- splits ----------------------------------------------------------------------------------

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


# --- batches ---------------------------------------------------------------------------------

@needs_shared
def test_resident_split_gathers_what_collate_builds():
    """Training gathers its batches on the device from indices (data/batches.ResidentSplit): every field equals
    the host-built batch, for histories of every length, any order, repeats, and a one-item history."""
    dataset = load_dataset("office", data_dir=SHARED_DATASETS, allow_download=False)
    split = dataset.splits["train"]
    resident = ResidentSplit(dataset.catalog, split, "cpu")
    rng = np.random.default_rng(0)
    shortest = np.flatnonzero(split.history_lengths == 1)[:3]
    for indices in [rng.choice(len(split), 64, replace=False), np.array([5, 5, 7]), shortest,
                    np.flatnonzero(split.history_lengths == 20)[:2]]:
        expected = collate(dataset.catalog, split, indices)
        got = resident.batch(indices, torch.as_tensor(indices))
        for field in ("history_ids", "history_mask", "labels", "target_items", "target_sem", "sample_index"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), field


def test_collate_pads_left_with_eos_last(catalog, splits):
    split = splits["train"]
    indices = np.array([4, 2, 0])  # history lengths 1, 3, 1
    batch = collate(catalog, split, indices)
    tokens = catalog.item_tokens
    num_levels = 4
    assert batch.history_ids.shape == (3, 3 * num_levels + 1)  # longest history in the batch, + EOS
    assert batch.history_ids.dtype == torch.int64
    for row, index in enumerate(indices):
        history = [int(i) for i in split.histories[index] if i >= 0]
        expected = [PAD_TOKEN] * (3 - len(history)) * num_levels + \
            [int(t) for item in history for t in tokens[item]] + [EOS_TOKEN]
        assert batch.history_ids[row].tolist() == expected
        assert batch.history_mask[row].tolist() == [t != PAD_TOKEN for t in expected]
        assert batch.labels[row].tolist() == tokens[split.targets[index]].tolist()
    np.testing.assert_array_equal(batch.target_items.numpy(), split.targets[indices])
    np.testing.assert_array_equal(batch.target_sem.numpy(), catalog.item_sem[split.targets[indices]])
    np.testing.assert_array_equal(batch.sample_index.numpy(), indices)
    assert len(batch) == 3


def test_collate_trims_to_the_longest_history_in_the_batch(catalog, splits):
    batch = collate(catalog, splits["train"], np.array([0, 4]))  # both have 1 item of history
    assert batch.history_ids.shape == (2, 4 + 1)
    assert batch.history_mask.all()
    assert batch.history_ids[:, -1].tolist() == [EOS_TOKEN, EOS_TOKEN]
    assert batch.history_ids[0, :4].tolist() == catalog.item_tokens[0].tolist()


def test_decoder_only_inputs(catalog, splits):
    batch = collate(catalog, splits["test"], np.array([0, 1, 2]))
    input_ids, attention_mask, labels = batch.decoder_only_inputs()
    num_rows, length = batch.history_ids.shape
    assert input_ids.shape == attention_mask.shape == labels.shape == (num_rows, length + 4)
    assert torch.equal(input_ids[:, :length], batch.history_ids)
    assert torch.equal(input_ids[:, length:], batch.labels)
    assert torch.equal(attention_mask[:, :length], batch.history_mask) and attention_mask[:, length:].all()
    assert (labels[:, :length] == -100).all()
    assert torch.equal(labels[:, -4:], batch.labels)
    assert (labels != -100).sum() == num_rows * 4


def test_batch_to_keeps_every_field(catalog, splits):
    batch = collate(catalog, splits["valid"], np.array([2, 0]))
    moved = batch.to("cpu")
    for field in ["history_ids", "history_mask", "labels", "target_items", "target_sem", "sample_index"]:
        assert torch.equal(getattr(moved, field), getattr(batch, field))


def _order(batches) -> list[int]:
    return torch.cat([batch.sample_index for batch in batches]).tolist()


@needs_shared
def test_iter_batches_covers_every_sample_once_and_shuffles_by_seed():
    dataset = load_dataset("office", data_dir=SHARED_DATASETS, allow_download=False)
    catalog, split = dataset.catalog, dataset.splits["train"]
    plain = list(iter_batches(catalog, split, 1000))
    assert _order(plain) == list(range(len(split)))
    assert [len(b) for b in plain] == [1000] * 38 + [543]
    shuffled = _order(iter_batches(catalog, split, 1000, shuffle=True, seed=7))
    assert sorted(shuffled) == list(range(len(split))) and shuffled != list(range(len(split)))
    assert _order(iter_batches(catalog, split, 1000, shuffle=True, seed=7)) == shuffled
    assert _order(iter_batches(catalog, split, 1000, shuffle=True, seed=8)) != shuffled
    dropped = list(iter_batches(catalog, split, 1000, shuffle=True, seed=7, drop_last=True))
    assert [len(b) for b in dropped] == [1000] * 38 and _order(dropped) == shuffled[:38000]
    # each batch is exactly collate() of its samples
    first = plain[3]
    again = collate(catalog, split, first.sample_index.numpy())
    assert torch.equal(first.history_ids, again.history_ids) and torch.equal(first.labels, again.labels)


def test_iter_batches_over_given_indices(catalog, splits):
    chosen = np.array([3, 1, 4])
    assert _order(iter_batches(catalog, splits["train"], 2, indices=chosen)) == [3, 1, 4]
    assert sorted(_order(iter_batches(catalog, splits["train"], 2, indices=chosen, shuffle=True, seed=1))) == [1, 3, 4]
    assert _order(iter_batches(catalog, splits["train"], 2, indices=chosen, drop_last=True)) == [3, 1]


def test_group_by_length_batches_similar_histories_and_keeps_every_sample(synthetic):
    from apao_ray.data.batches import group_by_length

    lengths = synthetic.splits["train"].history_lengths
    order = np.random.default_rng(3).permutation(len(lengths))
    grouped = group_by_length(order, lengths, 32, np.random.default_rng(4), window_batches=8)
    assert sorted(grouped.tolist()) == sorted(order.tolist())  # a permutation: nothing lost or repeated
    assert np.array_equal(grouped, group_by_length(order, lengths, 32, np.random.default_rng(4), window_batches=8))

    def padded_tokens(sequence):  # what collate pads to: each batch's longest history
        return sum(int(lengths[sequence[i:i + 32]].max()) * len(sequence[i:i + 32]) for i in range(0, len(sequence), 32))

    assert padded_tokens(grouped) < 0.75 * padded_tokens(order), (padded_tokens(grouped), padded_tokens(order))
    # batches are shuffled, not sorted from short to long across the epoch
    maxima = [int(lengths[grouped[i:i + 32]].max()) for i in range(0, len(grouped), 32)]
    assert maxima != sorted(maxima)
