"""Item catalog: level-specific tokens, collisions, and the array trie against brute force."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from apao_ray.data import NUM_SPECIAL_TOKENS, Catalog, load_dataset
from datasets_helpers import SHARED_DATASETS, needs_shared, require_shared

# level sizes (3, 3, 2, 3); items "a" and "b" share one semantic ID
TINY_IDS = ["a", "b", "c", "d", "e", "f"]
TINY_CODES = np.array([[0, 1, 0, 2], [0, 1, 0, 2], [0, 2, 1, 0], [1, 0, 0, 0], [2, 1, 1, 1], [0, 1, 1, 0]])


@pytest.fixture(scope="module")
def tiny() -> Catalog:
    return Catalog.from_codes(TINY_IDS, TINY_CODES)


@pytest.fixture(scope="module")
def office() -> Catalog:
    require_shared()
    return load_dataset("office", data_dir=SHARED_DATASETS, allow_download=False).catalog


# --- tokens ----------------------------------------------------------------------------------

def test_tiny_sizes_and_tokens(tiny):
    assert tiny.level_sizes == (3, 3, 2, 3)
    assert tiny.num_levels == 4 and tiny.num_items == 6 and tiny.num_semantic_ids == 5
    assert tiny.vocab_size == NUM_SPECIAL_TOKENS + 3 + 3 + 2 + 3 == 14
    np.testing.assert_array_equal(tiny.token_offsets, [3, 6, 9, 11])
    np.testing.assert_array_equal(tiny.item_tokens[0], [3, 7, 9, 13])
    np.testing.assert_array_equal(tiny.item_tokens[4], [5, 7, 10, 12])
    # every (level, code) pair has its own token: no token is shared by two levels
    tokens_per_level = [set(tiny.token_offsets[m] + np.arange(tiny.level_sizes[m])) for m in range(4)]
    assert sum(len(t) for t in tokens_per_level) == len(set().union(*tokens_per_level)) == 11
    assert min(min(t) for t in tokens_per_level) == NUM_SPECIAL_TOKENS
    assert max(max(t) for t in tokens_per_level) == tiny.vocab_size - 1


def test_tokens_to_codes_round_trip(tiny):
    np.testing.assert_array_equal(tiny.tokens_to_codes(tiny.item_tokens), TINY_CODES)
    np.testing.assert_array_equal(tiny.tokens_to_codes(tiny.sem_tokens), tiny.sem_codes)
    np.testing.assert_array_equal(tiny.sem_tokens[tiny.item_sem], tiny.item_tokens)


def test_token_at_the_wrong_level_does_not_decode(tiny):
    level2_token = tiny.token_offsets[1] + 0  # code 0 of level 2
    tokens = tiny.item_tokens[0].copy()
    tokens[0] = level2_token  # placed at level 1
    with pytest.raises(ValueError, match="level-specific"):
        tiny.tokens_to_codes(tokens)
    tokens = tiny.item_tokens[0].copy()
    tokens[1] = tiny.token_offsets[0] + 2  # a level-1 token placed at level 2
    with pytest.raises(ValueError, match="level-specific"):
        tiny.tokens_to_codes(tokens)
    with pytest.raises(ValueError, match="level-specific"):
        tiny.tokens_to_codes(np.array([1, 7, 9, 13]))  # EOS is no code
    with pytest.raises(ValueError, match="level-specific"):
        tiny.tokens_to_codes(np.array([3, 7, 9, tiny.vocab_size]))


@needs_shared
def test_office_vocab_and_level_counts(office):
    assert office.level_sizes == (256, 256, 256, 256)
    assert office.vocab_size == NUM_SPECIAL_TOKENS + 4 * 256
    np.testing.assert_array_equal(office.tokens_to_codes(office.item_tokens), office.item_codes)
    per_level_used = [len(np.unique(office.item_codes[:, m])) for m in range(4)]
    assert all(1 < n <= 256 for n in per_level_used)
    assert office.item_tokens.max() < office.vocab_size and office.item_tokens.min() >= NUM_SPECIAL_TOKENS


# --- collisions --------------------------------------------------------------------------------

def test_tiny_collisions_and_representatives(tiny):
    assert tiny.collisions() == {(0, 1, 0, 2): ["a", "b"]}
    assert tiny.item_sem[0] == tiny.item_sem[1]
    np.testing.assert_array_equal(tiny.sem_codes[tiny.item_sem], TINY_CODES)
    # sem_codes sorted lexicographically and distinct
    assert [tuple(r) for r in tiny.sem_codes] == sorted({tuple(r) for r in TINY_CODES})
    # the representative of each semantic ID is its first item in catalog order
    for sem in range(tiny.num_semantic_ids):
        assert tiny.sem_items[sem] == np.flatnonzero(tiny.item_sem == sem)[0]


@needs_shared
def test_office_collisions(office):
    report = office.collisions()
    assert office.num_items == 2420 and office.num_semantic_ids == 2415
    assert len(report) == 5 and sum(len(items) for items in report.values()) == 10
    by_id = {item: i for i, item in enumerate(office.item_ids)}
    for codes, items in report.items():
        assert len(items) >= 2
        for item in items:
            assert tuple(office.item_codes[by_id[item]]) == codes
    # brute force: exactly the codes shared by more than one item
    counts: dict[tuple, int] = {}
    for row in map(tuple, office.item_codes.tolist()):
        counts[row] = counts.get(row, 0) + 1
    assert set(report) == {row for row, n in counts.items() if n > 1}
    for sem in range(office.num_semantic_ids):
        assert office.sem_items[sem] == np.flatnonzero(office.item_sem == sem)[0]


# --- the trie ----------------------------------------------------------------------------------

def brute_force_children(sem_codes: np.ndarray, depth: int) -> dict[tuple, set[int]]:
    children: dict[tuple, set[int]] = {}
    for row in sem_codes.tolist():
        children.setdefault(tuple(row[:depth]), set()).add(row[depth])
    return children


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_valid_next_matches_brute_force(office, depth):
    children = brute_force_children(office.sem_codes, depth)
    prefixes = np.array(sorted(children), dtype=np.int64).reshape(len(children), depth)  # (P, depth)
    nodes = office.prefix_nodes(prefixes)                                               # (P,)
    assert (nodes >= 0).all() and len(set(nodes.tolist())) == len(children)
    mask = office.valid_next(depth, nodes)                                              # (P, size)
    assert mask.shape == (len(children), office.level_sizes[depth])
    for row, prefix in zip(mask, map(tuple, prefixes.tolist())):
        assert set(np.flatnonzero(row).tolist()) == children[prefix]
    # a (B, 2) batch of prefixes drawn from items, duplicates included, keeps its shape
    rng = np.random.default_rng(depth)
    picked = office.item_codes[rng.integers(0, office.num_items, size=(7, 2)), :depth]  # (7, 2, depth)
    batch_mask = office.valid_next(depth, office.prefix_nodes(picked))
    assert batch_mask.shape == (7, 2, office.level_sizes[depth])
    for i in range(7):
        for j in range(2):
            assert set(np.flatnonzero(batch_mask[i, j]).tolist()) == children[tuple(picked[i, j].tolist())]


def test_tiny_valid_next_by_hand(tiny):
    root = tiny.prefix_nodes(np.zeros((0,), dtype=np.int64))
    assert root == 0
    np.testing.assert_array_equal(tiny.valid_next(0, np.array([0])), [[True, True, True]])
    node_0 = tiny.prefix_nodes(np.array([0]))
    np.testing.assert_array_equal(tiny.valid_next(1, node_0), [False, True, True])
    node_01 = tiny.prefix_nodes(np.array([0, 1]))
    np.testing.assert_array_equal(tiny.valid_next(2, node_01), [True, True])
    node_010 = tiny.prefix_nodes(np.array([0, 1, 0]))
    np.testing.assert_array_equal(tiny.valid_next(3, node_010), [False, False, True])
    node_1 = tiny.prefix_nodes(np.array([1]))
    np.testing.assert_array_equal(tiny.valid_next(1, node_1), [True, False, False])


def test_prefix_nodes_of_full_ids_are_sem_indices(office):
    np.testing.assert_array_equal(office.prefix_nodes(office.item_codes), office.item_sem)
    np.testing.assert_array_equal(office.prefix_nodes(office.sem_codes), np.arange(office.num_semantic_ids))
    for m in range(5):
        np.testing.assert_array_equal(office.prefix_nodes(office.sem_codes[:, :m]), office.leaf_prefix_nodes[:, m])


def test_prefix_nodes_of_absent_prefixes_are_minus_one(tiny):
    assert tiny.prefix_nodes(np.array([1, 1])) == -1          # level-2 code exists, prefix does not
    assert tiny.prefix_nodes(np.array([0, 1, 0, 0])) == -1
    assert tiny.prefix_nodes(np.array([3])) == -1             # code beyond the level size
    assert tiny.prefix_nodes(np.array([-1, 0])) == -1
    np.testing.assert_array_equal(tiny.prefix_nodes(np.array([[0, 2], [5, 0], [2, 1]])) >= 0, [True, False, True])


def test_num_distinct_prefixes_match_brute_force(tiny, office):
    for catalog in (tiny, office):
        expected = [len({tuple(r[:m]) for r in catalog.item_codes.tolist()}) for m in range(1, 5)]
        np.testing.assert_array_equal(catalog.num_distinct_prefixes, expected)
        assert [t.shape[0] for t in catalog.child_node] == [1, *expected[:3]]
    np.testing.assert_array_equal(tiny.num_distinct_prefixes, [3, 4, 5, 5])


def test_catalog_tensors_agree_with_numpy(office):
    tensors = office.tensors("cpu")
    assert tensors.vocab_size == office.vocab_size and tensors.level_sizes == office.level_sizes
    np.testing.assert_array_equal(tensors.token_offsets.numpy(), office.token_offsets)
    np.testing.assert_array_equal(tensors.num_distinct_prefixes.numpy(), office.num_distinct_prefixes)
    assert tensors.num_distinct_prefixes.dtype == torch.float32
    np.testing.assert_array_equal(tensors.leaf_prefix_nodes.numpy(), office.leaf_prefix_nodes)
    rng = np.random.default_rng(0)
    for depth in range(4):
        num_nodes = office.child_node[depth].shape[0]
        nodes = rng.integers(0, num_nodes, size=(5, 3))                           # (B, K)
        codes = rng.integers(0, office.level_sizes[depth], size=(5, 3))           # (B, K)
        np.testing.assert_array_equal(tensors.valid_next(depth, torch.from_numpy(nodes)).numpy(),
                                      office.valid_next(depth, nodes))
        next_nodes = tensors.next_node(depth, torch.from_numpy(nodes), torch.from_numpy(codes))  # (B, K)
        np.testing.assert_array_equal(next_nodes.numpy(), office.child_node[depth][nodes, codes])
    # walking the item codes through next_node ends at each item's semantic ID
    node = torch.zeros(office.num_items, dtype=torch.long)
    item_codes = torch.from_numpy(office.item_codes)
    for depth in range(4):
        assert tensors.valid_next(depth, node).gather(1, item_codes[:, depth:depth + 1]).all()
        node = tensors.next_node(depth, node, item_codes[:, depth])
    np.testing.assert_array_equal(node.numpy(), office.item_sem)


@pytest.mark.parametrize("ids, codes, match", [
    (["a", "b"], np.array([[0, 1, 2, 3]]), "num_items=2"),
    ([], np.zeros((0, 4)), "num_items=0"),
    (["a"], np.array([0, 1, 2, 3]), "num_items=1"),
    (["a", "b"], np.array([[0, 1, 2, 3], [0, -1, 2, 3]]), ">= 0"),
])
def test_from_codes_rejects_bad_input(ids, codes, match):
    with pytest.raises(ValueError, match=match):
        Catalog.from_codes(ids, codes)
