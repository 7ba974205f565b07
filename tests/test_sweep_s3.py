"""A study whose --output-dir is an S3 bucket (a real S3 API server on loopback, tests/conftest.py ``s3_bucket``):
every trial finishes once though the driver is killed mid-way and the study resumed elsewhere, nothing of the study lands on the local disk,
and ``best``, the logged model and the export read what the study left in the bucket."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from apao_ray import storage
from conftest import SWEEP, best_rows, launch_until, mid_trial, mlflow_sqlite, run_script
from study_helpers import every_trial_finished_once


EPOCHS = 3


@pytest.fixture(scope="module")
def s3_study(s3_bucket, tmp_path_factory):
    """A --smoke study (tiger x {ce, apao_pointwise}, one trial each, one at a time, 3 epochs) into
    ``s3://.../studies``, its MLflow and Optuna stores local; SIGKILL to the whole process group (its driver and the
    local Ray it started: a lost machine) once one trial has finished and the other validated an epoch; then
    `sweep --resume` from another working directory and HOME, given the study's output directory, MLflow store and
    Optuna storage explicitly, as on another machine."""
    workdir = tmp_path_factory.mktemp("s3study")
    elsewhere, home = workdir / "elsewhere", workdir / "home"
    elsewhere.mkdir(), home.mkdir()
    uri = mlflow_sqlite(workdir)
    output = f"{s3_bucket}/studies"
    command = [sys.executable, SWEEP, "--smoke", "--epochs", str(EPOCHS), "--num-samples", "1", "--max-concurrent", "1",
               "--output-dir", output, "--tracking-uri", uri, "--optuna-storage", str(workdir / "optuna.db")]
    process, at_kill = launch_until(command, workdir, lambda state: mid_trial(state) and any(
        status == "FINISHED" for _, status, _ in state))
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    result = run_script([*command[1:], "--resume"], cwd=elsewhere, env={"HOME": str(home)})
    assert result.returncode == 0, result.stderr[-4000:]
    from apao_ray.tracking import Tracker

    return {"dir": workdir, "elsewhere": elsewhere, "uri": uri, "output": output, "at_kill": at_kill,
            "stderr": result.stderr, "tracker": Tracker(uri, "apao-synthetic")}


@pytest.mark.e2e
def test_a_study_on_s3_finishes_every_trial_once_after_its_driver_is_killed(s3_study):
    """Every planned trial finishes once (Tune's state restored from the bucket); the trial cut mid-way continues
    from its checkpoint there, the one finished before the kill keeps its run; nothing of the study is on a local
    disk, and the resumed driver wrote nothing into its working directory."""
    end = every_trial_finished_once(s3_study["uri"], 2, s3_study["dir"] / "optuna.db", EPOCHS)
    tracker, children = end["tracker"], end["children"]
    (finished,) = [trial for trial, status, _ in s3_study["at_kill"] if status == "FINISHED"]
    (cut,) = [(trial, epoch) for trial, status, epoch in s3_study["at_kill"] if status == "RUNNING"]
    assert set(children) == {finished, cut[0]}

    def resumed(trial: str) -> list[float]:
        return [value for _, value in tracker.metric_history(children[trial].info.run_id, "train/resumed_after_epoch")]

    assert resumed(cut[0]) and min(resumed(cut[0])) >= cut[1], (resumed(cut[0]), s3_study["at_kill"])
    assert not resumed(finished)
    # the final checkpoints are in the bucket, and nothing of the study is on the local disk
    for trial_id, run in children.items():
        checkpoint = run.data.tags["apao.checkpoint"]
        assert checkpoint.startswith(f"{s3_study['output']}/") and checkpoint.endswith("_final"), checkpoint
        assert storage.exists(storage.join(checkpoint, "best_model.pt"))
    local = sorted(str(path) for path in s3_study["dir"].rglob("*") if "mlartifacts" not in path.parts  # MLflow's
                   and ("train-trial_id" in path.name or path.name.startswith("epoch_")))
    assert not local and not (s3_study["dir"] / "apao_runs").exists(), local
    assert not list(s3_study["elsewhere"].iterdir()), "the resumed study wrote into its working directory"
    study_dir = storage.find(s3_study["output"], "*")
    assert [storage.name(location) for location in study_dir] == ["synthetic-study"], study_dir
    assert storage.find(study_dir[0], "experiment_state-*.json", directories=False)


@pytest.mark.e2e
def test_best_and_the_logged_model_read_the_study_on_s3(s3_study):
    rows = best_rows(s3_study["uri"], s3_study["dir"])
    import mlflow

    import apao_ray
    from apao_ray.data import load_dataset
    from apao_ray.reuse.inference import Recommender

    mlflow.set_tracking_uri(s3_study["uri"])
    registered = apao_ray.load_recommender("models:/apao-synthetic-tiger-ce@best")
    run = s3_study["tracker"].client.get_run(next(row["run_id"] for row in rows if row["loss"] == "ce"))
    in_bucket = Recommender.from_checkpoint(run.data.tags["apao.checkpoint"])  # read from the bucket
    dataset = load_dataset("synthetic")
    histories = [[dataset.catalog.item_ids[i] for i in h if i >= 0] for h in dataset.splits["test"].histories[:4]]
    expected = in_bucket.recommend(histories, k=5)
    assert expected and registered.recommend(histories, k=5) == expected


@pytest.mark.e2e
def test_a_pruned_trials_test_finds_and_loads_its_checkpoint_in_the_bucket(s3_study):
    """What the driver does for a trial ASHA stopped: its newest epoch checkpoint up to the pruned epoch, found in
    the bucket and tested from a local copy (here a finished trial's last epoch: the same best weights)."""
    from apao_ray.study.run.pruned import evaluate_checkpoint, latest_checkpoint

    run = next(run for run in s3_study["tracker"].child_runs() if run.data.tags["loss"] == "ce")
    train_root = run.data.tags["apao.checkpoint"].split("/train-trial_id=")[0]
    assert latest_checkpoint(train_root, run.data.tags["apao.trial_id"], up_to_epoch=2) is None  # two kept: 3, final
    location = latest_checkpoint(train_root, run.data.tags["apao.trial_id"])
    assert location.startswith(f"{s3_study['output']}/") and storage.name(location) == "epoch_0003", location
    metrics = evaluate_checkpoint(location)
    assert metrics["best/epoch"] == run.data.metrics["best/epoch"]
    assert metrics["test/ndcg_at_10"] == pytest.approx(run.data.metrics["test/ndcg_at_10"], abs=1e-6)


@pytest.mark.e2e
def test_export_recomputes_a_per_user_table_from_a_checkpoint_on_s3(s3_study, tmp_path):
    from apao_ray.analysis.export import _recompute

    run = next(run for run in s3_study["tracker"].child_runs() if run.data.tags["loss"] == "ce")
    said = _recompute(run, tmp_path / "per_user.csv.gz", 1)
    assert said.startswith(f"recomputed from {s3_study['output']}/") and "equals the logged" in said, said
    assert (tmp_path / "per_user.csv.gz").stat().st_size > 0


@pytest.mark.parametrize("where, changes, tracking_uri, message", [
    ("s4://bucket/x", {}, "sqlite:////tmp/mlflow.db", r"--output-dir 's4://bucket/x' cannot be read \(Unrecognized "),
    ("{bucket}-absent/x", {}, "sqlite:////tmp/mlflow.db", r"cannot be read \(s3://apao-test-absent does not exist\)"),
    ("{bucket}/x", {"cohort_size": 2, "seeds": (0, 1)}, "sqlite:////tmp/mlflow.db",
     r"--cohort-size 2 with --output-dir 's3://apao-test/x': .* give a local or shared --output-dir"),
    ("{bucket}/x", {}, "http://127.0.0.1:5000", r"the Optuna store cannot default .* pass --optuna-storage"),
])
def test_a_remote_output_dir_that_cannot_hold_the_study_is_refused_in_one_line(s3_bucket, where, changes,
                                                                                 tracking_uri, message):
    from apao_ray.study.setup import checked_output_dir
    from apao_ray.study.spec.study import StudySpec

    spec = StudySpec(losses=("ce",), output_dir=where.format(bucket=s3_bucket), **changes)
    with pytest.raises(ValueError, match=message) as error:
        checked_output_dir(spec, tracking_uri)
    assert "\n" not in str(error.value)
    fine = StudySpec(losses=("ce",), output_dir=f"{s3_bucket}/x/", optuna_storage="/tmp/optuna.db")
    assert checked_output_dir(fine, tracking_uri) == f"{s3_bucket}/x"


def test_a_trials_failure_record_in_the_bucket_stops_its_restart_until_retry_failed_forgets_it(s3_bucket, tmp_path):
    """The record a trial that failed for good leaves beside its checkpoints (a non-finite loss, out of memory)
    is written to, read from and removed from the bucket, as from a local run directory."""
    from apao_ray.study.run.trial import FAILURE_FILE, forget_failures
    from apao_ray.training.failures import TrialFailedError, leave_failure
    from apao_ray.training.loss_watch import NonFiniteLossError
    from apao_ray.training.worker import _start_in_tune_actor

    train_root = f"{s3_bucket}/{tmp_path.name}/train_runs"
    loop_config = {"failure_file": storage.join(train_root, "train-trial_id=a", FAILURE_FILE), "trial": {}}
    reason = leave_failure(loop_config, NonFiniteLossError("loss is nan at step 3"))
    assert storage.read_text(loop_config["failure_file"]) == reason and "nan" in reason
    with pytest.raises(TrialFailedError, match="loss is nan at step 3"):
        _start_in_tune_actor(loop_config)
    storage.write_text(storage.join(train_root, "train-trial_id=b", "metrics.jsonl"), "{}\n")  # a run that did not fail
    assert forget_failures(train_root) == 1 and not storage.exists(loop_config["failure_file"])
    assert storage.exists(storage.join(train_root, "train-trial_id=b", "metrics.jsonl"))
