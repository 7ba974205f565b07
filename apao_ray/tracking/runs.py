"""Runs of one experiment: ``Tracker`` (params, metrics, tags, artifacts, datasets, child runs).

All writes of a study happen in the driver process (see ``study/record/mlflow_callback.py``), so
concurrent trials never contend for the SQLite database.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from .models import ModelLogging
from .store import default_artifact_location, flatten

PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests children by
# The experiment's kind for MLflow 3 UIs that read it ("Machine learning": open on the runs table,
# not the GenAI overview). MLflow 3.17's UI ignores it for a global "GenAI | Model training" switch,
# remembered per browser, that a link sets with ?workflowType=machine_learning (mlflow_ui.runs_table_url)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
DATASET_CONTEXT_TAG = "mlflow.data.context"
_DIGEST_LENGTH = 36  # MLflow's datasets table holds a digest of at most 36 characters
_MAX_BATCH = 900  # log_batch accepts at most 1000 metrics


class Tracker(ModelLogging):
    """Thin wrapper over ``MlflowClient`` for one experiment; its logged models: :class:`ModelLogging`."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_location: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        existing = self.client.get_experiment_by_name(experiment)
        if existing is None:
            location = artifact_location or default_artifact_location(tracking_uri, experiment)
            try:  # created once, in the driver, before any trial starts
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
            except MlflowException:  # created concurrently by another driver
                self.experiment_id = self.client.get_experiment_by_name(experiment).experiment_id
        else:
            self.experiment_id = existing.experiment_id
        if existing is None or EXPERIMENT_KIND_TAG not in existing.tags:  # a kind the user chose stays
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)

    @classmethod
    def existing(cls, tracking_uri: str, experiment: str) -> "Tracker | None":
        """The experiment's Tracker if it exists; never creates anything (for checks before a run)."""
        if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[len("sqlite:///"):]).exists():
            return None
        if MlflowClient(tracking_uri).get_experiment_by_name(experiment) is None:
            return None
        return cls(tracking_uri, experiment)

    def find_run(self, tags: dict[str, str]) -> str | None:
        """The newest run whose tags match all of ``tags`` (how a resumed study finds its runs)."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], query, max_results=1, order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def start_run(self, name: str, tags: dict[str, str], params: dict[str, Any] | None = None,
                  parent_run_id: str | None = None) -> str:
        run_tags = dict(tags)
        if parent_run_id:
            run_tags[PARENT_TAG] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=run_tags)
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

    def reopen(self, run_id: str) -> None:
        self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start:start + 100])

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int) -> None:
        """Logs every finite numeric value of ``metrics`` at ``step``."""
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")]
        for start in range(0, len(items), _MAX_BATCH):
            self.client.log_batch(run_id, metrics=items[start:start + _MAX_BATCH])

    def log_dataset(self, run_id: str, record: dict[str, Any], context: str = "training") -> None:
        """Logs a dataset (see ``dataset_record``) as the run's input: the runs table's Dataset column."""
        inputs = [DatasetInput(dataset_entity(record), [InputTag(DATASET_CONTEXT_TAG, context)])]
        try:
            self.client.log_inputs(run_id, inputs)
        except MlflowException:
            # MLflow looks the dataset up, then inserts it: two studies of one dataset starting together on PostgreSQL
            # both inserted it, and the later one failed on the duplicate (measured); now it is there to be found
            time.sleep(1.0)
            self.client.log_inputs(run_id, inputs)

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client.get_metric_history(run_id, key)]

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, data: Any, artifact_file: str) -> None:
        self.client.log_dict(run_id, data, artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def log_table(self, run_id: str, columns: dict[str, list[Any]], artifact_file: str) -> None:
        """An MLflow table (``artifact_file``, ``.json``): the run's Artifacts tab shows it as a table."""
        self.client.log_table(run_id, columns, artifact_file)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def child_runs(self, parent_run_id: str | None = None, filter_string: str = "") -> list[Any]:
        parts = [f"tags.`{PARENT_TAG}` = '{parent_run_id}'"] if parent_run_id else [f"tags.`{PARENT_TAG}` != ''"]
        if filter_string:
            parts.append(filter_string)
        return list(self.client.search_runs([self.experiment_id], " and ".join(parts), max_results=50000))


def dataset_record(name: str, checksums: dict[str, str], split_sizes: dict[str, int], source: str,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A dataset as MLflow records it: a plain (picklable) dict for ``Tracker.log_dataset``.

    Args:
        name: the dataset's name (``office``).
        checksums: file name -> SHA-256 of that file; the digest is the SHA-256 over them (sorted by
            name), so it changes exactly when a file does. Empty for a generated dataset: then the
            digest covers the name and split sizes.
        split_sizes: split name -> number of samples (the profile shows them).
        source: where the files are (a directory), or what generated them.
        extra: more profile entries (items, users, ...).
    """
    lines = [f"{file}:{digest}" for file, digest in sorted(checksums.items())] or \
        [f"{name}:{split}={size}" for split, size in sorted(split_sizes.items())]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    profile = {f"{split}_samples": int(size) for split, size in split_sizes.items()}
    profile.update({"num_rows": int(sum(split_sizes.values())), **(extra or {}),
                    "sha256": dict(sorted(checksums.items())), "combined_sha256": digest})
    return {"name": name, "digest": digest[:_DIGEST_LENGTH], "source_type": "local" if checksums else "code",
            "source": json.dumps({"uri": source}), "profile": json.dumps(profile)}


def dataset_entity(record: dict[str, Any]) -> Dataset:
    return Dataset(record["name"], record["digest"], record["source_type"], record["source"],
                   record.get("schema"), record.get("profile"))
