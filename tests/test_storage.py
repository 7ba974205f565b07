"""apao_ray/storage.py: one set of file operations for a local directory and an S3 bucket (a real S3 API
server on loopback), so that every reader of a study's files works on both."""
from __future__ import annotations

import gzip
import os

import pytest

from apao_ray import storage


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "runs")
    return request.getfixturevalue("s3_bucket") + f"/{tmp_path.name}/runs"


def test_files_are_written_appended_found_and_deleted_alike_locally_and_on_s3(root):
    run = storage.join(root, "train-trial_id=a")
    assert storage.read_text(storage.join(run, "metrics.jsonl")) is None and not storage.exists(run)
    storage.append_text(storage.join(run, "metrics.jsonl"), "1\n")
    storage.append_text(storage.join(run, "metrics.jsonl"), "2\n")
    assert storage.read_text(storage.join(run, "metrics.jsonl")) == "1\n2\n"
    for epoch in ("epoch_0001", "epoch_0002", "epoch_0002_final"):
        storage.write_text(storage.join(run, "checkpoints", epoch, "state.pt"), epoch)
    assert storage.is_dir(run) and storage.exists(storage.join(run, "metrics.jsonl"))
    found = storage.find(root, "epoch_[0-9][0-9][0-9][0-9]", recursive=True)
    assert [storage.name(location) for location in found] == ["epoch_0001", "epoch_0002"]
    assert found[0] == storage.join(run, "checkpoints", "epoch_0001")
    assert storage.find(root, "*_final", recursive=True) == [storage.join(run, "checkpoints", "epoch_0002_final")]
    assert storage.find(run, "*.jsonl", directories=False) == [storage.join(run, "metrics.jsonl")]
    assert storage.find(storage.join(root, "absent"), "*") == []
    with storage.local_copy(found[1]) as local:  # what torch loads and MLflow logs: a local directory
        assert (local / "state.pt").read_text() == "epoch_0002"
    storage.delete(found[0])
    assert not storage.exists(found[0]) and storage.exists(found[1])
    moved = storage.sibling(found[1], "damaged-epoch_0002")  # a checkpoint set aside: renamed beside itself
    assert moved == storage.join(run, "checkpoints", "damaged-epoch_0002")
    storage.move_dir(found[1], moved)
    assert storage.read_text(storage.join(moved, "state.pt")) == "epoch_0002" and not storage.exists(found[1])


def test_a_mirror_uploads_new_and_grown_files_and_removes_what_is_gone(s3_bucket, tmp_path):
    """What a trial on an object store keeps in step with its local copy of its run (local runs write in place)."""
    root = f"{s3_bucket}/{tmp_path.name}/mirrored"
    local = tmp_path / "mirror"
    (local / "checkpoints" / "epoch_0001").mkdir(parents=True)
    (local / "checkpoints" / "epoch_0001" / "state.pt").write_bytes(b"one")
    (local / "metrics.jsonl").write_text("1\n")
    storage.mirror(local, root)
    (local / "metrics.jsonl").write_text("1\n2\n")
    (local / "checkpoints" / "epoch_0002").mkdir()
    (local / "checkpoints" / "epoch_0002" / "state.pt").write_bytes(b"two")
    storage.delete(local / "checkpoints" / "epoch_0001")
    storage.mirror(local, root)
    assert storage.read_text(storage.join(root, "metrics.jsonl")) == "1\n2\n"
    assert [storage.name(c) for c in storage.find(storage.join(root, "checkpoints"), "epoch_*")] == ["epoch_0002"]
    again = storage.download(root, tmp_path / "again")  # what a restarted trial starts from
    assert sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file()) == [
        "checkpoints/epoch_0002/state.pt", "metrics.jsonl"]
    # a restarted trial writes a checkpoint again under its name: a file of the same size but other bytes (its
    # manifest) must go up too, or the store holds the new tables beside the old manifest
    synced = storage.file_stats(again)
    (again / "checkpoints" / "epoch_0002" / "state.pt").write_bytes(b"TWO")
    storage.mirror(again, root, synced)
    assert storage.read_text(storage.join(root, "checkpoints", "epoch_0002", "state.pt")) == "TWO"
    assert synced == storage.file_stats(again)
    storage.mirror(again, root, synced)  # nothing changed since: nothing sent (the stats say so)
    assert synced == storage.file_stats(again)
    # a .gz file goes up byte for byte (pyarrow's streams would gzip it again by its name: its manifest then failed)
    table = again / "checkpoints" / "epoch_0002" / "per_user_test.csv.gz"
    table.write_bytes(gzip.compress(b"user,rank\n0,3\n"))
    storage.mirror(again, root, synced)
    back = storage.download(root, tmp_path / "back")
    assert (back / "checkpoints" / "epoch_0002" / "per_user_test.csv.gz").read_bytes() == table.read_bytes()


def test_locations_are_spelt_one_way_in_every_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.absolute("runs") == str(tmp_path / "runs")
    assert storage.absolute("s3://bucket/prefix/") == "s3://bucket/prefix"
    assert storage.is_remote("gs://b/p") and not storage.is_remote("/abs") and not storage.is_remote("file:///abs")
    assert storage.join("s3://b/p", "x", "y") == "s3://b/p/x/y" and storage.name("s3://b/p/x/") == "x"


def test_a_uri_keeps_its_options_on_every_location_under_it(s3_bucket, tmp_path, monkeypatch):
    """pyarrow's URI options (``?endpoint_override=...&scheme=http``: an S3-compatible store named in the URI
    instead of ``AWS_ENDPOINT_URL``) reach every file of the run."""
    endpoint = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    root = f"{s3_bucket}/{tmp_path.name}?endpoint_override={endpoint}&scheme=http"
    checkpoint = storage.join(root, "run", "epoch_0001")
    assert checkpoint == f"{s3_bucket}/{tmp_path.name}/run/epoch_0001?endpoint_override={endpoint}&scheme=http"
    assert storage.name(checkpoint) == "epoch_0001" and storage.bucket(checkpoint).startswith(f"{s3_bucket}?")
    storage.write_text(storage.join(checkpoint, "trial_config.json"), "{}")
    assert storage.find(root, "epoch_*", recursive=True) == [checkpoint]
    assert storage.read_text(storage.join(checkpoint, "trial_config.json")) == "{}"
