"""Losses: one signature (LossInputs -> LossOutput), picked by name from ``LOSSES`` (SPEC §3).

Importing this package registers every loss module's classes in ``LOSSES``, then imports the modules
named in ``$APAO_PLUGINS`` (comma-separated, e.g. ``APAO_PLUGINS=my_losses``), so that a loss defined
outside the package registers itself in the driver and in every Ray worker (a local Ray's workers inherit
the driver's environment; a study passes the variable to a cluster's workers, whose nodes must be able to
import the modules: install them there or put them on the nodes' PYTHONPATH). docs/own-loss.md.
"""
import importlib as _importlib
import os as _os

from .apao import (AdaptivePrefixWeights, APAOPairwiseLoss, APAOPointwiseLoss, apao_pairwise_losses,
                   apao_pointwise_losses, prefix_scores)
from .base import LossInputs, LossOutput
from .bear import BEARLoss
from .ce import CrossEntropyLoss
from .msl import MaskedSoftmaxLoss, valid_token_mask
from .negatives import counted_negatives_mask, sample_negatives
from .preference import CESDPOLoss, DMPOLoss, DPOLoss, SDPOLoss
from .token_weighted import FrontGreaterTokenLoss
from .knobs import Knob
from .registry import LOSSES, Loss, build_loss, register
from ..names import PLUGINS_ENV


def import_plugins(names: str | None = None) -> list[str]:
    """Imports each module of ``names`` (comma-separated; None: ``$APAO_PLUGINS``), so their ``@register``
    runs; returns the module names. An unknown module fails naming it and the variable."""
    names = _os.environ.get(PLUGINS_ENV, "") if names is None else names
    modules = [name.strip() for name in names.split(",") if name.strip()]
    for module in modules:
        try:
            _importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or not module.startswith(error.name):  # a module the plugin imports is missing
                raise
            raise ModuleNotFoundError(f"{PLUGINS_ENV} names the module {module!r}, which cannot be imported "
                                      f"({error}); put it on PYTHONPATH or install it, or fix {PLUGINS_ENV}="
                                      f"{names!r}", name=module) from None
    return modules


import_plugins()

__all__ = [
    "LOSSES", "Knob", "Loss", "LossInputs", "LossOutput", "PLUGINS_ENV", "build_loss", "import_plugins", "register",
    "prefix_scores", "apao_pointwise_losses", "apao_pairwise_losses", "AdaptivePrefixWeights",
    "counted_negatives_mask", "sample_negatives", "valid_token_mask",
    "CrossEntropyLoss", "MaskedSoftmaxLoss", "APAOPointwiseLoss", "APAOPairwiseLoss",
    "DPOLoss", "DMPOLoss", "SDPOLoss", "CESDPOLoss", "BEARLoss", "FrontGreaterTokenLoss",
]
