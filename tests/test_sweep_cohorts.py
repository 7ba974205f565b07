"""`sweep --cohort-size K` (study/run/cohorts.py): the repeat phase's trials grouped into fused cohorts, the
reservations of leaders and followers, a follower relaying its reports, and a real study interrupted (Ctrl-C) in
its repeat phase, a cohort of 3 and a lone repeat mid-way, and resumed by re-running the command: each member
one MLflow child run, no duplicate."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest

from apao_ray.config import TrialConfig
from apao_ray.names import REPORTS_FILE
from apao_ray.study.run import cohorts
from conftest import SWEEP, launch_until, mlflow_sqlite, run_script, runs_state


def _configs():
    return [{"backbone": "tiger", "loss": "ce", "seed": 1}, {"backbone": "tiger", "loss": "ce", "seed": 2},
            {"backbone": "llama", "loss": "ce", "seed": 1},
            {"backbone": "tiger", "loss": "apao_pointwise", "tiger__apao_pointwise__beta": 0.3,
             "tiger__apao_pointwise__eta": 1e-4, "seed": 1},
            {"backbone": "tiger", "loss": "msl", "seed": 1}]


def test_cohorts_group_one_backbone_up_to_k_and_leave_two_stage_studies_and_lone_trials_alone():
    out = cohorts.assign_cohorts(_configs(), TrialConfig(), 3, prefix="repeat")
    members = [(c["loss"], c["backbone"], c.get("cohort"), c.get("cohort_member"), c.get("cohort_size")) for c in out]
    assert members == [("ce", "tiger", "repeat0", 0, 3), ("ce", "tiger", "repeat0", 1, 3),
                       ("apao_pointwise", "tiger", "repeat0", 2, 3), ("msl", "tiger", None, None, None),
                       ("ce", "llama", None, None, None)]
    configs = _configs()
    assert [{k: v for k, v in c.items() if not k.startswith("cohort")} for c in out] == \
        [configs[0], configs[1], configs[3], configs[4], configs[2]]  # keys added, nothing else changed
    assert cohorts.cohorts_in(out) == 1 and [cohorts.is_leader(c) for c in out] == [True] + [False] * 4
    assert cohorts.assign_cohorts(_configs(), TrialConfig(), 1, prefix="repeat") == _configs()  # off
    four = cohorts.assign_cohorts(_configs(), TrialConfig(), 4, prefix="r")
    assert [c.get("cohort_member") for c in four] == [0, 1, 2, 3, None]
    # a study with a two-stage loss gives every trial a CE stage (study/spec/study.py with_pretrain): all alone
    two_stage = TrialConfig().replace(loss=TrialConfig().loss.replace(pretrain_ce_epochs=1).to_dict())
    assert cohorts.assign_cohorts(_configs(), two_stage, 3, prefix="repeat") == _configs()


def test_a_leader_reserves_the_cohort_and_a_follower_a_sliver():
    trial = {"cpu": 2.0, "gpu": 1.0, "memory": 1000}
    leader = {"cohort": "repeat0", "cohort_member": 0, "cohort_size": 4}
    assert cohorts.tune_resources({"loss": "ce"}, trial) == trial
    assert cohorts.tune_resources({**leader, "cohort_member": 2}, trial) == {"cpu": cohorts.FOLLOWER_CPUS}
    reserved = cohorts.tune_resources(leader, trial)
    assert reserved == {"cpu": pytest.approx(2.0 - 3 * cohorts.FOLLOWER_CPUS), "gpu": 1.0, "memory": 4000}
    assert reserved["cpu"] + 3 * cohorts.FOLLOWER_CPUS == pytest.approx(trial["cpu"])  # the cohort fits a trial's CPUs


def _append(path, line: str) -> None:
    with open(path, "a") as handle:
        handle.write(line)
        handle.flush()


def test_a_follower_relays_whole_reports_once_across_restarts_and_fails_with_its_leader(tmp_path):
    from apao_ray.training.failures import TrialFailedError

    run_dir, directory = tmp_path / "run", tmp_path / "cohort"
    run_dir.mkdir(), directory.mkdir()
    reports, seen = run_dir / REPORTS_FILE, []

    def write() -> None:
        _append(reports, json.dumps({"epoch": 1}) + "\n" + '{"epoch": ')  # the second report half written
        time.sleep(0.8)
        _append(reports, "2}\n" + json.dumps({"epoch": 3}) + "\n")

    writer = threading.Thread(target=write)
    writer.start()

    def killed_in_the_third(metrics):
        if len(seen) == 2:
            raise KeyboardInterrupt  # the follower's actor killed while relaying epoch 3
        seen.append(metrics)
    with pytest.raises(KeyboardInterrupt):
        cohorts.relay(run_dir, directory, killed_in_the_third, run_dir / "failure.txt")
    writer.join()
    assert seen == [{"epoch": 1}, {"epoch": 2}]
    _append(reports, json.dumps({"epoch": 3, "done": True, "test/x": 1}) + "\n")
    cohorts.relay(run_dir, directory, seen.append, run_dir / "failure.txt")  # a restarted follower goes on
    assert seen == [{"epoch": 1}, {"epoch": 2}, {"epoch": 3}, {"epoch": 3, "done": True, "test/x": 1}]

    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "failure.txt").write_text("NonFiniteLossError: train/loss is nan at epoch 2")
    with pytest.raises(TrialFailedError, match="nan at epoch 2"):
        cohorts.relay(failed, directory, seen.append, failed / "failure.txt")

    silent = tmp_path / "silent"
    silent.mkdir()
    beat = directory / cohorts.HEARTBEAT_FILE
    # no heartbeat: the leader has not started (waiting for a slot), and the follower waits however long
    threading.Timer(1.5, lambda: _append(silent / REPORTS_FILE, '{"done": true}\n')).start()
    cohorts.relay(silent, directory, seen.append, silent / "failure.txt", silent_s=0.5)  # waits 1.5 s
    assert seen[-1] == {"done": True}
    # a heartbeat from an earlier attempt: a leader started again beats within the silence allowed ...
    again = tmp_path / "again"
    again.mkdir()
    beat.touch()
    os.utime(beat, (time.time() - 3600, time.time() - 3600))
    threading.Timer(0.5, beat.touch).start()
    threading.Timer(1.5, lambda: _append(again / REPORTS_FILE, '{"done": true, "epoch": 9}\n')).start()
    cohorts.relay(again, directory, seen.append, again / "failure.txt", silent_s=3.0)  # its beat at 0.5 s
    assert seen[-1] == {"done": True, "epoch": 9}
    # ... one that died stays silent: the follower fails, naming the cohort (also when itself was restarted)
    dead = tmp_path / "dead"
    dead.mkdir()
    os.utime(beat, (time.time() - 3600, time.time() - 3600))
    with pytest.raises(RuntimeError, match="leader of cohort cohort .* silent"):
        cohorts.relay(dead, directory, seen.append, dead / "failure.txt", silent_s=1.0)


def _cohort_reports(train_runs) -> list[dict]:
    return [json.loads(line) for path in train_runs.glob(f"*/{REPORTS_FILE}")
            for line in path.read_text().splitlines() if '"perf/cohort_members": 3' in line]


@pytest.mark.e2e
def test_a_study_trains_its_repeats_as_a_cohort_one_child_run_each_through_an_interruption(tmp_path):
    """`--seeds 0,1,2 --cohort-size 3` over CE and APAO-pointwise: the search's two trials alone, then the four
    repeats as a cohort of 3 and a lone trial. Ctrl-C once every cohort member has reported an epoch; re-running
    the command finishes the cohort from its members' checkpoints: six child runs, one per (method, seed), each
    with all its epochs once, its test metrics and a final checkpoint of its own."""
    uri = mlflow_sqlite(tmp_path)
    command = [sys.executable, SWEEP, "--smoke", "--losses", "ce,apao_pointwise", "--num-samples", "1", "--epochs", "3",
               "--seeds", "0,1,2", "--cohort-size", "3", "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri]
    train_runs = tmp_path / "runs" / "synthetic-study" / "train_runs"
    process, _ = launch_until(command, tmp_path, lambda state: len(_cohort_reports(train_runs)) >= 3, timeout=600)
    searched = {trial for trial, _, _ in runs_state(tmp_path / "mlflow.db")}
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 130 and "re-run the same command" in stderr, stderr[-3000:]
    interrupted_at = {report["epoch"] for report in _cohort_reports(train_runs)}
    result = run_script(command[1:], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "3 of them in 1 fused cohort(s)" in result.stderr or "3 of them in 1 fused cohort(s)" in stderr
    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-synthetic")
    children = tracker.child_runs()
    assert sorted((run.data.tags["loss"], run.data.tags["apao.seed"]) for run in children) == [
        ("apao_pointwise", s) for s in "012"] + [("ce", s) for s in "012"]
    assert all(run.info.status == "FINISHED" and "test/ndcg_at_10" in run.data.metrics for run in children)
    assert searched <= {run.data.tags["apao.trial_id"] for run in children}  # no run of before was replaced
    fused = [run for run in children if 3 in {m.value for m in tracker.client.get_metric_history(
        run.info.run_id, "perf/cohort_members")}]
    assert len(fused) == 3 and {run.data.tags["loss"] for run in fused} == {"ce", "apao_pointwise"}
    assert all("apao.repeats" in run.data.tags for run in fused)
    assert sorted(run.data.tags.get("apao.cohort", "-") for run in children) == [
        "-", "-", "-", "repeat0: member 0 of 3", "repeat0: member 1 of 3", "repeat0: member 2 of 3"]
    assert {run.data.tags["apao.cohort"] for run in fused} == {f"repeat0: member {m} of 3" for m in range(3)}
    for run in children:  # every epoch once, in its own run; the member's final checkpoint in its own directory
        steps = [m.step for m in tracker.client.get_metric_history(run.info.run_id, "val/ndcg_at_10")]
        assert sorted(steps) == [1, 2, 3], (run.data.tags, steps)
        run_dir = train_runs / f"train-trial_id={run.data.tags['apao.trial_id']}"
        assert list((run_dir / "checkpoints").glob("epoch_*_final")), run_dir
    resumed = [run for run in fused if "train/resumed_after_epoch" in run.data.metrics]
    assert max(interrupted_at) < 3 and len(resumed) == 3, (interrupted_at, [r.data.metrics for r in fused])
    losses = {run.data.metrics["train/loss"] for run in fused}
    assert len(losses) == 3  # three trials, not one trained three times
