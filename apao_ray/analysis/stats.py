"""Paired significance between two methods on the same test users (issue #18 item 2).

Each method's finished trial logs one row per test user (``per_user_test.csv.gz``). Two methods
trained on the same split are compared user by user: the mean of the per-user differences, a
percentile bootstrap CI of that mean (users resampled with replacement), and a Wilcoxon
signed-rank p-value (scipy). A study compares every method with one baseline, so the p-values of
one family are Holm-corrected (step-down, controls the family-wise error rate).

Over seeds, each seed is one paired comparison on its own, and the seeds are pooled by first
averaging every user's difference over the seeds (the user stays the independent unit: the same
users are tested under every seed, so stacking seeds as extra "users" would overstate n).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_CONFIDENCE = 0.95


@dataclass(frozen=True)
class Comparison:
    """One paired comparison ``method - baseline`` on ``num_users`` users.

    Attributes:
        mean_difference: mean over users of (method - baseline).
        ci_low, ci_high: percentile bootstrap CI of that mean.
        p_value: two-sided Wilcoxon signed-rank p (1.0 when every difference is 0).
        p_holm: ``p_value`` after Holm's correction in its family (= p_value until corrected).
        num_users: paired users.
        holm_family: the family ``p_holm`` corrects over, e.g. ``3 comparisons: 3 methods x 1 metric``:
            printed beside it, as one comparison gets different p_holm in families of different sizes.
    """

    mean_difference: float
    ci_low: float
    ci_high: float
    p_value: float
    num_users: int
    p_holm: float | None = None
    holm_family: str = ""

    def text(self) -> str:
        """``+0.0041 [0.0012, 0.0070], p_holm = 0.003 (Holm over 3 comparisons: ...)`` (``p = ...`` before the
        correction)."""
        head = f"{self.mean_difference:+.4f} [{self.ci_low:.4f}, {self.ci_high:.4f}]"
        if self.p_holm is None:
            return f"{head}, p = {_p_text(self.p_value)}"
        return f"{head}, p_holm = {_p_text(self.p_holm)} (Holm over {self.holm_family or 'its family'})"


def _p_text(p: float) -> str:
    return f"{p:.1e}" if p < 0.001 else f"{p:.3f}"


def _paired(method: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    method, baseline = np.asarray(method, dtype=float), np.asarray(baseline, dtype=float)
    if method.ndim != 1 or method.shape != baseline.shape:
        raise ValueError(f"paired values need two 1-D arrays of equal length, got shapes {method.shape} "
                         f"and {baseline.shape}")
    if method.size < 2:
        raise ValueError(f"a paired comparison needs at least 2 users, got {method.size}")
    if not (np.isfinite(method).all() and np.isfinite(baseline).all()):
        raise ValueError("paired values must be finite (a NaN or inf per-user metric)")
    return method - baseline


def bootstrap_ci(differences: np.ndarray, num_resamples: int = DEFAULT_RESAMPLES,
                 confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of per-user differences (users resampled with replacement).

    Args:
        differences: (U,) per-user differences.
        num_resamples: bootstrap resamples (>= 100).
        confidence: in (0, 1).
        seed: resampling seed (the CI is reproducible).

    Returns:
        (low, high).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    if num_resamples < 100:
        raise ValueError(f"num_resamples={num_resamples} must be >= 100")
    differences = np.asarray(differences, dtype=float)
    rng = np.random.default_rng(seed)
    means = np.empty(num_resamples)
    chunk = max(1, 4_000_000 // max(differences.size, 1))  # bounded memory: (chunk, U) indices at a time
    for start in range(0, num_resamples, chunk):
        stop = min(num_resamples, start + chunk)
        means[start:stop] = differences[rng.integers(0, differences.size, size=(stop - start, differences.size))].mean(1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def wilcoxon_p(differences: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of per-user differences (zeros dropped, Wilcoxon's
    convention: most users tie at 0 for a top-K hit); 1.0 when no difference is non-zero."""
    from scipy.stats import wilcoxon  # lazy: scipy.stats, only when a p-value is computed

    differences = np.asarray(differences, dtype=float)
    if not np.any(differences != 0):
        return 1.0
    return float(wilcoxon(differences, zero_method="wilcox", alternative="two-sided").pvalue)


def paired_comparison(method: np.ndarray, baseline: np.ndarray, num_resamples: int = DEFAULT_RESAMPLES,
                      confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Comparison:
    """``method - baseline`` on the same users (arrays aligned by user): mean, bootstrap CI, Wilcoxon p."""
    differences = _paired(method, baseline)
    low, high = bootstrap_ci(differences, num_resamples, confidence, seed)
    return Comparison(float(differences.mean()), low, high, wilcoxon_p(differences), int(differences.size))


def pooled_comparison(methods: list[np.ndarray], baselines: list[np.ndarray],
                      num_resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                      seed: int = 0) -> Comparison:
    """Seeds pooled: each user's difference averaged over the seeds (every array aligned on the same
    users), then compared like one seed. With one seed it equals :func:`paired_comparison`."""
    if not methods or len(methods) != len(baselines):
        raise ValueError(f"pooling needs one baseline per method seed, got {len(methods)} and {len(baselines)}")
    differences = np.mean([_paired(m, b) for m, b in zip(methods, baselines)], axis=0)
    low, high = bootstrap_ci(differences, num_resamples, confidence, seed)
    return Comparison(float(differences.mean()), low, high, wilcoxon_p(differences), int(differences.size))


def holm(p_values: list[float]) -> list[float]:
    """Holm step-down adjusted p-values (same order as given): the smallest p times n, the next
    times n-1, ..., made monotone and capped at 1."""
    p = np.asarray(p_values, dtype=float)
    if p.size and (np.isnan(p).any() or (p < 0).any() or (p > 1).any()):
        raise ValueError(f"p-values must be in [0, 1], got {p_values}")
    order = np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate(p[order] * (p.size - np.arange(p.size)))
    result = np.empty_like(p)
    result[order] = np.minimum(adjusted, 1.0)
    return result.tolist()


def with_holm(comparisons: list[Comparison], family: str = "") -> list[Comparison]:
    """The comparisons of one family with ``p_holm`` filled in; ``family`` says what they are
    (``3 methods x 1 metric``), recorded as ``holm_family`` with their count."""
    size = f"{len(comparisons)} comparison{'s' if len(comparisons) != 1 else ''}"
    named = f"{size}: {family}" if family else size
    return [replace(c, p_holm=p, holm_family=named) for c, p in zip(comparisons, holm([c.p_value for c in comparisons]))]
