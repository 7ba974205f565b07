"""Per-user test tables: read them, and recompute one from a finished trial's checkpoint for runs
made before trials logged ``per_user_test.csv.gz``."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from ..config import TrialConfig
from ..data import load_dataset
from ..names import PER_USER_FILE
from ..protocol import decoding_scoring
from ..rank_metrics import PER_USER_CUTOFFS, PER_USER_METRICS, rank_metrics_at
from ..training.checkpoint import CONFIG_FILE, load_checkpoint


def read_per_user(path: str | os.PathLike) -> pd.DataFrame:
    """A per-user table (gzip CSV) with ``user`` read as text (ids such as ``007`` stay as written).

    A registered metric (``PER_USER_METRICS``) that the table lacks, as one written before the metric was
    registered, is computed from its ``rank`` column: the beam rank the written metrics came from (-1: absent),
    so the values are those the table would have held. Columns of other rankings (``<metric>_by_<rule>``,
    ``full_sort_<metric>``) cannot be, and stay absent.
    """
    table = pd.read_csv(path, dtype={"user": str})
    missing = [c for c in ("user", "rank") if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: not a per-user test table, columns {missing} are missing "
                         f"(has {list(table.columns)})")
    ranks = table["rank"].to_numpy()
    for name, (metric, k) in rank_metrics_at(PER_USER_CUTOFFS).items():
        if name not in table.columns:
            table[name] = metric.per_user(ranks, k)
    return table


def recompute_per_user(checkpoint_dir: str | os.PathLike, num_threads: int = 1) -> tuple[dict[str, float], dict[str, Any]]:
    """Tests the best weights of a final checkpoint again and returns (test metrics, per-user table).

    The checkpoint's own config decides the dataset, model, precision and decoding, so the means of
    the table equal the trial's logged ``test/*`` metrics (checked by the export, which says so).

    Args:
        checkpoint_dir: an ``epoch_XXXX_final`` directory (or a logged model's ``checkpoint`` artifact).
        num_threads: torch threads for the evaluation.
    """
    # lazy: torch (and the modules that import it), only when a table is recomputed; the report and
    # every command's parser import this module
    import torch

    from ..models import build_model
    from ..training.evaluation import evaluate_split_per_user
    from ..training.precision import resolve_precision

    directory = Path(checkpoint_dir)
    if not (directory / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{directory} is not a trial checkpoint: it has no {CONFIG_FILE}")
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        config = TrialConfig.from_dict(json.loads((directory / CONFIG_FILE).read_text()))
        device = torch.device("cuda" if config.train.use_gpu and torch.cuda.is_available() else "cpu")
        # a final checkpoint holds the resolved precision; 'auto' only in a config saved before that
        config = config.replace(train=config.train.replace(precision=resolve_precision(config.train.precision, device)))
        dataset = load_dataset(config.data.dataset, config.data.data_dir, config.data.max_history,
                               config.data.synthetic_seed)
        _, best_weights, _ = load_checkpoint(directory)
        model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels)
        model.load_state_dict(best_weights)
        model.to(device).eval()
        return evaluate_split_per_user(model, dataset, "test", dataset.catalog.tensors(device), config.train, device,
                                       None, decoding_scoring(config))
    finally:
        torch.set_num_threads(previous)


__all__ = ["PER_USER_FILE", "PER_USER_METRICS", "read_per_user", "recompute_per_user"]
