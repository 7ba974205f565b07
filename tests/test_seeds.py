"""study/record/seeds.py and study/run/repeats.py without Ray: seeds grouped per method, mean/std, the significance
column (analysis.stats through analysis.results), cost sums, and the repeat trials' configs and tags."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from apao_ray.analysis.stats import crossed_t


def _record(run_id, loss, seed, val, test, status="FINISHED", repeats=None, cost=None, **knobs):
    tags = {"backbone": "tiger", "loss": loss, "apao.seed": str(seed)}
    if repeats:
        tags["apao.repeats"] = repeats
    metrics = {"best/val/ndcg_at_10": val, **({"test/ndcg_at_10": test, "test/recall_at_10": test * 2} if test else {}),
               **(cost or {})}
    params = {"base.train.seed": str(seed), "base.data.dataset": "synthetic", **{k: str(v) for k, v in knobs.items()}}
    return {"run_id": run_id, "status": status, "tags": tags, "params": params, "metrics": metrics}


def _study():
    """CE (a) on seeds 0, 1, 2; APAO-pointwise: the best search trial (b) repeated on 1 and 2, a weaker one
    (c) with a stray repeat, a repeat of b that failed."""
    return [_record("a", "ce", 0, 0.50, 0.40), _record("a1", "ce", 1, 0.40, 0.30, repeats="a"),
            _record("a2", "ce", 2, 0.45, 0.35, repeats="a"),
            _record("b", "apao_pointwise", 0, 0.60, 0.42, beta=0.3, eta=1e-4),
            _record("c", "apao_pointwise", 0, 0.55, 0.10, beta=0.1, eta=5e-4),
            _record("c1", "apao_pointwise", 1, 0.99, 0.90, repeats="c", beta=0.1, eta=5e-4),
            _record("b2", "apao_pointwise", 2, 0.58, 0.46, repeats="b", beta=0.3, eta=1e-4),
            _record("b1", "apao_pointwise", 1, 0.57, 0.44, repeats="b", beta=0.3, eta=1e-4),
            _record("b9", "apao_pointwise", 9, 0.0, None, status="FAILED", repeats="b", beta=0.3, eta=1e-4)]


def test_a_method_is_its_best_trial_and_that_trials_repeats_with_mean_and_sample_std():
    from apao_ray.study.record.seeds import RunSource, seed_columns, seed_methods

    methods = seed_methods(RunSource("s", _study()), ["b", "a"])
    assert [(m.loss, [t.run_id for t in m.trials]) for m in methods] == [("apao_pointwise", ["b", "b1", "b2"]),
                                                                         ("ce", ["a", "a1", "a2"])]
    columns = seed_columns(methods[0])
    assert columns["seeds"] == "0,1,2" and columns["n_seeds"] == 3
    assert columns["test/ndcg_at_10"] == pytest.approx(0.44)                        # (0.42 + 0.44 + 0.46) / 3
    assert columns["test/ndcg_at_10 std"] == pytest.approx(0.02)                    # sample std (ddof 1)
    assert columns["test/recall_at_10"] == pytest.approx(0.88)
    assert columns["test/ndcg_at_20"] is None and columns["test/ndcg_at_20 std"] is None
    single = seed_columns(seed_methods(RunSource("s", _study()[:1]), ["a"])[0])
    assert single["n_seeds"] == 1 and single["test/ndcg_at_10"] == 0.40 and single["test/ndcg_at_10 std"] is None


def test_the_report_picks_the_best_search_trial_not_a_repeat_and_keeps_its_repeats():
    from apao_ray.analysis.results import finished_trials

    class Export:  # the interface finished_trials reads
        name, trials = "s", _study()

    chosen = {t.run_id for t in finished_trials([Export()], "best")}
    assert chosen == {"a", "a1", "a2", "b", "b1", "b2"}  # c1 (val 0.99) repeats c: never a candidate


def _tables(seed: int, shift: float, users: int = 60):
    rng = np.random.default_rng(seed)
    base = rng.random(users)
    return base, np.clip(base + shift + rng.normal(0, 0.05, users), 0, None)


def test_the_significance_column_pools_seeds_per_user_and_holm_corrects_over_methods():
    from apao_ray.study.record.seeds import RunSource, significance_cells

    records, tables, arrays = [], {}, {}
    users = [f"u{i:03d}" for i in range(60)]
    for seed in (0, 1):
        ce, pointwise = _tables(seed, 0.05)
        _, pairwise = _tables(seed + 10, 0.0)
        pairwise = ce + (pairwise - _tables(seed + 10, 0.0)[0])  # same users, no real shift
        for loss, values in (("ce", ce), ("apao_pointwise", pointwise), ("apao_pairwise", pairwise)):
            run_id = f"{loss}-{seed}"
            repeats = None if seed == 0 else f"{loss}-0"
            records.append(_record(run_id, loss, seed, 0.5, float(values.mean()), repeats=repeats))
            frame = pd.DataFrame({"user": users, "rank": 1, "recall_at_10": values, "recall_at_20": values,
                                  "ndcg_at_10": values, "ndcg_at_20": values})
            tables[run_id] = frame.sample(frac=1, random_state=seed)  # rows in another order: aligned by user
            arrays[(loss, seed)] = values
    source = RunSource("s", records, tables=tables)
    from apao_ray.study.record.seeds import seed_methods

    methods = seed_methods(source, ["ce-0", "apao_pointwise-0", "apao_pairwise-0"])
    cells = significance_cells(methods, "ce", "ndcg_at_10", num_resamples=2000)
    assert cells[("tiger", "ce")] == "baseline"
    # expected, computed here: the seeds x users table of differences under the crossed model, Holm over 2 methods
    pooled = {loss: np.stack([arrays[(loss, s)] - arrays[("ce", s)] for s in (0, 1)])
              for loss in ("apao_pointwise", "apao_pairwise")}
    p = {loss: crossed_t(d)[3] for loss, d in pooled.items()}
    order = sorted(p, key=p.get)
    holm = {order[0]: min(1.0, 2 * p[order[0]])}
    holm[order[1]] = min(1.0, max(holm[order[0]], p[order[1]]))
    for loss, difference in pooled.items():
        cell = cells[("tiger", loss)]
        mean, interval, p_text = cell.split(" ", 1)[0], cell.split("[")[1].split("]")[0], cell.split("p_holm = ")[1].split(" ")[0]
        assert cell.endswith("(Holm over 2 comparisons: 2 methods x 1 metric (ndcg_at_10) vs ce, synthetic, >= 2 seeds "
                             "each)"), cell
        assert float(mean) == pytest.approx(difference.mean(), abs=5e-5)
        low, high = (float(x) for x in interval.split(", "))
        assert low < difference.mean() < high
        assert float(p_text) == pytest.approx(holm[loss], rel=0.01, abs=1e-6)
    assert cells[("tiger", "apao_pointwise")].startswith("+0.05")  # a real shift of +0.05
    # two seeds leave 1 degree of freedom: a real +0.05 with seed means ~0.01 apart stands out from the method with
    # no shift but is not significant at 2 seeds (t quantile 12.7)
    p_holm = {loss: float(cells[("tiger", loss)].split("p_holm = ")[1].split(" ")[0]) for loss in pooled}
    assert 0.05 < p_holm["apao_pointwise"] < 0.2 < p_holm["apao_pairwise"], p_holm


def test_a_method_without_per_user_tables_or_baseline_says_why():
    from apao_ray.study.record.seeds import RunSource, seed_methods, significance_cells

    methods = seed_methods(RunSource("s", _study()), ["a", "b"])
    cells = significance_cells(methods, "ce", "ndcg_at_10", num_resamples=200)
    assert cells[("tiger", "apao_pointwise")] == "- (seeds [0, 1, 2]: no paired per-user tables)"
    cells = significance_cells(methods, "dpo", "ndcg_at_10", num_resamples=200)
    assert cells[("tiger", "ce")] == "- (no dpo trial to compare with)"


def test_cost_is_summed_over_every_trial_of_a_method_and_peak_memory_is_the_largest():
    from apao_ray.analysis.export import cost_totals

    records = [_record("a", "ce", 0, 0.5, 0.4, cost={"cost/wall_seconds": 10.0, "cost/peak_rss_mb": 300.0}),
               _record("a1", "ce", 1, 0.5, 0.4, repeats="a", cost={"cost/wall_seconds": 5.0, "cost/peak_rss_mb": 500.0}),
               _record("x", "apao_pointwise", 0, 0.1, None, status="FAILED", cost={"cost/cpu_seconds": 7.0})]
    assert cost_totals(records) == {("tiger", "ce"): {"cost/wall_seconds": 15.0, "cost/peak_rss_mb": 500.0},
                                    ("tiger", "apao_pointwise"): {"cost/cpu_seconds": 7.0}}


def test_repeat_configs_read_back_as_the_searched_choices_and_tag_their_seed_and_origin():
    from apao_ray.config import TrialConfig
    from apao_ray.study.record.outcomes import seed_tags
    from apao_ray.study.run.repeats import repeat_configs
    from apao_ray.study.spec.space import trial_choices, trial_config

    best = [{"backbone": "tiger", "loss": "ce", "beta": None, "eta": None, "num_negatives": None, "run_id": "a"},
            {"backbone": "tiger", "loss": "apao_pairwise", "beta": 0.2, "eta": 3e-5, "num_negatives": 17, "run_id": "b"}]
    configs = repeat_configs(best, (1, 2))
    assert len(configs) == 4 and [c["seed"] for c in configs] == [1, 2, 1, 2]
    assert trial_choices(configs[3]) == {"backbone": "tiger", "loss": "apao_pairwise", "beta": 0.2, "eta": 3e-5,
                                         "num_negatives": 17}
    base = TrialConfig.from_dict({"train": {"seed": 0, "epochs": 3}, "data": {"dataset": "synthetic"}})
    repeat = trial_config(base, configs[3])
    assert (repeat.train.seed, repeat.train.epochs, repeat.loss.name, repeat.loss.num_negatives) == (2, 3, "apao_pairwise", 17)
    assert seed_tags(configs[3], repeat.train.seed) == {"apao.seed": "2", "apao.repeats": "b"}
    member = {**configs[3], "cohort": "repeat0", "cohort_member": 2, "cohort_size": 3}
    assert seed_tags(member, 2) == {"apao.seed": "2", "apao.repeats": "b", "apao.cohort": "repeat0: member 2 of 3"}
    assert seed_tags({**configs[3], "cohort": None, "cohort_member": None}, 2) == seed_tags(configs[3], 2)  # alone
    search = {"backbone": "tiger", "loss": "ce"}
    assert trial_config(base, search).train.seed == 0 and seed_tags(search, 0) == {"apao.seed": "0"}


def test_the_best_trial_rule_breaks_ties_by_start_time_and_skips_trials_without_a_value():
    from apao_ray.analysis.outcome import best_of

    trials = [("late", 0.5, 30), ("early", 0.5, 10), ("worse", 0.4, 0), ("untested", None, 5)]
    for order in (trials, trials[::-1]):
        assert best_of(order, lambda t: t[1], lambda t: t[2])[0] == "early"
    assert best_of([("untested", None, 5)], lambda t: t[1], lambda t: t[2]) is None
    assert best_of([], lambda t: t[1], lambda t: t[2]) is None
