"""A synthetic dataset that needs no files: hierarchical semantic IDs and a planted
sequential rule that a small model can learn, deterministic given a seed.

Every item has a fixed successor; a user's next item is its previous item's successor with
probability ``follow_prob``, otherwise a popularity-weighted random item. Successors stay in
a related branch of the code tree (same or next first-level code), so the prefix structure
matters. Two items share a semantic ID on purpose, to exercise collision handling.
"""
from __future__ import annotations

import numpy as np


def make_synthetic(seed: int = 0, num_items: int = 400, num_users: int = 600,
                   level_sizes: tuple[int, ...] = (8, 8, 8, 8), min_length: int = 5,
                   max_length: int = 15, follow_prob: float = 0.8) -> tuple[list[str], np.ndarray, list[str], list[np.ndarray]]:
    """Returns item ids, (I, T) codes, user ids and item-index sequences."""
    rng = np.random.default_rng(seed)
    space = int(np.prod(level_sizes))
    if num_items > space:
        raise ValueError(f"num_items={num_items} exceeds the {space} distinct semantic IDs of {level_sizes}")
    flat = np.sort(rng.choice(space, size=num_items, replace=False))
    codes = np.stack(np.unravel_index(flat, level_sizes), axis=1).astype(np.int64)  # (I, T), sorted by code
    codes[-1] = codes[-2]  # one planted collision
    # successor: the item a fixed stride ahead in code order, i.e. a nearby branch of the tree
    stride = max(1, num_items // level_sizes[0] // 2)
    successor = (np.arange(num_items) + stride + rng.integers(0, 3, size=num_items)) % num_items
    # mildly skewed popularity (rank^-0.7): a popularity baseline stays weak, the rule is learnable
    popularity = 1.0 / (1.0 + rng.permutation(num_items)) ** 0.7
    popularity /= popularity.sum()
    lengths = rng.integers(min_length, max_length + 1, size=num_users)
    sequences = []
    for length in lengths:  # ~600 users x 10 steps: well under a second
        seq = np.empty(length, dtype=np.int64)
        seq[0] = rng.choice(num_items, p=popularity)
        follows = rng.random(length) < follow_prob
        randoms = rng.choice(num_items, size=length, p=popularity)
        for t in range(1, length):
            seq[t] = successor[seq[t - 1]] if follows[t] else randoms[t]
        sequences.append(seq)
    item_ids = [str(i) for i in range(num_items)]
    user_ids = [f"u{u}" for u in range(num_users)]
    return item_ids, codes, user_ids, sequences
