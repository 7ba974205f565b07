"""Token cross-entropy, the baseline every other loss is compared with (SPEC §3, CE)."""
from __future__ import annotations

from .base import LossInputs, LossOutput
from .registry import Loss, register


@register("ce")
class CrossEntropyLoss(Loss):
    """L_CE = -(1 / (B T)) sum_b sum_t s^t_b, the mean token cross-entropy of the target.

    Only candidate 0 (the target) is read; no negatives, no reference, no state.
    """

    display_name = "CE"
    help = "token cross-entropy of the target item (the baseline)"
    num_negatives = 0

    def __call__(self, inputs: LossInputs) -> LossOutput:
        self.check_candidates(inputs)
        token_logp = self.token_log_probs(inputs, num_candidates=1)[:, 0]  # (B, T)
        loss = -token_logp.mean()
        return LossOutput(loss=loss, metrics={"loss": loss.detach(), "loss_ce": loss.detach()})
