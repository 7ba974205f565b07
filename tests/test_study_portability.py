"""A study on a machine that is not the developer's: the memory cap on the allocator auto picks, the dataset
found from another working directory with a relative $APAO_DATA_DIR (and never downloaded by a worker), and
exit codes a script can trust. Real Ray, real MLflow (SQLite), the --smoke configuration or Office
with tiny settings."""
from __future__ import annotations

import os
import socket

import pytest

from apao_ray.data.files import DATA_URL_ENV
from apao_ray.paths import DATA_DIR_ENV
from apao_ray.training.memory import ALLOCATOR_ENV, find_tcmalloc
from conftest import ROOT, SHARED_DATASETS, mlflow_sqlite, run_script
from datasets_helpers import needs_shared

SWEEP, TRAIN = str(ROOT / "studies" / "sweep.py"), str(ROOT / "studies" / "train.py")


def _children(uri: str, dataset: str) -> dict[str, object]:
    from apao_ray.tracking import Tracker

    return {run.data.tags["loss"]: run for run in Tracker(uri, f"apao-{dataset}").child_runs()}


@pytest.mark.e2e
def test_a_study_whose_every_trial_fails_exits_1_after_its_table(tmp_path):
    """Exit codes: 1 when no trial finished, after the table that says why (a cap far below what the trial needs
    fails it as out of memory at its first optimizer step); the note under the table names no schedule of trials
    that never ended. Under the allocator a worker picks by itself (tcmalloc where installed); the exit code does
    not depend on it. A capped study on the glibc fallback, where CE trains under the cap and the trials that
    need more fail, is test_study_reliability.py's (on an MLflow server)."""
    uri = mlflow_sqlite(tmp_path)
    result = run_script([SWEEP, "--smoke", "--losses", "apao_pairwise", "--negatives", "300", "--num-samples", "1",
                         "--memory-per-trial", "1", "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri],
                        cwd=tmp_path, timeout=900, env={ALLOCATOR_ENV: ""})
    assert result.returncode == 1, result.stderr[-4000:]
    assert "study synthetic-study: 1 trial (1 failed)" in result.stderr
    row = next(line for line in result.stdout.splitlines() if "| apao_pairwise |" in line)
    assert "failed: TrialOutOfMemoryError: out of memory (memory cap 1.00 GiB: " in row
    assert "'None'" not in result.stdout + result.stderr and "test columns: none, no trial finished" in result.stdout
    assert "no trial finished (1 failed" in result.stderr.splitlines()[-1]
    # the worker ran on what auto picks here: tcmalloc where installed (CI installs it), else the glibc fallback;
    # failing before its first report, the trial has no allocator tag: its error names it
    expected = "tcmalloc" if find_tcmalloc() else "glibc-cached"
    assert f"; allocator {expected}) " in _children(uri, "synthetic")["apao_pairwise"].data.tags["apao.error"]


def test_sweep_help_gives_the_exit_codes_and_refused_input_exits_2(capsys):
    from apao_ray.study.cli.sweep import main

    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert help_exit.value.code == 0
    for code in ("0 the study ran and at least one trial finished", "1 no trial finished", "2 input refused",
                 "130 / 143 stopped by SIGINT"):
        assert f"exit codes: {code}" in text or f"; {code}" in text, code
    assert "counting what the trial itself allocates" in text  # --memory-per-trial says what is counted
    with pytest.raises(SystemExit) as refused:
        main(["--smoke", "--losses", "ce,nope"])
    assert refused.value.code == 2 and "unknown loss(es) ['nope']" in capsys.readouterr().err


def _elsewhere(tmp_path) -> tuple[os.PathLike, dict[str, str]]:
    """A working directory away from the repo and the datasets, $APAO_DATA_DIR relative to it, a download URL
    that refuses connections and an empty cache: a trial reads the user's files or fails, never downloads."""
    workdir = tmp_path / "elsewhere" / "deeper"
    workdir.mkdir(parents=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    return workdir, {DATA_DIR_ENV: os.path.relpath(SHARED_DATASETS, workdir), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                     DATA_URL_ENV: f"http://127.0.0.1:{closed}"}


OFFICE_TINY = ["--dataset", "office", "--model-size", "tiny", "--epochs", "1", "--max-train-samples", "256",
               "--eval-max-users", "32", "--batch-size", "128", "--precision", "fp32"]


@pytest.mark.e2e
@needs_shared
def test_a_study_started_elsewhere_with_a_relative_data_dir_trains_on_the_users_files(tmp_path):
    workdir, env = _elsewhere(tmp_path)
    uri = mlflow_sqlite(tmp_path)
    result = run_script([SWEEP, *OFFICE_TINY, "--losses", "ce", "--num-samples", "1", "--output-dir", "runs",
                         "--tracking-uri", uri], cwd=workdir, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "study office-study: 1 trial (0 failed)" in result.stderr
    ce = _children(uri, "office")["ce"]
    assert ce.info.status == "FINISHED" and ce.data.params["base.data.data_dir"] == str(SHARED_DATASETS)
    assert (workdir / "runs" / "office-study").is_dir() and not (tmp_path / "cache" / "apao_ray").exists()


@pytest.mark.e2e
@needs_shared
def test_train_py_started_elsewhere_with_a_relative_data_dir_trains_on_the_users_files(tmp_path):
    workdir, env = _elsewhere(tmp_path)
    result = run_script([TRAIN, *OFFICE_TINY, "--output-dir", "runs", "--run-name", "office-ce", "--quiet",
                         "--cpus-per-worker", "1"], cwd=workdir, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert '"test/ndcg_at_10"' in result.stdout and (workdir / "runs" / "office-ce").is_dir()
    assert not (tmp_path / "cache" / "apao_ray").exists()
