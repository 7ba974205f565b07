"""Two-stage trials (DPO/DMPO/S-DPO, CE -> APAO) as two stages, on small real runs.

The preference stage starts from the best CE epoch with its own optimizer, its own warmup +
cosine schedule over its own epochs, a frozen reference copied from that epoch and its own
best-epoch selection; the CE epochs are logged under ``ce_stage/``; a resume works in either stage.
"""
from __future__ import annotations

import math

import pytest
import torch

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from apao_ray.data import load_dataset
from apao_ray.training.checkpoint import load_checkpoint
from apao_ray.training.hooks import TrainingHooks
from apao_ray.training.loop import run_trial

from apao_ray.config import TINY_MODEL
from conftest import InterruptedHooks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR = 3e-3


@pytest.fixture(scope="module")
def short():
    return load_dataset("synthetic", max_history=2)


def two_stage_config(loss: str = "dpo", epochs: int = 4, ce_epochs: int = 2) -> TrialConfig:
    train = TrainConfig(epochs=epochs, batch_size=64, effective_batch_size=64, lr=LR, max_train_samples=256,
                        eval_max_users=48, retention_users=0, patience=10, beam_size=10, topk=(5, 10))
    return TrialConfig(DataConfig(max_history=2), ModelConfig(dropout=0.0, **TINY_MODEL),
                       LossConfig(name=loss, num_negatives=3, pretrain_ce_epochs=ce_epochs), train)


@pytest.fixture(scope="module")
def dpo_run(short, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("dpo")
    hooks = TrainingHooks(output_dir, verbose=False, keep_checkpoints=10)
    final = run_trial(two_stage_config(), hooks, short)
    return output_dir, hooks, final


def epochs_of(hooks):
    return [r for r in hooks.reports if not r.get("done")]


def test_ce_epochs_logged_under_their_own_prefix(dpo_run):
    _, hooks, _ = dpo_run
    ce, preference = epochs_of(hooks)[:2], epochs_of(hooks)[2:]
    assert [r["epoch"] for r in preference] == [3, 4]
    for report in ce:
        assert "ce_stage/train/loss_ce" in report and "ce_stage/val/ndcg_at_10" in report
        assert not any(k.startswith(("train/", "val/")) for k in report)
        assert "best/val/ndcg_at_10" in report  # what Tune's scheduler reads, in every report
    for report in preference:
        assert "train/loss_dpo" in report and "val/ndcg_at_10" in report
        assert not any(k.startswith("ce_stage/") for k in report)


def test_each_stage_has_its_own_warmup_and_cosine_schedule(dpo_run):
    """Both stages end their cosine at ~0 and the preference stage restarts near the full LR;
    one schedule over all 4 epochs would be at 0.5 * LR after epoch 2 and ~0.15 * LR after 3."""
    _, hooks, _ = dpo_run
    lr = {r["epoch"]: r.get("train/lr", r.get("ce_stage/train/lr")) for r in epochs_of(hooks)}
    assert lr[1] > 0.4 * LR and lr[2] < 1e-3 * LR  # the CE stage's own cosine, over 2 epochs
    assert lr[3] > 0.4 * LR and lr[4] < 1e-3 * LR  # the preference stage's own cosine


def test_reference_and_start_are_the_best_ce_epoch_and_selection_is_the_stage_own(dpo_run, short):
    output_dir, hooks, final = dpo_run
    ce_best = final["ce_stage/best/epoch"]
    ce_ndcg = [r["ce_stage/val/ndcg_at_10"] for r in epochs_of(hooks)[:2]]
    assert ce_best == ce_ndcg.index(max(ce_ndcg)) + 1
    _, ce_best_weights, _ = load_checkpoint(output_dir / "checkpoints" / "epoch_0002")  # after the CE stage
    _, _, reference = load_checkpoint(output_dir / "checkpoints" / "epoch_0003")
    assert reference is not None and all(torch.equal(reference[k], ce_best_weights[k]) for k in reference)
    # the kept epoch is the preference stage's best, even where a CE epoch scored higher
    preference = epochs_of(hooks)[2:]
    ndcg = [r["val/ndcg_at_10"] for r in preference]
    assert final["best/epoch"] == 3 + ndcg.index(max(ndcg))
    assert final["best/val/ndcg_at_10"] == max(ndcg)


@pytest.mark.parametrize("stop_after", [1, 3])
def test_resume_in_either_stage_matches_the_uninterrupted_run(dpo_run, short, tmp_path, stop_after):
    _, full_hooks, full = dpo_run
    config = two_stage_config()
    with pytest.raises(KeyboardInterrupt):
        run_trial(config, InterruptedHooks(tmp_path, verbose=False, stop_after=stop_after), short)
    hooks = TrainingHooks(tmp_path, resume=True, verbose=False)
    resumed = run_trial(config, hooks, short)
    assert [r["epoch"] for r in epochs_of(hooks)] == list(range(stop_after + 1, 5))
    keys = [k for k in full if k.startswith(("test/", "best/", "val/", "train/lr", "ce_stage/best"))]
    assert {k: resumed[k] for k in keys} == {k: full[k] for k in keys}
    lr = [r.get("train/lr", r.get("ce_stage/train/lr")) for r in epochs_of(hooks)]
    assert lr == [r.get("train/lr", r.get("ce_stage/train/lr")) for r in epochs_of(full_hooks)[stop_after:]]


def test_ce_then_apao_is_two_stages_too(short, tmp_path):
    hooks = TrainingHooks(tmp_path, verbose=False)
    final = run_trial(two_stage_config("apao_pointwise", epochs=3, ce_epochs=1), hooks, short)
    reports = epochs_of(hooks)
    assert "ce_stage/train/loss" in reports[0] and "train/loss_apao" in reports[1]
    assert reports[1]["train/lr"] > 0.4 * LR and final["best/epoch"] >= 2 and math.isfinite(final["test/ndcg_at_10"])


def test_a_ce_stage_as_long_as_the_trial_is_refused(short, tmp_path):
    with pytest.raises(ValueError, match=r"pretrain_ce_epochs=4 leaves no epoch of 'dpo' within epochs=4"):
        run_trial(two_stage_config(epochs=4, ce_epochs=4), TrainingHooks(tmp_path, verbose=False), short)
