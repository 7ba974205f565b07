"""The logged model: the pyfunc wrapper MLflow serves, logging it from a run, registering the best,
and finding, downloading and loading it again."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import pandas as pd
from mlflow.entities import LoggedModelStatus, Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.tracking.artifact_utils import _download_artifact_from_uri

from ..paths import TRACKING_URI_ENV, apao_command
from .store import flatten, quiet_mlflow, redact, resolve_tracking_uri, tracking_at

MODEL_NAME = "model"
# the params a served request may give (predict's ``params``) and their defaults; serve refuses others
SERVED_PARAMS = {"k": 10, "skip_unknown": False}


class RecommenderModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: predict on a DataFrame with a ``history`` column of item-id lists.

    Bad input raises ``MlflowException`` with ``INVALID_PARAMETER_VALUE``: MLflow's scoring server
    answers HTTP 400 with that message (any other exception becomes a 400 whose message hides the cause).
    """

    def load_context(self, context: Any) -> None:
        from ..reuse.inference import Recommender  # lazy: torch, in the serving process only (tracking stays torch-free)

        self.checkpoint_dir = context.artifacts["checkpoint"]
        self.recommender = Recommender.from_checkpoint(self.checkpoint_dir)

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        from ..reuse.inference import served_request  # lazy: as in load_context

        params = {**SERVED_PARAMS, **(params or {})}
        try:
            histories, k = served_request(model_input, params["k"], self.recommender.catalog.num_semantic_ids)
            recommended = self.recommender.recommend(histories, k=k, skip_unknown=bool(params["skip_unknown"]))
        except ValueError as error:
            raise MlflowException.invalid_parameter_value(str(error)) from error
        return pd.DataFrame({"items": [[item for item, _ in row] for row in recommended],
                             "scores": [[score for _, score in row] for row in recommended]})


def require_model(model_uri: str, tracking_uri: str, choose: str = "pass --tracking-uri") -> None:
    """Fails, naming the URI and the registered models, when ``model_uri`` is no logged model there;
    never creates a store (MLflow's client creates an empty SQLite file where it finds none). ``choose``: how the
    caller's user names another store (a command's flag; ``tracking_uri=`` from Python)."""
    is_tracked = model_uri.startswith(("models:/", "runs:/"))
    if not is_tracked and ":/" not in model_uri and not Path(model_uri).exists():
        raise ValueError(f"model {model_uri!r}: no such directory; give models:/<name>@best, runs:/<run id>/model "
                         "or a model directory")
    database = tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else None
    if is_tracked and database and not Path(database).is_file():
        raise ValueError(f"model {model_uri!r}: no MLflow database at {database}; {choose} or set "
                         f"${TRACKING_URI_ENV}")
    with tracking_at(tracking_uri):
        try:
            mlflow.models.get_model_info(model_uri)  # reads the MLmodel file only
        except (MlflowException, OSError) as error:
            names = [m.name for m in MlflowClient(tracking_uri).search_registered_models()] if is_tracked else []
            reason = str(getattr(error, "message", error)).splitlines()[0]
            hint = (f"; `{apao_command()} best` registers each method's best trial as "
                    "models:/apao-<dataset>-<backbone>-<loss>@best" if model_uri.startswith("models:/") else "")
            raise ValueError(f"model {model_uri!r} not found in {redact(tracking_uri)}: {reason}. Registered models: "
                             f"{sorted(names)} (models:/<name>@best, runs:/<run id>/model or a model directory){hint}") \
                from None


def download_model(model_uri: str, tracking_uri: str) -> str:
    """A logged model's local directory (downloaded from ``tracking_uri`` as ``mlflow models serve`` does)."""
    with tracking_at(tracking_uri):
        return _download_artifact_from_uri(model_uri)


def scoring_app(model_directory: str) -> Any:
    """MLflow's own scoring server (the FastAPI app ``mlflow models serve`` runs) for a local model directory."""
    from mlflow.pyfunc import scoring_server  # lazy: FastAPI and the server's stack, in the server process only

    return scoring_server.init(scoring_server.load_model_with_mlflow_config(model_directory))


def load_checkpoint_dir_from_model(model_uri: str, tracking_uri: str | None = None) -> str:
    """Downloads a logged model (from ``tracking_uri``, found as the commands find it: the argument,
    ``$MLFLOW_TRACKING_URI`` or ``mlflow.set_tracking_uri``, else ``./mlflow.db``) and returns its local checkpoint directory; a model that is not
    there fails naming the URI, the store's registered models and the ``tracking_uri=`` argument
    (``require_model``), not with MLflow's traceback."""
    tracking_uri = resolve_tracking_uri(tracking_uri or (mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set()
                                                         else None))
    require_model(model_uri, tracking_uri, choose="pass tracking_uri= (the store's URI)")
    with tracking_at(tracking_uri):
        return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().checkpoint_dir


class ModelLogging:
    """The model methods of :class:`~apao_ray.tracking.runs.Tracker`, which sets ``client`` and ``tracking_uri``
    and defines ``reopen``."""

    client: MlflowClient
    tracking_uri: str

    def log_recommender(self, run_id: str, checkpoint_dir: str | Path, example_history: list[str],
                        params: dict[str, Any] | None = None, metric_prefixes: tuple[str, ...] = (),
                        name: str = MODEL_NAME, tags: dict[str, str] | None = None) -> str:
        """Logs the final checkpoint as a pyfunc model named ``name`` (``runs:/<run>/<name>``), an output of the run
        (its page lists it), with ``params`` (flattened), ``tags`` and the run's latest metrics whose names start with
        one of ``metric_prefixes`` on the model's page too; returns its URI."""
        package_dir = str(Path(__file__).resolve().parents[1])  # apao_ray/, shipped with the model
        # versions from the installed metadata: importing torch here would load it into every importer of tracking
        requirements = [f"torch=={importlib.metadata.version('torch').split('+')[0]}",
                        f"numpy=={importlib.metadata.version('numpy')}",
                        f"pandas=={pd.__version__}", f"mlflow=={mlflow.__version__}"]
        try:
            with tracking_at(self.tracking_uri), mlflow.start_run(run_id=run_id), quiet_mlflow():
                info = mlflow.pyfunc.log_model(
                    name=name, python_model=RecommenderModel(), tags=tags,
                    artifacts={"checkpoint": str(checkpoint_dir)}, code_paths=[package_dir],
                    pip_requirements=requirements, params={k: str(v) for k, v in flatten(params or {}).items()},
                    # (data, params): the signature then accepts predict(..., params={"k": ...})
                    input_example=(pd.DataFrame({"history": [example_history]}), dict(SERVED_PARAMS)))
        finally:
            self.reopen(run_id)  # start_run's context closed the run; its owner ends it
        self.link_model_metrics(run_id, info.model_uri, metric_prefixes)
        return info.model_uri

    def link_model_metrics(self, run_id: str, model_uri: str, metric_prefixes: tuple[str, ...]) -> None:
        """The run's latest metrics whose names start with one of ``metric_prefixes`` again, now naming the model
        (``models:/<model id>``): the run keeps one copy (an identical point is not added twice) and the model's
        page shows them. Idempotent: a resumed study calls it again for a model a killed driver logged but had not
        linked yet."""
        model_id = model_uri.removeprefix("models:/")
        linked = [Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id)
                  for m in self.client.get_run(run_id).data._metric_objs if m.key.startswith(metric_prefixes)]
        if metric_prefixes and linked:
            self.client.log_batch(run_id, metrics=linked)

    def logged_model_uri(self, run_id: str, name: str = MODEL_NAME) -> str | None:
        """The URI of the last model named ``name`` the run logged completely (``models:/<model id>``), if any.

        ``log_model`` names the model as the run's output before it uploads the files: a driver killed in
        between leaves a PENDING model with no ``MLmodel``. Such a model is marked FAILED here (nothing is
        logging it any more: a run's models are logged by the one driver that owns it) and not returned, so
        the caller logs the model again instead of registering one that cannot load. Every PENDING output is
        marked so, wherever it stands among the run's outputs (their order is MLflow's, not promised to be the
        logging order), and the newest READY one is returned."""
        outputs = self.client.get_run(run_id).outputs
        models = [self.client.get_logged_model(output.model_id) for output in (outputs.model_outputs if outputs else [])]
        for model in models:
            if model.status == LoggedModelStatus.PENDING:
                self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        ready = [model for model in models if model.status == LoggedModelStatus.READY and model.name == name]
        newest = max(ready, key=lambda model: model.creation_timestamp, default=None)
        return None if newest is None else f"models:/{newest.model_id}"

    def describe_registered(self, name: str, version: int, model_words: tuple[str, dict[str, str]],
                            version_words: tuple[str, dict[str, str]]) -> None:
        """Gives the registered model ``name`` and its ``version`` each a description and tags (``(description,
        tags)``): what the model is, and which study, knobs, rule and verdict chose this version."""
        description, tags = model_words
        self.client.update_registered_model(name, description=description)
        for key, value in tags.items():
            self.client.set_registered_model_tag(name, key, str(value)[:5000])
        description, tags = version_words
        self.client.update_model_version(name, str(version), description=description)
        for key, value in tags.items():
            self.client.set_model_version_tag(name, str(version), key, str(value)[:5000])

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
