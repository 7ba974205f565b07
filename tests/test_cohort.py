"""Fused trial cohorts (training/cohort.py, models/fused.py): each member trains as its solo trial would.

Cost (~40 s on a shared 2-CPU machine): tiny models on the synthetic data cut to two history items, one thread.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from apao_ray.config import TINY_MODEL, ModelConfig
from apao_ray.data import PAD_TOKEN, collate
from apao_ray.models import build_model
from apao_ray.models.dropout import Dropout
from apao_ray.models.fused import FusedModels
from apao_ray.protocol import with_end_token
from apao_ray.training.cohort import check_cohort, run_cohort
from apao_ray.training.hooks import TrainingHooks
from apao_ray.training.loop import run_trial
from conftest import InterruptedHooks
from test_loop import WEIGHT_KEYS, epoch_reports, make_config, short  # noqa: F401 - short: a fixture

# float32 losses of a member and its solo trial after several AdamW steps: they differ by rounding only
# (batched products, and the padded history pass where a lone CPU trial packs): ~1e-6 seen (2026-11-28); a
# member given another member's samples, negatives or updates differs by ~1e-2 or more
LOSS_TOLERANCE = 1e-4
# a ranking metric over the 64 validation users moves by up to 1/64 if rounding swaps one user's hit
RANKING_TOLERANCE = 1 / 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def stacked_batches(dataset, k: int, batch_size: int):
    """K micro-batches of different samples, left-padded to one width: ids (K, B, L), mask, candidates."""
    split, rng = dataset.splits["train"], np.random.default_rng(0)
    batches = [collate(dataset.catalog, split, rng.choice(len(split), batch_size, replace=False)) for _ in range(k)]
    width = max(b.history_ids.shape[1] for b in batches)
    ids = torch.stack([torch.nn.functional.pad(b.history_ids, (width - b.history_ids.shape[1], 0), value=PAD_TOKEN)
                       for b in batches])
    sem = torch.as_tensor(dataset.catalog.sem_tokens)
    candidates = torch.stack([with_end_token(sem[b.target_sem[:, None]], False) for b in batches])
    return batches, ids, ids != PAD_TOKEN, candidates


@pytest.mark.parametrize("backbone", ["tiger", "llama"])
def test_fused_models_give_each_model_its_own_logits_and_gradients(synthetic, backbone):
    catalog = synthetic.catalog
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(build_model(ModelConfig(backbone=backbone, **{**TINY_MODEL, "dropout": 0.0}),
                                  catalog.vocab_size, catalog.num_levels).train())
    batches, ids, mask, candidates = stacked_batches(synthetic, 3, 16)
    fused = FusedModels(models)(ids, mask, candidates)                                    # (K, B, 1, T, V)
    (fused.float() ** 2).mean(dim=(1, 2, 3, 4)).sum().backward()
    fused_grads = [{name: p.grad.clone() for name, p in m.named_parameters()} for m in models]
    for k, model in enumerate(models):
        model.zero_grad()
        # each model alone on its own (unpadded) batch, the CPU's packed history pass included
        solo = model(batches[k].history_ids, batches[k].history_mask, candidates[k])
        assert (solo - fused[k]).abs().max().item() < 1e-5
        (solo.float() ** 2).mean().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(fused_grads[k][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (fused[0] - fused[1]).abs().max() > 1e-3  # the members' weights differ, and so do their logits


def test_fused_dropout_draws_for_each_member_apart():
    """Under vmap the product's CPU dropout kernel steps aside for F.dropout with a stream per member: each
    member drops ~p of its elements, scales the rest by 1/(1-p), and no two members share a mask."""
    p, size = 0.3, 20_000
    members = [nn.Sequential(nn.Identity(), Dropout(p)).train() for _ in range(3)]
    out = FusedModels(members)(torch.ones(3, size))                                      # (K, size)
    dropped = (out == 0).double().mean(dim=1)
    bound = 5 * (p * (1 - p) / size) ** 0.5  # five standard errors of a binomial fraction
    assert ((dropped - p).abs() < bound).all(), dropped
    torch.testing.assert_close(out[out != 0], torch.full_like(out[out != 0], 1 / (1 - p)))
    masks = out == 0
    for a in range(3):
        for b in range(a + 1, 3):  # independent masks agree on p^2 + (1-p)^2 = 58% of elements, not all
            assert (masks[a] == masks[b]).double().mean() < 0.62


def members(**options):
    """CE seed 0, APAO-pointwise seed 0, and CE seed 1 at a learning rate so small that its validation never
    improves after epoch 1: with patience 1 it stops early after epoch 2 and the cohort goes on without it."""
    # two micro-batches of 64 per optimizer step; eta large enough that APAO's adaptive weights move
    common = {"epochs": 3, "batch_size": 64, "effective_batch_size": 128, **options}
    return [make_config(loss="ce", **common), make_config(loss="apao_pointwise", loss_options={"eta": 0.05}, **common),
            make_config(loss="ce", seed=1, lr=1e-9, patience=1, **common)]


def test_cohort_members_equal_their_solo_trials_through_an_early_stop(short, tmp_path):
    configs = members(dropout=0.0, precision="fp32")  # dropout off: a fused and a solo stream cannot match
    solo_hooks = [TrainingHooks(tmp_path / f"solo{k}", verbose=False) for k in range(3)]
    solo = [run_trial(config, hooks, short) for config, hooks in zip(configs, solo_hooks)]
    cohort_hooks = [TrainingHooks(tmp_path / f"member{k}", verbose=False) for k in range(3)]
    fused = run_cohort(configs, cohort_hooks, short)
    assert [r["epochs_trained"] for r in fused] == [r["epochs_trained"] for r in solo] == [3, 3, 2]
    assert [[r["perf/cohort_members"] for r in epoch_reports(h)] for h in cohort_hooks] == [[3, 3, 2], [3, 3, 2],
                                                                                              [3, 3]]
    for k, (alone, member) in enumerate(zip(solo, fused)):
        assert member["best/epoch"] == alone["best/epoch"]
        for key, value in alone.items():
            if not isinstance(value, float) or not key.startswith(("train/", "val/", "test/", "best/")):
                continue
            ranking = "_at_" in key and "loss" not in key
            tolerance = RANKING_TOLERANCE if ranking else LOSS_TOLERANCE * max(1.0, abs(value))
            assert abs(member[key] - value) <= tolerance, (k, key, member[key], value)
        # and every epoch's training loss, each from the member's own samples and updates
        assert [r["train/loss"] for r in epoch_reports(cohort_hooks[k])] == pytest.approx(
            [r["train/loss"] for r in epoch_reports(solo_hooks[k])], rel=LOSS_TOLERANCE)
    weights = [fused[1][key] for key in WEIGHT_KEYS]  # APAO's adaptive weights moved, as alone
    assert max(abs(w - 0.25) for w in weights) > 1e-3
    assert fused[0]["train/loss"] != pytest.approx(fused[1]["train/loss"], rel=1e-3)  # members really differ


def test_resumed_cohort_equals_an_uninterrupted_one(short, tmp_path):
    configs = members()[:2]  # dropout on: the cohort's stream is a function of the epoch and the members' seeds
    whole = run_cohort(configs, [TrainingHooks(tmp_path / f"whole{k}", verbose=False) for k in range(2)], short)
    hooks = [TrainingHooks(tmp_path / "part0", verbose=False),
             InterruptedHooks(tmp_path / "part1", verbose=False, stop_after=2)]  # after every member's epoch 2
    with pytest.raises(KeyboardInterrupt):
        run_cohort(configs, hooks, short)
    hooks = [TrainingHooks(tmp_path / f"part{k}", verbose=False) for k in range(2)]
    resumed = run_cohort(configs, hooks, short)
    assert [[r["epoch"] for r in epoch_reports(h)] for h in hooks] == [[3], [3]]
    for before, after in zip(whole, resumed):
        assert after.pop("train/resumed_after_epoch") == 2
        same = {k for k in before if not k.startswith(("perf/", "cost/", "system/"))}
        assert same <= set(after) and {k: after[k] for k in same} == {k: before[k] for k in same}


def test_a_member_interrupted_behind_the_others_catches_up(short, tmp_path):
    """Member 0 checkpointed epoch 2 when the cohort died, member 1 had not: member 1's epoch 2 runs alone
    (its dropout stream then is its solo trial's), then both go on together."""
    configs = members()[:2]
    with pytest.raises(KeyboardInterrupt):
        run_cohort(configs, [InterruptedHooks(tmp_path / "m0", verbose=False, stop_after=2),
                             TrainingHooks(tmp_path / "m1", verbose=False)], short)
    hooks = [TrainingHooks(tmp_path / f"m{k}", verbose=False) for k in range(2)]
    final = run_cohort(configs, hooks, short)
    assert [[(r["epoch"], r["perf/cohort_members"]) for r in epoch_reports(h)] for h in hooks] == [
        [(3, 2)], [(2, 1), (3, 2)]]
    assert [r["epochs_trained"] for r in final] == [3, 3]


def test_cohort_refuses_members_that_cannot_share_a_batch():
    base = make_config(loss="ce")
    check_cohort([base, make_config(loss="apao_pointwise", seed=3, lr=1e-3)])  # these may differ
    with pytest.raises(ValueError, match=r"train\.batch_size=64 where member 0 has 128"):
        check_cohort([base, make_config(loss="ce", batch_size=64)])
    with pytest.raises(ValueError, match=r"model\.backbone='llama'"):
        check_cohort([base, make_config(backbone="llama", loss="ce")])
    with pytest.raises(ValueError, match="two-stage"):
        check_cohort([base, make_config(loss="ce", loss_options={"pretrain_ce_epochs": 1})])
