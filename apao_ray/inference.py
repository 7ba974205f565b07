"""Reusing a trained model from other code: histories of item ids in, top-k item ids out.

    rec = apao_ray.load_recommender("models:/apao-office-tiger-apao_pointwise@best")
    rec.recommend([["12", "7", "301"]], k=10)   # -> [[("88", -1.23), ("5", -2.01), ...]]
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .config import TrialConfig
from .data import Catalog
from .data.batches import encode_histories
from .decoding import beam_search
from .protocol import decoding_scoring
from .training.checkpoint import BEST_MODEL_FILE, CONFIG_FILE, load_catalog_arrays
from .training.precision import autocast, resolve_precision


class Recommender:
    """A trained backbone + its catalog, recommending with the constrained beam search (SPEC §4).

    Attributes:
        config: the trial's configuration.
        catalog: the items the model can recommend.
        precision: ``fp32`` or ``bf16``, what the beam search computes in; by default the
            trial's own (its test metrics were computed so), ``auto`` resolved for ``device``.
    """

    def __init__(self, model: torch.nn.Module, catalog: Catalog, config: TrialConfig, device: str = "cpu",
                 precision: str | None = None) -> None:
        self.model = model.to(device).eval()
        self.catalog = catalog
        self.config = config
        self.device = torch.device(device)
        self.precision = resolve_precision(precision or config.train.precision, self.device)
        self._tensors = catalog.tensors(self.device)
        self._item_tokens = catalog.item_tokens

    @classmethod
    def from_checkpoint(cls, directory: str | Path, device: str = "cpu", precision: str | None = None) -> "Recommender":
        """Loads a final checkpoint directory (best weights, trial config, catalog)."""
        from .models import build_model

        directory = Path(directory)
        config = TrialConfig.from_dict(json.loads((directory / CONFIG_FILE).read_text()))
        item_ids, item_codes = load_catalog_arrays(directory)
        catalog = Catalog.from_codes(item_ids, item_codes)
        model = build_model(config.model, catalog.vocab_size, catalog.num_levels)
        model.load_state_dict(torch.load(directory / BEST_MODEL_FILE, map_location="cpu", weights_only=True))
        return cls(model, catalog, config, device, precision)

    def _history_matrix(self, histories: Sequence[Sequence[Any]]) -> np.ndarray:
        max_history = self.config.data.max_history
        rows = []
        for row, history in enumerate(histories):
            indices = []
            for item in list(history)[-max_history:]:
                index = self.catalog.item_index.get(str(item))
                if index is None:
                    raise ValueError(f"history {row} contains item {item!r}, which is not in the model's catalog "
                                     f"of {self.catalog.num_items} items")
                indices.append(index)
            rows.append(indices)
        width = max(1, max(len(r) for r in rows))
        matrix = np.full((len(rows), width), -1, dtype=np.int64)                   # left-padded
        for row, indices in enumerate(rows):
            if indices:
                matrix[row, width - len(indices):] = indices
        return matrix

    @torch.inference_mode()
    def recommend(self, histories: Sequence[Sequence[Any]], k: int = 10, beam_size: int | None = None,
                  batch_size: int = 256) -> list[list[tuple[str, float]]]:
        """Top-k items for each history, best first, with their log-probability scores.

        Args:
            histories: item ids (str or int), oldest first; truncated to the model's max_history.
            k: items per history (<= beam size).
            beam_size: beam width (default max(k, the trial's beam size)).

        Returns:
            For each history, up to k ``(item_id, score)`` pairs. Items sharing one semantic ID
            are represented by the first of them in catalog order.
        """
        if not histories:
            return []
        beam_size = beam_size or max(k, self.config.train.beam_size)
        if not 1 <= k <= beam_size:
            raise ValueError(f"k={k} must be between 1 and the beam size {beam_size}")
        matrix = self._history_matrix(histories)
        results: list[list[tuple[str, float]]] = []
        for start in range(0, len(matrix), batch_size):
            ids, mask = encode_histories(self._item_tokens, matrix[start:start + batch_size])
            with autocast(self.precision, self.device):
                beam = beam_search(self.model, ids.to(self.device), mask.to(self.device), self._tensors, beam_size,
                                   scoring=decoding_scoring(self.config))
            sem_ids, scores = beam.sem_ids[:, :k].cpu().numpy(), beam.scores[:, :k].cpu().numpy()
            for sem_row, score_row in zip(sem_ids, scores):
                results.append([(self.catalog.item_ids[self.catalog.sem_items[s]], float(v))
                                for s, v in zip(sem_row, score_row) if s >= 0])
        return results


def load_recommender(model_uri: str, device: str = "cpu", precision: str | None = None) -> Recommender:
    """Loads a model logged by a study: an MLflow URI (``runs:/<id>/model``, ``models:/<name>@best``)
    or a local final-checkpoint directory. ``precision`` (fp32/bf16/auto) defaults to the trial's."""
    if Path(model_uri).is_dir():
        return Recommender.from_checkpoint(model_uri, device, precision)
    from .tracking import load_checkpoint_dir_from_model

    return Recommender.from_checkpoint(load_checkpoint_dir_from_model(model_uri), device, precision)
