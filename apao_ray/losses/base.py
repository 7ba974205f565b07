"""What every loss consumes and returns. The model never calls the loss."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LossInputs:
    """Model outputs for one batch, with candidate 0 of every row the positive (the target).

    Attributes:
        logits: (B, C, T, V) teacher-forced next-token logits of C = 1 + N candidates, in the
            model's dtype (bf16 under bf16 autocast): a loss upcasts what it needs
            (``label_log_probs`` and ``at_least_float32`` do).
        candidates: (B, C, T) token ids of the candidates' semantic IDs.
        candidate_nodes: (B, C, T + 1) trie node id of each candidate's length-m prefix
            (m = 0..T, as ``Catalog.leaf_prefix_nodes``); for masking duplicate prefixes and MSL.
        ref_token_logp: (B, C, T) label log-probs under the frozen reference model, for the
            preference losses; None otherwise.
    """

    logits: torch.Tensor
    candidates: torch.Tensor
    candidate_nodes: torch.Tensor
    ref_token_logp: torch.Tensor | None = None


@dataclass
class LossOutput:
    """A scalar to minimise plus detached values to log.

    Attributes:
        loss: scalar with grad.
        metrics: detached scalars, MLflow-safe names without the ``train/`` prefix
            (e.g. ``loss_ce``, ``loss_apao``, ``loss_prefix_m1``, ``apao_weight_m1``).
        prefix_losses: (T,) detached per-prefix losses L_m, for the adaptive weight update.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    prefix_losses: torch.Tensor | None = None
