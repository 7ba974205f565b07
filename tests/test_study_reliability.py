"""Studies under stress: failing trials on an MLflow server, killed trials, what the recorded command lines hide.
Real Ray, real MLflow stores, the --smoke configuration. Two Ray nodes (4 concurrent trials on SQLite, the docs'
cluster recipe): tests/test_study_cluster.py. Resumes that must be refused: tests/test_study_resume_checks.py."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from apao_ray.study.cluster.ray_cluster import stable_free_port
from apao_ray.training.memory import ALLOCATOR_ENV
from conftest import ROOT, descendant_pids, mlflow_sqlite, run_script

SWEEP = str(ROOT / "studies" / "sweep.py")
MLFLOW = str(Path(sys.executable).with_name("mlflow"))


def test_a_trial_whose_workers_cannot_start_is_told_how_they_failed():
    """Ray Train gives up on a worker group after its start failed on every try: a timeout says how long each
    try waited; workers killed while starting (Ray's memory monitor kills them within seconds) say so, with
    no invented wait; the MLflow outcome follows the cause."""
    from ray.exceptions import OutOfMemoryError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    from apao_ray.study.record.outcomes import failure_outcome
    from apao_ray.study.run.trial import MAX_START_RETRIES, TrialStartError, start_failure_message

    killed = start_failure_message("train-trial_id=abc", OutOfMemoryError(
        "3 worker(s) were killed due to the node running low on memory. Details follow"))
    assert killed.startswith(f"train-trial_id=abc: its Ray Train workers could not be started in "
                             f"{MAX_START_RETRIES + 1} tries (the last: OutOfMemoryError: 3 worker(s) were killed")
    assert " s each" not in killed and "Details follow" not in killed
    assert failure_outcome(f"{TrialStartError.__module__}.TrialStartError: {killed}") == "out of memory"
    slow = start_failure_message("train-trial_id=abc", WorkerGroupStartupTimeoutError(1))
    assert f"{MAX_START_RETRIES + 1} tries of " in slow and "WorkerGroupStartupTimeoutError" in slow
    assert failure_outcome(f"TrialStartError: {slow}") == "could not start its workers"


def _children(tracker):
    return {c.data.tags["apao.trial_id"]: c for c in tracker.child_runs()}


def _parent(tracker):
    (parent,) = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")
    return parent


def _wait_http(url: str, process: subprocess.Popen, log: Path | None = None, timeout: float = 300) -> None:
    """Until ``url`` answers; the process's output (its ``log`` file, else its stderr pipe) if it dies first."""
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            assert process.poll() is None, (log.read_text() if log else process.communicate()[1])[-3000:]
            assert time.time() < deadline, f"{url} did not answer in {timeout} s"
            time.sleep(0.5)


@contextlib.contextmanager
def serving_mlflow(backend_store_uri: str, directory: Path):
    """`mlflow server` on a loopback port over ``backend_store_uri``, its artifacts in ``directory/artifacts``;
    yields the port."""
    port = stable_free_port()
    # its log goes to a file: a pipe nobody reads fills after ~64 KiB of request lines and blocks the server
    # mid-response (a study then hung in an MLflow call until its test timed out)
    log = directory / "server.log"
    with log.open("w") as output:
        server = subprocess.Popen([MLFLOW, "server", "--backend-store-uri", backend_store_uri,
                                   "--artifacts-destination", str(directory / "artifacts"), "--host", "127.0.0.1",
                                   "--port", str(port), "--workers", "1"],
                                  stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                  # no GenAI job runner: its 7 huey consumer processes import MLflow while the study
                                  # trains, and apao_ray submits no jobs
                                  env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", server, log)
        yield port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a loopback port with a SQLite backend and a local artifact root."""
    with serving_mlflow(mlflow_sqlite(tmp_path, "server.db"), tmp_path) as port:
        yield port, tmp_path / "artifacts"


@pytest.mark.e2e
def test_failing_trials_are_recorded_on_an_mlflow_server_and_the_study_goes_on(tmp_path, mlflow_server):
    """Against `mlflow server`, three trials at once: CE trains; APAO-pointwise with beta=1e39 overflows
    its loss to inf; APAO-pairwise with 300 negatives needs more than the 0.75 GiB memory cap already in its first
    forward pass (at 2.5 GiB its forward fits and its loss overflows first). On the allocator a machine without
    tcmalloc gets (glibc keeping its large blocks, which maps the most): the cap counts what a trial allocates,
    not the 1.5-2.5 GiB its worker maps with torch and Ray loaded, so CE finishes under it. That the cap counts
    the same under every allocator is test_memory.py's; a study on the allocator auto picks is
    test_study_portability.py's."""
    port, artifacts = mlflow_server
    # credentials in the URI must reach the server but never MLflow's params or tags
    uri = f"http://apao:s3cret-token@127.0.0.1:{port}"
    allocator = {ALLOCATOR_ENV: "glibc-cached"}
    result = run_script([SWEEP, "--smoke", "--losses", "ce,apao_pointwise,apao_pairwise", "--num-samples", "1",
                         "--beta", "1e39", "--negatives", "300", "--memory-per-trial", "0.75", "--max-concurrent", "3",
                         "--cpus-per-trial", "0.5", "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri,
                         # fp32: the point here is which trials fail and how they are recorded, on any CPU
                         "--precision", "fp32"],
                        cwd=tmp_path, timeout=900, env=allocator)  # three plan probes first, one pairwise, 300 negatives
    assert result.returncode == 0, result.stderr[-4000:]
    assert "study synthetic-study: 3 trials (2 failed)" in result.stderr
    # each failed trial and why, on the console
    lines = result.stderr.splitlines()
    listed = lines[lines.index("failed trials (2):") + 1:][:2]
    assert sorted(line.split()[0].rstrip(":") for line in listed) == ["tiger/apao_pairwise", "tiger/apao_pointwise"]
    from apao_ray.tracking import Tracker

    tracker = Tracker(f"http://127.0.0.1:{port}", "apao-synthetic")
    runs = {c.data.tags["loss"]: c for c in _children(tracker).values()}
    assert runs["ce"].info.status == "FINISHED" and runs["ce"].data.tags["apao.model_uri"]
    assert runs["ce"].data.tags["apao.allocator"] == "glibc-cached"
    # the models (the trial's own and one per other selection rule) went through the server to its root
    assert len(list(artifacts.rglob("best_model.pt"))) == 3
    pointwise, pairwise = runs["apao_pointwise"], runs["apao_pairwise"]
    assert pointwise.info.status == "FAILED" and pointwise.data.tags["apao.outcome"] == "non-finite loss"
    # raised once by the trial's driver (TrialFailedError), not retried by Ray Train from the checkpoint
    assert "TrialFailedError: NonFiniteLossError: training loss became" in pointwise.data.tags["apao.error"]
    assert "loss 'apao_pointwise'" in pointwise.data.tags["apao.error"]
    assert pairwise.info.status == "FAILED" and pairwise.data.tags["apao.outcome"] == "out of memory"
    assert "TrialFailedError: TrialOutOfMemoryError: out of memory (memory cap 0.75 GiB: " in pairwise.data.tags["apao.error"]
    assert "while training in epoch 1" in pairwise.data.tags["apao.error"]
    assert "batch_size=128, num_negatives=300" in pairwise.data.tags["apao.error"]
    assert "resident peak +" in pairwise.data.tags["apao.error"]
    assert "; allocator glibc-cached) " in pairwise.data.tags["apao.error"]  # what the cap's count depends on
    parent = _parent(tracker)
    assert "--tracking-uri http://apao:***@127.0.0.1" in parent.data.tags["command_line"]
    for run in [parent, *runs.values()]:
        assert "s3cret" not in json.dumps({**run.data.params, **run.data.tags})

    # the memory was the machine's fault: a resume with --retry-failed and a larger cap runs the failed trials
    # again in their own child runs; the one that failed for its own reason fails again
    retried = run_script([SWEEP, "--smoke", "--losses", "ce,apao_pointwise,apao_pairwise", "--num-samples", "1",
                          "--beta", "1e39", "--negatives", "300", "--memory-per-trial", "8", "--max-concurrent", "3",
                          "--cpus-per-trial", "0.5", "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri,
                          "--precision", "fp32", "--retry-failed"], cwd=tmp_path, timeout=900, env=allocator)
    assert retried.returncode == 0, retried.stderr[-4000:]
    after = {c.data.tags["loss"]: c for c in _children(tracker).values()}
    assert len(after) == 3 and {k: r.info.run_id for k, r in after.items()} == {k: r.info.run_id for k, r in runs.items()}
    # with the memory it needed, the pairwise trial really ran again: it now trains, and overflows like the
    # pointwise one does (beta 1e39 is both their beta), in the same child run
    assert after["apao_pairwise"].data.tags["apao.outcome"] == "non-finite loss", after["apao_pairwise"].data.tags
    assert after["apao_pointwise"].info.status == "FAILED" and after["ce"].info.status == "FINISHED"


def test_readme_mlflow_server_commands_bind_loopback():
    """The commands a reader copies must not expose an unauthenticated MLflow server to the network."""
    # docs/cli.md is the CLI's own --help (serve's --host names 0.0.0.0 as an option), not commands to copy
    prose = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "cli.md")]
    text = "\n".join(path.read_text() for path in prose)
    text = text.replace("\\\n", " ")
    commands = [line for line in text.splitlines() if re.match(r"\s*([A-Z_]+=\S+\s+)*mlflow server", line)]
    assert commands, "neither the README nor docs/ documents an mlflow server command"
    for command in commands:
        assert "--host 127.0.0.1" in command, command
    assert "0.0.0.0" not in text


@pytest.mark.parametrize("line, secret", [
    ("--tracking-uri https://me:p4ss@mlflow.example.org", "p4ss"),
    ("--tracking-uri postgresql://apao:hunter2@db:5432/mlflow", "hunter2"),
    ("--api-key=abc123 --lr 2e-3", "abc123"),
    ("--token t0ken --dataset office", "t0ken"),
    ("--db-password s3cr3t", "s3cr3t"),
])
def test_recorded_command_lines_hide_secrets(line, secret):
    from apao_ray.tracking import redact

    recorded = redact(f"studies/sweep.py {line}")
    assert secret not in recorded and "***" in recorded
    assert recorded.split()[1].split("=")[0] == line.split()[0].split("=")[0]  # the flag stays readable


@pytest.mark.parametrize("line", [
    "--study-name office-bear_token_weighted-seed0 --cpus-per-trial 1",
    "--losses bear,token_weighted --seed 0",
    "--study-name my-secret-study --max-concurrent 2",
])
def test_recorded_command_lines_keep_values_that_merely_mention_a_secret_word(line):
    """A study or loss named with 'token' or 'secret' is no secret flag: the line is recorded as run (a study
    named ...bear_token_weighted-seed0 once lost the flag after it to '***')."""
    from apao_ray.tracking import redact

    assert redact(f"studies/sweep.py {line}") == f"studies/sweep.py {line}"


def test_ray_dashboard_port_is_free_and_outside_the_range_the_os_hands_out(tmp_path, monkeypatch):
    """Ray's own processes bind port 0 (the kernel's ephemeral range) while ours starts: the dashboard's port
    comes from below that range and above Ray's worker ports, and is one nobody holds."""
    import apao_ray.study.cluster.ray_cluster as runner

    ephemeral_start = int(runner.EPHEMERAL_RANGE_FILE.read_text().split()[0])
    ports = {runner.stable_free_port() for _ in range(20)}
    assert all(runner.RAY_WORKER_PORTS_END < port < ephemeral_start for port in ports), sorted(ports)
    held = []
    try:  # the whole gap held by us: the port comes from elsewhere, never a held one
        for port in range(runner.RAY_WORKER_PORTS_END + 1, runner.RAY_WORKER_PORTS_END + 4):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()  # held by someone else already: just as good
                continue
            held.append(sock)
        (tmp_path / "range").write_text(f"{runner.RAY_WORKER_PORTS_END + 4}\t60999\n")
        monkeypatch.setattr(runner, "EPHEMERAL_RANGE_FILE", tmp_path / "range")
        port = runner.stable_free_port()
        assert not runner.RAY_WORKER_PORTS_END < port < runner.RAY_WORKER_PORTS_END + 4
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    finally:
        for sock in held:
            sock.close()


def _one_trial_study_past_epoch_2(tmp_path: Path, epochs: int, *flags: str) -> tuple[subprocess.Popen, list[str],
                                                                                        str, float]:
    """Starts a --smoke study of one CE trial in its own process group and returns once the trial's epoch-2
    checkpoint exists: the process, its command (the script and flags), the MLflow URI and the deadline to keep."""
    uri = mlflow_sqlite(tmp_path)
    command = [SWEEP, "--smoke", "--losses", "ce", "--num-samples", "1", "--epochs", str(epochs), *flags,
               "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri]
    process = subprocess.Popen([sys.executable, *command], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    checkpoints = tmp_path / "runs" / "synthetic-study" / "train_runs"
    deadline = time.time() + 400
    while not list(checkpoints.glob("*/checkpoints/epoch_0002")):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline, "no epoch-2 checkpoint in 400 s"
        time.sleep(0.3)
    return process, command, uri, deadline


@pytest.mark.e2e
def test_a_trial_whose_process_is_killed_is_retried_from_its_checkpoint(tmp_path):
    """SIGKILL the process training a study's trial after its epoch-2 checkpoint: Tune retries the trial
    (--max-failures 1), which continues from that checkpoint in the same child run."""
    # smoke epochs take ~1 s: with 4 the trial had once finished before the kill landed (CI, 2026-11-26), so
    # there are 10, and the kill comes with ~8 s of training still to go
    epochs = 10
    process, _, uri, deadline = _one_trial_study_past_epoch_2(tmp_path, epochs, "--max-failures", "1")
    # Tune's trial actor (a function trainable runs as ``ImplicitFunc``), where the trial trains. Its title
    # is "ray::ImplicitFunc.train" only while Tune's call for the next result runs, "ray::ImplicitFunc"
    # between two calls: on a loaded machine a single look can fall between them
    pids = descendant_pids(process.pid, "ray::ImplicitFunc")
    while not pids and time.time() < deadline:
        time.sleep(0.1)
        pids = descendant_pids(process.pid, "ray::ImplicitFunc")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=400)
    assert process.returncode == 0, stderr[-4000:]
    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-synthetic")
    (run,) = tracker.child_runs()
    assert run.info.status == "FINISHED" and run.data.tags["apao.outcome"] == "finished", run.data.tags
    # every epoch logged once; the retry started after epoch 2 or later (its checkpoint), not from scratch
    assert [step for step, _ in tracker.metric_history(run.info.run_id, "val/ndcg_at_10")] == list(range(1, epochs + 1))
    resumed = tracker.metric_history(run.info.run_id, "train/resumed_after_epoch")
    assert resumed and all(value >= 2 for _, value in resumed), resumed
    assert "test/ndcg_at_10" in run.data.metrics

