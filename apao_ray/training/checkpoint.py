"""Checkpoint directories: everything needed to continue a trial exactly where it stopped.

A checkpoint directory holds ``state.pt`` (model, optimizer, scheduler, loss state such as the
adaptive weights, torch RNG, epoch, early-stopping state, the metric history), ``best_model.pt``
(weights of the best validation epoch so far, so the final test never needs an older
checkpoint), ``reference_model.pt`` in a preference stage, and ``trial_config.json``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"
BEST_MODEL_FILE = "best_model.pt"
REFERENCE_MODEL_FILE = "reference_model.pt"
CONFIG_FILE = "trial_config.json"
FINAL_METRICS_FILE = "final_metrics.json"
CATALOG_FILE = "catalog.npz"


def save_checkpoint(directory: str | os.PathLike, state: dict[str, Any], best_model_state: dict[str, Any],
                    trial_config: dict[str, Any], reference_state: dict[str, Any] | None = None) -> Path:
    """Writes a checkpoint atomically: into ``<dir>.tmp`` first, then renamed."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / STATE_FILE)
    torch.save(best_model_state, tmp / BEST_MODEL_FILE)
    if reference_state is not None:
        torch.save(reference_state, tmp / REFERENCE_MODEL_FILE)
    (tmp / CONFIG_FILE).write_text(json.dumps(trial_config, indent=2, sort_keys=True))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def load_checkpoint(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Returns (state, best_model_state, reference_state or None)."""
    directory = Path(directory)
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
    best = torch.load(directory / BEST_MODEL_FILE, map_location="cpu", weights_only=True)
    reference_path = directory / REFERENCE_MODEL_FILE
    reference = torch.load(reference_path, map_location="cpu", weights_only=True) if reference_path.exists() else None
    return state, best, reference


def latest_checkpoint_in(root: str | os.PathLike) -> Path | None:
    """The newest ``epoch_XXXX[_final]`` checkpoint under ``root`` (plain, non-Ray runs)."""
    candidates = sorted(Path(root).glob("epoch_[0-9][0-9][0-9][0-9]*"))
    return candidates[-1] if candidates else None


def save_catalog(directory: str | os.PathLike, item_ids: tuple[str, ...], item_codes: Any) -> None:
    """Stores the item catalog beside the weights so a saved model recommends on its own."""
    np.savez_compressed(Path(directory) / CATALOG_FILE, item_ids=np.asarray(item_ids, dtype=str), item_codes=item_codes)


def load_catalog_arrays(directory: str | os.PathLike) -> tuple[list[str], Any]:
    with np.load(Path(directory) / CATALOG_FILE) as arrays:
        return [str(i) for i in arrays["item_ids"]], arrays["item_codes"]
