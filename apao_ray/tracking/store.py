"""Where MLflow writes: the tracking URI (resolved, checked, redacted), the artifact location, MLflow's
fluent API pointed at a store, and which experiments and studies a store holds."""
from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

import mlflow
from mlflow.tracking import MlflowClient

from ..data.files import dataset_label
from ..paths import DEFAULT_DB_NAME, TRACKING_URI_ENV, pip_install_hint

# the one PostgreSQL URL form (docs/running.md, the postgres extra): SQLAlchemy 2.1 reads a bare postgresql:// as
# psycopg 3 too, SQLAlchemy 2.0 (which MLflow also accepts) as psycopg2, which the extra does not install
POSTGRES_URL_FORM = "postgresql+psycopg://USER@HOST:PORT/DATABASE"
T = TypeVar("T")


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
    elif "://" in uri and not uri.startswith("databricks"):
        require_database_driver(uri, "tracking URI")
        reach_database(uri, "tracking URI", timeout)  # MLflow's own client retries an unreachable one for ~2 min
        try:  # creates MLflow's tables in a new database, while no other study can be halfway through it
            opened_despite_schema_race(lambda: MlflowClient(uri).search_experiments(max_results=1))
        except Exception as error:  # a server that does not answer, a password refused
            raise ValueError(f"tracking URI {redact(uri)!r}: {first_line(error)}") from None


def reach_database(url: str, what: str, timeout: float = 5.0) -> None:
    """Fails in seconds, naming ``url`` (its password masked), when its database does not take a connection."""
    import sqlalchemy

    is_libpq = url.startswith(("postgresql://", "postgresql+psycopg://", "postgresql+psycopg2://"))
    engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": max(1, round(timeout))} if is_libpq else {})
    try:
        engine.connect().close()
    except Exception as error:  # refused, unknown host, password refused, no such database
        raise ConnectionError(f"{what} {redact(url)!r}: the database is unreachable: {first_line(error)}") from None
    finally:
        engine.dispose()


def opened_despite_schema_race(open_store: Callable[[], T], patience_s: float = 60.0) -> T:
    """``open_store()``, tried again while it fails as another process creating the same database's schema leaves it:
    a duplicate table, type or row, a table or column not there yet. Two studies started together into a new
    PostgreSQL database both create Optuna's tables, or MLflow's (its 68 migrations take seconds); measured: the later
    one failed with a duplicate ``CREATE TYPE``. Once the other's schema is committed, opening again finds it."""
    import sqlalchemy.exc

    races = (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError)
    deadline, wait = time.monotonic() + patience_s, 0.25
    while True:
        try:
            return open_store()
        except Exception as error:  # MLflow wraps SQLAlchemy's error in an MlflowException
            if not isinstance(error, races) and not isinstance(error.__cause__, races) \
                    or time.monotonic() + wait > deadline:
                raise
        time.sleep(wait)
        wait = min(2 * wait, 4.0)


def first_line(error: BaseException) -> str:
    """An error's first line: SQLAlchemy's messages go on with the SQL statement and a link."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def require_database_driver(url: str, what: str) -> None:
    """Fails in one line when the Python driver of the SQLAlchemy URL ``url`` is not installed, naming it and the
    extra that installs it (for PostgreSQL), instead of a traceback from MLflow or Optuna later; ``what`` names
    the URL in the message (``--optuna-storage``)."""
    import sqlalchemy.engine

    try:
        dialect = sqlalchemy.engine.make_url(url).get_dialect()  # an unknown database name fails here
    except Exception as error:  # sqlalchemy.exc.ArgumentError / NoSuchModuleError, or a bad port
        raise ValueError(f"{what} {redact(url)!r} is not a SQLAlchemy URL ({error}); give e.g. "
                         f"sqlite:////abs/file.db, {POSTGRES_URL_FORM} or a path to a SQLite file") from None
    try:
        (getattr(dialect, "import_dbapi", None) or dialect.dbapi)()  # SQLAlchemy 1.4 names it dbapi
    except ImportError as error:
        fix = (f"install apao_ray's postgres extra ({pip_install_hint('postgres')}) and give {POSTGRES_URL_FORM}"
               if dialect.name == "postgresql" else "install the Python package that provides it")
        raise ValueError(f"{what} {redact(url)!r}: its database driver {dialect.driver} is not installed "
                         f"({error}); {fix}") from None


_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^@/\s]+@")
# a flag starts a word: a value that holds such a word (``--study-name bear_token_weighted-seed0``) is no flag
_SECRET_FLAG = re.compile(
    r"(?P<flag>(?<!\S)--?[\w-]*(?:token|password|passwd|secret|api[-_]?key)[\w-]*(?:=|\s+))\S+", re.IGNORECASE)


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


EXPERIMENT_PREFIX = "apao-"  # a study's MLflow experiment is this and its dataset's label


def experiment_name(dataset: str) -> str:
    """``apao-<dataset>``; a dataset directory path gives its folder name (``data.dataset_label``)."""
    return f"{EXPERIMENT_PREFIX}{dataset_label(dataset)}"


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
    """MLflow's fluent API (models:/ URIs, log_model) pointed at ``tracking_uri`` for a block (None: unchanged).
    Afterwards MLflow is as it was, unset included: ``set_tracking_uri`` also writes ``$MLFLOW_TRACKING_URI``, so
    restoring the resolved default would leave a URI set that nobody chose."""
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)


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
