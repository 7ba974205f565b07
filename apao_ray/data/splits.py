"""Leave-one-out splits (SPEC §1): per user, last item = test target, second-to-last = valid
target, every earlier position i >= 1 of items[:-2] a training sample with history items[:i].

Histories are stored once per split as an (S, H) matrix of item indices, left-padded with -1
and truncated to the most recent ``max_history`` items, so collating a batch is slicing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True, eq=False)
class Split:
    """Samples of one split.

    Attributes:
        name: "train", "valid" or "test".
        histories: (S, H) int64 item indices, left-padded with -1, most recent item last.
        history_lengths: (S,) number of real items in each history.
        targets: (S,) int64 target item index.
        users: (S,) int64 user index.
    """

    name: str
    histories: np.ndarray
    history_lengths: np.ndarray
    targets: np.ndarray
    users: np.ndarray

    def __len__(self) -> int:
        return len(self.targets)

    def subset(self, indices: np.ndarray) -> "Split":
        return Split(self.name, self.histories[indices], self.history_lengths[indices],
                     self.targets[indices], self.users[indices])


def build_splits(sequences: list[np.ndarray], max_history: int = 20) -> dict[str, Split]:
    """Cuts item-index sequences (one per user, time order, length >= 3) into the three splits."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    if len(sequences) == 0 or lengths.min() < 3:
        raise ValueError("every user needs at least 3 interactions (train, valid, test)")
    flat = np.concatenate(sequences).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    users = np.arange(len(sequences), dtype=np.int64)

    def gather(user_of_sample: np.ndarray, target_pos: np.ndarray, name: str) -> Split:
        # target_pos: position of the target inside its user's sequence; history = [:target_pos]
        hist_len = np.minimum(target_pos, max_history)
        offsets = np.arange(-max_history, 0, dtype=np.int64)                     # (H,)
        pos = target_pos[:, None] + offsets[None, :]                             # (S, H)
        is_real = offsets[None, :] >= -hist_len[:, None]
        index = starts[user_of_sample][:, None] + np.where(is_real, pos, 0)
        histories = np.where(is_real, flat[index], -1)
        targets = flat[starts[user_of_sample] + target_pos]
        return Split(name, histories, hist_len, targets, user_of_sample)

    num_train = lengths - 3  # positions 1 .. len-3 of each sequence
    train_users = np.repeat(users, num_train)
    train_pos = np.arange(num_train.sum()) - np.repeat(np.cumsum(num_train) - num_train, num_train) + 1
    return {
        "train": gather(train_users, train_pos, "train"),
        "valid": gather(users, lengths - 2, "valid"),
        "test": gather(users, lengths - 1, "test"),
    }
