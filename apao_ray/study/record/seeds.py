"""The study table over seeds: per (backbone, loss), the best configuration's seed runs
(its search trial and its repeats, repeats.py) as mean, spread and count, the paired significance
against the baseline, and the cost of every trial of the method summed.

No Ray and no statistics of its own: the seeds are grouped into ``analysis.results.Method`` objects
and compared by ``analysis.comparisons.compare_methods`` (over seeds and users with >= 2 seeds, users only and no
verdict with 1; Holm over one family: ``analysis.stats``), exactly as ``python -m apao_ray report`` does. Runs are plain records
(``analysis.export.trial_record``), so every function here is testable on synthetic rows.
"""
from __future__ import annotations

import math
import tempfile
from typing import Any
import pandas as pd

from ...analysis.comparisons import compare_methods
from ...analysis.per_user import PER_USER_FILE, read_per_user
from ...analysis.results import Method, Trial, with_repeats
from ...names import PER_USER_VALID_FILE
from ...protocol import Selection
from ...rank_metrics import PER_USER_METRICS

TEST_COLUMNS = tuple(f"test/{name}" for name in PER_USER_METRICS)  # every registered metric of the per-user tables
STD_SUFFIX = " std"


class RunSource:
    """The ``StudyExport`` interface that ``Trial`` needs (a name, trial records, their per-user tables),
    over records given here; ``per_user`` reads the table from ``tables`` or downloads it from MLflow."""

    def __init__(self, name: str, records: list[dict[str, Any]], tracker: Any = None,
                 tables: dict[str, Any] | None = None, selection: Selection | None = None) -> None:
        self.name, self.trials, self.tracker = name, records, tracker
        self.selection = selection or Selection()  # the study's, as its parent run recorded it
        # run_id -> per-user test DataFrame, (run_id, split) -> another split's (each downloaded once)
        self.tables: dict[Any, Any] = dict(tables or {})

    def per_user(self, record: dict[str, Any], split: str = "test") -> Any:
        """The run's per-user table of ``split`` (``test``, or ``valid``: the kept model's), None without one."""
        key = record["run_id"] if split == "test" else (record["run_id"], split)  # tables given: by run id
        if key not in self.tables and self.tracker is not None:
            from ...tracking import quiet_mlflow

            name = {"test": PER_USER_FILE, "valid": PER_USER_VALID_FILE}[split]
            try:
                with tempfile.TemporaryDirectory() as tmp, quiet_mlflow():
                    self.tables[key] = read_per_user(self.tracker.client.download_artifacts(record["run_id"], name, tmp))
            except Exception:  # noqa: BLE001 - a run without the table (older, failed upload): no comparison for it
                self.tables[key] = None
        return self.tables.get(key)

    def history(self, run_id: str, key: str) -> Any:
        """(step -> value) of one metric of one run, from MLflow (empty without a tracker)."""
        points = self.tracker.metric_history(run_id, key) if self.tracker is not None else []
        return pd.Series(dict(points), dtype=float).sort_index()


def seed_methods(source: RunSource, best_run_ids: list[str]) -> list[Method]:
    """One ``Method`` per best run (in their order): that run and the finished, tested repeats of its
    configuration on other seeds."""
    trials = [Trial(source, record) for record in source.trials]
    finished = [t for t in trials if t.finished]
    by_id = {trial.run_id: trial for trial in trials}
    return [Method(trial.dataset, trial.backbone, trial.loss, trial.method, with_repeats([trial], finished))
            for trial in (by_id[run_id] for run_id in best_run_ids)]


def seed_columns(method: Method) -> dict[str, Any]:
    """``seeds`` ("0,1"), ``n_seeds``, and per test metric the mean over the seeds and its sample std
    (``<metric> std``; None with one seed)."""
    columns: dict[str, Any] = {"seeds": ",".join(map(str, method.seeds)), "n_seeds": len(method.trials)}
    for key in TEST_COLUMNS:
        stats = method.mean_std(key)
        mean, std = stats if stats is not None else (None, None)
        columns[key] = mean
        columns[key + STD_SUFFIX] = None if std is None or math.isnan(std) else std
    return columns


def significance_column(baseline: str, metric: str) -> str:
    """``vs ce test/ndcg_at_10``: the table column of paired differences against the baseline."""
    return f"vs {baseline} test/{metric}"


def significance_cells(methods: list[Method], baseline: str = "ce", metric: str = "ndcg_at_10",
                       num_resamples: int = 10_000) -> dict[tuple[str, str], str]:
    """Per (backbone, loss): ``Comparison.text()`` of method - baseline on the same test users over its seeds
    (``+0.0041 [0.0012, 0.0070] over seeds and users (3 seeds), p_holm = 0.003 (...)``, or the one-seed label),
    ``baseline`` for the baseline itself, or why there is no comparison."""
    cells: dict[tuple[str, str], str] = {(m.backbone, m.loss): "baseline" for m in methods if m.loss == baseline}
    for paired in compare_methods(methods, baseline, (metric,), num_resamples):
        key = (paired.method.backbone, paired.method.loss)
        cells[key] = paired.over_seeds.text() if paired.over_seeds else f"- ({paired.note or 'no paired users'})"
    for method in methods:
        cells.setdefault((method.backbone, method.loss), f"- (no {baseline} trial to compare with)")
    return cells
