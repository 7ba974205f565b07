"""Reusing a trained model from other code: histories of item ids in, top-k item ids out.

    rec = apao_ray.load_recommender("models:/apao-office-tiger-apao_pointwise@best")
    rec.recommend([["12", "7", "301"]], k=10)   # -> [[("88", -1.23), ("5", -2.01), ...]]

A model loads from an MLflow URI, a final checkpoint directory or an ``export --format hf``
directory (its transformers weights are mapped back, ``export.from_hf_state``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .. import storage
from ..config import TrialConfig
from ..data import Catalog
from ..data.batches import encode_histories
from ..decoding import beam_search
from .export import TRIAL_CONFIG_FILE, from_hf_state
from .hf_generate import ITEM_MAP_FILE
from ..models import build_model
from ..protocol import decoding_scoring
from ..training.checkpoint import CONFIG_FILE, load_catalog_arrays, load_checkpoint
from ..training.precision import autocast, resolve_precision

# What a loaded model decodes in unless told otherwise: fp32, whatever the trial trained in. bf16
# autocast rounds per operation, so two implementations of one model (ours, the transformers export,
# in load_recommender, the served model and recommend_hf.py) rank near-ties differently: on this
# repo's tiny TIGER 22/40 top-10 lists of the export equalled ours in bf16, 40/40 in fp32.
INFERENCE_PRECISION = "fp32"
TRIAL_PRECISION = "trial"  # precision= value: decode in the trial's own precision


class Recommender:
    """A trained backbone + its catalog, recommending with the constrained beam search (SPEC §4).

    Attributes:
        config: the trial's configuration.
        catalog: the items the model can recommend.
        precision: ``fp32`` or ``bf16``, what the beam search computes in; by default fp32
            (``INFERENCE_PRECISION``), ``trial`` for the trial's own (its test metrics were computed
            so), ``auto`` resolved for ``device``.
    """

    def __init__(self, model: torch.nn.Module, catalog: Catalog, config: TrialConfig, device: str = "cpu",
                 precision: str | None = None) -> None:
        self.model = model.to(device).eval()
        self.catalog = catalog
        self.config = config
        self.device = torch.device(device)
        chosen = config.train.precision if precision == TRIAL_PRECISION else precision or INFERENCE_PRECISION
        self.precision = resolve_precision(chosen, self.device)
        self._tensors = catalog.tensors(self.device)
        self._item_tokens = catalog.item_tokens
        self._items_of_sem = items_of_semantic_ids(catalog)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, device: str = "cpu", precision: str | None = None) -> "Recommender":
        """Loads a final checkpoint directory (best weights, trial config, catalog): a local one, or one on a
        filesystem pyarrow reads (``s3://...``, ``storage``), read from a temporary copy."""
        if storage.is_remote(directory):
            with storage.local_copy(directory) as local:
                return cls.from_checkpoint(local, device, precision)
        directory = Path(directory)
        _, best_weights, _ = load_checkpoint(directory)  # verified: a damaged one is refused, saying why
        config = TrialConfig.from_dict(json.loads((directory / CONFIG_FILE).read_text()))
        item_ids, item_codes = load_catalog_arrays(directory)
        catalog = Catalog.from_codes(item_ids, item_codes)
        model = build_model(config.model, catalog.vocab_size, catalog.num_levels)
        model.load_state_dict(best_weights)
        return cls(model, catalog, config, device, precision)

    @classmethod
    def from_export(cls, directory: str | Path, device: str = "cpu", precision: str | None = None) -> "Recommender":
        """Loads an ``export --format hf`` directory: safetensors weights, item map, trial config."""
        from safetensors.torch import load_file  # lazy: safetensors, an optional extra (hf)

        directory = Path(directory)
        config = TrialConfig.from_dict(json.loads((directory / TRIAL_CONFIG_FILE).read_text()))
        mapping = json.loads((directory / ITEM_MAP_FILE).read_text())
        item_ids = list(mapping["items"])
        tokens = np.array([mapping["items"][item]["tokens"] for item in item_ids], dtype=np.int64)  # (I, T)
        catalog = Catalog.from_codes(item_ids, tokens - np.asarray(mapping["token_offsets"]))
        model = build_model(config.model, catalog.vocab_size, catalog.num_levels)
        from_hf_state(model, load_file(str(directory / "model.safetensors")))
        return cls(model, catalog, config, device, precision)

    def _history_matrix(self, histories: Sequence[Sequence[Any]], skip_unknown: bool) -> np.ndarray:
        """(B, H) left-padded item indices (-1 = pad) of the last max_history known items of each history."""
        max_history, index = self.config.data.max_history, self.catalog.item_index
        lengths = np.fromiter((len(h) for h in histories), dtype=np.int64, count=len(histories))
        flat = np.fromiter((index.get(str(item), -1) for history in histories for item in history),
                           dtype=np.int64, count=int(lengths.sum()))              # one dict lookup per item
        row_of = np.repeat(np.arange(len(histories)), lengths)
        is_unknown = flat < 0
        if is_unknown.any():
            if not skip_unknown:
                items = [item for history in histories for item in history]
                unknown = sorted({str(items[i]) for i in np.flatnonzero(is_unknown)})
                rows = np.unique(row_of[is_unknown])
                raise ValueError(f"{len(unknown)} item id(s) not in the model's catalog of {self.catalog.num_items} "
                                 f"items: {unknown[:20]}{' ...' if len(unknown) > 20 else ''} (in histories "
                                 f"{rows[:10].tolist()}); pass skip_unknown=True to leave them out")
            flat, row_of = flat[~is_unknown], row_of[~is_unknown]
            lengths = np.bincount(row_of, minlength=len(histories))
        # position of each item counted from its history's end: 0 = most recent
        ends = np.cumsum(lengths)
        from_end = ends[row_of] - 1 - np.arange(len(flat))
        keep = from_end < max_history
        width = max(1, int(min(lengths.max(initial=0), max_history)))
        matrix = np.full((len(histories), width), -1, dtype=np.int64)              # left-padded
        matrix[row_of[keep], width - 1 - from_end[keep]] = flat[keep]
        return matrix

    @torch.inference_mode()
    def recommend(self, histories: Sequence[Sequence[Any]], k: int = 10, beam_size: int | None = None,
                  batch_size: int = 256, skip_unknown: bool = False) -> list[list[tuple[str, float]]]:
        """Top-k items for each history, best first, with their log-probability scores.

        Args:
            histories: item ids (str or int), oldest first; truncated to the model's max_history.
            k: items per history (<= beam size).
            beam_size: beam width (default max(k, the trial's beam size)).
            batch_size: histories per beam search (one model call per code level each).
            skip_unknown: leave out item ids the catalog does not know (default: ValueError naming them).

        Returns:
            For each history, the items of its top-k semantic IDs, best first, each with its semantic ID's
            log-probability score: ``k`` counts semantic IDs, as the metrics do (a target counts as a hit when
            its semantic ID is among the top k), so every item of a semantic ID that several items share is
            returned, in catalog order, and a list may hold more than k items.
        """
        if not histories:
            return []
        beam_size = beam_size or max(k, self.config.train.beam_size)
        if not 1 <= k <= beam_size:
            raise ValueError(f"k={k} must be between 1 and the beam size {beam_size}")
        matrix = self._history_matrix(histories, skip_unknown)
        results: list[list[tuple[str, float]]] = []
        for start in range(0, len(matrix), batch_size):
            ids, mask = encode_histories(self._item_tokens, matrix[start:start + batch_size])
            with autocast(self.precision, self.device):
                beam = beam_search(self.model, ids.to(self.device), mask.to(self.device), self._tensors, beam_size,
                                   scoring=decoding_scoring(self.config))
            sem_ids, scores = beam.sem_ids[:, :k].cpu().tolist(), beam.scores[:, :k].cpu().tolist()  # (B, k)
            for sem_row, score_row in zip(sem_ids, scores):  # -1: fewer than k semantic IDs reachable
                results.append([(item, score) for sem, score in zip(sem_row, score_row) if sem >= 0
                                for item in self._items_of_sem[sem]])
        return results


def items_of_semantic_ids(catalog: Catalog) -> list[tuple[str, ...]]:
    """(U,) the item ids of each semantic ID, in catalog order (several where items share one)."""
    order = np.argsort(catalog.item_sem, kind="stable")                               # (I,) grouped by ID
    bounds = np.cumsum(np.bincount(catalog.item_sem, minlength=catalog.num_semantic_ids))[:-1]
    return [tuple(group) for group in np.split(np.asarray(catalog.item_ids, dtype=object)[order], bounds)]


def served_request(model_input: Any, k: Any, num_semantic_ids: int) -> tuple[list[list[str]], int]:
    """The histories (item ids as str) and k of a served request; ValueError naming what is wrong and what is allowed.

    Stricter than ``recommend``: a client's empty history or k beyond the distinct semantic IDs is a mistake to report.

    Args:
        model_input: a DataFrame (pyfunc's input) with a ``history`` column of item-id lists, oldest first.
        k: the requested number of semantic IDs (``recommend``'s k).
        num_semantic_ids: the model's distinct semantic IDs, the largest k allowed.
    """
    columns = list(getattr(model_input, "columns", []))
    if "history" not in columns:
        raise ValueError(f"input columns {columns} lack 'history': send one row per user with a 'history' list "
                         'of item ids, oldest first ({"dataframe_records": [{"history": ["12", "7"]}]})')
    histories: Iterable[Any] = model_input["history"]
    if isinstance(k, bool) or not isinstance(k, (int, float)) or k != int(k) or not 1 <= k <= num_semantic_ids:
        raise ValueError(f"k={k!r} must be an integer between 1 and {num_semantic_ids}, the model's distinct "
                         "semantic IDs")
    rows = []
    for row, history in enumerate(histories):
        if isinstance(history, (str, bytes)) or not hasattr(history, "__len__"):
            raise ValueError(f"history {row} is {history!r}: send a list of item ids, oldest first")
        if len(history) == 0:
            raise ValueError(f"history {row} is empty: send at least one item id of the model's catalog")
        rows.append([str(item) for item in history])
    return rows, int(k)


def load_local(directory: str | Path, device: str = "cpu", precision: str | None = None) -> Recommender:
    """Loads a local final-checkpoint directory or an ``export --format hf`` directory (``apao_ray.load_recommender``
    also takes MLflow URIs). ``precision`` (fp32/bf16/auto, or ``trial``: the trial's own) defaults to fp32, what
    the export and the served model decode in (``INFERENCE_PRECISION``)."""
    if (Path(directory) / TRIAL_CONFIG_FILE).is_file():  # an `export --format hf` directory
        return Recommender.from_export(directory, device, precision)
    return Recommender.from_checkpoint(directory, device, precision)
