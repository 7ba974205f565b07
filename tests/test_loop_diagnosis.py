"""The diagnosis option ``test_every_epoch`` (why validation and test disagree): the test split
after every epoch, for a per-epoch test curve, without changing what the trial trains or selects."""
from __future__ import annotations

import pytest
import torch

from apao_ray.names import DIAGNOSIS_PREFIX
from apao_ray.training.hooks import TrainingHooks
from apao_ray.training.loop import run_trial
from test_loop import epoch_reports, make_config, prefixed, truncated


@pytest.mark.e2e  # two 3-epoch runs of a tiny model: ~20 s on 2 CPUs
def test_test_every_epoch_changes_nothing_and_its_kept_epoch_is_the_final_test(synthetic, tmp_path):
    torch.set_num_threads(1)
    short = truncated(synthetic, 2)
    config = make_config(epochs=3, eval_max_users=None, retention_users=0)
    plain = run_trial(config, TrainingHooks(tmp_path / "plain", verbose=False), short)
    hooks = TrainingHooks(tmp_path / "diagnosed", verbose=False)
    diagnosed = run_trial(config.replace(train=config.train.replace(test_every_epoch=True)), hooks, short)

    reports = epoch_reports(hooks)
    assert [r["epoch"] for r in reports] == [1, 2, 3]
    assert all(f"{DIAGNOSIS_PREFIX}test/ndcg_at_10" in r for r in reports)
    assert len({r[f"{DIAGNOSIS_PREFIX}test/loss_ce"] for r in reports}) == 3  # a curve, not one value repeated
    # nothing reads it: the same training, validation, selection and test as without it
    assert prefixed(diagnosed, "test/", "val/", "best/", "train/") == prefixed(plain, "test/", "val/", "best/", "train/")
    # the kept epoch's diagnosis is the final test: one evaluation code for every epoch's test and the last
    kept = next(r for r in reports if r["epoch"] == diagnosed["best/epoch"])
    for metric in ("ndcg_at_10", "recall_at_10", "ndcg_at_20", "loss_ce"):
        assert kept[f"{DIAGNOSIS_PREFIX}test/{metric}"] == pytest.approx(diagnosed[f"test/{metric}"], abs=1e-9)
