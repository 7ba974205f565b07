"""A study on a machine that is not the developer's: the memory cap on the glibc fallback and on the allocator
auto picks, the dataset found from another working directory with a relative $APAO_DATA_DIR (and never downloaded by a
worker), and exit codes a script can trust. Real Ray, real MLflow (SQLite), the --smoke configuration or Office
with tiny settings."""
from __future__ import annotations

import os
import socket

import pytest

from apao_ray.data.files import DATA_URL_ENV
from apao_ray.paths import DATA_DIR_ENV
from apao_ray.training.memory import ALLOCATOR_ENV, find_tcmalloc
from conftest import ROOT, SHARED_DATASETS, mlflow_sqlite, run_script

SWEEP, TRAIN = str(ROOT / "studies" / "sweep.py"), str(ROOT / "studies" / "train.py")
needs_office = pytest.mark.skipif(not (SHARED_DATASETS / "Office" / "Office.inter.json").is_file(),
                                  reason=f"shared datasets not found at {SHARED_DATASETS}")


def _children(uri: str, dataset: str) -> dict[str, object]:
    from apao_ray.tracking import Tracker

    return {run.data.tags["loss"]: run for run in Tracker(uri, f"apao-{dataset}").child_runs()}


@pytest.mark.e2e
def test_a_capped_study_on_the_glibc_fallback_trains_ce_and_fails_what_needs_more(tmp_path):
    """--memory-per-trial 2.5 counts what a trial allocates, not the 1.5-2.5 GiB its worker maps with torch and
    Ray loaded (which depends on the allocator): CE finishes. APAO-pairwise with 300 negatives allocates more,
    how much depending on the allocator (glibc keeps its freed heap, tcmalloc returns it: under tcmalloc on an
    AVX512-BF16 EPYC it fit, 2.1 GiB resident): where it exceeds the cap it fails as out of memory, naming the
    cap and what it held, and the study exits 0 and says one failed. The study runs on the allocator a machine
    without tcmalloc gets (glibc keeping its large blocks); that the cap counts the same under every allocator
    is test_memory.py's (a worker-sized process per allocator, in seconds where a study per allocator took a
    minute or more), and the study whose every trial fails below runs on the allocator auto picks."""
    allocator = "glibc-cached"
    uri = mlflow_sqlite(tmp_path)
    result = run_script([SWEEP, "--smoke", "--losses", "ce,apao_pairwise", "--negatives", "300", "--num-samples", "1",
                         "--epochs", "1", "--memory-per-trial", "2.5", "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri],
                        cwd=tmp_path, timeout=900, env={ALLOCATOR_ENV: allocator})
    assert result.returncode == 0, result.stderr[-4000:]
    runs = _children(uri, "synthetic")
    assert runs["ce"].info.status == "FINISHED" and runs["ce"].data.tags["apao.allocator"] == allocator
    pairwise = runs["apao_pairwise"]
    if pairwise.info.status == "FINISHED":  # it fit under this allocator's accounting
        assert "study synthetic-study: 2 trials (0 failed)" in result.stderr
        return
    assert "study synthetic-study: 2 trials (1 failed)" in result.stderr
    assert pairwise.info.status == "FAILED" and pairwise.data.tags["apao.outcome"] == "out of memory"
    assert "TrialOutOfMemoryError: out of memory (memory cap 2.50 GiB: " in pairwise.data.tags["apao.error"]
    assert "while training in epoch 1" in pairwise.data.tags["apao.error"]
    assert "resident peak +" in pairwise.data.tags["apao.error"]
    assert "; allocator glibc-cached) " in pairwise.data.tags["apao.error"]  # what the cap's count depends on
    assert "failed trials (1):\n  tiger/apao_pairwise" in result.stderr  # each failed trial and why, on the console


@pytest.mark.e2e
def test_a_study_whose_every_trial_fails_exits_1_after_its_table(tmp_path):
    """Exit codes: 1 when no trial finished, after the table that says why (a cap far below what the trial needs
    fails it as out of memory at its first optimizer step); the note under the table names no schedule of trials
    that never ended. Under the allocator a worker picks by itself (tcmalloc where installed: the one under
    which the capped study above may see APAO-pairwise fit); the exit code does not depend on it."""
    uri = mlflow_sqlite(tmp_path)
    result = run_script([SWEEP, "--smoke", "--losses", "apao_pairwise", "--negatives", "300", "--num-samples", "1",
                         "--memory-per-trial", "1", "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri],
                        cwd=tmp_path, timeout=900, env={ALLOCATOR_ENV: ""})
    assert result.returncode == 1, result.stderr[-4000:]
    assert "study synthetic-study: 1 trials (1 failed)" in result.stderr
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
@needs_office
def test_a_study_started_elsewhere_with_a_relative_data_dir_trains_on_the_users_files(tmp_path):
    workdir, env = _elsewhere(tmp_path)
    uri = mlflow_sqlite(tmp_path)
    result = run_script([SWEEP, *OFFICE_TINY, "--losses", "ce", "--num-samples", "1", "--output-dir", "runs",
                         "--tracking-uri", uri], cwd=workdir, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "study office-study: 1 trials (0 failed)" in result.stderr
    ce = _children(uri, "office")["ce"]
    assert ce.info.status == "FINISHED" and ce.data.params["base.data.data_dir"] == str(SHARED_DATASETS)
    assert (workdir / "runs" / "office-study").is_dir() and not (tmp_path / "cache" / "apao_ray").exists()


@pytest.mark.e2e
@needs_office
def test_train_py_started_elsewhere_with_a_relative_data_dir_trains_on_the_users_files(tmp_path):
    workdir, env = _elsewhere(tmp_path)
    result = run_script([TRAIN, *OFFICE_TINY, "--output-dir", "runs", "--run-name", "office-ce", "--quiet",
                         "--cpus-per-worker", "1"], cwd=workdir, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert '"test/ndcg_at_10"' in result.stdout and (workdir / "runs" / "office-ce").is_dir()
    assert not (tmp_path / "cache" / "apao_ray").exists()
