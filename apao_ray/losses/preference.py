"""Preference baselines on whole items: DPO, DMPO, S-DPO, and one-stage CE + lambda S-DPO (SPEC §3).

An item's log-likelihood is the sum of its T code log-probs, log pi(e) = S^T(e), and its
implicit reward is r(e) = beta_pref * (log pi(e) - log pi_ref(e)) against a frozen copy pi_ref
of the CE-trained model. The two-stage schedule (CE for ``pretrain_ce_epochs``, then freeze the
reference and switch to this loss) belongs to the training loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import LossConfig
from ..data.catalog import CatalogTensors
from .base import LossInputs, LossOutput
from .knobs import BETA, NUM_NEGATIVES
from .registry import Loss, at_least_float32, register


class _PreferenceLoss(Loss):
    """Shared plumbing: rewards (B, C) -> per-row loss (B,), batch mean, reward metrics."""

    needs_reference = True
    needs_ce_stage = True  # the reference is the CE stage's model
    uses_negatives = True
    metric_name = ""

    def __init__(self, config: LossConfig, catalog: CatalogTensors) -> None:
        super().__init__(config, catalog)
        self.beta_pref = config.beta_pref
        self.num_negatives = config.num_negatives

    def rewards(self, token_logp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """(B, C, T) label log-probs -> (B, C) rewards r(e) = beta_pref * (log pi(e) - log pi_ref(e))."""
        ref = inputs.ref_token_logp
        if ref is None:
            if self.needs_reference:
                raise ValueError(f"loss {self.name!r} needs inputs.ref_token_logp, the (B, C, T) label log-probs "
                                 "of the frozen reference (CE) model; got None. Train CE first "
                                 "(LossConfig.pretrain_ce_epochs > 0) and score the candidates with "
                                 "its frozen copy")
            return self.beta_pref * token_logp.sum(dim=-1)                  # uniform pi_ref: cancels in r_j - r_+
        if ref.shape != token_logp.shape:
            raise ValueError(f"loss {self.name!r}: ref_token_logp must have shape {tuple(token_logp.shape)} "
                             f"(B, C, T), got {tuple(ref.shape)}")
        return self.beta_pref * (token_logp.sum(dim=-1) - at_least_float32(ref.detach()).sum(dim=-1))  # (B, C)

    def row_losses(self, rewards: torch.Tensor) -> torch.Tensor:
        """(B, 1 + N) rewards, positive first -> (B,) per-row preference loss."""
        raise NotImplementedError

    def __call__(self, inputs: LossInputs) -> LossOutput:
        self.check_candidates(inputs)
        token_logp = self.token_log_probs(inputs)                          # (B, C, T)
        rewards = self.rewards(token_logp, inputs)                          # (B, C)
        loss_pref = self.row_losses(rewards).mean()
        loss_ce = -token_logp[:, 0].mean()
        loss = self.combine(loss_ce, loss_pref)
        with torch.no_grad():
            positive, negative = rewards[:, 0], rewards[:, 1:]              # (B,), (B, N)
            metrics = {
                "loss": loss.detach(), "loss_ce": loss_ce.detach(), f"loss_{self.metric_name}": loss_pref.detach(),
                "reward_margin": (positive - negative.mean(dim=1)).mean(),
                "reward_accuracy": (positive > negative.amax(dim=1)).float().mean(),
            }
        return LossOutput(loss=loss, metrics=metrics)

    def combine(self, loss_ce: torch.Tensor, loss_pref: torch.Tensor) -> torch.Tensor:
        return loss_pref


@register("dpo")
class DPOLoss(_PreferenceLoss):
    """DPO with one negative: -log sigma(r(e_+) - r(e_-)), batch mean."""

    display_name = "DPO"
    help = "two-stage: CE, then DPO against one sampled negative"
    metric_name = "dpo"

    def __init__(self, config: LossConfig, catalog: CatalogTensors) -> None:
        super().__init__(config, catalog)
        self.num_negatives = 1

    def row_losses(self, rewards: torch.Tensor) -> torch.Tensor:
        return -F.logsigmoid(rewards[:, 0] - rewards[:, 1])


@register("dmpo")
class DMPOLoss(_PreferenceLoss):
    """DMPO: the positive against the mean over N negatives, -log sigma(r_+ - (1/N) sum_j r_j)."""

    display_name = "DMPO"
    help = "two-stage: CE, then DMPO, the positive against the mean of N negatives"
    knobs = (NUM_NEGATIVES,)
    metric_name = "dmpo"

    def row_losses(self, rewards: torch.Tensor) -> torch.Tensor:
        return -F.logsigmoid(rewards[:, 0] - rewards[:, 1:].mean(dim=1))


@register("sdpo")
class SDPOLoss(_PreferenceLoss):
    """S-DPO (paper Eq. s_dpo): -log sigma(-log sum_j exp(r_j - r_+)), batch mean."""

    display_name = "S-DPO"
    help = "two-stage: CE, then S-DPO, softmax DPO over N negatives"
    knobs = (NUM_NEGATIVES,)
    metric_name = "sdpo"

    def row_losses(self, rewards: torch.Tensor) -> torch.Tensor:
        gaps = rewards[:, 1:] - rewards[:, :1]                              # (B, N) r_j - r_+
        return -F.logsigmoid(-torch.logsumexp(gaps, dim=1))


@register("ce_sdpo")
class CESDPOLoss(SDPOLoss):
    """One-stage L_CE + lambda * L_S-DPO with lambda = ``config.beta`` (paper Table 3).

    Needs no reference: without ``ref_token_logp`` pi_ref is uniform over items, whose log
    cancels in r_j - r_+; a given ``ref_token_logp`` is used.
    """

    display_name = "CE+S-DPO"
    help = "one stage: CE + beta x S-DPO over N negatives, no reference model"
    knobs = (BETA, NUM_NEGATIVES)
    needs_reference = False
    needs_ce_stage = False

    def combine(self, loss_ce: torch.Tensor, loss_pref: torch.Tensor) -> torch.Tensor:
        return loss_ce + self.config.beta * loss_pref
