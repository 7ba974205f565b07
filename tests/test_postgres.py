"""PostgreSQL as a team shares it: an MLflow server on PostgreSQL and the Optuna storage in PostgreSQL, two
studies started at once into both; drivers that create MLflow's or Optuna's tables in a new database together. A
real PostgreSQL server (Debian's `postgresql` package; .ci/run installs it) that the module starts on a loopback
port and stops by its pid; the --smoke configuration. A store whose driver is missing or whose database does not
answer: tests/test_sweep_input.py."""
from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import optuna
import pytest

from apao_ray.study.cluster.ray_cluster import stable_free_port
from conftest import SWEEP, ROOT
from test_study_cluster import _stop_nodes
from test_study_reliability import serving_mlflow

SERVER_BIN_DIRS = Path("/usr/lib/postgresql")  # Debian/Ubuntu: /usr/lib/postgresql/<major version>/bin


def _server_bin_dir() -> Path | None:
    """The newest installed PostgreSQL server's binaries (initdb, postgres), else None."""
    found = [path.parent for path in SERVER_BIN_DIRS.glob("*/bin/initdb") if (path.parent / "postgres").is_file()]
    return max(found, key=lambda path: int(re.sub(r"\D", "", path.parent.name) or 0), default=None)


def _as_server_user() -> dict:
    """Popen arguments that run a PostgreSQL binary as the `postgres` OS user when this is root (initdb and
    postgres refuse to run as root), else as this user."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root, and there is no 'postgres' OS user to run PostgreSQL's server as (initdb "
                    "refuses root; the postgresql package creates that user)")
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


def create_databases(url: str, *names: str) -> None:
    """New, empty databases ``names`` on the server of ``url`` (``postgresql+psycopg://USER:PASSWORD@HOST:PORT``)."""
    import psycopg

    with psycopg.connect(f"{url.replace('+psycopg', '')}/postgres", autocommit=True) as connection:
        for name in names:
            connection.execute(f"CREATE DATABASE {name}")


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server of its own on a loopback port, user `apao` with a password (scram-sha-256 over TCP);
    yields the URL prefix ``postgresql+psycopg://apao:PASSWORD@127.0.0.1:PORT`` (each test creates its databases)."""
    psycopg = pytest.importorskip("psycopg", reason="PostgreSQL stores need the postgres extra "
                                                    "(pip install -e '.[postgres]'; ./apao installs it)")
    bin_dir = _server_bin_dir()
    if bin_dir is None:
        pytest.skip(f"PostgreSQL's server is not installed (no {SERVER_BIN_DIRS}/<version>/bin/initdb; Debian: "
                    "apt-get install postgresql, which .ci/run does as root)")
    as_server_user = _as_server_user()
    # not under pytest's tmp_path: its parent directory is readable by this user only, and the server runs as postgres
    directory = Path(tempfile.mkdtemp(prefix="apao-postgres-"))
    server = None
    try:
        if as_server_user:
            shutil.chown(directory, "postgres", "postgres")
        password = secrets.token_hex(8)
        (directory / "password").write_text(password)
        if as_server_user:
            shutil.chown(directory / "password", "postgres", "postgres")
        subprocess.run([str(bin_dir / "initdb"), "--pgdata", str(directory / "data"), "--username", "apao",
                        "--pwfile", str(directory / "password"), "--auth-local", "trust", "--auth-host",
                        "scram-sha-256", "--encoding", "UTF8", "--no-sync"],
                       check=True, capture_output=True, text=True, **as_server_user)
        port = stable_free_port()
        log = directory / "server.log"
        with log.open("w") as output:
            # fsync off: a test's database need not survive a power cut, and each commit's fsync costs ms
            server = subprocess.Popen([str(bin_dir / "postgres"), "-D", str(directory / "data"), "-p", str(port),
                                       "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={directory}",
                                       "-c", "fsync=off"], stdout=output, stderr=subprocess.STDOUT,
                                      start_new_session=True, **as_server_user)
        url = f"postgresql+psycopg://apao:{password}@127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                psycopg.connect(f"{url.replace('+psycopg', '')}/postgres", connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                assert server.poll() is None, log.read_text()[-3000:]
                assert time.time() < deadline, f"PostgreSQL did not answer in 60 s: {log.read_text()[-3000:]}"
                time.sleep(0.3)
        yield url
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGINT)  # "fast shutdown": clients disconnected, no wait for them
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.e2e
def test_two_studies_at_once_into_mlflow_and_optuna_on_postgresql(tmp_path, postgres):
    """Two smoke studies started together (each its own local Ray) record into one MLflow server on PostgreSQL and
    one Optuna storage in PostgreSQL: each finishes both its trials, each trial is one MLflow child run under its
    own study's parent and one COMPLETE Optuna trial of its own study, nothing doubled, lost or crossed over."""
    from apao_ray.tracking import Tracker

    create_databases(postgres, "mlflow", "optuna")
    with serving_mlflow(f"{postgres}/mlflow", tmp_path) as port:
        tracking_uri = f"http://127.0.0.1:{port}"
        optuna_url = f"{postgres}/optuna"
        studies = ("pg-a", "pg-b")
        drivers: dict[str, subprocess.Popen] = {}
        try:
            for name in studies:
                command = [SWEEP, "--smoke", "--losses", "apao_pointwise", "--num-samples", "2", "--epochs", "1",
                           "--max-concurrent", "2", "--cpus-per-trial", "0.5", "--study-name", name,
                           "--output-dir", str(tmp_path / name), "--tracking-uri", tracking_uri,
                           "--optuna-storage", optuna_url]
                with (tmp_path / f"{name}.log").open("w") as log:  # a file: a pipe nobody reads would block them
                    drivers[name] = subprocess.Popen([sys.executable, *command], cwd=tmp_path, stdout=log,
                                                     stderr=subprocess.STDOUT, start_new_session=True,
                                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
            for name, driver in drivers.items():
                driver.wait(timeout=600)
                output = (tmp_path / f"{name}.log").read_text()
                assert driver.returncode == 0, output[-4000:]
                assert f"study {name}: 2 trials (0 failed)" in output, output[-4000:]
        finally:  # a driver still running (the other failed, or a timeout): it and its Ray, by its process group
            _stop_nodes([driver for driver in drivers.values() if driver.poll() is None])

        tracker = Tracker(tracking_uri, "apao-synthetic")
        parents = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")
        assert sorted(run.data.tags["apao.study"] for run in parents) == sorted(studies)
        all_children = tracker.child_runs()
        assert len(all_children) == 4, [run.data.tags for run in all_children]
        for parent in parents:
            name = parent.data.tags["apao.study"]
            children = tracker.child_runs(parent.info.run_id)
            assert [run.info.status for run in children] == ["FINISHED", "FINISHED"], name
            assert {run.data.tags["apao.study"] for run in children} == {name}
            assert len({run.data.tags["apao.trial_id"] for run in children}) == 2
            # the recorded command line and storage keep the database password out of what MLflow's users read
            assert f"--optuna-storage {re.sub(r':[^:@]+@', ':***@', optuna_url)}" in parent.data.tags["command_line"]
            assert urllib.parse.urlsplit(postgres).password not in str(parent.data.tags)

            optuna_study = optuna.load_study(study_name=f"apao-synthetic/{name}", storage=optuna_url)
            trials = optuna_study.get_trials(deepcopy=False)
            assert sorted(t.number for t in trials) == [0, 1], name
            assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), [t.state for t in trials]
            # each Optuna trial names its own study's MLflow run: none crossed over to the other study
            assert sorted(t.user_attrs["mlflow_run_id"] for t in trials) == sorted(r.info.run_id for r in children)
        assert sorted(optuna.get_all_study_names(optuna_url)) == [f"apao-synthetic/{name}" for name in studies]


def _together(start, count: int = 4) -> list[Exception]:
    """``start(number)`` in ``count`` threads released at once; the errors they raised."""
    import threading

    barrier, errors = threading.Barrier(count), []

    def run(number: int) -> None:
        barrier.wait()
        try:
            start(number)
        except Exception as error:  # reported by the caller, all at once
            errors.append(error)

    threads = [threading.Thread(target=run, args=(number,)) for number in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return errors


def test_studies_that_open_a_new_optuna_storage_together_each_open_it(postgres):
    """Optuna creates its tables when it first opens a database; four drivers doing so at once all get the storage
    (bare RDBStorage: the later ones failed with a duplicate `CREATE TYPE studydirection`) and each its own study."""
    from apao_ray.study.search.optuna_storage import open_storage

    create_databases(postgres, "optuna_together")
    url = f"{postgres}/optuna_together"

    def start(number: int) -> None:
        open_storage(url).create_new_study([optuna.study.StudyDirection.MAXIMIZE], f"study-{number}")

    assert _together(start) == []
    assert sorted(optuna.get_all_study_names(url)) == [f"study-{number}" for number in range(4)]


# a study's driver as far as the MLflow store goes: it checks --tracking-uri, then opens its dataset's experiment and
# logs its parent run with the dataset as its input (the same dataset entity for every driver)
DRIVER_OPENING_MLFLOW = """
import pathlib, sys, time
from apao_ray.tracking import Tracker, check_tracking_uri, dataset_record
url, number, gate = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
(gate / f"ready-{number}").touch()
while not (gate / "go").exists():
    time.sleep(0.01)
check_tracking_uri(url)
tracker = Tracker(url, "apao-together")
run_id = tracker.start_run(f"study-{number}", {"apao.role": "study"})
tracker.log_dataset(run_id, dataset_record("together", {}, {"train": 10}, "generated"))
tracker.client.log_metric(run_id, "val/ndcg_at_10", 0.5, step=1)
"""


@pytest.mark.e2e
def test_studies_that_open_a_new_mlflow_database_together_each_open_it(tmp_path, postgres):
    """A study's --tracking-uri straight to PostgreSQL: the check before it starts creates MLflow's tables, and three
    drivers doing so at once into a new database each get the store, the one experiment and their run with its
    dataset (without the retry one failed with a duplicate table or type; threads of one process did not meet it,
    so these are processes)."""
    from apao_ray.tracking import Tracker

    create_databases(postgres, "mlflow_together")
    url = f"{postgres}/mlflow_together"
    drivers = [subprocess.Popen([sys.executable, "-c", DRIVER_OPENING_MLFLOW, url, str(number), str(tmp_path)],
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
               for number in range(3)]
    try:
        deadline = time.time() + 120
        while len(list(tmp_path.glob("ready-*"))) < 3:  # imported: released together
            assert time.time() < deadline and all(d.poll() is None for d in drivers), "a driver did not start"
            time.sleep(0.05)
        (tmp_path / "go").touch()
        failures = [d.communicate(timeout=300)[1][-2000:] for d in drivers]
        assert [d.returncode for d in drivers] == [0, 0, 0], failures
    finally:
        for driver in drivers:
            if driver.poll() is None:
                driver.kill()
    tracker = Tracker(url, "apao-together")
    runs = tracker.client.search_runs([tracker.experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["study-0", "study-1", "study-2"]
    assert all(run.data.metrics == {"val/ndcg_at_10": 0.5} for run in runs)
    assert {len(run.inputs.dataset_inputs) for run in runs} == {1}
