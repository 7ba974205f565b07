"""Two ``train`` runs of one name side by side (an A/B of two checkouts): each removes only its
own scratch directories, so the one that finishes first never takes the other's checkpoints away."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, run_script
from test_train_cli import COMMON, TRAIN, _wait_for


def test_runs_of_one_name_in_two_directories_have_their_own_scratch(tmp_path):
    from apao_ray.names import remove_scratch, scratch_prefix

    first, second = tmp_path / "a" / "train-office-tiger-ce-seed1", tmp_path / "b" / "train-office-tiger-ce-seed1"
    assert scratch_prefix(first) != scratch_prefix(second)
    assert scratch_prefix(first) == scratch_prefix(tmp_path / "a" / ".." / "a" / first.name)  # one directory, one prefix
    mine, theirs = (Path(tempfile.mkdtemp(prefix=scratch_prefix(run))) for run in (first, second))
    try:
        remove_scratch(first)
        assert not mine.exists() and theirs.exists()
    finally:
        remove_scratch(second)
    assert not theirs.exists()


@pytest.mark.e2e
def test_two_same_named_train_runs_side_by_side_the_shorter_finishes_and_the_longer_trains_on(tmp_path):
    """The shorter run finishes, and removes its scratch, while the longer one trains; the longer then writes
    another epoch's checkpoint (a new one is made in its scratch directory, which the shorter would have taken
    away), and SIGTERM stops it as an interrupted run (143, its checkpoints kept for --resume) rather than
    letting it train its remaining epochs."""
    name, env = "same-name", {**os.environ, "PYTHONPATH": str(ROOT)}
    flags = [*COMMON, "--run-name", name, "--quiet"]
    longer_dir = tmp_path / "a" / name
    longer = subprocess.Popen([sys.executable, TRAIN, *flags, "--epochs", "40", "--patience", "40",
                               "--output-dir", str(tmp_path / "a")], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(longer_dir / "epoch_0002*", longer)  # training: its scratch holds checkpoints
        shorter = run_script([TRAIN, *flags, "--epochs", "2", "--output-dir", str(tmp_path / "b")], cwd=tmp_path,
                             timeout=600)
        assert shorter.returncode == 0, shorter.stderr[-3000:]
        assert longer.poll() is None, "the longer run ended before the shorter: nothing overlapped, make it longer"
        newest = max(int(path.name[len("epoch_"):][:4]) for path in longer_dir.glob("epoch_*"))
        _wait_for(longer_dir / f"epoch_{newest + 1:04d}*", longer)
        longer.send_signal(signal.SIGTERM)
        _, stderr = longer.communicate(timeout=120)
    finally:
        longer.kill()
    assert longer.returncode == 143, stderr[-3000:]
    assert f"run {name} stopped by SIGTERM: its checkpoints are kept (the newest: epoch_" in stderr
    assert "Traceback" not in stderr
