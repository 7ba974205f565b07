"""What a cluster does to a study, and what the study does about it: a Ray node lost while one of its trials
trains, storage that refuses writes for a while (a driver killed and started again elsewhere: tests/test_sweep_s3.py).
Each time the same command finishes every planned trial exactly once (every epoch logged once, none trained again
from scratch) and keeps what had finished. Real Ray nodes (`ray start --block`, tests/test_study_cluster.py's fixture), a real S3 API
server (moto, tests/conftest.py), real SQLite MLflow and Optuna stores, the --smoke configuration."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SWEEP, launch_until, mid_trial, mlflow_sqlite
from study_helpers import every_trial_finished_once
from test_study_cluster import _alive_nodes, two_node_cluster  # noqa: F401 - a fixture

EPOCHS = 6  # the fault comes with several epochs still to train
# --smoke, smaller still: a busy 2-CPU machine trained ~20 samples/s, so an epoch is a few batches here
SMALL = ["--smoke", "--epochs", str(EPOCHS), "--num-samples", "1", "--max-train-samples", "192", "--batch-size", "64",
         "--effective-batch-size", "64", "--eval-max-users", "48", "--retention-users", "8"]


def _trials(db: Path) -> dict[str, dict]:
    """Each child run's trial id -> status, node it is tagged with, and validated epochs, straight from SQLite."""
    query = ("select t.value, r.status, n.value, group_concat(m.step) from runs r "
             "join tags t on t.run_uuid = r.run_uuid and t.key = 'apao.trial_id' "
             "left join tags n on n.run_uuid = r.run_uuid and n.key = 'apao.node_id' "
             "left join metrics m on m.run_uuid = r.run_uuid and m.key = 'val/ndcg_at_10' group by r.run_uuid")
    try:
        with sqlite3.connect(db, timeout=10) as connection:
            rows = connection.execute(query).fetchall()
    except sqlite3.Error:  # not created yet, or mid-migration
        return {}
    return {trial: {"status": status, "node": node, "epochs": sorted(int(s) for s in (steps or "").split(",") if s)}
            for trial, status, node, steps in rows}


@contextlib.contextmanager
def _ended_with_the_test(process: subprocess.Popen):
    """Kills what is left of a study the test started (its process group) when the test ends early."""
    try:
        yield
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=60)


def _resumed_after(tracker, run) -> list[float]:
    return [value for _, value in tracker.metric_history(run.info.run_id, "train/resumed_after_epoch")]


def _node_process_group(address: str) -> int:
    """The process group of the `ray start --block` worker node that joined ``address`` (the fixture starts each
    node in a session of its own, so the group is that node's and nothing else's)."""
    def args(pid: str) -> list[str]:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        return []

    (pid,) = {int(pid) for pid in os.listdir("/proc") if pid.isdigit()
              if {f"--address={address}", "--block", "start"} <= set(args(pid))}
    return os.getpgid(pid)


@pytest.mark.e2e
def test_a_trial_whose_node_is_lost_continues_from_its_checkpoint_on_the_node_left(tmp_path, two_node_cluster):
    """Two trials of 1.5 CPU on two 2-CPU nodes: one trains on each. Once the worker node's trial has validated an
    epoch, that node's whole process group gets SIGKILL (a machine lost). Tune retries the trial (--max-failures 1)
    on the head node once the other trial frees it; it continues from its newest checkpoint (on storage both
    nodes share), so every epoch is logged once and its MLflow run says where it finished."""
    address, node_ids = two_node_cluster
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    (worker,) = _alive_nodes(address, env, "trial_driver")
    (head,) = node_ids - {worker}
    uri = mlflow_sqlite(tmp_path)
    db = tmp_path / "mlflow.db"
    command = [sys.executable, SWEEP, *SMALL, "--max-concurrent", "2", "--cpus-per-trial", "1.5", "--max-failures", "1", "--address", address,
               "--output-dir", str(tmp_path / "runs"), "--tracking-uri", uri]
    process, _ = launch_until(command, tmp_path, lambda _: any(
        t["node"] == worker and t["status"] == "RUNNING" and t["epochs"] for t in _trials(db).values()), timeout=900)
    with _ended_with_the_test(process):
        at_loss = {trial: facts for trial, facts in _trials(db).items() if facts["node"] == worker}
        os.killpg(_node_process_group(address), signal.SIGKILL)
        _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    assert len(_alive_nodes(address, env)) == 1  # the worker node is gone for good
    end = every_trial_finished_once(uri, 2, tmp_path / "optuna.db", EPOCHS)
    (lost,) = at_loss
    run = end["children"][lost]
    resumed = _resumed_after(end["tracker"], run)
    # continued from the checkpoint of an epoch it had validated before the loss, not from its first epoch
    assert resumed and min(resumed) >= max(at_loss[lost]["epochs"]), (resumed, at_loss)
    assert run.data.tags["apao.node_id"] == head, "its run names the node it finished on"
    lines = [line for line in stderr.splitlines() if f"(trial {lost}) lost its " in line]
    assert len(lines) == 1 and lines[0].endswith("retry 1 of 1 (--max-failures), from its newest checkpoint"), \
        stderr[-4000:]


class Relay:
    """A TCP relay on a port of its own in front of ``target_port`` (the S3 server) that the test takes down (its
    port refuses connections, open ones are cut), as an object store's outage does, and brings back on the same
    port, where the store kept what it held."""

    def __init__(self, target_port: int) -> None:
        from conftest import closed_port

        self.port, self.target_port, self.open = closed_port(), target_port, []
        self.up()

    def up(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def down(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
        self.server.close()
        for connection in self.open:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self.open = []

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            self.open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@pytest.mark.e2e
def test_an_object_store_outage_mid_study_is_waited_out_and_costs_no_trial(tmp_path, s3_bucket, monkeypatch):
    """The study's --output-dir in an S3 bucket reached through a relay; once a trial has validated an epoch the
    relay refuses every connection for 20 s, then serves again. Each trial's next checkpoint upload (and Tune's
    state) waits for the store, saying so in one line, and goes on: with --max-failures 0 no trial may fail or
    restart, and every trial finishes once with every epoch once."""
    relay = Relay(int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{relay.port}")  # the study and its Ray's processes
    uri = mlflow_sqlite(tmp_path)
    output = f"{s3_bucket}/outage"
    command = [sys.executable, SWEEP, *SMALL, "--max-concurrent", "2", "--max-failures", "0",
               "--output-dir", output, "--tracking-uri", uri]
    try:
        process, _ = launch_until(command, tmp_path, mid_trial, timeout=900)
        with _ended_with_the_test(process):
            relay.down()
            time.sleep(20)
            relay.up()
            _, stderr = process.communicate(timeout=600)
    finally:
        relay.down()  # its port closed for good
    assert process.returncode == 0, stderr[-4000:]
    end = every_trial_finished_once(uri, 2, tmp_path / "optuna.db", EPOCHS)
    for run in end["children"].values():  # waited, never restarted from a checkpoint
        assert not _resumed_after(end["tracker"], run), run.data.tags["apao.trial_id"]
    refused = [line for line in stderr.splitlines() if f"storage {output}/" in line and "refused" in line]
    took = [line for line in stderr.splitlines() if f"storage {output}/" in line and " took " in line]
    assert refused and took, stderr[-4000:]
    assert "trying again for up to 600 s ($APAO_STORAGE_WAIT_S)" in refused[0], refused


@pytest.mark.parametrize("error, said", [
    ("The actor 4ff4 is unavailable: The actor is temporarily unavailable: RpcError: RPC error: Socket closed "
     "rpc_code: 14. The task may or may not have been executed on the actor.", "lost its process or its Ray node"),
    ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
     "The actor is dead because its node has died. Node Id: 05a3", "lost its Ray node"),
    ("ray::ImplicitFunc.train() (pid=1, ip=10.0.0.2)\nRuntimeError: expected a tensor", "failed (RuntimeError: "
     "expected a tensor)"),
])
def test_a_retried_trial_says_how_its_last_attempt_ended_in_a_few_words(tmp_path, error, said):
    """The words of the retry line, from the error file Tune keeps per trial (its last failure when several):
    the text Ray 2.60 gave for the node killed mid-trial above, its words for an actor whose node it declared dead,
    and an error of the trial's own."""
    from types import SimpleNamespace

    from apao_ray.study.record.progress import lost_how

    error_file = tmp_path / "error.txt"
    error_file.write_text(f"Failure # 1 (occurred at 2026-12-07_03-18-56)\nRuntimeError: an earlier one\n"
                          f"Failure # 2 (occurred at 2026-12-07_03-19-56)\n{error}\n")
    assert lost_how(SimpleNamespace(error_file=str(error_file))) == said
    assert lost_how(SimpleNamespace(error_file=str(tmp_path / "absent.txt"))) == "lost its process"
