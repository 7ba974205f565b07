"""Losses: one signature (LossInputs -> LossOutput), picked by name from ``LOSSES`` (SPEC §3).

Importing this package registers every loss module's classes in ``LOSSES``.
"""
from .apao import (AdaptivePrefixWeights, APAOPairwiseLoss, APAOPointwiseLoss, apao_pairwise_losses,
                   apao_pointwise_losses, prefix_scores)
from .base import LossInputs, LossOutput
from .ce import CrossEntropyLoss
from .msl import MaskedSoftmaxLoss, valid_token_mask
from .negatives import counted_negatives_mask, sample_negatives
from .preference import CESDPOLoss, DMPOLoss, DPOLoss, SDPOLoss
from .registry import LOSSES, Loss, build_loss, register

__all__ = [
    "LOSSES", "Loss", "LossInputs", "LossOutput", "build_loss", "register",
    "prefix_scores", "apao_pointwise_losses", "apao_pairwise_losses", "AdaptivePrefixWeights",
    "counted_negatives_mask", "sample_negatives", "valid_token_mask",
    "CrossEntropyLoss", "MaskedSoftmaxLoss", "APAOPointwiseLoss", "APAOPairwiseLoss",
    "DPOLoss", "DMPOLoss", "SDPOLoss", "CESDPOLoss",
]
