"""data/batches.py: batch collation and the batch orders, checked against hand-computed and brute-force values."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apao_ray.data import EOS_TOKEN, PAD_TOKEN, Catalog, ResidentSplit, collate, iter_batches, load_dataset
from datasets_helpers import SHARED_DATASETS, needs_shared
from test_splits import splits  # noqa: F401 - a fixture


# 8 items with distinct semantic IDs; level sizes (2, 2, 2, 2) -> token offsets 3, 5, 7, 9
ITEM_CODES = np.array([[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 1, 1],
                       [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1]])


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.from_codes([f"i{k}" for k in range(8)], ITEM_CODES)


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
