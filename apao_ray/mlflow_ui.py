"""What the MLflow UI opens on: the link a study prints and the runs-table view that link loads.

MLflow 3.17's UI keeps a user's column choice in the browser, so a first visit shows no metric columns.
What a logger can set is a shared view: the experiment tag ``mlflow.sharedViewState.<key>`` holding the
view as JSON (what the UI's *Share* button saves), opened by ``?viewStateShareKey=<key>``. Read from the
UI bundle (``useSharedExperimentViewState``): it takes the search facets and the UI state (columns, their
order and widths; not expanded or pinned rows) from that JSON.
"""
from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from .paths import tool_command
from .tracking import redact

SHARED_VIEW_TAG = "mlflow.sharedViewState."
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` / `mlflow server` listen by default
_LEADING_COLUMNS = ("attributes.`Run Name`", "runDateAndNestInfo", "duration")  # the UI's own column ids


def runs_table_url(tracking_uri: str, experiment_id: str, view_key: str | None = None) -> str:
    """The UI's link to an experiment's runs table (an MLflow server's own address, else where
    ``mlflow ui`` listens by default), with the switch that keeps MLflow 3.17 off its GenAI overview
    and, given ``view_key``, the saved view (``save_runs_view``) that picks its columns."""
    base = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else DEFAULT_UI_URL
    view = f"&viewStateShareKey={urllib.parse.quote(view_key)}" if view_key else ""
    return f"{redact(base)}/#/experiments/{experiment_id}/runs?workflowType=machine_learning{view}"


def run_link(experiment_id: str, run_id: str) -> str:
    """A markdown link to a run's page inside the UI (a description's link: no server address), labelled by the run
    id's first 8 characters, with the switch that keeps MLflow 3.17 off its GenAI view (``runs_table_url``)."""
    return f"[{run_id[:8]}](#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning)"


def ui_hint(tracking_uri: str, experiment_id: str, view_key: str | None = None) -> str:
    """How to look at a study's runs: the command that serves a database (its job runner off: it doubles
    the server's processes and memory for nothing a study uses), and the runs table's link."""
    serve = "" if tracking_uri.startswith(("http://", "https://")) else \
        f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false {tool_command('mlflow')} ui --backend-store-uri {redact(tracking_uri)}, then open "
    return f"MLflow: {serve}{runs_table_url(tracking_uri, experiment_id, view_key)}"


def view_key(name: str) -> str:
    """A view's key from a study name: letters, digits, ``.``, ``_`` and ``-`` (an experiment tag's name
    and a URL parameter)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def column(kind: str, name: str) -> str:
    """A runs-table column as the UI names it: ``metrics.`test/ndcg_at_10```, ``tags.`apao.outcome```,
    ``attributes.`Models```."""
    if kind not in ("attributes", "params", "metrics", "tags"):
        raise ValueError(f"column kind {kind!r}; choose from attributes, params, metrics, tags")
    return f"{kind}.`{name}`"


def save_runs_view(tracker: Any, key: str, columns: list[str]) -> None:
    """Saves a runs-table view of ``tracker``'s experiment under ``key`` (``runs_table_url(..., key)`` opens
    it): the run's name, start and duration, then ``columns`` (see ``column``) in this order, each wide
    enough for its name; newest runs first."""
    widths = {name: max(110, int(5.6 * len(name.split("`")[1])) + 40) for name in columns}  # ~6 px a character
    widths[_LEADING_COLUMNS[0]] = 300  # the run names say method and knobs
    view = {"selectedColumns": columns, "columnOrder": [*_LEADING_COLUMNS, *columns], "columnWidths": widths,
            "orderByKey": "attributes.start_time", "orderByAsc": False}
    tracker.client.set_experiment_tag(tracker.experiment_id, SHARED_VIEW_TAG + key, json.dumps(view))
