"""study/record/mlflow_callback.py: what the driver's MLflow callback writes of a trial, in a real SQLite MLflow
store."""
from __future__ import annotations

from conftest import mlflow_sqlite


def test_a_trial_run_again_keeps_its_last_attempts_end_as_history_not_as_its_state(tmp_path):
    """--retry-failed (or a resume) reopens the trial's child run: while it runs again its outcome must not still
    say 'out of memory', and the error of the attempt before is kept under apao.previous_error."""
    from types import SimpleNamespace

    from apao_ray.study.record.mlflow_callback import MlflowStudyCallback
    from apao_ray.tracking import Tracker

    uri = mlflow_sqlite(tmp_path)
    tracker = Tracker(uri, "apao-retry")
    parent = tracker.start_run("study", {"apao.role": "study"})
    child = tracker.start_run("tiger/apao_pairwise", {"apao.trial_id": "t1", "apao.study": "s"}, parent_run_id=parent)
    tracker.set_tags(child, {"apao.outcome": "out of memory", "apao.error": "TrialStartError: killed"})
    tracker.client.set_terminated(child, "FAILED")
    callback = MlflowStudyCallback(uri, "apao-retry", parent, "s", tmp_path / "train_runs", {"base": {}}, [])
    callback.on_trial_start(0, [], SimpleNamespace(trial_id="t1", config={}))
    run = tracker.client.get_run(child)
    assert run.info.status == "RUNNING"
    assert run.data.tags["apao.outcome"] == "running again (its last attempt: out of memory)"
    assert run.data.tags["apao.previous_outcome"] == "out of memory"
    assert run.data.tags["apao.previous_error"] == "TrialStartError: killed" and "apao.error" not in run.data.tags



def test_a_final_report_tested_again_after_a_driver_died_keeps_one_test_in_its_run(tmp_path):
    """A driver killed after it logged a trial's final report, before the trial completed: resumed from its final
    checkpoint, the trial tests the same weights again and reports them; its run keeps the test it has (a study
    resumed this way had test/ndcg_at_10 twice). An epoch's report repeated at another step is still logged."""
    from types import SimpleNamespace

    from apao_ray.study.record.mlflow_callback import MlflowStudyCallback
    from apao_ray.tracking import Tracker

    uri = mlflow_sqlite(tmp_path)
    tracker = Tracker(uri, "apao-resumed")
    parent = tracker.start_run("study", {"apao.role": "study"})
    trial = SimpleNamespace(trial_id="t1", config={})
    final = {"done": True, "epochs_trained": 3, "epoch": 3, "test/ndcg_at_10": 0.25, "perf/total_seconds": 9.0}
    run_id = tracker.start_run("t1", {"apao.trial_id": "t1", "apao.study": "s"}, parent_run_id=parent)
    for attempt in (1, 2):  # a driver each, the second one finding the trial's run by its tags
        callback = MlflowStudyCallback(uri, "apao-resumed", parent, "s", tmp_path / "train_runs", {"base": {}}, [])
        callback.on_trial_result(0, [], trial, {"epoch": attempt, "val/ndcg_at_10": 0.1 * attempt})
        callback.on_trial_result(0, [], trial, final)
    assert tracker.metric_history(run_id, "test/ndcg_at_10") == [(3, 0.25)]
    assert tracker.metric_history(run_id, "val/ndcg_at_10") == [(1, 0.1), (2, 0.2)]


def test_a_runs_params_hold_only_its_own_losss_knobs_shown_to_three_digits():
    """A CE run has no beta or eta (they do not apply to it: MLflow's Compare would plot them); a tuned run's
    knobs read 0.203, not 0.20259821574970133."""
    from apao_ray.config import TrialConfig
    from apao_ray.study.record.mlflow_callback import child_params
    from apao_ray.study.spec.space import loss_knobs
    from apao_ray.tracking import flatten

    knobs = loss_knobs()
    ce = flatten(child_params(TrialConfig(), {"backbone": "tiger", "loss": "ce"}, knobs))
    assert not [key for key in ce if key.rsplit(".", 1)[-1] in {"beta", "eta", "num_negatives"}], sorted(ce)
    pairwise = flatten(child_params(TrialConfig(), {"backbone": "tiger", "loss": "apao_pairwise",
                                                    "beta": 0.20259821574970133, "eta": 0.000130412345}, knobs))
    assert (pairwise["beta"], pairwise["eta"]) == (0.203, 0.00013)
    # a knob of its own loss that the study does not tune stays, under base.loss
    assert pairwise["base.loss.num_negatives"] == TrialConfig().loss.num_negatives and "base.loss.beta" not in pairwise
