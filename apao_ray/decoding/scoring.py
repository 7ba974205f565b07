"""How decoding turns next-token logits into step scores s^t, as the trained loss declares.

CE, APAO and the preference losses train the log-softmax over the full vocabulary, so decoding
normalises over every token (SPEC §3-4). MSL trains a softmax over the valid children of the
prefix only (at temperature tau) and never pushes the invalid tokens down, so its step scores
are normalised over the valid children, as the released MSL model masks them in its forward.
Beam search, full sorting, beam retention and prefix recall all read scores from here.

With ``end_token`` (the ``reference`` protocol's labels = codes + EOS) an item's score also
counts log p(EOS | its T codes), as the released code's beam search scores finished items.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NORMALISERS = ("vocabulary", "valid_children")


@dataclass(frozen=True)
class StepScoring:
    """Step-score rule of one trained model.

    Attributes:
        normaliser: ``vocabulary`` (log-softmax over all V tokens) or ``valid_children``
            (log-softmax over the prefix's valid next codes only).
        temperature: logits are divided by it first (MSL's tau; 1 elsewhere).
        end_token: when set, an item's score adds log p(end_token | its T codes).
    """

    normaliser: str = "vocabulary"
    temperature: float = 1.0
    end_token: int | None = None

    def __post_init__(self) -> None:
        if self.normaliser not in NORMALISERS:
            raise ValueError(f"unknown step normaliser {self.normaliser!r}; choose from {list(NORMALISERS)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be > 0")

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the normaliser loses digits in half precision
        return logits if self.temperature == 1.0 else logits / self.temperature

    def level_log_probs(self, logits: torch.Tensor, offset: int, size: int, valid: torch.Tensor) -> torch.Tensor:
        """Step scores of one level's codes.

        Args:
            logits: (..., V) next-token logits.
            offset: token id of code 0 at this level; size: number of codes at this level.
            valid: (..., size) bool, True where the code is a valid child of the prefix.

        Returns:
            (..., size) float log-probabilities s^t; entries where ``valid`` is False are
            meaningless under ``valid_children`` (callers mask them to -inf).
        """
        logits = self._scaled(logits)
        codes = logits[..., offset:offset + size]                            # (..., size)
        if self.normaliser == "vocabulary":
            return codes - torch.logsumexp(logits, dim=-1, keepdim=True)
        codes = codes.masked_fill(~valid, float("-inf"))
        # a node with no valid child gives nan here; only valid entries are ever read
        return codes - torch.logsumexp(codes, dim=-1, keepdim=True)

    def end_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits after the T codes -> (...,) log p(end_token | item).

        Under ``valid_children`` the end token is the only valid continuation: 0.
        """
        if self.end_token is None:
            raise ValueError("end_log_probs needs end_token; this scoring has none")
        if self.normaliser == "valid_children":
            return torch.zeros(logits.shape[:-1], device=logits.device)
        logits = self._scaled(logits)
        return logits[..., self.end_token] - torch.logsumexp(logits, dim=-1)

    def item_scores(self, logits: torch.Tensor, candidates: torch.Tensor, candidate_nodes: torch.Tensor,
                    child_node: tuple[torch.Tensor, ...], token_offsets: list[int]) -> torch.Tensor:
        """Exact item scores S^T (+ log p(end) with ``end_token``) of teacher-forced candidates.

        Args:
            logits: (B, C, T', V) with T' = T, or T + 1 when ``end_token`` is set (position T
                then predicts the end token).
            candidates: (B, C, T) code tokens; candidate_nodes: (B, C, T + 1) their trie nodes.
            child_node: the catalog's per-depth child tables; token_offsets: (T,) as a list.

        Returns:
            (B, C) float scores.
        """
        total = None
        for t, table in enumerate(child_node):  # T is 4: one gather per level
            size = table.shape[1]
            valid = table[candidate_nodes[..., t]] >= 0                        # (B, C, S_t)
            step = self.level_log_probs(logits[:, :, t], token_offsets[t], size, valid)  # (B, C, S_t)
            code = (candidates[..., t] - token_offsets[t]).unsqueeze(-1)       # (B, C, 1)
            picked = step.gather(-1, code).squeeze(-1)                         # (B, C)
            total = picked if total is None else total + picked
        if self.end_token is not None:
            total = total + self.end_log_probs(logits[:, :, len(child_node)])
        return total


VOCABULARY_SCORING = StepScoring()
