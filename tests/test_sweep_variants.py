"""studies/sweep.py end to end in settings the shared --smoke study of test_sweep.py leaves out, each a study of
its own on a real local Ray and a real SQLite MLflow store: --seeds 0,1 interrupted (Ctrl-C) in its repeat phase
and resumed by re-running the command, and --workers-per-trial 2 training each trial on two data-parallel ranks."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from pathlib import Path

import pytest

from conftest import mlflow_sqlite, run_script
from test_sweep import SWEEP, _launch_until, _runs_state


def _repeat_runs(db: Path) -> list[tuple[str, str]]:
    """(run it repeats, status) of every repeat-phase child run, read straight from SQLite."""
    query = ("select t.value, r.status from runs r join tags t on t.run_uuid = r.run_uuid and t.key = 'apao.repeats'")
    try:
        with sqlite3.connect(db, timeout=10) as connection:
            return connection.execute(query).fetchall()
    except sqlite3.Error:
        return []


@pytest.mark.e2e
def test_a_study_interrupted_in_its_repeat_phase_resumes_it_without_duplicates(tmp_path):
    """Ctrl-C while the best configurations are re-trained on the other seed; re-running the command
    finishes the repeat phase with exactly one child run per (method, seed) and the search untouched."""
    command = [sys.executable, SWEEP, "--smoke", "--losses", "ce,apao_pointwise", "--num-samples", "1", "--epochs", "2",
               "--seeds", "0,1", "--output-dir", str(tmp_path / "runs"), "--tracking-uri", mlflow_sqlite(tmp_path)]
    process, _ = _launch_until(command, tmp_path, lambda state: any(
        status == "RUNNING" for _, status in _repeat_runs(tmp_path / "mlflow.db")), timeout=600)
    searched = {trial for trial, _, _ in _runs_state(tmp_path / "mlflow.db")}
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 130 and "re-run the same command" in stderr, stderr[-3000:]
    result = run_script(command[1:], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    repeats = _repeat_runs(tmp_path / "mlflow.db")
    assert len(repeats) == 2 and len({origin for origin, _ in repeats}) == 2, repeats  # one per method, no duplicate
    assert all(status == "FINISHED" for _, status in repeats), repeats
    from apao_ray.tracking import Tracker

    children = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "apao-synthetic").child_runs()
    assert len(children) == 4 and sorted(run.data.tags["apao.seed"] for run in children) == ["0", "0", "1", "1"]
    assert searched <= {run.data.tags.get("apao.trial_id") for run in children}  # the search's runs were kept


@pytest.mark.e2e
def test_smoke_study_with_two_workers_per_trial_trains_each_trial_on_two_ranks(tmp_path):
    """`sweep --smoke --workers-per-trial 2`: each trial is a 2-worker TorchTrainer driven from its Tune actor,
    planned as 2 workers, recorded as such in MLflow, and tested and logged like any other trial."""
    uri = mlflow_sqlite(tmp_path)
    result = run_script([SWEEP, "--smoke", "--workers-per-trial", "2", "--cpus-per-trial", "1", "--losses",
                         "ce,apao_pointwise", "--num-samples", "1", "--epochs", "2", "--output-dir",
                         str(tmp_path / "runs"), "--tracking-uri", uri], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "1 at a time, 2 data-parallel workers x 1 thread each" in result.stderr
    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-synthetic")
    children = tracker.child_runs()
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    (parent,) = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")
    assert parent.data.params["workers_per_trial"] == "2"
    for child in children:
        assert child.data.params["base.train.num_workers"] == "2"  # the trial's own config
        assert "test/ndcg_at_10" in child.data.metrics
        steps = [step for step, _ in tracker.metric_history(child.info.run_id, "val/ndcg_at_10")]
        assert steps == [1, 2]
        # rank 0 alone recorded each epoch once where a resumed study's scheduler reads it
        run_dir = tmp_path / "runs" / "synthetic-study" / "train_runs" / f"train-trial_id={child.data.tags['apao.trial_id']}"
        reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in reports] == [1, 2, 2] and reports[-1]["done"]
        # each rank trained half of every epoch: together the whole 2048-sample subset
        assert all(r["train/num_samples"] == 1024 for r in reports[:2])
