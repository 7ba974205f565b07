"""training.loop without Ray: learning, every loss, determinism, resume, checkpoints, early stop, errors.

Cost (~75 s on a shared 2-CPU machine): every run is a tiny model on the synthetic data with
histories cut to the last one or two items (the planted rule only needs the last one), on one
CPU thread: two intra-op threads spinning against other jobs ran several times slower than one.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from apao_ray.data import load_dataset
from apao_ray.losses import LOSSES, build_loss, register
from apao_ray.losses.ce import CrossEntropyLoss
from apao_ray.models import build_model
from apao_ray.training.checkpoint import (BEST_MODEL_FILE, CATALOG_FILE, CONFIG_FILE, FINAL_METRICS_FILE, STATE_FILE,
                                          load_catalog_arrays, load_checkpoint)
from apao_ray.training.evaluation import select_users
from apao_ray.training.hooks import TrainingHooks
from apao_ray.names import RESUMED_HISTORY_KEY
from apao_ray.training.loop import run_trial
from apao_ray.training.loss_watch import NonFiniteLossError
from apao_ray.training.precision import resolve_precision

from apao_ray.config import TINY_MODEL
from conftest import InterruptedHooks
from test_evaluation import split_ce_loss

MAX_HISTORY = 2
NUM_LEVELS = 4
WEIGHT_KEYS = [f"train/apao_weight_m{m}" for m in range(1, NUM_LEVELS + 1)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def truncated(synthetic, max_history: int):
    """The synthetic dataset with histories cut to ``max_history`` items; same samples and targets."""
    dataset = load_dataset("synthetic", max_history=max_history)
    for name in ("train", "valid", "test"):
        np.testing.assert_array_equal(dataset.splits[name].targets, synthetic.splits[name].targets)
    return dataset


@pytest.fixture(scope="module")
def short(synthetic):
    return truncated(synthetic, MAX_HISTORY)


@pytest.fixture(scope="module")
def last_item(synthetic):
    return truncated(synthetic, 1)


def make_config(backbone: str = "tiger", loss: str = "apao_pointwise", loss_options: dict | None = None,
                dropout: float | None = None, max_history: int = MAX_HISTORY, **train_options) -> TrialConfig:
    train = {"epochs": 2, "batch_size": 128, "effective_batch_size": 128, "lr": 2e-3, "max_train_samples": 384,
             "eval_max_users": 64, "retention_users": 16, **train_options}
    return TrialConfig(data=DataConfig(max_history=max_history),
                       model=ModelConfig(backbone=backbone, dropout=dropout, **TINY_MODEL),
                       loss=LossConfig(name=loss, **(loss_options or {})), train=TrainConfig(**train))


def epoch_reports(hooks: TrainingHooks) -> list[dict]:
    return [r for r in hooks.reports if not r.get("done")]


def prefixed(metrics: dict, *prefixes: str) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith(prefixes)}


# --- 1. learning ------------------------------------------------------------------------------

@pytest.mark.parametrize("backbone, loss, loss_options, max_train_samples", [
    ("tiger", "apao_pointwise", {}, 3000),
    ("llama", "apao_pairwise", {"num_negatives": 20}, 1600),
])
@pytest.mark.e2e  # trains several epochs: seconds to tens of seconds on 2 CPUs
def test_learns_the_sequential_rule_beyond_popularity(last_item, popularity_recall_at_10, tmp_path, backbone, loss,
                                                      loss_options, max_train_samples):
    # the planted rule needs only the last item: one-item histories learn it in 3 short epochs
    config = make_config(backbone, loss, loss_options, max_history=1, epochs=3, lr=3e-3,
                         max_train_samples=max_train_samples, eval_max_users=100)
    final = run_trial(config, TrainingHooks(tmp_path, verbose=False), last_item)
    recall, baseline = final["test/recall_at_10"], popularity_recall_at_10
    message = f"{backbone}/{loss}: test recall@10 {recall:.4f} vs popularity {baseline:.4f}"
    assert recall > 2 * baseline and recall > baseline + 0.1, message
    assert final["done"] is True and final["epochs_trained"] == 3


# --- 2. every loss lowers the validation CE ---------------------------------------------------

def untrained_val_ce(config: TrialConfig, dataset) -> float:
    torch.manual_seed(config.train.seed)
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels)
    users = select_users(len(dataset.splits["valid"]), config.train.eval_max_users, config.train.seed)
    return split_ce_loss(model, dataset, "valid", 256, torch.device("cpu"), users)


PREFERENCE_START = {  # the preference loss when pi == pi_ref (all rewards 0), N negatives
    "dpo": lambda n: math.log(2.0), "dmpo": lambda n: math.log(2.0), "sdpo": lambda n: math.log1p(n),
}


def _val_ce_without_and_with(short, tmp_path, backbone: str, loss: str, flag: str,
                             values: tuple = (False, True)) -> tuple[float, dict]:
    """Untrained validation CE, and after 2 short epochs with ``flag`` (a TrainConfig field) at each value."""
    after = {}
    for on in values:
        config = make_config(backbone, loss, {}, None, epochs=2, batch_size=32, effective_batch_size=32,
                             max_train_samples=1600, eval_max_users=128, retention_users=0, beam_size=10,
                             topk=(5, 10), **{flag: on})
        hooks = TrainingHooks(tmp_path / f"{flag}-{on}", verbose=False)
        run_trial(config, hooks, short)
        after[on] = epoch_reports(hooks)[-1]["val/loss_ce"]
    return untrained_val_ce(config, short), after


@pytest.mark.e2e  # trains several epochs: seconds to tens of seconds on 2 CPUs
def test_length_grouped_batches_learn_like_random_ones(short, tmp_path):
    """--group-by-length changes only which samples share a batch: training still learns as well."""
    before, after = _val_ce_without_and_with(short, tmp_path, "tiger", "ce", "group_by_length")
    # no worse than random batches up to their own noise: over seeds 0-3 (2026-11-25) random batches ended at
    # 1.93-2.11 and grouped minus random per seed ranged -0.064..+0.061, so 0.05 failed on seed 0 by chance
    assert after[True] < before - 0.5 and after[True] < after[False] + 0.15, (before, after)
    assert after[True] != after[False]  # the batches really were different


@pytest.mark.e2e  # trains several epochs: seconds to tens of seconds on 2 CPUs
@pytest.mark.parametrize("backbone", ["tiger", "llama"])
def test_bf16_autocast_training_on_cpu_learns_like_fp32(short, tmp_path, backbone):
    """--precision bf16 on a CPU (native on AVX512-BF16/AMX machines) trains as well as fp32."""
    before, after = _val_ce_without_and_with(short, tmp_path, backbone, "apao_pointwise", "precision", ("fp32", "bf16"))
    assert after["bf16"] < before - 0.5 and abs(after["bf16"] - after["fp32"]) < 0.05, (before, after)
    assert after["bf16"] != after["fp32"]  # bf16 really ran (the setting is not ignored on a CPU)


@pytest.mark.parametrize("backbone, loss, loss_options", [
    ("tiger", "ce", {}), ("llama", "ce", {}),
    ("tiger", "msl", {"tau": 2.0}),
    ("tiger", "apao_pointwise", {}), ("llama", "apao_pointwise", {}),
    ("tiger", "apao_pairwise", {"num_negatives": 5}), ("llama", "apao_pairwise", {"num_negatives": 5}),
    ("tiger", "dpo", {"pretrain_ce_epochs": 1}),
    ("tiger", "dmpo", {"pretrain_ce_epochs": 1, "num_negatives": 5}),
    ("tiger", "sdpo", {"pretrain_ce_epochs": 1, "num_negatives": 5}),
    ("tiger", "ce_sdpo", {"num_negatives": 5, "beta": 0.5}),
])
@pytest.mark.e2e  # trains several epochs: seconds to tens of seconds on 2 CPUs
def test_every_loss_lowers_validation_ce(short, tmp_path, backbone, loss, loss_options):
    # No dropout for the two-stage losses: the policy runs in train mode against a reference in
    # eval mode, so TIGER's dropout noise alone pushes the rewards of positives down and the
    # DPO-style objectives end this short stage above their starting value (TRL disables it).
    dropout = 0.0 if loss in PREFERENCE_START else None
    # 2 epochs x 50 optimizer steps of 32 samples. A preference stage starts a fresh AdamW at this
    # test's LR (4x the paper's): its first epoch overshoots, so it gets 2 epochs and the last is checked.
    epochs = 3 if loss in PREFERENCE_START else 2
    config = make_config(backbone, loss, loss_options, dropout, epochs=epochs, batch_size=32, effective_batch_size=32,
                         max_train_samples=1600, eval_max_users=128, retention_users=0, beam_size=10, topk=(5, 10))
    before = untrained_val_ce(config, short)
    hooks = TrainingHooks(tmp_path, verbose=False)
    run_trial(config, hooks, short)
    # a two-stage loss's CE epoch (epoch 1) logs its train/ and val/ metrics under ce_stage/
    history = [{k.removeprefix("ce_stage/"): v for k, v in r.items()} for r in epoch_reports(hooks)]
    assert [r["epoch"] for r in history] == list(range(1, epochs + 1))
    assert all(r["train/num_samples"] == 1600 for r in history)
    after = [r["val/loss_ce"] for r in history]
    message = f"{backbone}/{loss}: val CE untrained {before:.4f}, after epochs 1, 2: {after}"
    assert before > 2.5, message  # ~log(vocab): sanity of the untrained reference
    assert after[0] < before - 0.5 and after[1] < before - 0.5, message
    if loss in PREFERENCE_START:  # epochs 2-3 are the preference stage: did it optimise its own objective?
        start = PREFERENCE_START[loss](config.loss.num_negatives)
        value = history[-1][f"train/loss_{loss}"]
        assert value < start - 0.05, f"{loss}: mean preference loss {value:.4f} vs {start:.4f} at pi = pi_ref"
        assert history[-1]["train/reward_accuracy"] > 0.5, history[-1]


# --- 3-5. determinism, resume, checkpoints (one 3-epoch APAO run shared) ------------------------

def resume_config(**train_options) -> TrialConfig:
    # eta large enough that the adaptive weights visibly move; accumulation over 2 micro-batches
    return make_config("tiger", "apao_pointwise", {"eta": 0.05}, **{
        "epochs": 3, "batch_size": 64, "effective_batch_size": 128, "max_train_samples": 384, **train_options})


@pytest.fixture(scope="module")
def apao_run(short, tmp_path_factory):
    """A finished 3-epoch run: (config, output dir, hooks, final metrics)."""
    config = resume_config()
    output_dir = tmp_path_factory.mktemp("apao_run")
    hooks = TrainingHooks(output_dir, verbose=False)
    final = run_trial(config, hooks, short)
    return config, output_dir, hooks, final


@pytest.mark.e2e  # trains several epochs: seconds to tens of seconds on 2 CPUs
def test_same_seed_same_metrics_other_seed_different(short, apao_run, tmp_path):
    config, _, _, final = apao_run
    again = run_trial(config, TrainingHooks(tmp_path / "again", verbose=False), short)
    evaluated = prefixed(final, "test/", "val/")
    assert len(prefixed(final, "test/")) >= 8 and len(prefixed(final, "val/")) >= 8
    assert prefixed(again, "test/", "val/") == evaluated
    assert prefixed(again, *WEIGHT_KEYS) == prefixed(final, *WEIGHT_KEYS)

    other = run_trial(resume_config(seed=1), TrainingHooks(tmp_path / "other", verbose=False), short)
    assert other["test/loss_ce"] != final["test/loss_ce"]
    assert prefixed(other, "test/", "val/") != evaluated


def test_resume_after_interruption_matches_uninterrupted_run(short, apao_run, tmp_path):
    config, _, full_hooks, full = apao_run
    with pytest.raises(KeyboardInterrupt):
        run_trial(config, InterruptedHooks(tmp_path, verbose=False, stop_after=2), short)
    assert (tmp_path / "checkpoints" / "epoch_0002" / STATE_FILE).exists()

    hooks = TrainingHooks(tmp_path, resume=True, verbose=False)
    resumed = run_trial(config, hooks, short)
    assert [r["epoch"] for r in epoch_reports(hooks)] == [3]  # epochs 1-2 were not trained again
    assert prefixed(resumed, "test/") == prefixed(full, "test/")
    assert prefixed(resumed, "val/", "best/", "train/loss") == prefixed(full, "val/", "best/", "train/loss")
    weights = [resumed[k] for k in WEIGHT_KEYS]
    assert weights == [full[k] for k in WEIGHT_KEYS]
    assert max(abs(w - 1 / NUM_LEVELS) for w in weights) > 1e-3, f"weights did not move: {weights}"
    # the first report after the resume carries where it resumed and the epochs before, for trackers
    # that missed them; otherwise it equals the uninterrupted run's epoch-3 report
    first = dict(epoch_reports(hooks)[0])
    assert first.pop("train/resumed_after_epoch") == 2
    history = first.pop(RESUMED_HISTORY_KEY)

    def without_timings(report):
        return {k: v for k, v in report.items() if not k.startswith(("perf/", "system/")) and isinstance(v, (int, float))}

    assert [without_timings(h) for h in history] == [without_timings(r) for r in epoch_reports(full_hooks)[:2]]
    assert without_timings(first) == without_timings(epoch_reports(full_hooks)[2])
    assert [h["epoch"] for h in hooks.reports[-1][RESUMED_HISTORY_KEY]] == [1, 2, 3]  # and with the final one


def test_resuming_a_finished_run_rereports_without_training(short, apao_run):
    config, output_dir, _, final = apao_run
    before = sorted(p.name for p in (output_dir / "checkpoints").iterdir())
    hooks = TrainingHooks(output_dir, resume=True, verbose=False)
    again = run_trial(config, hooks, short)
    assert len(hooks.reports) == 1 and hooks.reports[0]["done"] is True
    assert again == final
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == before


def test_checkpoint_contents(short, apao_run):
    config, output_dir, hooks, final = apao_run
    root = output_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["epoch_0003", "epoch_0003_final"]  # keep_checkpoints=2

    state, best, reference = load_checkpoint(root / "epoch_0003")
    assert {"model", "optimizer", "scheduler", "loss", "torch_rng", "epoch", "best_epoch", "best_value",
            "history"} <= set(state)
    assert state["epoch"] == 3 and reference is None
    assert len(state["optimizer"]["state"]) > 0            # AdamW moments are saved
    assert state["scheduler"]["last_epoch"] == 3 * 3       # 384 / 128 = 3 optimizer steps per epoch
    assert isinstance(state["torch_rng"], torch.Tensor) and state["torch_rng"].dtype == torch.uint8
    assert [h["epoch"] for h in state["history"]] == [1, 2, 3]
    assert state["best_epoch"] == final["best/epoch"]

    loss = build_loss(config.loss, short.catalog.tensors(torch.device("cpu")))
    loss.load_state_dict(state["loss"])
    logged = [epoch_reports(hooks)[-1][k] for k in WEIGHT_KEYS]
    assert loss.prefix_weights.weights.tolist() == pytest.approx(logged, abs=1e-12)
    assert loss.prefix_weights.num_updates == 9

    final_dir = root / "epoch_0003_final"
    for name in (FINAL_METRICS_FILE, BEST_MODEL_FILE, CATALOG_FILE, CONFIG_FILE):
        assert (final_dir / name).exists(), name
    assert json.loads((final_dir / FINAL_METRICS_FILE).read_text()) == final
    saved_config = TrialConfig.from_dict(json.loads((final_dir / CONFIG_FILE).read_text()))
    resolved = resolve_precision(config.train.precision, "cpu")  # 'auto' is saved as what it ran in
    assert resolved in ("fp32", "bf16") and saved_config.train.precision == final["precision"] == resolved
    assert saved_config == config.replace(train=config.train.replace(precision=resolved))
    item_ids, item_codes = load_catalog_arrays(final_dir)
    assert item_ids == list(short.catalog.item_ids)
    np.testing.assert_array_equal(item_codes, short.catalog.item_codes)
    final_best = torch.load(final_dir / BEST_MODEL_FILE, weights_only=True)
    assert final_best.keys() == best.keys()
    assert all(torch.equal(final_best[k], best[k]) for k in best)
    if state["best_epoch"] == 3:  # the best weights are the last epoch's
        assert all(torch.equal(best[k], state["model"][k]) for k in best)


# --- 6. early stopping ------------------------------------------------------------------------

def test_early_stopping_stops_after_patience_and_keeps_the_best_epoch(short, tmp_path):
    # lr at its floor: the validation metric cannot improve after epoch 1
    config = make_config("tiger", "ce", epochs=5, patience=1, lr=1e-12, max_train_samples=128, eval_max_users=32,
                         retention_users=0, beam_size=10, topk=(5, 10))
    hooks = TrainingHooks(tmp_path, verbose=False)
    final = run_trial(config, hooks, short)
    history = epoch_reports(hooks)
    values = [r["val/ndcg_at_10"] for r in history]
    assert len(history) == 2 < config.train.epochs, values
    assert final["epochs_trained"] == 2
    assert final["best/epoch"] == 1 + int(np.argmax(values)) == 1
    assert final["best/val/ndcg_at_10"] == max(values)

    # a learning run with patience 2: it stops exactly `patience` epochs after its best one
    config = make_config("tiger", "ce", epochs=6, patience=2, lr=2e-2, max_train_samples=256, eval_max_users=32,
                         retention_users=0, beam_size=10, topk=(5, 10))
    hooks = TrainingHooks(tmp_path / "second", verbose=False)
    final = run_trial(config, hooks, short)
    values = [r["val/ndcg_at_10"] for r in epoch_reports(hooks)]
    best_epoch = 1 + int(np.argmax(values))
    assert final["best/epoch"] == best_epoch, values
    stopped_early = len(values) < config.train.epochs
    assert len(values) == (best_epoch + 2 if stopped_early else config.train.epochs), values


# --- 7. non-finite loss -----------------------------------------------------------------------

def test_non_finite_loss_stops_the_trial_naming_epoch_and_loss(short, tmp_path):
    name = "test_ce_blowing_up"

    class InfAfterOneEpoch(CrossEntropyLoss):
        """CE whose loss becomes +inf from the third training micro-batch on (epoch 2 at 2 batches per epoch); the
        validation loss's calls (inference mode) are not counted."""

        calls = 0

        def __call__(self, inputs):
            output = super().__call__(inputs)
            if torch.is_inference_mode_enabled():
                return output
            type(self).calls += 1
            if type(self).calls > 2:
                output.loss = output.loss * float("inf")
                output.metrics["loss"] = output.loss.detach()
            return output

    register(name)(InfAfterOneEpoch)
    try:
        config = make_config("tiger", name, epochs=3, max_train_samples=256, eval_max_users=32, retention_users=0)
        hooks = TrainingHooks(tmp_path, verbose=False)
        # stopped at the step whose loss overflowed, not at the end of its epoch
        with pytest.raises(NonFiniteLossError, match=rf"became (inf|nan) in epoch 2 \(loss '{name}', lr [\d.e-]+; "
                                                     r"optimizer step 1 of 2\)"):
            run_trial(config, hooks, short)
    finally:
        LOSSES.pop(name)
    assert InfAfterOneEpoch.calls == 3  # no micro-batch after the one that overflowed
    assert [r["epoch"] for r in hooks.reports] == [1]  # epoch 1 was reported, epoch 2 never was


# --- 8. configuration errors before any work --------------------------------------------------

@pytest.mark.parametrize("num_negatives", [399, 1000])
def test_too_many_negatives_fail_before_training(short, tmp_path, num_negatives):
    assert short.catalog.num_semantic_ids == 399
    config = make_config("tiger", "apao_pairwise", {"num_negatives": num_negatives})
    hooks = TrainingHooks(tmp_path, verbose=False)
    with pytest.raises(ValueError, match=rf"num_negatives={num_negatives}\b.*\b399 semantic IDs"):
        run_trial(config, hooks, short)
    assert hooks.reports == [] and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("loss", ["dpo", "dmpo", "sdpo"])
def test_preference_loss_without_ce_stage_fails_before_training(short, tmp_path, loss):
    hooks = TrainingHooks(tmp_path, verbose=False)
    with pytest.raises(ValueError, match=re.escape(f"loss {loss!r} needs a CE stage first")):
        run_trial(make_config("tiger", loss, {"num_negatives": 5}), hooks, short)
    assert hooks.reports == [] and not (tmp_path / "checkpoints").exists()


def test_in_epoch_progress_lines_name_their_trial_and_are_shown_in_a_quiet_study_worker(tmp_path, capsys):
    from apao_ray.training.hooks import TrainingHooks
    from apao_ray.training.progress import EpochProgress

    hooks = TrainingHooks(tmp_path, verbose=False)  # a study's worker: no per-epoch lines of its own
    hooks.progress_label = "[tiger/ce] "
    progress = EpochProgress(hooks, epoch=2, num_epochs=5, seconds_per_other_epoch=60.0, interval=0.0)
    progress(500, 1000)
    progress(1000, 1000)  # the epoch's end: its own report says the rest
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[tiger/ce] epoch 2/5: 500/1,000 samples"), lines
    assert lines[0].endswith("min") and "trial ETA" in lines[0]
    hooks.show_progress = False
    progress(600, 1000)
    assert capsys.readouterr().err == ""
