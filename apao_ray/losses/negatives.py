"""Negative sampling for the pairwise and preference losses, and which negatives count per depth.

SPEC §3 (APAO pairwise): N negatives are drawn uniformly from the catalog's semantic IDs other
than the target, resampled every epoch; at depth m a negative whose length-m prefix equals the
positive's, or repeats an earlier negative's, does not count.
"""
from __future__ import annotations

import torch


def sample_negatives(target_sem: torch.Tensor, num_semantic_ids: int, num_negatives: int,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Draws negatives uniformly over the semantic IDs other than each target, with replacement.

    Draws ``d ~ U{0, ..., U-2}`` and maps ``d >= target`` to ``d + 1``: a bijection onto
    ``{0, ..., U-1} \\ {target}``, so every non-target ID has probability 1/(U-1) (SPEC §3).

    Args:
        target_sem: (S,) long, semantic-ID index of each sample's target, in [0, U).
        num_semantic_ids: U, the number of distinct semantic IDs in the catalog.
        num_negatives: N >= 0 negatives per sample.
        generator: random source (its device must match ``target_sem``'s); None uses torch's
            global generator.

    Returns:
        (S, N) long semantic-ID indices on ``target_sem``'s device, never equal to the row's target.

    Raises:
        ValueError: U < 2 (no ID other than the target), N < 0, or a target outside [0, U).
    """
    if num_negatives < 0:
        raise ValueError(f"num_negatives={num_negatives} must be >= 0")
    if num_negatives > 0 and num_semantic_ids < 2:
        raise ValueError(f"cannot sample num_negatives={num_negatives} negatives other than the target "
                         f"from num_semantic_ids={num_semantic_ids}; need at least 2 semantic IDs")
    if target_sem.dim() != 1:
        raise ValueError(f"target_sem must be (S,), got shape {tuple(target_sem.shape)}")
    if target_sem.numel() and (int(target_sem.min()) < 0 or int(target_sem.max()) >= num_semantic_ids):
        raise ValueError(f"target_sem values must lie in [0, {num_semantic_ids}); got "
                         f"[{int(target_sem.min())}, {int(target_sem.max())}]")
    shape = (target_sem.shape[0], num_negatives)
    if num_negatives == 0:
        return torch.empty(shape, dtype=torch.long, device=target_sem.device)
    draws = torch.randint(0, num_semantic_ids - 1, shape, generator=generator,
                          device=target_sem.device)                       # (S, N) in [0, U-2]
    return skip_targets(draws, target_sem)


def skip_targets(draws: torch.Tensor, target_sem: torch.Tensor) -> torch.Tensor:
    """Maps uniform draws ``d`` in [0, U-2] to negatives: ``d + 1`` where ``d >= target`` (SPEC §3), the
    bijection of ``sample_negatives``, for draws made elsewhere (the training loop draws an epoch's
    negatives by position in the epoch, so that they do not depend on how the samples are split over ranks).

    Args:
        draws: (S, N) long in [0, U-2].
        target_sem: (S,) long semantic-ID index of each row's target.

    Returns:
        (S, N) long, never equal to the row's target.
    """
    return draws + (draws >= target_sem.unsqueeze(1)).long()              # (S, N) skip the target


def counted_negatives_mask(candidate_nodes: torch.Tensor, mask_duplicates: bool = True) -> torch.Tensor:
    """Which candidates count at each depth of the pairwise loss.

    At depth m (SPEC §3), negative j counts iff its length-m prefix node differs from the
    positive's and, when ``mask_duplicates``, from every earlier negative's (j' < j), so each
    distinct competing prefix enters the denominator once. A negative sharing the positive's
    prefix is never counted: it is the positive prefix itself, not a competitor. The positive
    (candidate 0) always counts.

    Args:
        candidate_nodes: (B, C, T + 1) long, trie node of each candidate's length-m prefix,
            m = 0..T (``Catalog.leaf_prefix_nodes`` rows), candidate 0 the positive.
        mask_duplicates: also drop repeats among the negatives (the paper's code does).

    Returns:
        (B, C, T) bool; entry [b, j, m-1] is True when candidate j counts at depth m.
    """
    if candidate_nodes.dim() != 3 or candidate_nodes.shape[-1] < 2:
        raise ValueError(f"candidate_nodes must be (B, C, T + 1) with T >= 1, got {tuple(candidate_nodes.shape)}")
    nodes = candidate_nodes[..., 1:]                                        # (B, C, T) depths 1..T
    num_candidates = nodes.shape[1]
    if mask_duplicates:
        same = nodes.unsqueeze(2) == nodes.unsqueeze(1)                      # (B, C, C, T) [b, j, k, m]
        earlier = torch.ones(num_candidates, num_candidates, dtype=torch.bool,
                             device=nodes.device).tril(-1)                   # (C, C) k < j
        repeated = (same & earlier[None, :, :, None]).any(dim=2)              # (B, C, T)
    else:
        repeated = nodes == nodes[:, :1]                                     # (B, C, T) equals the positive
    repeated[:, 0] = False                                                  # the positive always counts
    return ~repeated
