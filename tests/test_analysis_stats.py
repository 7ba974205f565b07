"""Paired significance on synthetic per-user data with a known effect and with none."""
from __future__ import annotations

import numpy as np
import pytest

from apao_ray.analysis.stats import (MAX_SEEDS_NEEDED, ONE_SEED, Comparison, bootstrap_ci, crossed_t, holm,
                                     paired_comparison, seeds_comparison, seeds_for_verdict, wilcoxon_p, with_holm)
from test_gpu_full_protocol import evidence_script


def _hits(rng: np.random.Generator, num_users: int, rate: float) -> np.ndarray:
    return (rng.random(num_users) < rate).astype(float)


def _with_effect(rng: np.random.Generator, baseline: np.ndarray, gained: float, lost: float) -> np.ndarray:
    """The baseline's per-user hits, with a share of misses turned into hits and of hits into misses."""
    method = baseline.copy()
    misses, hits = np.flatnonzero(baseline == 0), np.flatnonzero(baseline == 1)
    method[rng.choice(misses, int(gained * baseline.size), replace=False)] = 1
    method[rng.choice(hits, int(lost * baseline.size), replace=False)] = 0
    return method


def test_known_effect_is_found_with_a_ci_around_it():
    rng = np.random.default_rng(0)
    baseline = _hits(rng, 4000, 0.06)
    method = _with_effect(rng, baseline, gained=0.03, lost=0.01)  # true mean difference +0.02
    result = paired_comparison(method, baseline, num_resamples=2000)
    assert result.mean_difference == pytest.approx(0.02, abs=1e-9)
    assert 0 < result.ci_low < 0.02 < result.ci_high < 0.04
    assert result.p_value < 1e-6 and result.num_users == 4000


def test_no_effect_gives_a_ci_over_zero_and_a_large_p():
    rng = np.random.default_rng(1)
    baseline = _hits(rng, 4000, 0.06)
    method = _with_effect(rng, baseline, gained=0.02, lost=0.02)  # as many gained as lost: difference 0
    result = paired_comparison(method, baseline, num_resamples=2000)
    assert result.mean_difference == pytest.approx(0.0, abs=1e-9)
    assert result.ci_low < 0 < result.ci_high
    assert result.p_value > 0.5


def test_bootstrap_ci_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(2)
    covered = 0
    for trial in range(200):
        differences = rng.normal(0.01, 0.1, size=300)  # true mean 0.01
        low, high = bootstrap_ci(differences, num_resamples=500, seed=trial)
        covered += low <= 0.01 <= high
    assert 0.90 <= covered / 200 <= 0.99


def test_wilcoxon_false_positive_rate_under_no_effect():
    rng = np.random.default_rng(3)
    p_values = [wilcoxon_p(rng.normal(0, 1, 200)) for _ in range(400)]
    assert 0.02 <= np.mean(np.asarray(p_values) < 0.05) <= 0.09
    assert wilcoxon_p(np.zeros(50)) == 1.0  # identical users: no evidence at all


def test_holm_matches_hand_computed_values():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # capped at 1 (0.6 * 2, then monotone)
    assert holm([]) == []
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([1.5])


def test_seeds_that_disagree_give_an_interval_over_zero_wider_than_the_users_only_one():
    """The Office/TIGER pattern: each seed 'significant' on its own, in opposite directions."""
    rng = np.random.default_rng(4)
    baseline = _hits(rng, 4000, 0.06)
    methods = [_with_effect(rng, baseline, gained=g, lost=l) for g, l in ((0.03, 0.01), (0.01, 0.03), (0.02, 0.02))]
    per_seed = [paired_comparison(m, baseline, num_resamples=1000) for m in methods]
    assert per_seed[0].ci_low > 0 and per_seed[1].ci_high < 0  # seeds 0 and 1 each exclude 0, opposite ways
    users_only = paired_comparison(np.mean(methods, axis=0), baseline, num_resamples=1000)  # the old pooled CI
    over_seeds = seeds_comparison(methods, [baseline] * 3, num_resamples=1000)
    assert over_seeds.num_seeds == 3 and over_seeds.has_verdict
    assert over_seeds.mean_difference == pytest.approx(0.0, abs=1e-9)
    assert over_seeds.ci_low < 0 < over_seeds.ci_high and over_seeds.p_value > 0.5
    assert over_seeds.ci_high - over_seeds.ci_low > 3 * (users_only.ci_high - users_only.ci_low)
    assert over_seeds.seed_sd == pytest.approx(np.std([m.mean() - baseline.mean() for m in methods], ddof=1))


def test_identical_seeds_keep_the_seed_level_degrees_of_freedom():
    """Seeds that agree exactly still leave 2 degrees of freedom at 3 seeds: the users' standard error with the
    t quantile of 2 df, never the users-only interval with ~U df."""
    from scipy.stats import t as student_t

    rng = np.random.default_rng(5)
    baseline = _hits(rng, 4000, 0.06)
    method = _with_effect(rng, baseline, gained=0.03, lost=0.01)
    users_only = paired_comparison(method, baseline, num_resamples=4000)
    over_seeds = seeds_comparison([method] * 3, [baseline] * 3)
    difference = method - baseline
    error = difference.std(ddof=1) / np.sqrt(difference.size)
    assert over_seeds.mean_difference == pytest.approx(users_only.mean_difference)
    assert over_seeds.ci_high - over_seeds.ci_low == pytest.approx(2 * student_t.ppf(0.975, 2) * error)
    assert over_seeds.ci_high - over_seeds.ci_low > 2 * (users_only.ci_high - users_only.ci_low)
    assert over_seeds.p_value == pytest.approx(2 * student_t.sf(difference.mean() / error, 2))
    assert over_seeds.seed_sd == 0 and over_seeds.p_value > 1e-4


def test_one_seed_keeps_the_users_interval_labelled_and_prints_no_verdict():
    rng = np.random.default_rng(6)
    baseline = _hits(rng, 2000, 0.05)
    method = _with_effect(rng, baseline, gained=0.02, lost=0.0)
    single = seeds_comparison([method], [baseline], num_resamples=1000)
    assert single == paired_comparison(method, baseline, num_resamples=1000) and not single.has_verdict
    assert single.p_value < 1e-6  # recorded; still no verdict printed
    assert single.text() == f"{single.interval()} over test users, {ONE_SEED}" and "p" not in single.text().split(",")[0]
    assert "p =" not in single.text() and "p_holm" not in single.text()
    with pytest.raises(ValueError, match="1-seed comparison has no verdict"):
        with_holm([single])


@pytest.mark.parametrize("seed_sd", [0.0035, 0.0])
def test_interval_over_seeds_covers_a_zero_difference_at_2_3_and_5_seeds(seed_sd):
    """Office-shaped fabricated tables (benchmarks/evidence/interval_coverage.py), true difference 0, with the
    Office seed spread and with none: the report's interval covers 0 in >= 93% of 300 replicates at every seed
    count. An interval that drops the seed term when the seeds happen to agree covers ~87% at 2 seeds."""
    coverage = evidence_script("interval_coverage").coverage
    for num_seeds in (2, 3, 5):
        row = coverage(num_seeds, seed_sd, replicates=300)
        assert row["coverage"] >= 0.93, row


def test_seeds_for_verdict_follows_the_power_of_a_t_test():
    # at the Office/TIGER seed sd 0.0049, the paper's gap of ~0.0029 needs more than 20 seeds; a gap of one sd ~10
    assert 20 < seeds_for_verdict(0.0029, 0.0049) < 30
    assert 8 <= seeds_for_verdict(0.0049, 0.0049) <= 12
    assert seeds_for_verdict(0.01, 0.0049) < seeds_for_verdict(0.005, 0.0049)
    assert seeds_for_verdict(0.0, 0.0049) is None and seeds_for_verdict(0.001, 0.0) is None
    assert seeds_for_verdict(1e-6, 1.0) == MAX_SEEDS_NEEDED + 1
    text = Comparison(0.0024, 0.0013, 0.0035, 1e-4, 1000, seed_sd=0.0049, seeds_needed=34).text()
    assert text.endswith(f"{ONE_SEED}; a verdict needs ~34 seeds at seed sd 0.0049")


def test_text_and_holm_family():
    family = with_holm([Comparison(0.0041, 0.0012, 0.0070, 0.001, 100, num_seeds=3),
                        Comparison(-0.001, -0.003, 0.001, 0.4, 100, num_seeds=3)], "2 methods x 1 metric")
    # the family beside the p-value: the same comparison has another p_holm in a larger family
    assert family[0].text() == ("+0.0041 [0.0012, 0.0070] over seeds and users (3 seeds), p_holm = 0.002 (Holm over "
                                "2 comparisons: 2 methods x 1 metric)")
    assert family[1].p_holm == pytest.approx(0.4)
    assert Comparison(0.0041, 0.0012, 0.0070, 0.0001, 100, num_seeds=2).text() == (
        "+0.0041 [0.0012, 0.0070] over seeds and users (2 seeds), p = 1.0e-04")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="equal length"):
        paired_comparison(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="at least 2 users"):
        paired_comparison(np.zeros(1), np.zeros(1))
    with pytest.raises(ValueError, match="confidence=1.5"):
        bootstrap_ci(np.zeros(10), confidence=1.5)
    with pytest.raises(ValueError, match=r"seeds >= 2, users >= 2\) table, got shape \(1, 5\)"):
        crossed_t(np.zeros((1, 5)))
    assert crossed_t(np.full((3, 5), 0.01)) == (0.01, 0.01, 0.01, 0.0)  # every difference equal: no uncertainty
