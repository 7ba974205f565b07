"""Checks of a trial config against its dataset's catalog, before anything trains (the sweep checks every
method this way before its plan's probe; ``train`` before its one trial)."""
from __future__ import annotations

from typing import Any

from ..config import TrialConfig
from ..losses import LOSSES, build_loss


def check_against_catalog(config: TrialConfig, catalog: Any, requested_negatives: int | None = None) -> None:
    """Refuses negatives or a beam the catalog cannot supply, naming the values."""
    num_negatives = build_loss(config.loss, catalog.tensors()).num_negatives
    if requested_negatives is not None and num_negatives == 0:
        using = sorted(name for name, loss in LOSSES.items() if loss.uses_negatives)
        raise ValueError(f"--num-negatives {requested_negatives} was given, but loss {config.loss.name!r} uses no "
                         f"negatives; use it with one of {using}")
    if num_negatives >= catalog.num_semantic_ids:
        raise ValueError(f"num_negatives={num_negatives} must be < the {catalog.num_semantic_ids} semantic IDs "
                         f"of {config.data.dataset!r}")
    if config.train.beam_size > catalog.num_semantic_ids:
        raise ValueError(f"beam_size={config.train.beam_size} exceeds the {catalog.num_semantic_ids} semantic IDs "
                         f"of {config.data.dataset!r}")
