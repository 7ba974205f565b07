"""MLflow: the only module that imports it. Runs, metrics, artifacts, the logged model.

All writes of a study happen in the driver process (see ``study/run/mlflow_callback.py``), so
concurrent trials never contend for the SQLite database.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import pandas as pd
from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelStatus, Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from .paths import DEFAULT_DB_NAME, TRACKING_URI_ENV

PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests children by
MODEL_NAME = "model"
# The experiment's kind for MLflow 3 UIs that read it ("Machine learning": open on the runs table,
# not the GenAI overview). MLflow 3.17's UI ignores it for a global "GenAI | Model training" switch,
# remembered per browser, that a link sets with ?workflowType=machine_learning (mlflow_ui.runs_table_url)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
DATASET_CONTEXT_TAG = "mlflow.data.context"
_DIGEST_LENGTH = 36  # MLflow's datasets table holds a digest of at most 36 characters
_MAX_BATCH = 900  # log_batch accepts at most 1000 metrics


def resolve_tracking_uri(uri: str | None = None) -> str:
    """``--tracking-uri`` > ``$MLFLOW_TRACKING_URI`` > ``sqlite:///<cwd>/mlflow.db``, made absolute.

    Inside a trial the working directory is a per-trial folder, so a relative SQLite path would
    create a second database: every path is resolved here, in the driver.
    """
    uri = uri or os.environ.get(TRACKING_URI_ENV) or DEFAULT_DB_NAME
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        return "sqlite:///" + str(Path(path).expanduser().resolve()) if not path.startswith("/") else uri
    if uri.startswith(("http://", "https://", "databricks", "postgresql", "mysql", "mssql")):
        return uri
    if uri.startswith("file:") or "://" in uri:
        raise ValueError(f"tracking URI {uri!r} is not supported: use a SQLite file (sqlite:////abs/mlflow.db or a "
                         "plain path), a database URI, or an MLflow server http://host:port (MLflow 3 refuses file stores)")
    return "sqlite:///" + str(Path(uri).expanduser().resolve())  # a plain path -> a SQLite database


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fails fast, naming the URI, when a tracking server cannot be reached or a DB not created."""
    if uri.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(uri)
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "") if parts.hostname else parts.netloc
        request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=netloc)).rstrip("/") + "/health")
        if parts.username:  # credentials in the URI: send them as MLflow's client would, never print them
            token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
        except (urllib.error.URLError, OSError) as error:
            raise ConnectionError(f"MLflow tracking server {redact(uri)!r} is unreachable: {error}") from None
    elif uri.startswith("sqlite:///"):
        directory = Path(uri[len("sqlite:///"):]).parent
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            raise ValueError(f"tracking URI {uri!r}: directory {directory} does not exist or is not writable")


_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^@/\s]+@")
_SECRET_FLAG = re.compile(r"(?P<flag>--?[\w-]*(?:token|password|passwd|secret|api[-_]?key)[\w-]*(?:=|\s+))\S+",
                          re.IGNORECASE)


def redact(text: str) -> str:
    """Hides passwords in URLs (``http://user:***@host``) and values of token/password/secret flags:
    command lines are recorded as tags, and an MLflow server's users can read every tag."""
    return _SECRET_FLAG.sub(r"\g<flag>***", _URL_PASSWORD.sub(r"\g<head>:***@", text))


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite database, in ``mlartifacts/<experiment>``.

    MLflow's own default for a database store is ``./mlruns`` of whatever directory the first run
    happened in (tens of MB of models per study, far from the database the user named). A tracking
    server decides for itself (``--artifacts-destination``): None leaves it to the server.
    """
    if tracking_uri.startswith("sqlite:///"):
        return str(Path(tracking_uri[len("sqlite:///"):]).parent / "mlartifacts" / experiment)
    return None


def experiment_name(dataset: str) -> str:
    """``apao-<dataset>``; a dataset directory path gives its folder name (``data.dataset_label``)."""
    from .data.files import dataset_label

    return f"apao-{dataset_label(dataset)}"


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config dict -> ``{"loss.beta": 0.3, ...}`` (MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


@contextlib.contextmanager
def quiet_mlflow():
    """MLflow without its per-call chatter: no artifact download bars (``log_model`` downloads the
    model back to validate its input example), no INFO/WARNING lines from model logging (a
    CloudPickle notice and "Inferring model signature" per trial). Errors still show."""
    loggers = [logging.getLogger(name) for name in ("mlflow.pyfunc", "mlflow.models")]
    levels = [logger.level for logger in loggers]
    previous = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = previous or "false"  # a user's own choice wins
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if previous is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)


@contextlib.contextmanager
def tracking_at(tracking_uri: str | None):
    """MLflow's fluent API (models:/ URIs, log_model) pointed at ``tracking_uri`` for a block (None: unchanged)."""
    previous = mlflow.get_tracking_uri()
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)


class Tracker:
    """Thin wrapper over ``MlflowClient`` for one experiment."""

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
        self.client.log_inputs(run_id, [DatasetInput(dataset_entity(record), [InputTag(DATASET_CONTEXT_TAG, context)])])

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client.get_metric_history(run_id, key)]

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, data: Any, artifact_file: str) -> None:
        self.client.log_dict(run_id, data, artifact_file)

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def log_recommender(self, run_id: str, checkpoint_dir: str | Path, example_history: list[str],
                        params: dict[str, Any] | None = None, metric_prefixes: tuple[str, ...] = ()) -> str:
        """Logs the final checkpoint as a pyfunc model (``runs:/<run>/model``), an output of the run (its page
        lists it), with ``params`` (flattened) and the run's latest metrics whose names start with one of
        ``metric_prefixes`` on the model's page too; returns its URI."""
        import numpy
        import torch

        package_dir = str(Path(__file__).resolve().parent)
        requirements = [f"torch=={torch.__version__.split('+')[0]}", f"numpy=={numpy.__version__}",
                        f"pandas=={pd.__version__}", f"mlflow=={mlflow.__version__}"]
        try:
            with tracking_at(self.tracking_uri), mlflow.start_run(run_id=run_id), quiet_mlflow():
                info = mlflow.pyfunc.log_model(
                    name=MODEL_NAME, python_model=RecommenderModel(),
                    artifacts={"checkpoint": str(checkpoint_dir)}, code_paths=[package_dir],
                    pip_requirements=requirements, params={k: str(v) for k, v in flatten(params or {}).items()},
                    # (data, params): the signature then accepts predict(..., params={"k": ...})
                    input_example=(pd.DataFrame({"history": [example_history]}), dict(SERVED_PARAMS)))
        finally:
            self.reopen(run_id)  # start_run's context closed the run; its owner ends it
        # the same points again, now naming the model: the run keeps one copy (an identical point is not
        # added twice), and the model's page shows them
        linked = [Metric(m.key, m.value, m.timestamp, m.step, model_id=info.model_id)
                  for m in self.client.get_run(run_id).data._metric_objs if m.key.startswith(metric_prefixes)]
        if metric_prefixes and linked:
            self.client.log_batch(run_id, metrics=linked)
        return info.model_uri

    def logged_model_uri(self, run_id: str) -> str | None:
        """The URI of the last model the run logged completely (``models:/<model id>``), if any.

        ``log_model`` names the model as the run's output before it uploads the files: a driver killed in
        between leaves a PENDING model with no ``MLmodel``. Such a model is marked FAILED here (nothing is
        logging it any more: a run's models are logged by the one driver that owns it) and not returned, so
        the caller logs the model again instead of registering one that cannot load."""
        outputs = self.client.get_run(run_id).outputs
        for output in reversed(outputs.model_outputs if outputs else []):
            model = self.client.get_logged_model(output.model_id)
            if model.status == LoggedModelStatus.READY:
                return f"models:/{model.model_id}"
            if model.status == LoggedModelStatus.PENDING:
                self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        return None

    def register_best(self, model_uri: str, name: str, alias: str = "best") -> tuple[int, bool]:
        """Points ``name@alias`` at ``model_uri``, registering it as a new version unless the alias already
        points to a version logged by the same run (re-running ``best`` on an unchanged study adds nothing).

        Returns:
            (the version the alias points to, whether it is new).
        """
        with tracking_at(self.tracking_uri):
            run_id = mlflow.models.get_model_info(model_uri).run_id
            try:
                current = self.client.get_model_version_by_alias(name, alias)
            except MlflowException:  # no such model or alias yet
                current = None
            if current is not None and run_id and current.run_id == run_id:
                return int(current.version), False
            version = mlflow.register_model(model_uri, name)
        self.client.set_registered_model_alias(name, alias, version.version)
        return int(version.version), True

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


# the params a served request may give (predict's ``params``) and their defaults; serve refuses others
SERVED_PARAMS = {"k": 10, "skip_unknown": False}


class RecommenderModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: predict on a DataFrame with a ``history`` column of item-id lists.

    Bad input raises ``MlflowException`` with ``INVALID_PARAMETER_VALUE``: MLflow's scoring server
    answers HTTP 400 with that message (any other exception becomes a 400 whose message hides the cause).
    """

    def load_context(self, context: Any) -> None:
        from .inference import Recommender

        self.checkpoint_dir = context.artifacts["checkpoint"]
        self.recommender = Recommender.from_checkpoint(self.checkpoint_dir)

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        from .inference import served_request

        params = {**SERVED_PARAMS, **(params or {})}
        try:
            histories, k = served_request(model_input, params["k"], self.recommender.catalog.num_semantic_ids)
            recommended = self.recommender.recommend(histories, k=k, skip_unknown=bool(params["skip_unknown"]))
        except ValueError as error:
            raise MlflowException.invalid_parameter_value(str(error)) from error
        return pd.DataFrame({"items": [[item for item, _ in row] for row in recommended],
                             "scores": [[score for _, score in row] for row in recommended]})


def require_model(model_uri: str, tracking_uri: str) -> None:
    """Fails, naming the URI and the registered models, when ``model_uri`` is no logged model there;
    never creates a store (MLflow's client creates an empty SQLite file where it finds none)."""
    is_tracked = model_uri.startswith(("models:/", "runs:/"))
    if not is_tracked and ":/" not in model_uri and not Path(model_uri).exists():
        raise ValueError(f"model {model_uri!r}: no such directory; give models:/<name>@best, runs:/<run id>/model "
                         "or a model directory")
    database = tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else None
    if is_tracked and database and not Path(database).is_file():
        raise ValueError(f"model {model_uri!r}: no MLflow database at {database}; pass --tracking-uri or set "
                         f"${TRACKING_URI_ENV}")
    with tracking_at(tracking_uri):
        try:
            mlflow.models.get_model_info(model_uri)  # reads the MLmodel file only
        except (MlflowException, OSError) as error:
            names = [m.name for m in MlflowClient(tracking_uri).search_registered_models()] if is_tracked else []
            reason = str(getattr(error, "message", error)).splitlines()[0]
            raise ValueError(f"model {model_uri!r} not found in {redact(tracking_uri)}: {reason}. Registered models: "
                             f"{sorted(names)} (models:/<name>@best, runs:/<run id>/model or a model directory)") from None


def download_model(model_uri: str, tracking_uri: str) -> str:
    """A logged model's local directory (downloaded from ``tracking_uri`` as ``mlflow models serve`` does)."""
    from mlflow.tracking.artifact_utils import _download_artifact_from_uri

    with tracking_at(tracking_uri):
        return _download_artifact_from_uri(model_uri)


def scoring_app(model_directory: str) -> Any:
    """MLflow's own scoring server (the FastAPI app ``mlflow models serve`` runs) for a local model directory."""
    from mlflow.pyfunc import scoring_server

    return scoring_server.init(scoring_server.load_model_with_mlflow_config(model_directory))


def load_checkpoint_dir_from_model(model_uri: str, tracking_uri: str | None = None) -> str:
    """Downloads a logged model (from ``tracking_uri``, default MLflow's) and returns its local checkpoint directory."""
    with tracking_at(tracking_uri):
        return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().checkpoint_dir


def study_experiment(tracking_uri: str, study: str) -> str | None:
    """The name of the experiment whose parent run is study ``study`` (tag ``apao.study``), if any."""
    client = MlflowClient(tracking_uri)
    for experiment in client.search_experiments():
        runs = client.search_runs([experiment.experiment_id], f"tags.`apao.study` = '{study}' and "
                                  "tags.`apao.role` = 'study'", max_results=1)
        if runs:
            return experiment.name
    return None


def experiment_names(tracking_uri: str) -> list[str]:
    """Names of the experiments in the store (for messages naming what exists)."""
    return sorted(e.name for e in MlflowClient(tracking_uri).search_experiments())


def studies_in(tracking_uri: str) -> list[str]:
    """Names of every study with a parent run in the store (for messages naming what exists)."""
    client = MlflowClient(tracking_uri)
    names = set()
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id], "tags.`apao.role` = 'study'", max_results=5000):
            names.add(run.data.tags.get("apao.study", "?"))
    return sorted(names)
