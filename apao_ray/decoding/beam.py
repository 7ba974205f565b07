"""Constrained beam search over the catalog trie (SPEC §4).

The history is encoded once per row; every step scores the K kept prefixes of a row in one
``decode_step`` call that shares the row's context (no per-beam copy of the encoder output or
of the history's key/value cache) and runs only each beam's newest position, reading the
earlier positions from a per-beam key/value cache that follows the beams as they are
reselected (``DecodeCache.select``). The trie constraint is one gather into
``catalog.child_node[t]`` per step. Python loops only over the T code levels, and over
chunks of rows (cache blocking, see ``CPU_ROW_CHUNK``) -- never over beams, rows or tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..data.catalog import CatalogTensors
from ..models.base import label_log_probs
from .scoring import VOCABULARY_SCORING, StepScoring


@dataclass(frozen=True)
class BeamResult:
    """What a beam search returns, best first within each row.

    Attributes:
        sem_ids: (B, K) int64 semantic-ID index of each returned item (= leaf node id of the
            trie). Since K <= U, always K real items; consumers still treat -1 as padding.
        scores: (B, K) cumulative log-probability S^T of each item (-inf where -1).
        prefix_nodes: T tensors; entry m-1 is (B, K_m) int64 with K_0 = 1 and
            K_m = min(K, K_{m-1} * S_{m-1}): the trie node ids (depth m) of the prefixes kept
            after step m, best first, -1 in slots beyond the min(K, P_m) length-m prefixes
            that exist.
        label_log_probs: (B, T) float32 teacher-forced log-probability of each code of the ``labels``
            given to the search, from the same encoding of the history (the validation CE without a
            second pass over the histories); None when no labels were given.
    """

    sem_ids: torch.Tensor
    scores: torch.Tensor
    prefix_nodes: tuple[torch.Tensor, ...]
    label_log_probs: torch.Tensor | None = None


def check_beam_size(beam_size: int, num_semantic_ids: int) -> None:
    """Raises ValueError unless 1 <= beam_size <= the number of semantic IDs."""
    if not isinstance(beam_size, int) or isinstance(beam_size, bool) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if beam_size > num_semantic_ids:
        raise ValueError(f"beam_size={beam_size} exceeds the number of semantic IDs in the "
                         f"catalog ({num_semantic_ids}); choose beam_size <= {num_semantic_ids}")


# Rows decoded together on a CPU. At 256 rows x 20 beams the decoder's (B*K, t+1, d_ff)
# activations outgrow the CPU caches: 64-row chunks ran Llama 1.7x faster on the 2-CPU
# benchmark machine (TIGER: unchanged; 24-96 rows all within noise; benchmarks/RESULTS.md,
# "Decoding"). Accelerators take the whole batch at once.
CPU_ROW_CHUNK = 64


@torch.inference_mode()
def beam_search(model: nn.Module, history_ids: torch.Tensor, history_mask: torch.Tensor,
                catalog: CatalogTensors, beam_size: int = 20, row_chunk_size: int | None = None,
                scoring: StepScoring = VOCABULARY_SCORING, labels: torch.Tensor | None = None) -> BeamResult:
    """Constrained beam search (SPEC §4): keep the K best valid prefixes by S^t at every step.

    At step t every kept prefix is extended by every code of level t that is a child of its
    trie node; the extension's score is S^{t+1} = S^t + s^{t+1} with s the log-softmax over the
    full vocabulary; the K best extensions over (beams x codes) of the row are kept. Step 0
    starts from the single root prefix, so fewer than K beams exist while the trie is narrow
    (those slots are padded with -inf / -1 and never win).

    Rows are independent: they are searched in chunks of ``row_chunk_size`` (cache blocking)
    grouped by history length, each chunk's history trimmed of columns that are padding in
    all of its rows; results come back in the input's row order. The model's train/eval
    mode is left as it is; call ``model.eval()`` first (``evaluate`` does). Ties between
    equal scores are broken by ``torch.topk``'s order.

    Args:
        model: a :class:`~apao_ray.models.base.Backbone` (``encode`` / ``decode``).
        history_ids: (B, L) history tokens, left-padded, ending with EOS.
        history_mask: (B, L) bool, True on real tokens.
        catalog: trie tables on the model's device.
        beam_size: K, 1 <= K <= number of semantic IDs.
        row_chunk_size: rows per search; default ``CPU_ROW_CHUNK`` on CPU, all rows elsewhere.
        scoring: how step scores are normalised (the trained loss's rule); with an end token
            the K items are re-ranked by S^T + log p(end | item).
        labels: (B, T) code tokens (e.g. ``Batch.labels``) whose teacher-forced log-probabilities to
            return as ``label_log_probs``, decoded from the histories' encoding that the search uses.

    Returns:
        :class:`BeamResult` with (B, K) items ordered by score, best first.

    Raises:
        ValueError: if ``beam_size`` is not in [1, number of semantic IDs].
    """
    check_beam_size(beam_size, catalog.leaf_prefix_nodes.shape[0])
    if scoring.end_token is not None:  # finished items add log p(end | item), then re-rank
        result = beam_search(model, history_ids, history_mask, catalog, beam_size, row_chunk_size,
                             replace(scoring, end_token=None), labels)
        return replace(add_end_scores(model, history_ids, history_mask, catalog, result, scoring),
                       label_log_probs=result.label_log_probs)
    num_rows = history_ids.shape[0]
    if row_chunk_size is None:
        row_chunk_size = CPU_ROW_CHUNK if history_ids.device.type == "cpu" else max(1, num_rows)
    if row_chunk_size < 1:
        raise ValueError(f"row_chunk_size must be >= 1, got {row_chunk_size}")
    if num_rows <= row_chunk_size:
        return _search(model, *_trim_padding(history_ids, history_mask), catalog, beam_size, scoring, labels)
    # chunks of rows of similar history length pad less; results go back to the input order
    order = history_mask.sum(dim=1).argsort(stable=True)                       # (B,)
    parts = []
    for start in range(0, num_rows, row_chunk_size):
        rows = order[start:start + row_chunk_size]
        parts.append(_search(model, *_trim_padding(history_ids[rows], history_mask[rows]), catalog, beam_size,
                             scoring, None if labels is None else labels[rows]))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_rows, device=order.device)

    def gather(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors)[inverse]

    return BeamResult(sem_ids=gather([p.sem_ids for p in parts]), scores=gather([p.scores for p in parts]),
                      prefix_nodes=tuple(gather(list(nodes)) for nodes in zip(*(p.prefix_nodes for p in parts))),
                      label_log_probs=None if labels is None else gather([p.label_log_probs for p in parts]))


def _trim_padding(history_ids: torch.Tensor, history_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops the leading columns that are PAD in every row (histories are left-padded)."""
    first_real = int(history_mask.any(dim=0).long().argmax())  # host sync; 0 if nothing to drop
    return history_ids[:, first_real:], history_mask[:, first_real:]


def _search(model: nn.Module, history_ids: torch.Tensor, history_mask: torch.Tensor,
            catalog: CatalogTensors, beam_size: int, scoring: StepScoring = VOCABULARY_SCORING,
            labels: torch.Tensor | None = None) -> BeamResult:
    """The beam search of :func:`beam_search` on one chunk of rows; a loop over the T steps."""
    num_rows = history_ids.shape[0]
    device = history_ids.device
    offsets = catalog.token_offsets.tolist()  # T small ints; one host copy per call
    context = model.encode(history_ids, history_mask)  # the only pass over the history
    label_logp = None
    if labels is not None:  # teacher forcing: one candidate per row, the labels themselves
        logits = model.decode(context, labels[:, None, :-1])                    # (B, 1, T, V)
        with torch.autocast(device.type, enabled=False):  # normalised in float32 (or wider)
            label_logp = label_log_probs(logits, labels[:, None, :])[:, 0]     # (B, T)

    nodes = torch.zeros(num_rows, 1, dtype=torch.long, device=device)          # (B, 1) root
    scores = torch.zeros(num_rows, 1, device=device)                           # (B, 1)
    cache = None  # the decoder's per-beam state: each step runs only the newest position
    kept_nodes = []
    for t, level_size in enumerate(catalog.level_sizes):
        logits, cache = model.decode_step(context, cache)                      # (B, K_t, V)
        # dead beams (node -1) read row 0 of the table; their -inf score keeps them dead
        children = catalog.child_node[t][nodes.clamp(min=0)]                   # (B, K_t, S_t)
        step = scoring.level_log_probs(logits, offsets[t], level_size, children >= 0)  # (B, K_t, S_t)
        scores = scores.to(step.dtype)
        total = torch.where(children >= 0, scores.unsqueeze(-1) + step, float("-inf"))
        num_beams = min(beam_size, total.shape[1] * level_size)
        scores, flat = total.flatten(1).topk(num_beams, dim=1)                 # (B, K_{t+1})
        beam = torch.div(flat, level_size, rounding_mode="floor")              # (B, K_{t+1})
        code = flat - beam * level_size                                        # (B, K_{t+1})
        nodes = children.flatten(1).gather(1, flat)                            # (B, K_{t+1})
        nodes = torch.where(torch.isneginf(scores), -1, nodes)
        if t + 1 < len(catalog.level_sizes):
            cache = cache.select(beam, code + offsets[t])                      # (B, K_{t+1}, ...)
        kept_nodes.append(nodes)

    # K <= U leaves: every depth keeps min(K, nodes at that depth) real beams, so the last
    # step has K slots and K real items (only prefix_nodes of narrow depths hold -1)
    return BeamResult(sem_ids=nodes, scores=scores, prefix_nodes=tuple(kept_nodes), label_log_probs=label_logp)


def add_end_scores(model: nn.Module, history_ids: torch.Tensor, history_mask: torch.Tensor,
                   catalog: CatalogTensors, result: BeamResult, scoring: StepScoring) -> BeamResult:
    """Adds log p(end | item) to each beam item's score and re-ranks the row's K items.

    The released code's beam search generates the end token after the T codes, so a finished
    item's score is S^T + log p(EOS | item) (``protocol.label_eos``); prefix nodes are unchanged.

    Args:
        result: a beam search's (B, K) items, scored without the end token.
        scoring: a rule with ``end_token`` set.
    """
    tokens = catalog.semantic_id_tokens()[result.sem_ids.clamp(min=0)]       # (B, K, T)
    logits = model.decode(model.encode(history_ids, history_mask), tokens)[:, :, -1]  # (B, K, V)
    scores = result.scores + scoring.end_log_probs(logits).to(result.scores.dtype)  # (B, K)
    scores = torch.where(result.sem_ids >= 0, scores, float("-inf"))
    scores, order = scores.sort(dim=1, descending=True, stable=True)          # (B, K)
    return BeamResult(sem_ids=result.sem_ids.gather(1, order), scores=scores, prefix_nodes=result.prefix_nodes)
