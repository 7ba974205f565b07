"""BEAR: beam-search-aware regularisation on top of MSL (arXiv 2601.22925; code Tiny-Snow/BEAR-WWW-2026 and
BEAR-SIGIR-2026, ``train_bear.py``), for semantic IDs (docs/SPEC.md, "BEAR").

At every decoding step t of the target, over the trie's valid next tokens (MSL's softmax, temperature tau):

    p_t = softmax(z_t / tau over the valid tokens),  CE_t = -log p_t[y_t]
    beta_t = sg(the B-th largest p_t; the smallest valid one when fewer than B tokens are valid)
    w_t = 1 + lambda * sg(sigmoid((log p_t[y_t] - log beta_t) / xi))
    L = sum_t w_t CE_t / sum_{t with more than one valid token} w_t        (sums over the micro-batch)

``sg`` is a stop-gradient: the weight only rescales each token's MSL gradient, by how far the target's token sits
above (weight towards 1 + lambda) or below (towards 1) the B-th best candidate, i.e. the beam's cut. This is the
released code's form; with lambda = 0 it is MSL averaged over the steps that have a choice.
"""
from __future__ import annotations

import torch

from .base import LossInputs, LossOutput
from .knobs import Knob
from .msl import MaskedSoftmaxLoss, plain_ce
from .registry import register

BEAR_B = Knob("bear_b", 2, 50, 10, log=True, integer=True, help="BEAR's B: the rank each target token is compared with")
BEAR_XI = Knob("bear_xi", 0.25, 4.0, 1.0, log=True, help="BEAR's xi: temperature of the sigmoid on the log-prob gap")
BEAR_LAMBDA = Knob("bear_lambda", 0.05, 4.0, 1.0, log=True, help="BEAR's lambda: weight of the beam-aware term")


def bear_token_weights(log_probs: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, top_b: int, xi: float,
                       weight: float) -> torch.Tensor:
    """(B, T) detached BEAR weights 1 + lambda * sigmoid((log p[y] - log beta) / xi) (module doc).

    Args:
        log_probs: (B, T, V) log-softmax over the valid tokens (-inf elsewhere).
        labels: (B, T) the target's tokens.
        valid: (B, T, V) bool, the valid tokens.
        top_b: B; xi, weight: the sigmoid's temperature and lambda.
    """
    with torch.no_grad():
        num_valid = valid.sum(dim=-1)                                                # (B, T)
        largest = log_probs.topk(min(top_b, log_probs.shape[-1]), dim=-1).values      # (B, T, b) best first
        cut = (num_valid.clamp(min=1, max=largest.shape[-1]) - 1).unsqueeze(-1)       # the B-th, or the last valid
        log_beta = largest.gather(-1, cut).squeeze(-1)                               # (B, T)
        gap = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_beta      # (B, T)
        return 1 + weight * torch.sigmoid(gap / xi)


@register("bear")
class BEARLoss(MaskedSoftmaxLoss):
    """MSL with each token weighted by where the target sits against the B-th best candidate (module doc)."""

    display_name = "BEAR"
    help = "MSL with beam-aware token weights: 1 + lambda x sigmoid(gap to the B-th best token / xi) (BEAR)"
    knobs = (BEAR_B, BEAR_XI, BEAR_LAMBDA)
    # the released code's defaults (cmd/run.py: topk_tau 1, topk_weight 1; K = 10, its beam); it publishes no
    # setting per dataset, and its README's example (xi 2.75, lambda 0.25) is for its Toy dataset
    paper_settings = {"tiger": {"office": {"bear_b": 10, "bear_xi": 1.0, "bear_lambda": 1.0}},
                      "llama": {"office": {"bear_b": 10, "bear_xi": 1.0, "bear_lambda": 1.0}}}

    def __call__(self, inputs: LossInputs) -> LossOutput:
        masked, labels, logits = self.masked_logits(inputs)                            # (B, T, V), (B, T)
        log_probs = torch.log_softmax(masked, dim=-1)                                  # -inf off the trie
        token_ce = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)             # (B, T)
        valid = masked > float("-inf")
        weights = bear_token_weights(log_probs, labels, valid, int(self.knob("bear_b")), self.knob("bear_xi"),
                                     self.knob("bear_lambda"))
        has_choice = valid.sum(dim=-1) > 1                                             # (B, T)
        loss = (weights * token_ce).sum() / (weights * has_choice).sum().clamp_min(1e-8)
        mean_weight = (weights * has_choice).sum() / has_choice.sum().clamp_min(1)  # no host sync (a mask index is one)
        return LossOutput(loss=loss, metrics={"loss": loss.detach(), "loss_msl": token_ce.mean().detach(),
                                              "loss_ce": plain_ce(logits, labels), "bear_weight": mean_weight})
