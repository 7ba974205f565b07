"""Datasets: files -> item catalog + leave-one-out splits -> batches."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .catalog import BOS_TOKEN, EOS_TOKEN, NUM_SPECIAL_TOKENS, PAD_TOKEN, Catalog, CatalogTensors
from .files import (SYNTHETIC, DatasetFiles, canonical_dataset, dataset_label, index_sequences, is_dataset_path,
                    known_dataset_names, locate, locate_directory, parse_index, parse_interactions)
from .splits import SPLIT_NAMES, Split, build_splits
from .synthetic import make_synthetic
from .tables import DEFAULT_MIN_INTERACTIONS, table_sequences

__all__ = ["Batch", "Catalog", "CatalogTensors", "Dataset", "ResidentSplit", "Split", "collate", "iter_batches",
           "load_dataset", "known_dataset_names", "PAD_TOKEN", "EOS_TOKEN", "BOS_TOKEN",
           "NUM_SPECIAL_TOKENS", "SPLIT_NAMES", "canonical_dataset", "dataset_label", "is_dataset_path",
           "read_sequences"]

_BATCHES = frozenset({"Batch", "ResidentSplit", "collate", "iter_batches"})  # from .batches, which imports torch


def __getattr__(name: str):
    """``Batch``, ``ResidentSplit``, ``collate`` and ``iter_batches`` on first use: a study's driver, ``--help`` and the CLIs that
    read MLflow load datasets without torch (~1 s of CPU per process)."""
    if name in _BATCHES:
        from . import batches  # lazy: torch, see above

        return getattr(batches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded dataset.

    Attributes:
        name: canonical lower-case name.
        catalog: items and their semantic IDs.
        splits: "train", "valid", "test".
        user_ids: external user ids, index = ``Split.users``.
        num_interactions: total interactions in the file.
        checksums: file name -> SHA-256 of the files read (empty for synthetic).
        notes: how a dataset directory was read (five-core filter, semantic-ID source), for stats.
        data_dir: the absolute directory a dataset named by name was found (or downloaded) in, which the processes
            that train are given (``DataConfig.data_dir``); None for synthetic data and a dataset given as a path.
    """

    name: str
    catalog: Catalog
    splits: dict[str, Split]
    user_ids: tuple[str, ...]
    num_interactions: int
    checksums: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    data_dir: str | None = None

    def stats(self) -> dict[str, object]:
        num_users, num_items = len(self.user_ids), self.catalog.num_items
        collisions = self.catalog.collisions()
        return {
            "dataset": self.name,
            "users": num_users,
            "items": num_items,
            "interactions": self.num_interactions,
            "density": self.num_interactions / (num_users * num_items),
            "distinct_semantic_ids": self.catalog.num_semantic_ids,
            "colliding_semantic_ids": len(collisions),
            "items_in_collisions": sum(len(items) for items in collisions.values()),
            "codes_per_level": list(self.catalog.level_sizes),
            "train_samples": len(self.splits["train"]),
            "valid_samples": len(self.splits["valid"]),
            "test_samples": len(self.splits["test"]),
            **self.notes,
        }


def read_sequences(files: DatasetFiles, item_index: dict[str, int],
                   min_interactions: int | None = None) -> tuple[list[str], list, dict[str, str]]:
    """User ids, item-index sequences and notes from ``<Name>.inter.json`` or an interactions table.

    A table goes through the k-core filter (``data.tables``) with ``min_interactions``, by default
    the value ``tokenize`` recorded in the index's meta file, else 5.
    """
    meta = json.loads(files.meta_path.read_text()) if files.meta_path else {}
    notes = {"semantic_ids": str(meta["embedding"])} if "embedding" in meta else {}
    if not files.is_table:
        users, sequences = parse_interactions(files.inter_path, item_index, files.index_path)
        return users, sequences, notes
    core = min_interactions or int(meta.get("min_interactions", DEFAULT_MIN_INTERACTIONS))
    table = table_sequences(files.inter_path, core)
    users, sequences = index_sequences(table.sequences, item_index, files.inter_path, files.index_path)
    return users, sequences, {"filter": table.describe(), **notes}


def load_dataset(name: str, data_dir: str | None = None, max_history: int = 20,
                 synthetic_seed: int = 0, allow_download: bool = True,
                 min_interactions: int | None = None) -> Dataset:
    """Loads a dataset by name (office, grocery, beauty, yelp, synthetic; any case) or directory path.

    Files are searched in ``data_dir``, ``$APAO_DATA_DIR``, ``./data`` and the user cache, and
    downloaded (checksummed) when absent. A path (``./mine``, ``/data/mine``) is a directory
    read by ``files.locate_directory`` (only without ``data_dir``); its interactions table is
    five-core filtered (``min_interactions``, see ``read_sequences``). Raises ValueError naming
    the file and key at fault.
    """
    if not isinstance(name, str):
        raise ValueError(f"dataset name must be a string, got {name!r}")
    notes: dict[str, str] = {}
    found_in = None
    if name.lower() == SYNTHETIC:
        item_ids, codes, user_ids, sequences = make_synthetic(seed=synthetic_seed)
        checksums: dict[str, str] = {}
    else:
        # with a data_dir, a name stays inside it (a path there is rejected, never followed out of it)
        by_path = is_dataset_path(name) and not data_dir
        files = locate_directory(name) if by_path else locate(name, data_dir, allow_download=allow_download)
        item_ids, codes = parse_index(files.require_index())
        item_index = {item: i for i, item in enumerate(item_ids)}
        user_ids, sequences, notes = read_sequences(files, item_index, min_interactions)
        checksums = files.checksums()
        found_in = None if by_path else str(files.inter_path.parent.parent.resolve())
    catalog = Catalog.from_codes(item_ids, codes)
    splits = build_splits(sequences, max_history=max_history)
    return Dataset(name=dataset_label(name), catalog=catalog, splits=splits, user_ids=tuple(user_ids),
                   num_interactions=int(sum(len(s) for s in sequences)), checksums=checksums, notes=notes,
                   data_dir=found_in)
