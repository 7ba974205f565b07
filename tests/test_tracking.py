"""tracking.py against a real SQLite MLflow store: where a study's artifacts land."""
from __future__ import annotations

from conftest import mlflow_sqlite
from mlflow_names import names_diff


def test_artifacts_and_models_go_beside_the_sqlite_database_not_into_the_working_directory(tmp_path, monkeypatch):
    from apao_ray.tracking import Tracker

    store, elsewhere, checkpoint = tmp_path / "store", tmp_path / "cwd", tmp_path / "checkpoint"
    for directory in (store, elsewhere, checkpoint):
        directory.mkdir()
    (checkpoint / "final_metrics.json").write_text("{}")
    monkeypatch.chdir(elsewhere)  # MLflow's own default would be ./mlruns here
    tracker = Tracker(mlflow_sqlite(store), "apao-tiny")
    run_id = tracker.start_run("tiger/ce", {})
    tracker.log_artifact(run_id, checkpoint / "final_metrics.json")
    tracker.log_recommender(run_id, checkpoint, ["i1"])
    assert list(elsewhere.iterdir()) == []
    location = store / "mlartifacts" / "apao-tiny"
    assert tracker.client.get_experiment(tracker.experiment_id).artifact_location.endswith(str(location))
    assert (location / run_id / "artifacts" / "final_metrics.json").exists()
    assert list((location / "models").rglob("final_metrics.json"))  # the logged model's copy of the checkpoint


def test_the_drivers_callbacks_read_results_without_loading_torch():
    """The study's driver records trials (MLflow and progress callbacks, pruned-trial bookkeeping, seed tables)
    through the names in apao_ray/names.py, not by importing the training code: torch stays out of it."""
    import subprocess
    import sys

    code = ("import sys; import apao_ray.study.record.mlflow_callback, apao_ray.study.record.progress, "
            "apao_ray.study.run.pruned, apao_ray.study.record.seeds; "
            "print(sorted(m for m in ('torch', 'ray.train.torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def test_a_model_left_half_logged_by_a_killed_driver_is_marked_failed_and_logged_again(tmp_path, monkeypatch):
    """log_model names the model as the run's output before it uploads MLmodel: a driver killed in between
    (here: interrupted at the upload, which MLflow does not mark FAILED, as after SIGKILL) leaves a PENDING
    model. The resumed study must log the model again, not register the one that cannot load."""
    import mlflow
    import pytest
    from mlflow.entities import LoggedModelStatus
    from mlflow.tracking import MlflowClient

    from apao_ray.tracking import Tracker, tracking_at

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "final_metrics.json").write_text("{}")
    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-tiny")
    run_id = tracker.start_run("tiger/ce", {})

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # not an Exception: MLflow's own FAILED marking does not run, as after SIGKILL

    with monkeypatch.context() as patch:
        patch.setattr(MlflowClient, "log_model_artifacts", killed)
        with pytest.raises(KeyboardInterrupt):
            tracker.log_recommender(run_id, checkpoint, ["i1"])
    (half,) = tracker.client.get_run(run_id).outputs.model_outputs
    assert tracker.client.get_logged_model(half.model_id).status == LoggedModelStatus.PENDING
    assert tracker.logged_model_uri(run_id) is None
    assert tracker.client.get_logged_model(half.model_id).status == LoggedModelStatus.FAILED
    model_uri = tracker.log_recommender(run_id, checkpoint, ["i1"])
    assert tracker.logged_model_uri(run_id) == model_uri != f"models:/{half.model_id}"
    with tracking_at(tracker.tracking_uri):
        assert mlflow.models.get_model_info(model_uri).run_id == run_id  # its MLmodel is there

    # a half-logged model AFTER a complete one (a driver killed while logging again): marked FAILED too, and
    # the complete one is the run's model whatever order MLflow lists the outputs in
    with monkeypatch.context() as patch:
        patch.setattr(MlflowClient, "log_model_artifacts", killed)
        with pytest.raises(KeyboardInterrupt):
            tracker.log_recommender(run_id, checkpoint, ["i1"])
    with monkeypatch.context() as patch:  # MLflow listing the newest output first (its order follows the random ids)
        real_get_run = MlflowClient.get_run

        def get_run(client, run):
            found = real_get_run(client, run)
            found.outputs.model_outputs.sort(key=lambda o: -client.get_logged_model(o.model_id).creation_timestamp)
            return found

        patch.setattr(MlflowClient, "get_run", get_run)
        assert tracker.logged_model_uri(run_id) == model_uri
    statuses = [tracker.client.get_logged_model(o.model_id).status
                for o in tracker.client.get_run(run_id).outputs.model_outputs]
    assert sorted(map(str, statuses)) == ["FAILED", "FAILED", "READY"], statuses


def test_a_kept_models_metrics_are_linked_again_idempotently(tmp_path):
    """A driver killed between logging a model and linking the run's metrics to it left the model's page without
    them (a resumed study keeps that model): linking again adds them there, and twice adds nothing to the run."""
    from apao_ray.tracking import Tracker

    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-tiny")
    run_id = tracker.start_run("tiger/ce", {})
    tracker.log_metrics(run_id, {"test/ndcg_at_10": 0.25, "best/val/ndcg_at_10": 0.3, "train/loss": 1.5}, 1)
    model = tracker.client.create_logged_model(tracker.experiment_id, source_run_id=run_id)
    assert not tracker.client.get_logged_model(model.model_id).metrics  # as the kill left it
    for _ in range(2):
        tracker.link_model_metrics(run_id, f"models:/{model.model_id}", ("test/", "best/val/"))
    linked = tracker.client.get_logged_model(model.model_id).metrics
    assert sorted((m.key, m.value) for m in linked) == [("best/val/ndcg_at_10", 0.3), ("test/ndcg_at_10", 0.25)]
    assert [m.value for m in tracker.client.get_metric_history(run_id, "test/ndcg_at_10")] == [0.25]


def test_names_diff_names_what_was_added_and_removed():
    assert names_diff({"a": ["x", "y"]}, {"a": ["y", "z"], "b": ["w"]}) == [
        "a: added ['z'], removed ['x']", "b: added ['w'], removed []"]
    assert names_diff({"a": ["x"]}, {"a": ["x"]}) == []
