"""Paired significance on synthetic per-user data with a known effect and with none."""
from __future__ import annotations

import numpy as np
import pytest

from apao_ray.analysis.stats import (Comparison, bootstrap_ci, holm, paired_comparison, pooled_comparison,
                                     wilcoxon_p, with_holm)


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


def test_pooled_over_seeds_averages_each_users_difference():
    rng = np.random.default_rng(4)
    baselines = [_hits(rng, 2000, 0.05) for _ in range(3)]
    methods = [_with_effect(rng, b, gained=0.02, lost=0.0) for b in baselines]
    pooled = pooled_comparison(methods, baselines, num_resamples=1000)
    assert pooled.mean_difference == pytest.approx(0.02, abs=1e-9) and pooled.num_users == 2000
    assert pooled.ci_low > 0 and pooled.p_value < 1e-6
    single = pooled_comparison(methods[:1], baselines[:1], num_resamples=1000)
    assert single == paired_comparison(methods[0], baselines[0], num_resamples=1000)


def test_text_and_holm_family():
    family = with_holm([Comparison(0.0041, 0.0012, 0.0070, 0.001, 100), Comparison(-0.001, -0.003, 0.001, 0.4, 100)],
                       "2 methods x 1 metric")
    # the family beside the p-value: the same comparison has another p_holm in a larger family
    assert family[0].text() == "+0.0041 [0.0012, 0.0070], p_holm = 0.002 (Holm over 2 comparisons: 2 methods x 1 metric)"
    assert family[1].p_holm == pytest.approx(0.4)
    assert Comparison(0.0041, 0.0012, 0.0070, 0.0001, 100).text() == "+0.0041 [0.0012, 0.0070], p = 1.0e-04"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="equal length"):
        paired_comparison(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="at least 2 users"):
        paired_comparison(np.zeros(1), np.zeros(1))
    with pytest.raises(ValueError, match="confidence=1.5"):
        bootstrap_ci(np.zeros(10), confidence=1.5)
