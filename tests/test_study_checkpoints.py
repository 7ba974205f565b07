"""A study's trials over damaged checkpoints: a resume continues each from the newest checkpoint that loads,
saying so (the checks themselves: tests/test_checkpoint.py)."""
from __future__ import annotations

import os
import signal

import pytest

from apao_ray.tracking import Tracker
from conftest import run_script
from test_study_reliability import _one_trial_study_past_epoch_2


@pytest.mark.e2e
def test_a_resumed_study_continues_a_trial_whose_newest_checkpoint_is_damaged_from_the_one_before(tmp_path):
    """Ctrl-C a one-trial study once its trial has checkpoints, cut the newest short, resume: the trial says so in
    one line, sets it aside and continues from the checkpoint before it, in its same child run, to its end."""
    epochs = 6  # smoke epochs take ~1 s: the stop comes with 4 epochs still to go
    process, command, uri, _ = _one_trial_study_past_epoch_2(tmp_path, epochs)
    checkpoints = tmp_path / "runs" / "synthetic-study" / "train_runs"
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 130, stderr[-3000:]
    kept = sorted(checkpoints.glob("*/checkpoints/epoch_[0-9][0-9][0-9][0-9]"))
    assert len(kept) == 2 and not list(checkpoints.glob("*/checkpoints/epoch_*_final")), kept
    newest, damaged_epoch = kept[-1], int(kept[-1].name.removeprefix("epoch_"))
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[:state.stat().st_size // 2])

    result = run_script([*command, "--resume"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stderr.splitlines() if "does not load" in line]
    assert len(lines) == 1 and f"/{newest.name} does not load (state.pt has " in lines[0], lines
    assert lines[0].endswith(f"set aside as damaged-{newest.name}; using epoch_{damaged_epoch - 1:04d}"), lines
    assert (newest.parent / f"damaged-{newest.name}" / "state.pt").exists()  # kept beside the others
    tracker = Tracker(uri, "apao-synthetic")
    (run,) = tracker.child_runs()  # the same child run, not a second one
    assert run.info.status == "FINISHED" and run.data.tags["apao.outcome"] == "finished", run.data.tags
    assert run.data.metrics["train/resumed_after_epoch"] == damaged_epoch - 1
    assert "test/ndcg_at_10" in run.data.metrics
    assert {step for step, _ in tracker.metric_history(run.info.run_id, "val/ndcg_at_10")} == set(range(1, epochs + 1))
