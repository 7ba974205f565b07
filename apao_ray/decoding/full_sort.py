"""Full item sorting: the exact score S^T of every semantic ID for every row (SPEC §4).

The ground truth a beam search approximates. Every semantic ID is scored teacher-forced as a
candidate of the row; candidates are processed in chunks of ``chunk_size`` so the (B, C, T, V)
logits stay bounded, and every chunk shares the row's history encoding.
"""
from __future__ import annotations

import torch
from torch import nn

from ..data.catalog import CatalogTensors
from .beam import BeamResult
from .scoring import VOCABULARY_SCORING, StepScoring

# default bound on the elements of one chunk's (B, C, T, V) logits (64 MiB in fp32). At 1 << 26 the test
# pass's full sort (128 users) was a trial's peak: 1.55 GiB resident vs 0.76 GiB now, in the same time
# (benchmarks/bench_eval_memory.py --max-logit-elements N, RESULTS.md session 17)
MAX_LOGIT_ELEMENTS = 1 << 24


def semantic_id_tokens(catalog: CatalogTensors) -> torch.Tensor:
    """(U, T) token ids of every semantic ID, in semantic-ID index order.

    Read off the trie: the code of leaf u at level m is the column of ``child_node[m]`` at its
    length-m prefix node that leads to its length-(m+1) prefix node.
    """
    nodes = catalog.leaf_prefix_nodes                                        # (U, T+1)
    columns = []
    for m, table in enumerate(catalog.child_node):
        is_child = table[nodes[:, m]] == nodes[:, m + 1].unsqueeze(1)        # (U, S_m)
        columns.append(is_child.long().argmax(dim=1) + catalog.token_offsets[m])
    return torch.stack(columns, dim=1)                                       # (U, T)


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
    candidates = semantic_id_tokens(catalog)                                 # (U, T)
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
def add_end_scores(model: nn.Module, history_ids: torch.Tensor, history_mask: torch.Tensor,
                   catalog: CatalogTensors, result: BeamResult, scoring: StepScoring) -> BeamResult:
    """Adds log p(end | item) to each beam item's score and re-ranks the row's K items.

    The released code's beam search generates the end token after the T codes, so a finished
    item's score is S^T + log p(EOS | item) (``protocol.label_eos``); prefix nodes are unchanged.

    Args:
        result: a beam search's (B, K) items, scored without the end token.
        scoring: a rule with ``end_token`` set.
    """
    tokens = semantic_id_tokens(catalog)[result.sem_ids.clamp(min=0)]       # (B, K, T)
    logits = model.decode(model.encode(history_ids, history_mask), tokens)[:, :, -1]  # (B, K, V)
    scores = result.scores + scoring.end_log_probs(logits).to(result.scores.dtype)  # (B, K)
    scores = torch.where(result.sem_ids >= 0, scores, float("-inf"))
    scores, order = scores.sort(dim=1, descending=True, stable=True)          # (B, K)
    return BeamResult(sem_ids=result.sem_ids.gather(1, order), scores=scores, prefix_nodes=result.prefix_nodes)


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
