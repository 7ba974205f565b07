"""Resumes that must be refused before anything runs (a dataset changed since the study started, another
Optuna storage) and --overwrite, which retires the old study's runs: real SQLite MLflow stores, no Ray."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import mlflow_sqlite


def _tiny_study(tracking_uri: str, output_dir: Path, study: str, checksums: dict[str, str], argv: list[str],
                overwrite: bool = False, select_by: str = "ndcg_at_10"):
    """Study ``study`` of the tiny dataset as the driver holds it, its epochs kept by ``select_by``."""
    from types import SimpleNamespace

    from apao_ray.config import DataConfig, ProtocolConfig, TrialConfig
    from apao_ray.study.plan.budget import Fit
    from apao_ray.study.plan.plan import Plan
    from apao_ray.study.run.study import Study
    from apao_ray.study.setup import StudySetup
    from apao_ray.study.spec.study import StudySpec

    base = TrialConfig(DataConfig(dataset="tiny"), protocol=ProtocolConfig(select_by=select_by))
    spec = StudySpec(dataset="tiny", losses=("ce",), study_name=study, overwrite=overwrite)
    setup = StudySetup(dataset=SimpleNamespace(checksums=checksums), base=base, study_name=study,
                       tracking_uri=tracking_uri, output_dir=output_dir, optuna_storage="", dataset_record={},
                       cpus_per_trial=1.0)
    plan = Plan("tiny", "paper", "fp32", 1, [], 20, 3, Fit(20, 3, 5, 0.0)).scheduled(base, spec.search, spec.losses, None)
    return Study(spec, setup, plan, argv)


def _parent_with_checksums(tracking_uri: str, output_dir: Path, study: str, checksums: dict[str, str], argv: list[str],
                           overwrite: bool = False):
    """What a first run of the study leaves in MLflow: its parent run with the dataset checksums."""
    from apao_ray.study.run.driver import open_parent_run
    from apao_ray.tracking import Tracker

    return open_parent_run(Tracker(tracking_uri, "apao-tiny"),
                           _tiny_study(tracking_uri, output_dir, study, checksums, argv, overwrite))


def _started_tiny_study(tmp_path: Path, monkeypatch) -> tuple[list[str], str, dict[str, str], str]:
    """A tiny dataset and the MLflow parent run a first start of study 's' left: (argv, uri, checksums, parent)."""
    from apao_ray.data import load_dataset
    from test_data_files import write_dataset

    monkeypatch.chdir(tmp_path)
    write_dataset(tmp_path / "data", "tiny")
    uri = mlflow_sqlite(tmp_path)
    argv = ["--dataset", "tiny", "--data-dir", str(tmp_path / "data"), "--losses", "ce", "--beam-size", "2",
            "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri, "--study-name", "s"]
    checksums = load_dataset("tiny", str(tmp_path / "data"), allow_download=False).checksums
    return argv, uri, checksums, _parent_with_checksums(uri, tmp_path / "runs", "s", checksums, argv)


def test_resume_refuses_a_dataset_that_changed_since_the_study_started(tmp_path, monkeypatch, capsys):
    from apao_ray.study.cli.sweep import main
    from test_data_files import GOOD_INTER

    argv, _, original, _ = _started_tiny_study(tmp_path, monkeypatch)
    # one more interaction for u1: a different file, still a valid dataset
    (tmp_path / "data" / "tiny" / "tiny.inter.json").write_text(json.dumps({**GOOD_INTER, "u1": ["i1", "i2", "i3", "i4"]}))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr[-2000:]
    assert f"dataset files changed since study 's' started (tiny.inter.json: recorded {original['tiny.inter.json'][:12]}" in stderr
    assert "tiny.index.rq-kmeans.json" not in stderr  # only the changed file is named
    assert not (tmp_path / "runs").exists()


def test_overwrite_retires_the_old_study_runs_under_their_own_name(tmp_path):
    from apao_ray.study.record.report import best_rows
    from apao_ray.tracking import Tracker

    uri = mlflow_sqlite(tmp_path)
    argv = ["--dataset", "tiny", "--study-name", "s"]
    old_parent = _parent_with_checksums(uri, tmp_path / "runs", "s", {}, argv)
    tracker = Tracker(uri, "apao-tiny")
    child = tracker.start_run("tiger/ce", {"apao.study": "s", "apao.trial_id": "t1", "loss": "ce", "backbone": "tiger"},
                              parent_run_id=old_parent)
    tracker.log_metrics(child, {"best/val/ndcg_at_10": 0.5, "test/ndcg_at_10": 0.4}, 1)
    tracker.end_run(child)
    assert len(best_rows(tracker, study="s")) == 1
    new_parent = _parent_with_checksums(uri, tmp_path / "runs", "s", {}, [*argv, "--overwrite"], overwrite=True)
    assert new_parent != old_parent
    retired = f"s.overwritten-{old_parent[:8]}"
    assert {tracker.client.get_run(r).data.tags["apao.study"] for r in (old_parent, child)} == {retired}
    assert best_rows(tracker, study="s") == []  # the new study does not inherit the old trials
    assert len(best_rows(tracker, study=retired)) == 1


def test_resume_refuses_an_optuna_storage_other_than_the_one_the_study_started_with(tmp_path, monkeypatch, capsys):
    """The restored searcher keeps writing to its first storage: a different --optuna-storage is an error, not ignored."""
    from apao_ray.study.cli.sweep import main
    from apao_ray.study.search.optuna_storage import STORAGE_TAG
    from apao_ray.tracking import Tracker

    argv, uri, _, parent_id = _started_tiny_study(tmp_path, monkeypatch)
    first = f"sqlite:///{tmp_path}/optuna.db"
    Tracker(uri, "apao-tiny").set_tags(parent_id, {STORAGE_TAG: first})
    (tmp_path / "runs" / "s").mkdir(parents=True)
    (tmp_path / "runs" / "s" / "tuner.pkl").write_bytes(b"")  # what Tune saves: the study can be resumed
    other = tmp_path / "elsewhere.db"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--optuna-storage", str(other), "--dry-run"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr[-2000:]
    assert f"study 's' was started with Optuna storage '{first}'; --optuna-storage now gives 'sqlite:///{other}'" in stderr
    # the recorded storage itself (or none named) passes this check
    for given in (["--optuna-storage", first], []):
        try:
            main([*argv, *given, "--dry-run"])
        except SystemExit as error:
            assert "Optuna storage" not in capsys.readouterr().err, given


def test_a_study_saved_before_study_run_was_split_still_unpickles():
    """Tune pickles the searcher, the scheduler and the run callbacks by module path: a study saved before they
    left ``study/run/`` names the old modules, and resuming it must find the same classes (run/__init__.MOVED)."""
    import pickle

    from apao_ray.study.record.live_callbacks import LiveCallbacks
    from apao_ray.study.search.optuna_storage import PersistentOptunaSearch
    from apao_ray.study.search.scheduler import PerMethodASHA

    for old, cls in [("optuna_storage", PersistentOptunaSearch), ("scheduler", PerMethodASHA),
                     ("live_callbacks", LiveCallbacks)]:
        assert pickle.loads(f"capao_ray.study.run.{old}\n{cls.__name__}\n.".encode()) is cls


def test_a_study_records_its_selection_and_a_resume_refuses_another(tmp_path):
    """The parent run carries the selection every surface names the best trial by; a resume that would select
    otherwise (here keeping the epoch of the lowest validation loss) is refused, as a changed space is."""
    from apao_ray.study.run.driver import check_same_schedule
    from apao_ray.tracking import Tracker

    uri, runs = mlflow_sqlite(tmp_path), tmp_path / "runs"
    parent = _parent_with_checksums(uri, runs, "s", {}, [])
    tags = Tracker(uri, "apao-tiny").client.get_run(parent).data.tags
    assert json.loads(tags["apao.selection"]) == {"metric": "ndcg_at_10", "rule": "ndcg_at_10"}
    (runs / "s").mkdir(parents=True)
    (runs / "s" / "tuner.pkl").write_bytes(b"")  # what Tune saves: the study can be resumed
    check_same_schedule(_tiny_study(uri, runs, "s", {}, []))  # the same selection resumes
    with pytest.raises(ValueError, match=r"^study 's' names its best trial by best/val/ndcg_at_10 \(max\) at the epoch "
                       r"validation ndcg_at_10 keeps, .*; now by .* at the epoch the lowest validation loss keeps"):
        check_same_schedule(_tiny_study(uri, runs, "s", {}, [], select_by="loss"))
