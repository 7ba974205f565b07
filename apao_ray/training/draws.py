"""An epoch's random draws as functions of (seed, epoch, place): the negatives of each sample by its position in
the epoch's order, the same on every data-parallel rank and in a resumed epoch (SPEC §3)."""
from __future__ import annotations

import numpy as np
import torch

from ..losses.negatives import skip_targets


def seed_of(*keys: int) -> int:
    """A 32-bit seed that is a function of ``keys`` (e.g. seed, epoch, rank), well mixed."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


class PositionNegatives:
    """An epoch's negatives, drawn by position in the epoch's sample order (SPEC §3's uniform draw).

    Positions come in blocks of ``BLOCK``; block k is drawn from a generator seeded with (seed, epoch, k). A
    sample's negatives are thus a function of the seed, the epoch and its place in the epoch's order, not of
    the rank that trains it, its micro-batch or what was drawn before: two ranks draw for their samples what
    one worker draws for the same samples, disjoint positions get independent draws, and a resumed epoch
    draws what the interrupted one did. Each rank draws every block it touches (a few ms per block).
    """

    BLOCK = 4096

    def __init__(self, seed: int, epoch: int, num_semantic_ids: int, num_negatives: int) -> None:
        self.seed, self.epoch = seed, epoch
        self.num_semantic_ids, self.num_negatives = num_semantic_ids, num_negatives
        self._blocks: dict[int, torch.Tensor] = {}

    def _block(self, index: int) -> torch.Tensor:
        if index not in self._blocks:
            generator = torch.Generator().manual_seed(seed_of(self.seed, self.epoch, index))
            self._blocks[index] = torch.randint(0, self.num_semantic_ids - 1, (self.BLOCK, self.num_negatives),
                                                generator=generator)             # (BLOCK, N) in [0, U-2]
        return self._blocks[index]

    def __call__(self, positions: np.ndarray, target_sem: torch.Tensor) -> torch.Tensor:
        """(S,) increasing positions in the epoch's order and their (S,) targets (on the host: no device
        sync) -> (S, N) negatives, on the host."""
        blocks = positions // self.BLOCK
        for old in [k for k in self._blocks if k < blocks[0]]:  # a rank's positions only increase
            del self._blocks[old]
        draws = torch.cat([self._block(int(k))[positions[blocks == k] % self.BLOCK] for k in np.unique(blocks)])
        return skip_targets(draws, target_sem)                                 # (S, N)
