"""Full item sorting: the exact score S^T of every semantic ID for every row (SPEC §4).

The ground truth a beam search approximates. Every semantic ID is scored teacher-forced as a
candidate of the row; candidates are processed in chunks of ``chunk_size`` so the (B, C, T, V)
logits stay bounded, and every chunk shares the row's history encoding.
"""
from __future__ import annotations

import torch
from torch import nn

from ..data.catalog import CatalogTensors
from .scoring import VOCABULARY_SCORING, StepScoring

# default bound on the elements of one chunk's (B, C, T, V) logits (64 MiB in fp32). At 1 << 26 the test
# pass's full sort (128 users) was a trial's peak: 1.55 GiB resident vs 0.76 GiB now, in the same time
# (benchmarks/bench_eval_memory.py --max-logit-elements N, RESULTS.md 2026-11-26)
MAX_LOGIT_ELEMENTS = 1 << 24


@torch.inference_mode()
def full_sort(model: nn.Module, history_ids: torch.Tensor, history_mask: torch.Tensor,
              catalog: CatalogTensors, chunk_size: int | None = None,
              scoring: StepScoring = VOCABULARY_SCORING) -> torch.Tensor:
    """Exact S^T = sum_t log p(y^t | y^{<t}, x) of every semantic ID (SPEC §3-4).

    Args:
        model: a :class:`~apao_ray.models.base.Backbone`; its train/eval mode is left as is.
        history_ids: (B, L) history tokens, left-padded, ending with EOS.
        history_mask: (B, L) bool, True on real tokens.
        catalog: trie tables on the model's device.
        chunk_size: semantic IDs scored per ``decode`` call; default keeps one chunk's logits
            under ``MAX_LOGIT_ELEMENTS`` elements.
        scoring: the step-score rule (as ``beam_search``'s, so retention compares like with like).

    Returns:
        (B, U) float scores; column u is semantic ID u (the index ``beam_search`` returns).
    """
    candidates = catalog.semantic_id_tokens()                                 # (U, T)
    num_rows = history_ids.shape[0]
    num_semantic_ids, num_levels = candidates.shape
    if chunk_size is None:
        chunk_size = max(1, MAX_LOGIT_ELEMENTS // max(1, num_rows * num_levels * catalog.vocab_size))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    context = model.encode(history_ids, history_mask)                        # once per row
    offsets = catalog.token_offsets.tolist()
    chunks = []
    for start in range(0, num_semantic_ids, chunk_size):
        chunk = candidates[start:start + chunk_size]                          # (C, T)
        labels = chunk.unsqueeze(0).expand(num_rows, -1, -1)                  # (B, C, T) view
        nodes = catalog.leaf_prefix_nodes[start:start + chunk_size].unsqueeze(0).expand(num_rows, -1, -1)
        # with an end token the last code is fed too: position T predicts the end
        prefix = labels if scoring.end_token is not None else labels[..., :-1]
        logits = model.decode(context, prefix)                                # (B, C, T or T+1, V)
        chunks.append(scoring.item_scores(logits, labels, nodes, catalog.child_node, offsets))  # (B, C)
    return torch.cat(chunks, dim=1)                                          # (B, U)


@torch.inference_mode()
def topk_from_scores(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best semantic IDs of each row of a full-sort score matrix.

    Args:
        scores: (B, U) scores from :func:`full_sort`.
        k: 1 <= k <= U.

    Returns:
        ``(sem_ids, scores)``, both (B, k), best first (ties in ``torch.topk``'s order).
    """
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k={k} must be in [1, {scores.shape[1]}] (the number of semantic IDs)")
    values, indices = scores.topk(k, dim=1)
    return indices, values
