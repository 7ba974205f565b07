"""A study on a Ray cluster whose worker node shares nothing with the driver but the storage: the worker node
(test_study_cluster.py's recipe nodes) runs in a mount namespace of its own, where empty filesystems cover this
machine's temporary directory (the driver's working and data directories, the head's Ray session, the token's
HOME), the shared datasets and the checkout's apao_ray/ sources (so the editable install imports nothing; the
virtual environment stays, as on a node with the dependencies installed). The study's code reaches it through
Ray's runtime_env, the dataset through Ray's object store, the run files through S3 (moto on loopback)."""
from __future__ import annotations

import json
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from apao_ray.data.synthetic import make_synthetic
from conftest import ROOT, SHARED_DATASETS, SWEEP, mlflow_sqlite, run_script
from test_study_cluster import two_node_cluster  # noqa: F401 - a fixture
from test_study_reliability import _children

MASKED = [Path(tempfile.gettempdir()), ROOT / "apao_ray", SHARED_DATASETS]


def in_own_mount_namespace(command: str) -> str:
    """``command`` (a worker node's `ray start`) in a new mount namespace where a tmpfs covers each of ``MASKED``;
    the head's token goes in $RAY_AUTH_TOKEN first (its file lies under the covered HOME)."""
    mounts = " && ".join(f"mount -t tmpfs apao-nodisk {shlex.quote(str(path))}" for path in MASKED if path.is_dir())
    inner = f'export RAY_AUTH_TOKEN="$(cat "$HOME/.ray/auth_token")" && {mounts} && exec bash -c {shlex.quote(command)}'
    return f"unshare --mount --propagation private bash -c {shlex.quote(inner)}"


def mount_namespaces_refused() -> str | None:
    """Why this machine cannot give a process a mount namespace with a tmpfs of its own (None: it can)."""
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed"
    with tempfile.TemporaryDirectory() as probe:
        tried = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "apao-probe",
                                probe], capture_output=True, text=True, timeout=30)
    if tried.returncode != 0:
        return f"`unshare --mount` with a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): " \
               f"{tried.stderr.strip()[:200]}"
    return None


def write_dataset(directory: Path, folder: str) -> None:
    """The synthetic dataset as files in the shipped datasets' format: ``folder/folder.inter.json`` and its
    semantic-ID index."""
    item_ids, codes, user_ids, sequences = make_synthetic(seed=3)
    (directory / folder).mkdir(parents=True)
    index = {item: [f"<{letter}_{code}>" for letter, code in zip("abcd", row)] for item, row in zip(item_ids, codes)}
    (directory / folder / f"{folder}.index.rq-kmeans.json").write_text(json.dumps(index))
    inter = {user: [item_ids[i] for i in sequence] for user, sequence in zip(user_ids, sequences)}
    (directory / folder / f"{folder}.inter.json").write_text(json.dumps(inter))


def four_writers_lost_nothing(db: Path, tracker, children: dict, epochs: int) -> None:
    """Trials that ran at once, all logging to one SQLite file, lost and doubled nothing: some two were between
    their start (Tune launched them) and their test at the same time (run one after the other, none would be; not
    their training alone: a trial's training is seconds once its worker is up, and the workers' starts, torch
    imports on 2 CPUs, were seen in CI staggered by more); no (run, key, step) is stored twice; every run holds the
    same metric keys as the runs of its loss, each per-epoch one at every epoch, and one test."""
    tested = [tracker.client.get_metric_history(c.info.run_id, "test/ndcg_at_10")[0].timestamp for c in children.values()]
    spans = [(c.info.start_time, end) for c, end in zip(children.values(), tested)]
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1:]), spans
    run_ids = [c.info.run_id for c in children.values()]
    loss_of = {c.info.run_id: c.data.tags["loss"] for c in children.values()}
    marks = ",".join("?" * len(run_ids))
    with sqlite3.connect(db) as connection:
        doubled = connection.execute(f"select run_uuid, key, step, count(*) from metrics where run_uuid in ({marks}) "
                                     "group by run_uuid, key, step having count(*) > 1", run_ids).fetchall()
        stored = connection.execute(f"select run_uuid, key, group_concat(step) from metrics where run_uuid in ({marks}) "
                                    "group by run_uuid, key", run_ids).fetchall()
    assert doubled == [], doubled
    keys = {run: {key: sorted(map(int, steps.split(","))) for r, key, steps in stored if r == run} for run in run_ids}
    every_epoch = list(range(1, epochs + 1))
    for run in run_ids:
        same_loss = [other for other in run_ids if loss_of[other] == loss_of[run]]
        assert all(set(keys[other]) == set(keys[run]) for other in same_loss), (loss_of[run], keys)
        per_epoch = [key for key in keys[run] if key.startswith(("train/", "val/", "perf/epoch"))]
        assert len(per_epoch) >= 15 and all(keys[run][key] == every_epoch for key in per_epoch), keys[run]  # CE: 19
        assert keys[run]["val/ndcg_at_10"] == every_epoch and keys[run]["test/recall_at_10"] == [epochs], keys[run]


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform != "linux", reason="mount namespaces are Linux's")
@pytest.mark.skipif(ROOT.is_relative_to(MASKED[0].resolve()),
                    reason=f"the checkout {ROOT} lies under the temporary directory {MASKED[0]}, which the worker "
                           "node's namespace covers: its virtual environment would be hidden from the node too")
@pytest.mark.parametrize("two_node_cluster", [{"worker": in_own_mount_namespace}], indirect=True)
def test_a_study_trains_on_a_node_without_its_code_data_or_output_on_disk(s3_bucket, two_node_cluster, tmp_path):
    """Four trials (CE, three APAO) of 0.9 CPU at once on two 2-CPU nodes: a node holds at most two, so both
    train; a dataset read from files (not generated), which the worker node cannot see; every trial finishes, its
    final checkpoint in the bucket, and the four runs writing to one SQLite file at once lost no metric."""
    refused = mount_namespaces_refused()
    if refused:
        pytest.skip(refused)
    address, node_ids = two_node_cluster
    assert tmp_path.is_relative_to(MASKED[0]), f"{tmp_path} must lie under the covered {MASKED[0]}"
    write_dataset(tmp_path / "data", "tiny")
    uri = mlflow_sqlite(tmp_path)
    output = f"{s3_bucket}/nodisk"
    result = run_script([SWEEP, "--quick", "--dataset", "tiny", "--data-dir", str(tmp_path / "data"),
                         "--num-samples", "3", "--epochs", "2", "--patience", "2", "--max-concurrent", "4",
                         "--cpus-per-trial", "0.9", "--address", address,
                         "--output-dir", output, "--tracking-uri", uri], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Started a local Ray instance" not in result.stderr  # it joined the running cluster
    assert "database is locked" not in result.stderr + result.stdout
    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-tiny")
    children = _children(tracker)
    outcomes = {trial: (run.info.status, run.data.tags.get("apao.error", "")[:300]) for trial, run in children.items()}
    assert len(children) == 4 and all(status == "FINISHED" for status, _ in outcomes.values()), outcomes
    assert {run.data.tags["apao.node_id"] for run in children.values()} == node_ids  # trained on both nodes
    assert all(run.data.tags["apao.checkpoint"].startswith(f"{output}/") for run in children.values())
    four_writers_lost_nothing(tmp_path / "mlflow.db", tracker, children, epochs=2)
