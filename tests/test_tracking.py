"""tracking.py against a real SQLite MLflow store: where a study's artifacts land."""
from __future__ import annotations


def test_artifacts_and_models_go_beside_the_sqlite_database_not_into_the_working_directory(tmp_path, monkeypatch):
    from apao_ray.tracking import Tracker

    store, elsewhere, checkpoint = tmp_path / "store", tmp_path / "cwd", tmp_path / "checkpoint"
    for directory in (store, elsewhere, checkpoint):
        directory.mkdir()
    (checkpoint / "final_metrics.json").write_text("{}")
    monkeypatch.chdir(elsewhere)  # MLflow's own default would be ./mlruns here
    tracker = Tracker(f"sqlite:///{store}/mlflow.db", "apao-tiny")
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

    code = ("import sys; import apao_ray.study.mlflow_callback, apao_ray.study.progress, apao_ray.study.pruned, "
            "apao_ray.study.seeds; print(sorted(m for m in ('torch', 'ray.train.torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]
