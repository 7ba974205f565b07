"""Per-prefix recall (paper Fig. 7) readable on a trial's run and on the study's: the recall of the target's
length-m prefix at beam step m, on the test split, at the epoch each selection rule kept.

MLflow charts each of these numbers alone (``test_by/<rule>/prefix_recall_at_20_m<m>``: a point per chart, rules and
levels apart); here they are one chart (``prefix_recall.png``) and one table (``prefix_recall.json``, an MLflow
table: the run's Artifacts tab shows it as one) per run. The metrics stay as they are, for queries and the report.
"""
from __future__ import annotations

import re
from typing import Any

from ...names import TEST_BY, reached_test
from ...protocol import Selection
from ...tracking import Tracker
from . import plots
from .outcomes import describe

CHART_FILE, TABLE_FILE = "prefix_recall.png", "prefix_recall.json"
STUDY_CHART_FILE = "prefix_recall_per_method.png"
_KEY = re.compile(rf"^{TEST_BY}/(?P<rule>[^/]+)/prefix_recall_at_(?P<beam>\d+)_m(?P<level>\d+)$")
MAX_TRIALS_PER_PANEL = 6  # a method's best trials by validation on the study's chart; more lines hide each other


def prefix_recall_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per selection rule: ``{"selection_rule", "epoch", "kept", "beam_size", "m1".."mT"}`` from a trial's
    final metrics (``test_by/<rule>/...``), the trial's own rule (``kept``: its model is the run's ``model``) first."""
    rows: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        match = _KEY.match(key)
        if match:
            rule = match["rule"]
            row = rows.setdefault(rule, {"selection_rule": rule, "epoch": metrics.get(f"{TEST_BY}/{rule}/epoch"),
                                         "kept": False, "beam_size": int(match["beam"])})
            row[f"m{match['level']}"] = float(value)
    for row in rows.values():  # the epoch of the run's own model (more than one rule may have kept it)
        row["kept"] = row["epoch"] == metrics.get("best/epoch")
    return sorted(rows.values(), key=lambda row: (not row["kept"], row["selection_rule"]))


def _levels(row: dict[str, Any]) -> list[str]:
    return sorted((key for key in row if re.fullmatch(r"m\d+", key)), key=lambda key: int(key[1:]))


def log_trial_prefix_recall(tracker: Tracker, run_id: str, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Logs a finished trial's chart and table of per-prefix test recall under each selection rule; returns the
    table's rows (none, and nothing logged, for a trial tested before its rules were recorded)."""
    rows = prefix_recall_rows(metrics)
    if not rows or TABLE_FILE in {a.path for a in tracker.client.list_artifacts(run_id)}:
        return rows  # a trial completed again after a resume has them: MLflow would append the table's rows again
    tracker.log_table(run_id, {key: [row.get(key) for row in rows] for key in rows[0]}, TABLE_FILE)
    series = [(f"{row['selection_rule']} (epoch {row['epoch']}{', kept' if row['kept'] else ''})",
               [row[level] for level in _levels(row)]) for row in rows]
    figure = plots.trial_prefix_recall_figure(series, rows[0]["beam_size"])
    tracker.log_figure(run_id, figure, CHART_FILE)
    plots.close(figure)
    return rows


def log_study_prefix_recall(tracker: Tracker, parent_run_id: str, rows: list[dict[str, Any]], beam_size: int,
                            selection: Selection = Selection()) -> dict[str, list[str]]:
    """The study's chart: a panel per method (backbone/loss), a line per trial among its best by ``selection``
    (at most ``MAX_TRIALS_PER_PANEL``) that reached its test, its knobs (rounded as
    the run names round them) in the legend. Returns each panel's legend."""
    methods: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if reached_test(row["metrics"]):
            methods.setdefault(f"{row['choices']['backbone']}/{row['choices']['loss']}", []).append(row)
    panels = {}
    for method, trials in methods.items():
        scored = [(selection.score(row["metrics"]), row) for row in trials]  # best first, unscored last
        trials = [row for _, row in sorted(scored, key=lambda pair: -pair[0] if pair[0] is not None else float("inf"))]
        trials = trials[:MAX_TRIALS_PER_PANEL]
        knobs = [describe(row["choices"]).partition(" ")[2] or "no knobs" for row in trials]
        panels[method] = [(legend + (f" seed={row.get('seed')}" if knobs.count(legend) > 1 else "")
                           + (" (best)" if index == 0 else ""), row["metrics"])  # repeats differ by their seed
                          for index, (legend, row) in enumerate(zip(knobs, trials))]
    if panels:
        figure = plots.prefix_recall_figure(panels, beam_size)
        tracker.log_figure(parent_run_id, figure, STUDY_CHART_FILE)
        plots.close(figure)
    return {method: [legend for legend, _ in trials] for method, trials in panels.items()}

