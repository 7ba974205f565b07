"""What a test asserts of a whole study's end, shared by the tests that interrupt one (tests/test_study_faults.py,
tests/test_sweep_s3.py)."""
from __future__ import annotations

from pathlib import Path

import pytest


def every_trial_finished_once(uri: str, num_trials: int, optuna_db: Path, epochs: int) -> dict:
    """Asserts a synthetic study's end: ``num_trials`` child runs, one per trial, each FINISHED with its ``epochs``
    validated exactly once and one test; the Optuna study holds each trial once, COMPLETE with MLflow's value. Returns the
    child runs by trial id."""
    import optuna

    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-synthetic")
    runs = tracker.child_runs()
    children = {run.data.tags["apao.trial_id"]: run for run in runs}
    assert len(runs) == len(children) == num_trials, [(r.data.tags["apao.trial_id"], r.info.status) for r in runs]
    for trial_id, run in children.items():
        assert run.info.status == "FINISHED" and run.data.tags["apao.outcome"] == "finished", (trial_id, run.data.tags)
        steps = [step for step, _ in tracker.metric_history(run.info.run_id, "val/ndcg_at_10")]
        assert steps == list(range(1, epochs + 1)), (trial_id, steps)
        assert len(tracker.metric_history(run.info.run_id, "test/ndcg_at_10")) == 1, trial_id
    trials = optuna.load_study(study_name="apao-synthetic/synthetic-study", storage=f"sqlite:///{optuna_db}").trials
    assert sorted(t.user_attrs["tune_trial_id"] for t in trials) == sorted(children), trials
    for trial in trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE, trial
        run = children[trial.user_attrs["tune_trial_id"]]
        assert trial.value == pytest.approx(run.data.metrics["best/val/ndcg_at_10"], rel=1e-9)
    return {"tracker": tracker, "children": children}
