"""study/plan/plan.py: budget parsing and fitting arithmetic, the plan's text and the order its trials start in
(no training; the probe and its cache: test_probe.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from apao_ray.study.plan.budget import RAY_START_S, Fit, MethodCost, asha_rungs, fit_budget, makespan, study_seconds
from apao_ray.study.spec.duration import format_duration, parse_duration
from apao_ray.config import LossConfig, TrialConfig
from apao_ray.study.plan.make import cost_summary
from apao_ray.study.plan.plan import Plan
from apao_ray.study.plan.probe_cache import probe_key

CE = MethodCost("tiger", "ce", True, epoch_s=60.0, fixed_s=30.0, peak_bytes=2**30)
POINTWISE = MethodCost("tiger", "apao_pointwise", False, epoch_s=60.0, fixed_s=30.0, peak_bytes=2 * 2**30)


@pytest.mark.parametrize("text, seconds", [("90m", 5400), ("3h", 10800), ("1h30m", 5400), ("45s", 45), ("5400", 5400),
                                           ("1.5h", 5400), ("2h0m30s", 7230), (" 10M ", 600), (120, 120)])
def test_durations_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "3x", "h", "1m30h", "-5", "0", "0m", "inf", "nan", "3 hours"])
def test_bad_durations_are_named(text):
    with pytest.raises(ValueError, match=f"budget {text!r} (is not a duration|must be a duration > 0)"):
        parse_duration(text)


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


def test_the_plan_estimates_each_methods_cost_and_the_summary_sets_it_beside_the_actual():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 1, None, num_repeats=1)
    plan = Plan("office", "paper", "fp32", 1, [CE, POINTWISE], 20, 3, fit, repeat_seeds=(1,), threads=2)
    assert plan.num_trials == 6
    trial = 30 + 20 * 60
    assert plan.cost_estimates() == {
        ("tiger", "ce"): {"cost/wall_seconds": 2 * trial, "cost/cpu_seconds": 4 * trial, "cost/peak_rss_mb": 1024},
        ("tiger", "apao_pointwise"): {"cost/wall_seconds": 4 * trial, "cost/cpu_seconds": 8 * trial,
                                      "cost/peak_rss_mb": 2048}}
    text = plan.text()
    assert "then the best configuration of each method again on seeds [1]: 2 trials of 20 epochs\n" in text
    fused = Plan("office", "paper", "fp32", 1, [CE, POINTWISE], 20, 3, fit, repeat_seeds=(1,), threads=2,
                 cohort_size=4)
    assert ("seeds [1]: 2 trials of 20 epochs, as fused cohorts of up to 4 trials of one backbone" in fused.text()
            and fused.record()["cohort_size"] == 4 and plan.record()["cohort_size"] == 1)
    assert "tiger/ce" in text and f"all its trials ~41.0 min wall, ~1h22m CPU  (baseline" in text
    summary = cost_summary(plan, {("tiger", "ce"): {"cost/wall_seconds": 1200.0, "cost/cpu_seconds": 600.0,
                                                    "cost/peak_rss_mb": 900.0, "cost/energy_kwh": 0.0123}})
    lines = {line.split()[0]: line for line in summary.splitlines()[2:]}
    assert lines["tiger/ce"].split() == ["tiger/ce", "41.0", "/", "20.0", "82.0", "/", "10.0", "1024", "/", "900",
                                         "-", "/", "0.0123"]
    assert lines["tiger/apao_pointwise"].split()[1:4] == ["82.0", "/", "-"]  # estimated, nothing ran


def test_the_plan_says_when_no_repeat_trial_can_join_a_cohort():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 1, None, num_repeats=1)
    lone = Plan("office", "paper", "fp32", 1, [CE], 20, 3, fit, repeat_seeds=(1,), threads=2, cohort_size=4)
    assert lone.cohorts_apart() == "one repeat trial per backbone forms no cohort"
    assert "seeds [1]: 1 trial of 20 epochs, each alone (one repeat trial per backbone forms no cohort)" in lone.text()
    two_seeds = replace(lone, repeat_seeds=(1, 2))  # two trials of one backbone: a cohort
    assert two_seeds.cohorts_apart() is None and "2 trials of 20 epochs, as fused cohorts of up to 4" in two_seeds.text()
    staged = replace(two_seeds, base=TrialConfig(loss=LossConfig(name="dpo", pretrain_ce_epochs=2)))
    assert "each alone (a two-stage loss's CE stage keeps its trials apart)" in staged.text()


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


def test_the_plan_warns_when_its_peak_memory_nears_the_machines():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 2, None)  # 2 at a time: 2 GiB + 2 GiB at peak
    assert "warning" not in Plan("office", "paper", "fp32", 2, [CE, POINTWISE], 20, 3, fit, machine_bytes=8 * 2**30).text()
    assert "warning" not in Plan("office", "paper", "fp32", 2, [CE, POINTWISE], 20, 3, fit).text()  # a cluster
    text = Plan("office", "paper", "fp32", 2, [CE, POINTWISE], 20, 3, fit, machine_bytes=4 * 2**30).text()
    assert "warning: ~4.0 GiB at peak is over 80% of this machine's 4.0 GiB; Ray's memory monitor kills workers at " \
           "95%: lower --max-concurrent" in text


def test_no_pruning_asked_stays_no_pruning_when_fitted():
    fit = fit_budget([CE, POINTWISE], 4, 2, 5, 1, study_seconds([CE, POINTWISE], 3, 2, 1))
    assert (fit.epochs, fit.asha_grace_period) == (3, 4)  # grace past the last epoch, as --quick asks
    assert asha_rungs(fit.asha_grace_period, fit.epochs) == []


def test_asha_rungs():
    assert asha_rungs(5, 20) == [5]
    assert asha_rungs(1, 20) == [1, 4, 16]
    assert asha_rungs(3, 2) == []


def test_plan_text_names_methods_costs_and_the_fit():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 1, 3000)
    plan = Plan("office", "paper", "fp32", 1, [CE, POINTWISE], 20, 3, fit, budget_s=3000)
    text = plan.text()
    assert plan.num_trials == 4 and plan.peak_bytes == 2 * 2**30
    assert "plan: 4 trials on office, protocol paper, precision fp32, 1 at a time" in text
    named = Plan("office", "paper", "fp32", 1, [CE, POINTWISE], 20, 3, fit, allocator="tcmalloc").text()
    assert "plan: 4 trials on office, protocol paper, precision fp32, allocator tcmalloc, 1 at a time" in named
    single = Plan("office", "paper", "bf16", 1, [CE], 4, 1, fit_budget([CE], 4, 1, 4, 1, None), threads=2).text()
    assert single.startswith("plan: 1 trial on office, protocol paper, precision bf16, 1 at a time, 2 threads each")
    assert "tiger/ce" in text and "1 trial " in text and "3 trials  11 epochs  epoch ~1.0 min  trial ~11.5 min" in text
    assert "budget 50.0 min: the study as asked (~1h22m) exceeds it; fitted: epochs 20 -> 11, ASHA grace period " \
           "5 -> 2 (~46.2 min)" in text
    assert "ASHA compares each tuned method's trials at epochs [2, 8]" in text


def test_the_slowest_methods_trials_start_first_with_their_paper_points():
    from apao_ray.study.spec.space import SearchSpec, param_name

    asked = SearchSpec(("tiger",), ("ce", "apao_pointwise", "apao_pairwise"), trials_per_tuned=2)
    assert [a[1] for a in asked.allocation()] == ["ce", "apao_pointwise", "apao_pairwise", "apao_pointwise",
                                                  "apao_pairwise"]  # as given, baselines first
    spec = SearchSpec(("tiger",), ("ce", "apao_pointwise", "apao_pairwise"), trials_per_tuned=2,
                      first=(("tiger", "apao_pairwise"), ("tiger", "ce"), ("tiger", "apao_pointwise")))
    assert spec.allocation() == [("tiger", "apao_pairwise", True), ("tiger", "ce", False),
                                 ("tiger", "apao_pointwise", True), ("tiger", "apao_pairwise", False),
                                 ("tiger", "apao_pointwise", False)]
    points = spec.points_to_evaluate()  # one per trial number of the first round, each its method's
    assert [sorted(p) for p in points] == [sorted(param_name("tiger", "apao_pairwise", k) for k in
                                                  ("beta", "eta", "num_negatives")), [],
                                           sorted(param_name("tiger", "apao_pointwise", k) for k in ("beta", "eta"))]
    # without the paper points, the empty points still hold the trial numbers up to the baseline's
    assert spec.points_to_evaluate(enqueue_paper_setting=False) == [{}, {}]


def test_the_plan_orders_methods_slowest_first_and_slows_probes_of_trials_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("APAO_PROBE_CACHE", str(tmp_path / "probes.json"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    import apao_ray
    from apao_ray.study.plan.make import make_plan, trial_threads
    from apao_ray.study.plan.plan import method_config
    from apao_ray.study.plan.probe_cache import SIDE_BY_SIDE_SLOWDOWN

    def spec(max_concurrent):
        return apao_ray.StudySpec.quick(losses=("ce", "apao_pointwise"), num_samples=1, epochs=2,
                                        max_concurrent=max_concurrent, cpus_per_trial=1,  # one probe for both
                                        output_dir=str(tmp_path / "runs"))

    setups = {slots: apao_ray.prepare(spec(slots)) for slots in (1, 2)}
    base, threads = setups[1].base, trial_threads(setups[1].cpus_per_trial)
    rates = {"ce": 1 / 100, "apao_pointwise": 1 / 10}  # the tuned method is the slow one
    (tmp_path / "probes.json").write_text(json.dumps({probe_key(method_config(base, "tiger", loss), threads): {
        "train_s_per_sample": rate, "eval_s_per_user": 0.001, "peak_bytes": 2**30, "precision": "fp32", "threads":
        threads, "device": "cpu", "timed_samples": 1024} for loss, rate in rates.items()}))
    alone, side_by_side = make_plan(spec(1), setups[1], slots=1), make_plan(spec(2), setups[2], slots=2)
    assert alone.probes_cached == side_by_side.probes_cached == 2
    assert alone.start_order == side_by_side.start_order == (("tiger", "apao_pointwise"), ("tiger", "ce"))
    assert "trials start slowest method first: tiger/apao_pointwise, tiger/ce" in side_by_side.text()
    for one, two in zip(alone.methods, side_by_side.methods):
        assert two.epoch_s == pytest.approx(SIDE_BY_SIDE_SLOWDOWN * one.epoch_s)
    assert alone.side_by_side == 1.0 and f"probed rates x{SIDE_BY_SIDE_SLOWDOWN:g}" in side_by_side.text()
    # a one-trial study runs alone whatever the slots: no side-by-side slowdown, one trial's memory
    one_trial = apao_ray.StudySpec.quick(losses=("ce",), num_samples=1, epochs=2, max_concurrent=2, cpus_per_trial=1,
                                         output_dir=str(tmp_path / "runs"))
    lone = make_plan(one_trial, apao_ray.prepare(one_trial), slots=2)
    assert lone.slots == 1 and lone.side_by_side == 1.0 and "probed rates x" not in lone.text()
    ce_alone = next(m for m in alone.methods if m.loss == "ce")
    assert lone.methods[0].epoch_s == pytest.approx(ce_alone.epoch_s) and "(1 trial at once)" in lone.text()
    # the study runs that order: the plan's searcher allocates the slow method's trial first
    assert [a[1] for a in side_by_side.search.allocation()] == ["apao_pointwise", "ce"]


def test_a_method_whose_knobs_are_all_fixed_runs_once_and_the_plan_says_where_each_methods_knobs_come_from():
    """Fixed ranges leave a method nothing to search: one trial (not --num-samples copies of one setting),
    counted once in the estimate; every tuned method's line names its knobs' source and values."""
    from apao_ray.study.spec.space import SearchSpec

    fixed = SearchSpec(("tiger",), ("ce", "apao_pointwise", "apao_pairwise"), trials_per_tuned=3,
                       knob_ranges={"beta": (0.3, 0.3), "eta": (1e-4, 1e-4)}, dataset="grocery")
    # pairwise still searches its negatives and takes its turns; pointwise has nothing left to search
    assert [a[1] for a in fixed.allocation()] == ["ce", "apao_pointwise", "apao_pairwise", "apao_pairwise",
                                                  "apao_pairwise"]
    pointwise, pairwise = replace(POINTWISE, fixed=True), replace(POINTWISE, loss="apao_pairwise")
    assert study_seconds([CE, pointwise], 20, 3, 1) == RAY_START_S + 2 * (30 + 20 * 60)
    fit = fit_budget([CE, pointwise, pairwise], 20, 3, 5, 1, 10**9)
    plan = Plan("grocery", "paper", "fp32", 1, [CE, pointwise, pairwise], 20, 3, fit, search=fixed)
    lines = plan.text().splitlines()
    assert plan.num_trials == 5 and lines[0].startswith("plan: 5 trials on grocery")
    assert lines[2].startswith("  tiger/apao_pointwise   1 trial ")
    assert lines[2].endswith("(knobs fixed: beta 0.3, eta 0.0001; one trial, --seeds repeats it)")
    negatives = fixed.paper_knobs("tiger", "apao_pairwise")["num_negatives"]
    assert lines[3].endswith(f"(first trial the paper's Grocery setting, beta 0.3, eta 0.0001, num_negatives "
                             f"{negatives:g}; then Optuna TPE + ASHA)")
    # one trial of a searched method is its paper setting alone (Grocery's Table 5 for TIGER: 0.1, 5e-5)
    one = SearchSpec(("tiger",), ("ce", "apao_pointwise"), trials_per_tuned=1, dataset="grocery")
    alone = Plan("grocery", "paper", "fp32", 1, [CE, POINTWISE], 20, 1, fit_budget([CE, POINTWISE], 20, 1, 5, 1, 10**9),
                 search=one)
    assert alone.text().splitlines()[2].endswith("(the paper's Grocery setting, beta 0.1, eta 5e-05: 1 trial, no search)")
    assert alone.to_dict()["methods"][1]["reason"] == "the paper's Grocery setting, beta 0.1, eta 5e-05: 1 trial, no search"
    unpaired = replace(alone, paper_setting_first=False, search=replace(one, dataset="mydata"))
    assert unpaired.text().splitlines()[2].endswith("(Optuna TPE + ASHA, no paper setting enqueued)")
    assert replace(alone, dataset="mydata", search=replace(one, dataset="mydata")).text().splitlines()[2].endswith(
        "(the paper's Office setting (none for mydata), beta 0.3, eta 0.0001: 1 trial, no search)")
