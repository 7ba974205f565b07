"""studies/train.py end to end on a real local Ray: learning, bad flags, kill-and-resume."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, descendant_pids, run_script

TRAIN = str(ROOT / "studies" / "train.py")
COMMON = ["--dataset", "synthetic", "--model-size", "tiny", "--batch-size", "128", "--effective-batch-size", "128",
          "--lr", "2e-3", "--cpus-per-worker", "1"]


def _metrics(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("flags, problem", [
    (["--loss", "nope"], "unknown loss 'nope'"),
    (["--backbone", "gpt"], "invalid choice: 'gpt'"),
    (["--epochs", "0"], "'0' must be an integer >= 1"),
    (["--lr", "-1"], "'-1' must be a number >= 0"),
    (["--loss", "apao_pairwise", "--num-negatives", "5000"], "num_negatives=5000 must be < the 399 semantic IDs"),
    (["--beam-size", "1000"], "beam_size=1000 exceeds the 399 semantic IDs"),
    (["--dataset", "../etc", "--data-dir", "."], "must be a plain name"),  # a name never leaves --data-dir
    (["--dataset", "./no/such/dir"], "no/such/dir does not exist"),  # a path is a dataset directory
    (["--loss", "ce", "--num-negatives", "10"], "loss 'ce' has no knob 'num_negatives'; its knobs: none (a baseline)"),
    (["--loss", "apao_pointwise", "--knob", "gamma=0.1"], "loss 'apao_pointwise' has no knob 'gamma'; its knobs: "
                                                          "['beta', 'eta']"),
    (["--loss", "apao_pointwise", "--beta", "0.2", "--knob", "beta=0.3"], "knob 'beta' was given twice (0.2 and 0.3)"),
    (["--loss", "apao_pointwise", "--eta", "1e-4", "--knob", "eta=1e-3"], "eta was given twice, by --eta"),
    (["--knob", "beta"], "argument --knob: 'beta' must be NAME=VALUE with a number"),
    (["--max-failures", "-1"], "argument --max-failures: '-1' must be an integer >= 0"),
    (["--pretrain-ce-epochs", "-1"], "argument --pretrain-ce-epochs: '-1' must be an integer >= 0"),
    (["--dataset", "office", "--data-dir", "no-such-dir"], "dataset 'office' not found in ['/"),
])
def test_bad_flags_are_refused_before_any_work(tmp_path, monkeypatch, capsys, flags, problem):
    from apao_ray.study.cli.train import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--output-dir", str(tmp_path / "runs"), *flags])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and problem in stderr, stderr
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.parametrize("flags, micro_batch", [([], 128), (["--use-gpu"], 1024), (["--use-gpu", "--batch-size", "64"], 64)])
def test_the_micro_batch_is_the_devices_fastest_unless_given(tmp_path, capsys, flags, micro_batch):
    from apao_ray.study.cli.train import main

    assert main(["--output-dir", str(tmp_path / "runs"), "--print-config", *flags]) == 0
    train = json.loads(capsys.readouterr().out)["config"]["train"]
    assert (train["batch_size"], train["effective_batch_size"]) == (micro_batch, 1024)


def _uninterrupted_reference(tmp_path: Path, epochs: int, num_workers: int) -> dict:
    """The same trial run with the plain loop and the worker's thread count: in this process, or on as many
    torch.distributed ranks (tests/test_data_parallel.py) as the run's workers."""
    from apao_ray.study.cli.train import build_parser, trial_config_from_args
    from apao_ray.training.hooks import TrainingHooks
    from apao_ray.training.loop import run_trial

    config = trial_config_from_args(build_parser().parse_args(_killed_run_flags(epochs, num_workers)))
    if num_workers > 1:
        from test_data_parallel import train

        train(config, tmp_path / "reference")
        return torch.load(tmp_path / "reference" / "rank0_final.pt", weights_only=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the Ray worker runs with --cpus-per-worker 1 thread
    try:
        return run_trial(config, TrainingHooks(tmp_path / "reference", verbose=False))
    finally:
        torch.set_num_threads(threads)


def _wait_for(path_glob: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not list(path_glob.parent.glob(path_glob.name)):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline, f"no {path_glob} after {timeout} s"
        time.sleep(0.5)


@pytest.mark.e2e
def test_a_run_whose_worker_is_killed_and_whose_driver_is_interrupted_resumes_to_the_same_metrics(tmp_path):
    """SIGKILL one of a run's 2 Ray Train workers mid-run: Ray restarts the worker group from its last
    checkpoint (FailureConfig). Then Ctrl-C (SIGINT to the process group): the driver exits 130 saying how to
    continue, a re-run without `--resume` is refused, and `--resume` lets Ray Train restore the run by name from
    storage without training epoch 1 again. The run ends as 2 uninterrupted ranks on half-size batches do. A
    one-worker run restarts by the same paths (its group of one); a study's trial whose process is killed is
    retried by Tune instead (test_study_reliability.py)."""
    # 6 epochs: Ctrl-C comes once epoch 3's checkpoint exists, three epochs before the end (with 4, a fast machine
    # finished the run before the signal arrived: an Intel Xeon with AMX, 2-3 s per epoch, 2026-11-29)
    epochs, out, num_workers, runs = 6, tmp_path / "r.json", 2, tmp_path / "runs"
    command = [sys.executable, TRAIN, *_killed_run_flags(epochs, num_workers), "--max-failures", "2",
               "--output-dir", str(runs), "--run-name", "killed", "--json-out", str(out)]
    process = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # once epoch 2's checkpoint directory appears, epoch 1's is surely registered with Ray
    _wait_for(runs / "killed" / "epoch_0002", process)
    pids = descendant_pids(process.pid, "ray::RayTrainWorker")
    assert len(pids) == num_workers, f"found Ray Train workers {pids}, expected {num_workers}"
    os.kill(pids[-1], signal.SIGKILL)  # one rank: the others are stopped and restarted with it
    _wait_for(runs / "killed" / "epoch_0003", process)  # trained on past the kill; epoch 2's checkpoint registered
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert "resumed from" in stderr, "the restarted worker did not restore the checkpoint"
    assert not out.exists()
    assert process.returncode == 130, stderr[-3000:]  # not 0 or 1: a script can tell a stop from an end or a failure
    assert re.search(r"run killed stopped by SIGINT: its checkpoints are kept \(the newest: epoch_\d{4}\); "
                     r"continue it with the same command and --resume", stderr), stderr[-3000:]
    # without --resume an existing run is refused with a clear message
    refused = run_script([*command[1:]], cwd=tmp_path, timeout=120)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    result = run_script([*command[1:], "--resume"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and f"epoch 1/{epochs}" not in result.stderr  # epoch 1 not trained again
    # one concise line per epoch, printed once: by rank 0 alone, not duplicated by Ray's print patch
    assert sum(f"epoch {epochs}/{epochs} " in line for line in result.stderr.splitlines()) == 1, result.stderr[-3000:]
    resumed = _metrics(out)
    reference = _uninterrupted_reference(tmp_path, epochs, num_workers)
    test_keys = sorted(k for k in reference if k.startswith("test/"))
    assert test_keys and {k: resumed[k] for k in test_keys} == pytest.approx({k: reference[k] for k in test_keys},
                                                                           abs=1e-9)
    assert resumed["epochs_trained"] == epochs and resumed["best/epoch"] == reference["best/epoch"]
    for m in range(1, 5):  # the adaptive weights were restored, not restarted from uniform
        assert resumed[f"train/apao_weight_m{m}"] == pytest.approx(reference[f"train/apao_weight_m{m}"], abs=1e-9)
    # the final checkpoint is rank 0's unwrapped model: it loads into a model built without DDP
    final = next((runs / "killed").glob("epoch_*_final"))
    weights = torch.load(final / "best_model.pt", weights_only=True)
    assert weights and not any(key.startswith("module.") for key in weights)


def _killed_run_flags(epochs: int, num_workers: int) -> list[str]:
    return [*COMMON, "--backbone", "tiger", "--loss", "apao_pointwise", "--eta", "0.01", "--epochs", str(epochs),
            "--num-workers", str(num_workers), "--batch-size", str(128 // num_workers)]


@pytest.mark.e2e
def test_a_non_finite_loss_fails_the_run_once_with_its_reason(tmp_path):
    """beta=1e39 overflows the APAO loss: the run stops with the reason and exit status 1, and Ray
    Train does not restart it from the checkpoint (--max-failures 3 would otherwise retry 3 times). On the
    Llama backbone with the pairwise loss, the train command's other model and loss family (that Llama with
    APAO-pairwise learns beyond popularity is test_training.py's)."""
    result = run_script([TRAIN, *COMMON, "--backbone", "llama", "--loss", "apao_pairwise", "--num-negatives", "20",
                         "--beta", "1e39", "--epochs", "2",
                         "--max-failures", "3", "--output-dir", str(tmp_path / "runs"), "--run-name", "nan"],
                        # Ray Train's INFO lines (off on the console by default) count the worker groups
                        cwd=tmp_path, timeout=300, env={"RAY_DEDUP_LOGS": "0", "APAO_RAY_TRAIN_LOG_LEVEL": "INFO"})
    assert result.returncode == 1, result.stderr[-3000:]
    # at the first optimizer step whose loss overflowed, not at the end of the epoch
    assert re.search(r"trial nan failed: NonFiniteLossError: training loss became (inf|nan) in epoch 1 \(loss "
                     r"'apao_pairwise', lr [\d.e-]+; optimizer step 1 of \d+\)", result.stderr), result.stderr[-3000:]
    assert result.stderr.count("Setting up process group") == 1  # one worker group: no restart


def test_train_and_sweep_build_the_same_trial_from_the_same_flags():
    """The flags the two commands share (StudySpec's trial group) reach a trial through one builder
    (spec/trial.py): the same data, model and schedule from `train` as from each trial of `sweep`."""
    from dataclasses import asdict

    from apao_ray.study.cli import sweep, train
    from apao_ray.study.setup import trial_base

    flags = ["--epochs", "7", "--patience", "3", "--batch-size", "64", "--effective-batch-size", "512", "--lr", "0.002",
             "--beam-size", "10", "--max-train-samples", "999", "--eval-max-users", "50", "--model-size", "tiny",
             "--precision", "fp32", "--group-by-length", "--seed", "5", "--test-every-epoch"]
    one = train.trial_config_from_args(train.build_parser().parse_args(flags))
    every = trial_base(sweep.spec_from_args(sweep.build_parser().parse_args([*flags, "--losses", "ce"])), None)
    assert one.data == every.data and one.model == every.model
    study_only = {"retention_users"}  # the study's own TrainConfig field: how many users its retention probe reads
    assert {k: v for k, v in asdict(one.train).items() if k not in study_only} == \
           {k: v for k, v in asdict(every.train).items() if k not in study_only}
    assert (one.train.epochs, one.train.batch_size, one.train.seed, one.model.d_model) == (7, 64, 5, every.model.d_model)


@pytest.mark.e2e
def test_a_resume_over_a_damaged_newest_checkpoint_continues_from_the_one_before(tmp_path):
    """A one-worker run stopped once Ray Train has recorded two checkpoints, the newest of them then cut
    short (what a flaky disk or a half-synced store leaves): `--resume` names it in one line, sets it aside and
    continues from the checkpoint before it, training the lost epoch again, to the planned epoch count; no
    traceback. A study's trials restore through the same reader (tests/test_checkpoint.py)."""
    from apao_ray.training.checkpoint import STATE_FILE

    epochs, out, runs = 6, tmp_path / "r.json", tmp_path / "runs"
    command = [TRAIN, *COMMON, "--loss", "ce", "--epochs", str(epochs), "--max-train-samples", "128",
               "--eval-max-users", "32", "--output-dir", str(runs), "--run-name", "cut", "--json-out", str(out)]
    process = subprocess.Popen([sys.executable, *command], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while _ray_train_newest(runs / "cut") < 2:  # Ray Train resumes from the newest checkpoint its record lists
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    damaged_epoch = _ray_train_newest(runs / "cut")
    assert damaged_epoch < epochs, f"the run ended (epoch {damaged_epoch}) before it was stopped"
    newest = f"epoch_{damaged_epoch:04d}"
    state = runs / "cut" / newest / STATE_FILE
    state.write_bytes(state.read_bytes()[:state.stat().st_size // 2])

    result = run_script([*command, "--resume"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    damaged = [line for line in result.stderr.splitlines() if "does not load" in line]
    assert len(damaged) == 1 and re.search(
        rf"checkpoint \S+/cut/{newest} does not load \(state\.pt has \d+ bytes, \d+ were written\): set aside as "
        rf"damaged-{newest}; using epoch_{damaged_epoch - 1:04d}$", damaged[0]), damaged
    assert f"after epoch {damaged_epoch - 1}" in result.stderr  # resumed from the checkpoint before it
    assert f"epoch {damaged_epoch}/{epochs} " in result.stderr  # the lost epoch trained again
    assert f"epoch {damaged_epoch - 1}/{epochs} " not in result.stderr  # and nothing before it
    assert _metrics(out)["epochs_trained"] == epochs
    assert (runs / "cut" / f"damaged-{newest}" / STATE_FILE).exists()  # kept, not deleted


def _ray_train_newest(run_dir: Path) -> int:
    """The epoch of the newest checkpoint Ray Train's record of the run lists (0: none yet): Ray registers a
    checkpoint after the worker has written it, so the newest directory may not be it."""
    try:
        latest = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())["latest_checkpoint_result"]
    except (FileNotFoundError, ValueError):  # not written yet, or caught mid-write
        return 0
    return int(latest["checkpoint_dir_name"].removeprefix("epoch_")[:4]) if latest else 0
