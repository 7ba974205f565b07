"""studies/sweep.py end to end in settings the shared --smoke study of test_sweep.py leaves out, each a study of
its own on a real local Ray and a real SQLite MLflow store: --workers-per-trial 2 training each trial on two
data-parallel ranks. (A study interrupted in its repeat phase: tests/test_sweep_cohorts.py.)"""
from __future__ import annotations

import json

import pytest

from conftest import SWEEP, mlflow_sqlite, run_script


@pytest.mark.e2e
def test_smoke_study_with_two_workers_per_trial_trains_each_trial_on_two_ranks(tmp_path):
    """`sweep --smoke --workers-per-trial 2`: a trial is a 2-worker TorchTrainer driven from its Tune actor,
    planned as 2 workers, recorded as such in MLflow, and tested and logged like any other trial. One APAO trial:
    that its adaptive weights and every loss train alike on 2 ranks and on one is test_data_parallel.py's."""
    uri = mlflow_sqlite(tmp_path)
    result = run_script([SWEEP, "--smoke", "--workers-per-trial", "2", "--cpus-per-trial", "1", "--losses",
                         "apao_pointwise", "--num-samples", "1", "--epochs", "2", "--output-dir",
                         str(tmp_path / "runs"), "--tracking-uri", uri], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "1 at a time, 2 data-parallel workers x 1 thread each" in result.stderr
    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-synthetic")
    children = tracker.child_runs()
    assert len(children) == 1 and all(c.info.status == "FINISHED" for c in children)
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
