"""studies/sweep.py refuses bad input before any trial: a bad flag, range, knob, store, address or dataset is
named on stderr with exit code 2, and neither the output directory nor an MLflow store is created (the study
itself: test_sweep.py)."""
from __future__ import annotations

import importlib.util

import pytest


@pytest.mark.parametrize("flags, problem", [
    (["--losses", "ce,nope"], "unknown loss(es) ['nope']"),
    (["--backbones", "gpt"], "unknown backbone(s) ['gpt']"),
    (["--beta", "0.4:0.1"], "range of 'beta' 0.4:0.1 is empty, inverted"),
    (["--eta", "1e-3:1e-5"], "range of 'eta' 0.001:1e-05 is empty, inverted"),
    (["--knob", "eta=0:1e-5"], "range of 'eta' 0.0:1e-05 is on a log scale: LOW must be > 0"),
    (["--losses", "ce,apao_pointwise", "--negatives", "10:20"],
     "--negatives was given, but none of the losses ['ce', 'apao_pointwise'] tunes num_negatives"),
    (["--losses", "apao_pairwise", "--negatives", "10:5000"], "num_negatives=5000 must be < the 399 semantic IDs"),
    (["--beam-size", "400"], "beam_size=400 exceeds the 399 semantic IDs"),
    (["--tracking-uri", "http://127.0.0.1:9"], "MLflow tracking server 'http://127.0.0.1:9' is unreachable"),
    (["--tracking-uri", "file:./mlruns"], "is not supported"),
    pytest.param(["--tracking-uri", "postgresql+psycopg://apao:pw@127.0.0.1:9/mlflow"],
                 "tracking URI 'postgresql+psycopg://apao:***@127.0.0.1:9/mlflow': the database is unreachable",
                 marks=pytest.mark.skipif(not importlib.util.find_spec("psycopg"), reason="needs the postgres extra")),
    (["--optuna-storage", "postgresql://u:pw@host:port/db"],
     "--optuna-storage 'postgresql://u:***@host:port/db' is not a SQLAlchemy URL"),  # the password never printed
    (["--optuna-storage", "postgress://host/db"], "--optuna-storage 'postgress://host/db' is not a SQLAlchemy URL"),
    (["--study-name", "../escape"], "study name '../escape' must be a plain name"),
    (["--dataset", "../synthetic"], "synthetic does not exist (a --dataset with a path separator is a directory"),
    (["--address", "127.0.0.1:9"], "Ray address '127.0.0.1:9' is unreachable"),
    (["--address", "headnode"], "Ray address 'headnode' must be HOST:PORT"),
    (["--resume"], "--resume: no study 'synthetic-study' to resume"),
    (["--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
    (["--smoke", "--dataset", "office"], "--smoke runs on the built-in synthetic dataset, not --dataset office"),
    (["--memory-per-trial", "0"], "'0' must be a number > 0"),
    (["--cpus-per-trial", "-1"], "'-1' must be a number > 0"),
    (["--gpus-per-trial", "-1"], "argument --gpus-per-trial: '-1' must be a number >= 0"),  # was a C++ stack trace
    (["--max-concurrent", "0"], "argument --max-concurrent: '0' must be an integer >= 1"),  # was silently "auto"
    (["--num-samples", "0"], "argument --num-samples: '0' must be an integer >= 1"),
    (["--time-budget", "-5"], "argument --time-budget: '-5' must be a number > 0"),
    (["--asha-grace-period", "0"], "argument --asha-grace-period: '0' must be an integer >= 1"),
    (["--max-failures", "-1"], "argument --max-failures: '-1' must be an integer >= 0"),
    (["--pretrain-ce-epochs", "-2"], "argument --pretrain-ce-epochs: '-2' must be an integer >= 0"),
    (["--seed", "-3"], "argument --seed: '-3' must be an integer >= 0"),
    (["--cohort-size", "0"], "argument --cohort-size: '0' must be an integer >= 1"),
    (["--cohort-size", "3", "--workers-per-trial", "2"], "--cohort-size 3 with --workers-per-trial 2: a cohort trains on one"),
    (["--epochs", "2.5"], "argument --epochs: '2.5' is not an integer; give an integer >= 1"),
    (["--lr", "inf"], "argument --lr: 'inf' must be a number >= 0"),
    (["--lr", "nan"], "argument --lr: 'nan' must be a number >= 0"),
    # an explicit --data-dir without the dataset, though $APAO_DATA_DIR may hold it
    (["--dataset", "office", "--data-dir", "no-such-dir"], "dataset 'office' not found in ['/"),
])
def test_bad_study_input_is_refused_before_any_trial(tmp_path, monkeypatch, capsys, flags, problem):
    from apao_ray.study.cli.sweep import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--dataset", "synthetic", "--output-dir", str(tmp_path / "runs"), *flags])  # a later --dataset wins
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and problem in stderr, stderr[-2000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("flag", ["--tracking-uri", "--optuna-storage"])
def test_a_postgresql_store_without_its_driver_is_refused_naming_the_extra(tmp_path, monkeypatch, capsys, flag):
    """Without the driver an MLflow client or Optuna fails with a traceback once the study runs (and an MLflow server
    never answers): the study stops first, in one line naming the postgres extra and the URL form it serves."""
    import sys

    from apao_ray.study.cli.sweep import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "psycopg", None)  # `import psycopg` fails, as where the extra is not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["--smoke", "--output-dir", str(tmp_path / "runs"), flag, "postgresql://apao:pw@127.0.0.1:9/apao"])
    stderr = capsys.readouterr().err
    (line,) = [line for line in stderr.splitlines() if "psycopg" in line]
    assert exit_info.value.code == 2 and "'postgresql://apao:***@127.0.0.1:9/apao': its database driver psycopg is " \
        "not installed" in line and "[postgres]" in line and "give postgresql+psycopg://USER@HOST:PORT/DATABASE" in line
    assert "Traceback" not in stderr and "pw@" not in stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
