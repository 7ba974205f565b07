"""study/plan/plan.py: the plan's cost estimates, its text and warnings, and the order its trials start in (no
training; the fitting arithmetic: test_budget.py; the probe and its cache: test_probe.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from apao_ray.study.plan.budget import RAY_START_S, fit_budget, study_seconds
from apao_ray.config import LossConfig, TrialConfig
from apao_ray.study.plan.make import cost_summary
from apao_ray.study.plan.plan import Plan
from apao_ray.study.plan.probe_cache import probe_key

from test_budget import CE, POINTWISE


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


def test_the_plan_warns_when_its_peak_memory_nears_the_machines():
    fit = fit_budget([CE, POINTWISE], 20, 3, 5, 2, None)  # 2 at a time: 2 GiB + 2 GiB at peak
    assert "warning" not in Plan("office", "paper", "fp32", 2, [CE, POINTWISE], 20, 3, fit, machine_bytes=8 * 2**30).text()
    assert "warning" not in Plan("office", "paper", "fp32", 2, [CE, POINTWISE], 20, 3, fit).text()  # a cluster
    text = Plan("office", "paper", "fp32", 2, [CE, POINTWISE], 20, 3, fit, machine_bytes=4 * 2**30).text()
    assert "warning: ~4.0 GiB at peak is over 80% of this machine's 4.0 GiB; Ray's memory monitor kills workers at " \
           "95%: lower --max-concurrent" in text


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
