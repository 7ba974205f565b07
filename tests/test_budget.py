"""study/plan/budget.py: the fitting arithmetic (makespan, the study's estimate, what a budget cuts, defers or
fills, ASHA's rungs), with the plan each fit gives where the test reads it (no training; the plan's own text and
order: test_plan.py; the probe and its cache: test_probe.py)."""
from __future__ import annotations

import pytest

from apao_ray.study.plan.budget import RAY_START_S, Fit, MethodCost, asha_rungs, fit_budget, makespan, study_seconds
from apao_ray.study.spec.duration import format_duration
from apao_ray.study.plan.plan import Plan


CE = MethodCost("tiger", "ce", True, epoch_s=60.0, fixed_s=30.0, peak_bytes=2**30)
POINTWISE = MethodCost("tiger", "apao_pointwise", False, epoch_s=60.0, fixed_s=30.0, peak_bytes=2 * 2**30)


def test_makespan_puts_the_longest_trials_first_on_the_freest_slot():
    assert makespan([2, 3, 2, 3, 2], 2) == 7      # 3+2+2 | 3+2
    assert makespan([2, 3, 2, 3, 2], 1) == 12
    assert makespan([5, 1, 1], 3) == 5             # never shorter than the longest trial
    assert makespan([], 2) == 0


def test_study_estimate_counts_baselines_once_and_tuned_methods_per_trial():
    # CE once + 3 pointwise trials, one slot: each trial 30 s + 20 epochs x 60 s
    assert study_seconds([CE, POINTWISE], 20, 3, 1) == RAY_START_S + 4 * (30 + 20 * 60)
    assert study_seconds([CE, POINTWISE], 20, 3, 2) == RAY_START_S + 2 * (30 + 20 * 60)


def test_repeats_on_other_seeds_run_after_the_search_one_per_method_and_seed():
    # search: CE + 3 pointwise on 2 slots = 2 trials' time; then 2 methods x 2 seeds on 2 slots = 2 trials' time
    trial = 30 + 20 * 60
    assert study_seconds([CE, POINTWISE], 20, 3, 2, num_repeats=2) == RAY_START_S + 2 * trial + 2 * trial
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 2, RAY_START_S + 4 * trial, num_repeats=2)
    assert fit == Fit(20, 3, 5, RAY_START_S + 4 * trial)
    assert fit_budget([CE, POINTWISE], 20, 3, 5, 2, RAY_START_S + 4 * trial - 1, num_repeats=2).epochs == 19


def test_a_study_that_fits_is_left_as_asked():
    asked = study_seconds([CE, POINTWISE], 20, 3, 1)
    assert fit_budget([CE, POINTWISE], 20, 3, 5, 1, asked) == Fit(20, 3, 5, asked)
    assert fit_budget([CE, POINTWISE], 20, 3, 5, 1, None) == Fit(20, 3, 5, asked)


def test_epochs_shrink_first_down_to_half():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 1, 3000)  # 10 + 4 * (30 + 60 e) <= 3000  ->  e = 11
    assert (fit.epochs, fit.trials_per_tuned, fit.asha_grace_period) == (11, 3, 2)
    assert fit.estimate_s == 10 + 4 * (30 + 660) <= 3000
    assert fit.changes == ("epochs 20 -> 11", "ASHA grace period 5 -> 2")


def test_then_trials_then_epochs_below_half():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 1, 1500)  # 3 trials at 10 epochs: 2530 s; 2 trials: 1900 s
    assert (fit.epochs, fit.trials_per_tuned) == (11, 1)    # 10 + 2 * (30 + 60 e) <= 1500
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 1, 500)
    assert (fit.epochs, fit.trials_per_tuned, fit.asha_grace_period) == (3, 1, 1)
    assert fit.changes == ("epochs 20 -> 3", "trials per tuned method 3 -> 1", "ASHA grace period 5 -> 1")


def test_two_slots_fit_more():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 2, 1500)  # 4 equal trials, 2 per slot: 10 + 2 * (30 + 60 e)
    assert (fit.epochs, fit.trials_per_tuned) == (11, 3)


def test_a_budget_too_small_for_the_minimum_epochs_of_any_method_is_refused_with_the_estimate():
    # the cheapest method alone, one trial of 3 epochs: 10 + 30 + 3 * 60 = 220 s
    with pytest.raises(ValueError, match=r"budget 1\.5 min is too small for 3 epochs of any method: one trial of the "
                                         r"cheapest, tiger/ce, is estimated at 3\.7 min .* --budget 4m or more, fewer "
                                         r"--min-epochs"):
        fit_budget([CE, POINTWISE], 20, 3, 5, 1, 90)
    with pytest.raises(ValueError, match=r"too small for 1 epoch of any method: .* estimated at 1\.7 min"):
        fit_budget([CE, POINTWISE], 20, 3, 5, 1, 90, min_epochs=1)


def test_a_budget_below_one_full_epoch_trains_every_method_on_the_largest_subset_that_fits():
    # 10,240 training samples per epoch; CE trains them in 50 s (+ 10 s validation), pairwise in 3,590 s (+ 10 s)
    ce = MethodCost("tiger", "ce", True, epoch_s=60.0, fixed_s=30.0, train_samples=10240, train_epoch_s=50.0)
    pairwise = MethodCost("tiger", "apao_pairwise", False, epoch_s=3600.0, fixed_s=30.0, train_samples=10240,
                          train_epoch_s=3590.0)
    assert study_seconds([ce, pairwise], 1, 1, 1) == RAY_START_S + 90 + 3630  # one full epoch each: over 1000 s
    fit = fit_budget([ce, pairwise], 20, 3, 5, 1, 1000, min_epochs=1)
    # 10 + (30 + 10 + 50 s/10240) + (30 + 10 + 3590 s/10240) <= 1000  ->  s <= 2560, a multiple of 256
    assert (fit.epochs, fit.trials_per_tuned, fit.train_samples, fit.deferred) == (1, 1, 2560, ())
    assert fit.estimate_s <= 1000 < study_seconds([m.with_train_samples(2816) for m in (ce, pairwise)], 1, 1, 1)
    assert "training samples per epoch 10,240 -> 2,560 (a fixed random subset, the same for every method: not " \
           "the paper's protocol)" in fit.changes
    plan = Plan("grocery", "paper", "bf16", 1, [ce, pairwise], 20, 3, fit, budget_s=1000)
    assert "tiger/apao_pairwise    1 trial   1 epoch   epoch ~15.1 min" in plan.text()  # the subset's epoch
    # at the default 3 epochs not even 1,024 samples keep pairwise: CE runs alone on all of them, pairwise deferred
    alone = fit_budget([ce, pairwise], 20, 3, 5, 1, 1000)
    assert (alone.epochs, alone.train_samples) == (16, None) and [d.loss for d in alone.deferred] == ["apao_pairwise"]
    # the cheapest method alone on 1,024 samples is the last resort; below it the budget is refused
    assert fit_budget([ce, pairwise], 20, 3, 5, 1, 60, min_epochs=1).train_samples == 2048  # 10 + 30 + 10 + 50 s/10240
    with pytest.raises(ValueError, match=r"1 epoch of any method: one trial of the cheapest, tiger/ce on 1,024 "
                                         r"training samples, is estimated at 55 s .* --budget 1m or more"):
        fit_budget([ce, pairwise], 20, 3, 5, 1, 50, min_epochs=1)


# a fit whose goal is a comparison at equal epochs
SLOW = MethodCost("tiger", "apao_pairwise", False, epoch_s=12 * 60.0, fixed_s=30.0, peak_bytes=3 * 2**30)


def test_a_method_12x_slower_than_the_rest_is_deferred_and_the_rest_keep_a_schedule_that_measures():
    # 2 slots, 1 h: the slow method's one trial of 3 epochs (10 + 30 + 3 x 720 s = 37 min) fits alone, but beside
    # it the others would get the leftovers; at the uniform fit all three got 3 epochs, one trial each
    budget = 3600
    fit = fit_budget([CE, POINTWISE, SLOW], 20, 3, 5, 2, budget, min_epochs=3)
    assert [(d.backbone, d.loss) for d in fit.deferred] == []  # it fits at the minimum: kept
    fit = fit_budget([CE, POINTWISE, SLOW], 20, 3, 5, 2, 1800, min_epochs=3)
    assert [(d.backbone, d.loss) for d in fit.deferred] == [("tiger", "apao_pairwise")]
    assert fit.epochs >= 3 and fit.estimate_s <= 1800
    deferral = fit.deferred[0]
    assert deferral.needs_s == RAY_START_S + 30 + 3 * 720
    assert deferral.reason == ("deferred: needs ~36.7 min here (~12.0 min per epoch) for one trial of 3 epochs; run "
                               "--backbones tiger --losses apao_pairwise --budget 37m, or on a GPU")
    plan = Plan("office", "paper", "fp32", 2, [CE, POINTWISE, SLOW], 20, 3, fit, budget_s=1800)
    assert plan.num_trials == 1 + fit.trials_per_tuned + 2 * fit.added_seeds  # no trial of the deferred method
    data = plan.to_dict()
    rows = {m["loss"]: m for m in data["methods"]}
    assert rows["apao_pairwise"]["status"] == "deferred" and rows["apao_pairwise"]["trials"] == 0
    assert rows["apao_pairwise"]["reason"] == deferral.reason
    assert rows["ce"]["status"] == rows["apao_pointwise"]["status"] == "run"
    assert rows["ce"]["epochs"] == rows["apao_pointwise"]["epochs"] == fit.epochs  # equal epochs
    assert data["answers"].startswith(f"tiger/ce vs tiger/apao_pointwise at {fit.epochs} epochs each")
    assert data["answers"].endswith("tiger/apao_pairwise deferred")
    assert "tiger/apao_pairwise    deferred: needs ~36.7 min" in plan.text()
    assert f"answers: {data['answers']} (methods compared at equal epochs)" in plan.text()


def test_a_fitted_study_uses_both_slots_within_the_budget():
    for budget in (1200, 1800, 3600, 4800):  # the study as asked takes 10 + 2 x (30 + 40 x 60) = 4870 s
        fit = fit_budget([CE, POINTWISE], 40, 3, 5, 2, budget)
        assert 0.75 * budget <= fit.estimate_s <= budget, (budget, fit)
    for budget in (1800, 3600, 7200, 14400):  # with a method 12x slower: deferred or kept, never starving the rest
        fit = fit_budget([CE, POINTWISE, SLOW], 20, 3, 5, 2, budget)
        assert 0.75 * budget <= fit.estimate_s <= budget and fit.epochs >= 3, (budget, fit)
    # the slow method deferred, the others' asked study (4 epochs, 3 trials) takes 550 s of 2,000: the slot time
    # left goes to seeds first (the comparison's spread, up to 3 seeds), then to more Optuna trials
    fit = fit_budget([CE, POINTWISE, SLOW], 4, 3, 5, 2, 2000)
    assert [d.loss for d in fit.deferred] == ["apao_pairwise"]
    assert (fit.epochs, fit.added_seeds, fit.trials_per_tuned) == (4, 2, 9)
    trial = 30 + 4 * 60
    assert fit.estimate_s == RAY_START_S + 5 * trial + 2 * trial == 1900  # 10 search trials, then 2 x 2 repeats
    assert "seeds 1 -> 3 (time a slot would sit idle)" in fit.changes and "trials per tuned method 3 -> 9" in fit.changes
    plan = Plan("office", "paper", "fp32", 2, [CE, POINTWISE, SLOW], 4, 3, fit, budget_s=2000, search_seed=4)
    assert plan.run_repeat_seeds == (5, 6) and plan.to_dict()["seeds"] == [4, 5, 6]  # after the asked seed
    assert plan.num_trials == 1 + 9 + 2 * 2 and plan.to_dict()["estimate_s"] == 1900
    assert plan.answers() == ("tiger/ce vs tiger/apao_pointwise at 4 epochs each (ce 1 trial, apao_pointwise 9 trials; "
                              "best of each on 3 seeds); tiger/apao_pairwise deferred")


def test_a_budget_that_fits_everything_changes_nothing():
    asked = study_seconds([CE, POINTWISE, SLOW], 20, 3, 2)
    fit = fit_budget([CE, POINTWISE, SLOW], 20, 3, 5, 2, asked, effective_batch_size=1024, micro_batch=128)
    assert fit == Fit(20, 3, 5, asked)
    plan = Plan("office", "paper", "fp32", 2, [CE, POINTWISE, SLOW], 20, 3, fit, budget_s=asked)
    data = plan.to_dict()
    assert [m["status"] for m in data["methods"]] == ["run"] * 3 and data["budget_protocol"] is None
    assert data["effective_batch_size"] == 1024 and data["changes"] == [] and data["seeds"] == [0]
    assert "budget protocol" not in plan.text() and f"budget {format_duration(asked)}: the study fits" in plan.text()


def test_a_heavy_cut_switches_to_the_stated_budget_protocol():
    # 20 epochs asked, 5 fit: a 4x cut; at batch 1024 five epochs barely train: batch 256
    budget = 10 + 30 + 5 * 60
    fit = fit_budget([CE], 20, 1, 5, 1, budget, effective_batch_size=1024, micro_batch=128)
    assert (fit.epochs, fit.effective_batch_size) == (5, 256)
    assert "effective batch 1024 -> 256 (budget protocol, not the paper's" in " ".join(fit.changes)
    plan = Plan("office", "paper", "bf16", 1, [CE], 20, 1, fit, budget_s=budget)
    assert plan.to_dict()["effective_batch_size"] == 256
    assert plan.budget_protocol == "effective batch 1024 -> 256 at 5 of 20 epochs (a budget protocol, not the paper's)"
    assert plan.record()["budget_protocol"] == plan.budget_protocol  # what the parent run's tag keeps
    assert "budget protocol: effective batch 1024 -> 256" in plan.text()
    # a lighter cut keeps the asked batch; so does a micro-batch above 256 (a GPU's 1024), which no batch can go under
    assert fit_budget([CE], 20, 1, 5, 1, 10 + 30 + 6 * 60, effective_batch_size=1024,
                      micro_batch=128).effective_batch_size is None
    assert fit_budget([CE], 20, 1, 5, 1, budget, effective_batch_size=1024, micro_batch=1024).effective_batch_size is None
    assert fit_budget([CE], 20, 1, 5, 1, budget, effective_batch_size=256, micro_batch=128).effective_batch_size is None


def test_no_pruning_asked_stays_no_pruning_when_fitted():
    fit = fit_budget([CE, POINTWISE], 4, 2, 5, 1, study_seconds([CE, POINTWISE], 3, 2, 1))
    assert (fit.epochs, fit.asha_grace_period) == (3, 4)  # grace past the last epoch, as --quick asks
    assert asha_rungs(fit.asha_grace_period, fit.epochs) == []


def test_asha_rungs():
    assert asha_rungs(5, 20) == [5]
    assert asha_rungs(1, 20) == [1, 4, 16]
    assert asha_rungs(3, 2) == []
