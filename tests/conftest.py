"""Shared fixtures: the synthetic dataset, tiny configs, a quiet environment for Ray/MLflow."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from apao_ray.config import TINY_MODEL
from apao_ray.data.files import DATA_URL_ENV
from apao_ray.paths import DATA_DIR_ENV, TRACKING_URI_ENV, absolute_data_dir_env

ROOT = Path(__file__).resolve().parents[1]
absolute_data_dir_env()  # as each command does where it starts: tests change directory, their subprocesses run elsewhere
SHARED_DATASETS = Path(os.environ.get(DATA_DIR_ENV) or ROOT.parent / "shared" / "datasets").resolve()

# quiet, deterministic Ray for every test process and the subprocesses they start. Ray's token authentication
# stays as Ray ships it (a local Ray runs in token mode), with a token of this test session's own: given in
# RAY_AUTH_TOKEN, so that no local Ray writes one into the user's ~/.ray/auth_token (Ray makes that file when no
# token is given). The two-node tests give their nodes a token file in a HOME of their own instead.
for key, value in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                   "RAY_AUTH_TOKEN": secrets.token_hex(32),
                   "RAY_DEDUP_LOGS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}.items():
    os.environ.setdefault(key, value)


def _usable_cpus() -> int:
    """As apao_ray.hardware.available_cpus, which imports torch: here the thread variables come first."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# in a pytest-xdist worker: a share of the CPUs for this process's torch and the subprocesses its tests start
# (trials set their own from --cpus-per-trial): two workers' full-size OpenMP pools on 2 CPUs spin against
# each other and every test runs slower
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = str(max(1, _usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_name, _share)

# the studies' timing probes: one cache per test session, shared by its sweep subprocesses (the first
# sweep of a config measures, later ones read), never the user's ~/.cache/apao_ray/probes.json. Made by the
# process that imports this first: under pytest-xdist the controller, whose environment its workers inherit,
# so all workers share one cache, and it outlives them (removed when the controller exits)
if "APAO_PROBE_CACHE" not in os.environ:
    _PROBE_CACHE_DIR = tempfile.TemporaryDirectory(prefix="apao-probes-")
    os.environ["APAO_PROBE_CACHE"] = os.path.join(_PROBE_CACHE_DIR.name, "probes.json")

from apao_ray.training.hooks import TrainingHooks  # noqa: E402 - after the environment above

GIB_PER_WORKER = 8    # a worker's heaviest tests run a 3-trial study under 2.5-8 GiB caps
MAX_WORKERS = 4       # beyond this the e2e tests' local Rays and MLflow servers contend more than they gain


# modules whose module-scoped fixture runs a study or trains a model: each is handed whole to one worker,
# which builds that fixture once (xdist's own `xdist_group` marks are ignored under pytest 9: pytest-xdist#1386)
ONE_WORKER_MODULES = frozenset({"test_sweep.py", "test_analysis_e2e.py", "test_api.py", "test_serve.py", "test_export.py",
                                "test_sweep_s3.py", "test_storage.py",  # these two: one S3 server each
                                "test_trial_record.py"})


def pytest_xdist_make_scheduler(config, log):
    """Every test is its own unit of work except in ONE_WORKER_MODULES; the largest units (those modules)
    are handed out first (xdist's --loadscope-reorder), then the rest in collection order, e2e tests first
    (pytest_collection_modifyitems) so that the long ones do not end the run on one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.rsplit("/", 1)[-1] in ONE_WORKER_MODULES else nodeid

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and sorts, the same way
        items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one pytest-xdist worker per usable CPU, at most MAX_WORKERS and one
    per GIB_PER_WORKER of memory. The suite on its own keeps about one CPU busy (its tests wait on Ray,
    MLflow servers and subprocess start-ups): 2 workers on 2 CPUs took it from 22.9 to 11-17 min (benchmarks/RESULTS.md)."""
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(_usable_cpus(), MAX_WORKERS, int(memory_gib // GIB_PER_WORKER)))


def train_tiny(backbone: str, output_dir: Path, dataset, precision: str = "fp32") -> Path:
    """A tiny ``backbone`` trained with CE for 2 short epochs (seconds on a CPU) in ``precision``: its final
    checkpoint directory."""
    import torch

    from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.training.loop import run_trial

    torch.set_num_threads(1)
    config = TrialConfig(DataConfig(), ModelConfig(backbone=backbone, **TINY_MODEL), LossConfig(name="ce"),
                         TrainConfig(epochs=2, batch_size=128, effective_batch_size=128, lr=3e-3, max_train_samples=768,
                                     eval_max_users=32, retention_users=8, precision=precision))
    run_trial(config, TrainingHooks(output_dir, verbose=False), dataset)
    return next((output_dir / "checkpoints").glob("epoch_*_final"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads; on a shared CPU a 2-thread pool waits on its second thread."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def synthetic():
    from apao_ray.data import load_dataset

    return load_dataset("synthetic")


@pytest.fixture(scope="session")
def popularity_recall_at_10(synthetic) -> float:
    """Recall@10 on the synthetic test split of recommending the 10 most frequent training targets."""
    import numpy as np

    train, test = synthetic.splits["train"], synthetic.splits["test"]
    sem = synthetic.catalog.item_sem
    counts = np.bincount(sem[train.targets], minlength=synthetic.catalog.num_semantic_ids)
    top = np.argsort(-counts, kind="stable")[:10]
    return float(np.isin(sem[test.targets], top).mean())


class InterruptedHooks(TrainingHooks):
    """Dies right after the checkpoint of ``stop_after`` epochs has been stored (a preemption)."""

    def __init__(self, *args, stop_after: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stop_after = stop_after

    def report(self, metrics, checkpoint_dir) -> None:
        super().report(metrics, checkpoint_dir)
        if metrics.get("epoch") == self.stop_after and not metrics.get("done"):
            raise KeyboardInterrupt(f"simulated preemption after epoch {self.stop_after}")


def closed_port() -> int:
    """A local port nothing listens on: a dataset mirror there refuses at once, never reaching a network."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def isolated(tmp_path, monkeypatch) -> Path:
    """``tmp_path`` as the working directory, none of the user's state: no ``$APAO_DATA_DIR`` or
    ``$MLFLOW_TRACKING_URI`` (a store defaults to ``./mlflow.db`` here), an empty cache at ``tmp_path/cache``
    (``XDG_CACHE_HOME``; absent until something writes it) and a dataset mirror that refuses connections,
    so nothing is found or downloaded by accident. Returns ``tmp_path``."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.delenv(TRACKING_URI_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(DATA_URL_ENV, f"http://127.0.0.1:{closed_port()}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


_MLFLOW_TEMPLATE: list[tempfile.TemporaryDirectory] = []  # holds this process's empty MLflow store, made on first use


def mlflow_sqlite(directory: Path, name: str = "mlflow.db") -> str:
    """The URI of a new, empty SQLite MLflow store at ``directory/name``: a copy of one that MLflow made in
    this process. MLflow creates a store by running its schema migrations (68 in MLflow 3.17), 3.4-3.8 s of
    CPU per new file here, which dozens of tests would each pay; the copy is the same file in 0.03 s.
    test_api's studies still let the product create its store, as a first study does."""
    import shutil

    if not _MLFLOW_TEMPLATE:
        from mlflow import MlflowClient

        folder = tempfile.TemporaryDirectory(prefix="apao-mlflow-template-")  # removed when the process exits
        MlflowClient(f"sqlite:///{folder.name}/mlflow.db").search_experiments()  # creates the schema
        _MLFLOW_TEMPLATE.append(folder)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(_MLFLOW_TEMPLATE[0].name) / "mlflow.db", directory / name)
    return f"sqlite:///{directory / name}"


def register_tiny(root: Path, dataset, backbone: str = "tiger", precision: str = "fp32") -> dict:
    """A tiny model trained, logged and registered as ``models:/apao-synthetic-<backbone>-ce@best`` in a fresh
    SQLite store under ``root``: ``{"tracking_uri", "model_uri", "checkpoint", "dir"}``."""
    from apao_ray.tracking import Tracker

    checkpoint = train_tiny(backbone, root / "trial", dataset, precision)
    tracker = Tracker(mlflow_sqlite(root), "apao-synthetic")
    run_id = tracker.start_run(f"{backbone}/ce", {})
    model_uri = tracker.log_recommender(run_id, checkpoint, list(dataset.catalog.item_ids[:3]))
    tracker.end_run(run_id)
    name = f"apao-synthetic-{backbone}-ce"
    tracker.register_best(model_uri, name)
    return {"tracking_uri": tracker.tracking_uri, "model_uri": f"models:/{name}@best", "checkpoint": checkpoint,
            "dir": root}


@contextlib.contextmanager
def serving(registered: dict, *flags: str):
    """``python -m apao_ray serve MODEL_URI FLAGS`` on a free port until /ping answers: its URL; then the
    server's whole process group is stopped."""
    import subprocess
    import time
    import urllib.request

    from apao_ray.study.cluster.ray_cluster import stable_free_port

    port = stable_free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": registered["tracking_uri"]}
    log = open(registered["dir"] / f"server-{port}.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "apao_ray", "serve", registered["model_uri"], "--port", str(port),
                                *flags], cwd=registered["dir"], env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # its own group: uvicorn's workers die with it
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=2):
                    break
            except OSError:
                log.seek(0)
                assert process.poll() is None, f"the server exited {process.returncode}:\n{log.read()[-3000:]}"
                assert time.time() < deadline, f"{url}/ping did not answer in 180 s:\n{log.read()[-3000:]}"
                time.sleep(0.5)
        yield url
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=20)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def post(url: str, body: dict | bytes) -> tuple[int, dict]:
    """POST ``body`` (a dict as JSON, or raw bytes) to a served model's /invocations: (status, JSON answer)."""
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/invocations", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def run_script(args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None):
    """Runs a studies/ script (or module) in a subprocess with the repo importable."""
    import subprocess

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def descendant_pids(root: int, command: str) -> list[int]:
    """PIDs under process ``root`` (children, their children, ...) whose command line starts with ``command``:
    the Ray processes of the study a test started, never those of another Ray on the machine (a long study
    training beside the suite)."""
    import subprocess

    listing = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    parent, args = {}, {}
    for line in listing.splitlines():
        pid, ppid, *rest = line.split(None, 2)
        parent[int(pid)], args[int(pid)] = int(ppid), rest[0] if rest else ""

    def under_root(pid: int) -> bool:
        while pid in parent and pid != root:
            pid = parent[pid]
        return pid == root

    return [pid for pid in args if pid != root and args[pid].startswith(command) and under_root(pid)]


# a study run as a user runs it, in a process of its own, watched through its MLflow store
SWEEP = str(ROOT / "studies" / "sweep.py")
BEST = str(ROOT / "studies" / "best.py")


def best_rows(tracking_uri: str, cwd: Path) -> list[dict]:
    """``best --format json`` on a --smoke study's store (registering each method's best model): its rows, each
    method's best trial; the command must succeed."""
    import json

    result = run_script([BEST, "--dataset", "synthetic", "--tracking-uri", tracking_uri, "--format", "json"], cwd=cwd,
                        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout)
    assert {(row["backbone"], row["loss"]) for row in rows} == {("tiger", "ce"), ("tiger", "apao_pointwise")}
    return rows


def runs_state(db: Path) -> list[tuple[str, str, int]]:
    """(trial id, status, last validated epoch) of every child run, read straight from SQLite."""
    query = ("select t.value, r.status, coalesce(max(m.step), 0) from runs r "
             "join tags t on t.run_uuid = r.run_uuid and t.key = 'apao.trial_id' "
             "left join metrics m on m.run_uuid = r.run_uuid and m.key = 'val/ndcg_at_10' group by r.run_uuid")
    try:
        with sqlite3.connect(db, timeout=10) as connection:
            return connection.execute(query).fetchall()
    except sqlite3.Error:  # not created yet, or mid-migration
        return []


def launch_until(command: list[str], cwd: Path, ready, timeout: float = 400) -> tuple[subprocess.Popen, list]:
    """Starts the sweep in its own process group and waits until ``ready(state)`` holds."""
    process = subprocess.Popen(command, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + timeout
    while True:
        state = runs_state(cwd / "mlflow.db")
        if ready(state):
            return process, state
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            raise AssertionError(f"state {state} never became ready: {process.communicate()[1][-3000:]}")
        time.sleep(0.3)


def mid_trial(state) -> bool:
    return any(status == "RUNNING" and epoch >= 1 for _, status, epoch in state)


def study_runs(tracker) -> dict:
    """The parent run's (status, outcome) and each child's, as a stop left them."""
    (parent,) = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")
    return {"parent": (parent.info.status, parent.data.tags.get("apao.outcome", "")),
            "children": [(run.info.status, run.data.tags.get("apao.outcome", ""))
                         for run in tracker.child_runs(parent.info.run_id)]}


@pytest.fixture(scope="module")
def s3_bucket():
    """An S3 API server on loopback (moto's standalone server, in a process of its own, stopped by its pid) with
    one empty bucket; the standard AWS variables point this process and the ones it starts (Ray's, a study's)
    at it for the module. Returns ``s3://<bucket>``."""
    if not shutil.which("moto_server", path=str(Path(sys.executable).parent)):
        pytest.skip("moto_server is not installed (the test extra installs moto[server])")
    port = closed_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test-key",
           "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        deadline = time.time() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert server.poll() is None and time.time() < deadline, "moto_server did not start"
            time.sleep(0.2)
        import boto3

        boto3.client("s3").create_bucket(Bucket="apao-test")
        yield "s3://apao-test"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        server.wait(timeout=30)
