"""Masked softmax loss (MSL): CE normalised over the trie's valid next codes only (SPEC §3)."""
from __future__ import annotations

import torch

from ..config import LossConfig
from ..data.catalog import CatalogTensors
from .base import LossInputs, LossOutput
from .registry import Loss, at_least_float32, register


def valid_token_mask(catalog: CatalogTensors, prefix_nodes: torch.Tensor,
                     token_offsets: list[int] | None = None) -> torch.Tensor:
    """Tokens that extend each ground-truth prefix to a prefix present in the catalog.

    Args:
        catalog: trie tables, on the device of ``prefix_nodes``.
        prefix_nodes: (B, T + 1) or (B, T) node of the target's length-t prefix at column t.
        token_offsets: ``catalog.token_offsets`` as a list, to skip a device-to-host copy.

    Returns:
        (B, T, V) bool: True at token ``token_offsets[t] + c`` when code c is a valid child of
        the length-t prefix; False for every other token (special tokens, other levels).
    """
    num_rows, num_levels = prefix_nodes.shape[0], len(catalog.level_sizes)
    offsets = catalog.token_offsets.tolist() if token_offsets is None else token_offsets
    mask = torch.zeros(num_rows, num_levels, catalog.vocab_size, dtype=torch.bool, device=prefix_nodes.device)
    for t in range(num_levels):  # T is 4: one fancy-index per level
        offset, size = offsets[t], catalog.level_sizes[t]
        mask[:, t, offset:offset + size] = catalog.child_node[t][prefix_nodes[:, t]] >= 0  # (B, |codes_t|)
    return mask


@register("msl")
class MaskedSoftmaxLoss(Loss):
    """L_MSL = -(1 / (B T)) sum_b sum_t log softmax_{v in A_t}(z^t / tau)[y^t].

    A_t is the set of valid children of the ground-truth prefix y^{<t} in the catalog trie
    (tokens outside it get logit -inf), tau = ``config.tau``. Reads candidate 0 and its
    ``candidate_nodes``; also logs the plain full-vocabulary CE as ``loss_ce`` for comparison.
    """

    display_name = "MSL"
    help = "masked softmax over the catalog's valid next tokens, temperature tau (LossConfig.tau, not tuned)"
    num_negatives = 0
    step_normaliser = "valid_children"  # invalid tokens are never trained down: decode without them

    @classmethod
    def decoding_temperature(cls, config: LossConfig) -> float:
        return config.tau

    def __init__(self, config: LossConfig, catalog: CatalogTensors) -> None:
        super().__init__(config, catalog)
        self.tau = config.tau
        self.token_offsets = catalog.token_offsets.tolist()  # once: avoids a GPU sync per batch

    def masked_logits(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidate 0's logits over the trie's valid next tokens: (z / tau with every other token at -inf,
        the labels, the plain logits), each (B, T, V) / (B, T) / (B, T, V) in at least float32. Labels that end
        with EOS (protocol.label_eos) get it as the only valid token of their last step."""
        self.check_candidates(inputs)
        logits = at_least_float32(inputs.logits[:, 0])                      # (B, T, V)
        labels = inputs.candidates[:, 0]                                    # (B, T)
        nodes = inputs.candidate_nodes[:, 0]                                # (B, T + 1)
        allowed = valid_token_mask(self.catalog, nodes, self.token_offsets)  # (B, T, V)
        if labels.shape[1] > allowed.shape[1]:  # labels end with EOS (protocol.label_eos): its only valid token
            is_end = torch.zeros_like(allowed[:, :1]).scatter_(-1, labels[:, -1:, None], True)  # (B, 1, V)
            allowed = torch.cat([allowed, is_end], dim=1)                   # (B, T+1, V)
        return (logits / self.tau).masked_fill(~allowed, float("-inf")), labels, logits

    def __call__(self, inputs: LossInputs) -> LossOutput:
        masked, labels, logits = self.masked_logits(inputs)
        picked = masked.gather(-1, labels.unsqueeze(-1)).squeeze(-1)        # (B, T)
        loss = (torch.logsumexp(masked, dim=-1) - picked).mean()
        return LossOutput(loss=loss, metrics={"loss": loss.detach(), "loss_msl": loss.detach(),
                                              "loss_ce": plain_ce(logits, labels)})


def plain_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary token CE of ``labels`` (B, T) under ``logits`` (B, T, V), detached, for logging."""
    with torch.no_grad():
        return (torch.logsumexp(logits, -1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)).mean()
