"""Pruned trials tested on their best checkpoint so far: a pruned trial still says how it does on test.

ASHA stops a trial mid-way, before its own final test. After the Tuner ends, each pruned trial's newest
checkpoint up to the epoch it was pruned at (which holds the weights of its best validation epoch so far)
is tested in a Ray task with the trial's resources, and the test metrics are logged to its MLflow run at
that epoch. A worker can train and save one more epoch before the stop reaches it; that checkpoint's
validation result never reached Tune or MLflow, so it is not the one tested.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ... import storage
from ...analysis.export import trial_record
from ...analysis.outcome import PRUNED_STATE, Outcome
from ...names import train_run_name
from ...training.checkpoint import CONFIG_FILE, load_checkpoint, newest_checkpoint_at, say_on_stderr
from ..record.outcomes import PRUNED_EPOCH_TAG, TRIAL_TAG
from ...config import TrialConfig

TESTED_TAG = "apao.tested_on"
TEST_TIMEOUT_S = 3600


def latest_checkpoint(train_root: str | Path, trial_id: str, up_to_epoch: int | None = None) -> str | None:
    """The newest per-epoch checkpoint of a trial's Train run (``epoch_XXXX``) at or before ``up_to_epoch``
    (any epoch if None) that loads, if one was saved: a location (``storage``) under ``train_root`` (a damaged one
    is set aside, saying so, and an older one used)."""
    return newest_checkpoint_at(storage.join(train_root, train_run_name(trial_id)), say_on_stderr, up_to_epoch)


def evaluate_checkpoint(location: str, num_threads: int = 1, dataset_files: Any = None) -> dict[str, float]:
    """Test metrics of the best weights in a checkpoint directory (a location, ``storage``), plus ``best/epoch``
    (their epoch); the dataset from this node's files, else from ``dataset_files`` (shipped by the driver)."""
    with storage.local_copy(location) as directory:
        return _evaluate(directory, num_threads, dataset_files)


def _evaluate(directory: Path, num_threads: int, dataset_files: Any) -> dict[str, float]:
    import torch

    from ...models import build_model
    from ...training.evaluation import evaluate_split
    from ...training.worker import DATASET_FILES_KEY, limit_threads, trial_dataset

    limit_threads(num_threads)
    config = TrialConfig.from_dict(json.loads((Path(directory) / CONFIG_FILE).read_text()))
    dataset = trial_dataset({DATASET_FILES_KEY: dataset_files}, config)  # in a Ray task, on any node
    state, best_weights, _ = load_checkpoint(directory)
    device = torch.device("cuda" if config.train.use_gpu and torch.cuda.is_available() else "cpu")
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels)
    model.load_state_dict(best_weights)
    model.to(device).eval()
    metrics = evaluate_split(model, dataset, "test", dataset.catalog.tensors(device), config.train, device, None)
    return {**metrics, "best/epoch": float(state["best_epoch"])}


def evaluate_pruned_trials(tracker: Any, parent_run_id: str, train_root: str, num_cpus: float, num_gpus: float,
                           dataset_files: Any = None) -> int:
    """Tests every pruned trial of the study that has no test metrics yet; returns how many it tested.
    ``dataset_files``: the dataset's files the driver ships (data/shipped.py), if any."""
    import ray

    runs = [run for run in tracker.child_runs(parent_run_id)
            if (outcome := Outcome(trial_record(run))).state == PRUNED_STATE and not outcome.tested]
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(evaluate_checkpoint)
    pending = {}
    shipped = ray.put(dataset_files) if runs and dataset_files is not None else None  # once for every test
    for run in runs:
        pruned_at = run.data.tags.get(PRUNED_EPOCH_TAG)
        checkpoint = latest_checkpoint(train_root, run.data.tags[TRIAL_TAG], int(pruned_at) if pruned_at else None)
        if checkpoint is not None:  # pruned before its first checkpoint: nothing to test
            pending[run.info.run_id] = remote.remote(checkpoint, max(1, round(num_cpus)), shipped)
    for run_id, task in pending.items():
        try:
            metrics = ray.get(task, timeout=TEST_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:  # never scheduled (CPUs held elsewhere): say so, do not hang
            ray.cancel(task, force=True)
            tracker.set_tags(run_id, {TESTED_TAG: f"not tested: its test did not end within {TEST_TIMEOUT_S} s"})
            continue
        epoch = int(metrics["best/epoch"])
        tracker.log_metrics(run_id, {k: v for k, v in metrics.items() if k.startswith("test/")}, epoch)
        tracker.set_tags(run_id, {TESTED_TAG: f"its best checkpoint before pruning (epoch {epoch})"})
    return len(pending)
