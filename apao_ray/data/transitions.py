"""What training already holds of each evaluated case: memorization against generalization.

A case is *memorization* when the transition it asks for, the history's last item followed by the target, occurs
in training (some training sample has that last item and that target), and *generalization* when it does not
(arXiv 2603.19809, "How Well Does Generative Recommendation Generalize?"). A second cut: whether the target was a
training target at all. Both need no model, only the splits; a trial writes them into its per-user test table
(``MEMORIZATION_COLUMN``, ``SEEN_TARGET_COLUMN``) and the report reads them there.
"""
from __future__ import annotations

import numpy as np

from .splits import Split

MEMORIZATION_COLUMN = "is_memorization"
SEEN_TARGET_COLUMN = "is_seen_target"


def transition_flags(splits: dict[str, Split], split: str = "test") -> dict[str, np.ndarray]:
    """Per sample of ``split``, in its order: ``MEMORIZATION_COLUMN`` and ``SEEN_TARGET_COLUMN`` (bool)."""
    train, evaluated = splits["train"], splits[split]
    num_items = int(max(train.targets.max(), evaluated.targets.max(), train.histories.max())) + 1
    has_previous = train.histories[:, -1] >= 0
    seen_pairs = np.unique(train.histories[has_previous, -1].astype(np.int64) * num_items
                           + train.targets[has_previous])                           # (P,) training transitions
    last = evaluated.histories[:, -1].astype(np.int64)                                  # (S,) -1: empty history
    pairs = last * num_items + evaluated.targets
    return {MEMORIZATION_COLUMN: (last >= 0) & np.isin(pairs, seen_pairs),
            SEEN_TARGET_COLUMN: np.isin(evaluated.targets, np.unique(train.targets))}
