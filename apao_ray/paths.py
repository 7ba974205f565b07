"""Where things live on disk: dataset directories, the user cache, study storage, MLflow."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "APAO_DATA_DIR"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_DB_NAME = "mlflow.db"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def tool_command(name: str) -> str:
    """How to run the console script ``name`` of this Python's environment (``mlflow``, ``optuna-dashboard``): its
    absolute path, so a printed command runs from any directory for someone whose environment is not on PATH
    (``./apao`` keeps it in the repo's .venv). A script not installed yet is named where installing its extra
    into this environment puts it (``pip_install_hint``), unless PATH already has one of that name."""
    scripts = Path(sysconfig.get_path("scripts"))
    beside = next((folder / name for folder in (Path(sys.executable).parent, scripts) if (folder / name).is_file()),
                  None)
    if beside is None and shutil.which(name):
        return name
    return shlex.quote(str(beside or scripts / name))


def apao_command() -> str:
    """How to run apao_ray from any directory, for a command this process prints: the repo's ``apao`` launcher
    (absolute) when this Python is the one it made, else this Python with ``-m apao_ray``."""
    launcher = Path(__file__).resolve().parents[1] / "apao"
    if launcher.is_file() and Path(sys.prefix).resolve() == launcher.parent / ".venv":
        return shlex.quote(str(launcher))
    return f"{shlex.quote(sys.executable)} -m apao_ray"


def pip_install_hint(extra: str) -> str:
    """The command that installs the optional extra ``extra`` of apao_ray into this Python's environment."""
    root = Path(__file__).resolve().parents[1]
    return f"{shlex.quote(sys.executable)} -m pip install -e {shlex.quote(f'{root}[{extra}]')}"


def check_plain_name(kind: str, name: str) -> str:
    """Rejects names that could escape their directory (``..``, separators, absolute paths)."""
    if not isinstance(name, str) or not _PLAIN_NAME.match(name) or ".." in name:
        raise ValueError(f"{kind} name {name!r} must be a plain name (letters, digits, '_', '-', '.'; "
                         "no path separators, no '..', at most 128 characters)")
    return name


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/apao_ray`` (default ``~/.cache/apao_ray``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "apao_ray"


def absolute_data_dir_env(environ: dict[str, str] | None = None) -> str | None:
    """Makes ``$APAO_DATA_DIR`` absolute, against the directory the command started in; returns it (None: unset).

    Called once where a command starts: the processes it starts (Ray workers, plan probes, test subprocesses)
    have other working directories, and a relative directory read there is another directory, or none.
    """
    environ = os.environ if environ is None else environ
    if environ.get(DATA_DIR_ENV):
        environ[DATA_DIR_ENV] = str(Path(environ[DATA_DIR_ENV]).expanduser().resolve())
    return environ.get(DATA_DIR_ENV) or None


def data_dir_candidates(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Directories searched for datasets: an explicit ``data_dir`` alone (a dataset missing there is an
    error or a download into it, never another copy found elsewhere), else ``$APAO_DATA_DIR``, ./data, cache."""
    if data_dir:
        return [Path(data_dir).expanduser().resolve()]
    candidates = []
    if os.environ.get(DATA_DIR_ENV):
        candidates.append(Path(os.environ[DATA_DIR_ENV]))
    candidates += [Path("data"), user_cache_dir() / "datasets"]
    return [c.expanduser().resolve() for c in candidates]


def download_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Where a missing dataset is downloaded: the first explicit location, else the cache."""
    return data_dir_candidates(data_dir)[0] if (data_dir or os.environ.get(DATA_DIR_ENV)) \
        else user_cache_dir() / "datasets"


def add_tracking_uri_argument(parser: Any, purpose: str = "MLflow store to read") -> None:
    """``--tracking-uri`` with one default for every command that reads MLflow (resolved by
    ``tracking.resolve_tracking_uri``, which never creates a store)."""
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help=f"{purpose} (default: ${TRACKING_URI_ENV}, else sqlite:///$PWD/{DEFAULT_DB_NAME}; "
                             "a plain path is a SQLite file)")
