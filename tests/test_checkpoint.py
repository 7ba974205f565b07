"""training/checkpoint.py: checkpoints verified when written and when read; a damaged one set aside, the newest that
loads used instead, on a local disk and on S3 (train --resume over a damaged checkpoint: test_train_cli.py)."""
from __future__ import annotations

import json

import pytest
import torch

from apao_ray import storage
from apao_ray.training.checkpoint import (BEST_MODEL_FILE, MANIFEST_FILE, RESTARTS, SET_ASIDE_FILE, STATE_FILE,
                                          DamagedCheckpointError, check_checkpoint, latest_checkpoint_in,
                                          load_checkpoint, newest_checkpoint_at, save_checkpoint)
from apao_ray.training.hooks import TrainingHooks
from apao_ray.training.loop import run_trial
from conftest import InterruptedHooks
from test_loop import apao_run, epoch_reports, prefixed, short  # noqa: F401 - fixtures


def _write(directory, epoch: int = 1):
    weights = {"w": torch.arange(1000, dtype=torch.float32) * epoch}
    return save_checkpoint(directory, {"epoch": epoch, "model": weights}, weights, {"epoch": epoch})


def _cut_short(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def test_a_written_checkpoint_is_sealed_by_its_manifest_and_loads(tmp_path):
    directory = _write(tmp_path / "epoch_0001")
    manifest = json.loads((directory / MANIFEST_FILE).read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in directory.iterdir() if p.name != MANIFEST_FILE)
    assert manifest[STATE_FILE]["bytes"] == (directory / STATE_FILE).stat().st_size
    check_checkpoint(directory)
    state, best, reference = load_checkpoint(directory)
    assert state["epoch"] == 1 and torch.equal(best["w"], state["model"]["w"]) and reference is None
    assert not list(tmp_path.glob("*.tmp"))  # written aside, renamed when whole


@pytest.mark.parametrize("damage, reason", [
    (lambda d: _cut_short(d / STATE_FILE), r"state\.pt has \d+ bytes, \d+ were written"),
    (lambda d: (d / BEST_MODEL_FILE).unlink(), r"best_model\.pt is missing"),
    # same size, other bytes: only the checksum tells
    (lambda d: (d / STATE_FILE).write_bytes(bytes(len((d / STATE_FILE).read_bytes()))), r"state\.pt differs"),
    (lambda d: (d / MANIFEST_FILE).write_text("{"), r"manifest\.json is unreadable"),
])
def test_a_damaged_checkpoint_is_detected_by_the_reader_naming_the_file(tmp_path, damage, reason):
    directory = _write(tmp_path / "epoch_0001")
    damage(directory)
    with pytest.raises(DamagedCheckpointError, match=reason):
        load_checkpoint(directory)


def test_a_checkpoint_from_before_manifests_is_verified_by_loading_it(tmp_path):
    directory = _write(tmp_path / "epoch_0001")
    (directory / MANIFEST_FILE).unlink()
    check_checkpoint(directory)  # whole: it loads
    _cut_short(directory / STATE_FILE)
    with pytest.raises(DamagedCheckpointError, match=r"state\.pt does not load \("):
        check_checkpoint(directory)


def test_the_newest_checkpoint_that_loads_is_used_and_damaged_newer_ones_are_set_aside_once(tmp_path):
    for epoch in (1, 2, 3):
        _write(tmp_path / f"epoch_{epoch:04d}", epoch)
    _cut_short(tmp_path / "epoch_0003" / STATE_FILE)
    (tmp_path / "epoch_0002" / STATE_FILE).unlink()
    said = []
    assert latest_checkpoint_in(tmp_path, said.append) == tmp_path / "epoch_0001"
    assert len(said) == 2 and all("set aside as damaged-epoch_000" in line and line.endswith("; using epoch_0001")
                                 for line in said)
    assert "epoch_0003 does not load (state.pt has" in said[0] and "epoch_0002 does not load (state.pt is missing" in said[1]
    # kept beside the others under a name no reader matches; their places marked (Ray Train lists them)
    assert (tmp_path / "damaged-epoch_0003" / BEST_MODEL_FILE).exists()
    assert sorted(p.name for p in (tmp_path / "epoch_0003").iterdir()) == [SET_ASIDE_FILE]
    again = []
    assert latest_checkpoint_in(tmp_path, again.append) == tmp_path / "epoch_0001" and again == []
    assert latest_checkpoint_in(tmp_path, said.append, up_to_epoch=2, final=False) == tmp_path / "epoch_0001"
    # none loads: said, and the run starts from its first epoch
    _cut_short(tmp_path / "epoch_0001" / BEST_MODEL_FILE)
    assert latest_checkpoint_in(tmp_path, again.append, RESTARTS) is None
    assert len(again) == 1 and again[0].endswith("; training starts again from the first epoch"), again


def test_on_an_object_store_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_used(s3_bucket, tmp_path):
    """What the driver's finders do on S3 (moto on loopback, conftest ``s3_bucket``) as on a local disk: a checkpoint
    altered and one cut short in the bucket are each said once, moved to ``damaged-<name>`` in the bucket, their
    places marked, and the newest that loads is used; none of a kind loads: said, and None."""
    local = tmp_path / "run"
    for name, epoch in (("epoch_0001", 1), ("epoch_0002", 2), ("epoch_0003", 3), ("epoch_0003_final", 3)):
        _write(local / "checkpoints" / name, epoch)
    run = f"{s3_bucket}/set-aside/train-trial_id=t1"
    storage.mirror(local, run)
    checkpoints = storage.join(run, "checkpoints")
    storage.write_text(storage.join(checkpoints, "epoch_0003", BEST_MODEL_FILE), "altered")
    storage.delete(storage.join(checkpoints, "epoch_0002", STATE_FILE))
    storage.write_text(storage.join(checkpoints, "epoch_0003_final", STATE_FILE), "cut")
    said = []
    assert newest_checkpoint_at(run, said.append) == storage.join(checkpoints, "epoch_0001")
    assert len(said) == 2 and all(line.endswith("; using epoch_0001") for line in said), said
    assert f"{checkpoints}/epoch_0003 does not load (best_model.pt has 7 bytes" in said[0]
    assert "epoch_0002 does not load (state.pt is missing): set aside as damaged-epoch_0002" in said[1]
    assert storage.exists(storage.join(checkpoints, "damaged-epoch_0003", BEST_MODEL_FILE))
    kept = storage.find(storage.join(checkpoints, "epoch_0003"), "*", directories=False)
    assert [storage.name(location) for location in kept] == [SET_ASIDE_FILE]
    again = []
    assert newest_checkpoint_at(run, again.append) == storage.join(checkpoints, "epoch_0001") and again == []
    assert newest_checkpoint_at(run, again.append, up_to_epoch=1) == storage.join(checkpoints, "epoch_0001")
    assert newest_checkpoint_at(run, again.append, final=True) is None
    assert len(again) == 1 and "epoch_0003_final does not load (state.pt has 3 bytes" in again[0], again
    assert again[0].endswith("set aside as damaged-epoch_0003_final; none before it loads")


@pytest.mark.e2e  # trains 4 epochs beside the uninterrupted run's 3: tens of seconds on 2 CPUs
def test_a_resume_over_a_damaged_newest_checkpoint_continues_from_the_one_before(short, apao_run, tmp_path, capsys):
    """The plain loop (a study's one-worker trial runs it in Ray Tune's actor): stopped after epoch 2 of 3, its
    newest checkpoint cut short, resumed: one line names the damaged checkpoint, epochs 2 and 3 are trained
    again from epoch 1's checkpoint, and the run ends as an uninterrupted one."""
    config, _, _, full = apao_run  # the same trial, uninterrupted
    with pytest.raises(KeyboardInterrupt):
        run_trial(config, InterruptedHooks(tmp_path / "run", verbose=False, stop_after=2), short)
    _cut_short(tmp_path / "run" / "checkpoints" / "epoch_0002" / STATE_FILE)
    capsys.readouterr()
    hooks = TrainingHooks(tmp_path / "run", resume=True, verbose=False)
    resumed = run_trial(config, hooks, short)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "epoch_0002 does not load (state.pt has" in lines[0], lines
    assert lines[0].endswith("set aside as damaged-epoch_0002; using epoch_0001"), lines
    assert [r["epoch"] for r in epoch_reports(hooks)] == [2, 3]
    assert epoch_reports(hooks)[0]["train/resumed_after_epoch"] == 1
    assert resumed["epochs_trained"] == 3
    assert prefixed(resumed, "test/", "best/") == prefixed(full, "test/", "best/")
    assert (tmp_path / "run" / "checkpoints" / "damaged-epoch_0002" / BEST_MODEL_FILE).exists()  # kept


def test_a_storage_that_refuses_for_a_while_is_waited_out_and_one_that_keeps_refusing_is_named(monkeypatch):
    """with_storage_retries: a write refused once goes through on the next try, said in two lines (refused, took);
    past $APAO_STORAGE_WAIT_S the error names the storage, how long and why, in one line, and what to do."""
    from apao_ray.training.checkpoint import STORAGE_WAIT_ENV, StorageUnavailableError, with_storage_retries

    said, tries = [], []

    def write_refused_once() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation:\ncurlCode: 7")
        return "written"

    monkeypatch.setenv(STORAGE_WAIT_ENV, "30")
    assert with_storage_retries(write_refused_once, "s3://b/run", "the epoch's checkpoint", said.append) == "written"
    assert len(tries) == 2 and len(said) == 2, said
    assert said[0] == ("storage s3://b/run refused the epoch's checkpoint (AWS Error NETWORK_CONNECTION during "
                       "PutObject operation: curlCode: 7); trying again for up to 30 s ($APAO_STORAGE_WAIT_S)")
    assert said[1].startswith("storage s3://b/run took the epoch's checkpoint after ")
    monkeypatch.setenv(STORAGE_WAIT_ENV, "0")

    def refused() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(StorageUnavailableError) as error:
        with_storage_retries(refused, "/shared/runs/t", "the epoch's checkpoint", said.append)
    assert str(error.value).startswith("storage /shared/runs/t refused the epoch's checkpoint for 0 s (the last time: "
                                       "[Errno 28] No space left on device)") and "\n" not in str(error.value)
    assert str(error.value).endswith("re-run the same command with --resume --retry-failed")
    with pytest.raises(ValueError):  # not a storage error: not retried
        with_storage_retries(lambda: int("x"), "/shared/runs/t", "the epoch's checkpoint", said.append)
