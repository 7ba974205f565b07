"""Paired comparisons of two methods on the same test users, and across training seeds.

Each method's finished trial logs one row per test user (``per_user_test.csv.gz``). Within one seed, two
methods trained on the same split are compared user by user: the mean of the per-user differences and a
percentile bootstrap CI of that mean (users resampled with replacement). That interval holds the two trained
models fixed: it says how sure we are about *these* models on other users, not about the methods, since
another training seed gives other models. So a one-seed comparison is printed with its CI labelled
``1 seed: training variance not measured`` and no significance verdict.

With two or more seeds, the differences form a seeds x users table ``D[s, u]`` (every seed tests the same users),
read under a crossed random-effects model, ``D[s, u] = mu + a_s + b_u + e_su``: the seed effect ``a_s`` is training
randomness, the user effect ``b_u`` the test users' sampling. Inference is at the seed level: the variance of the
grand mean is the variance of the per-seed mean differences over ``S`` (the seed mean square, never dropped) plus
the users' shared term where the users differ beyond the residual, and the CI and the p-value of ``mu = 0`` use
Student's t with ``S - 1`` degrees of freedom (2 with 3 seeds) whatever the sample variances do. An estimator that
cuts the seed variance at 0 when the seeds happen to agree jumps to ~U degrees of freedom and the users-only
interval, and covers a true 0 in 87-89% of fabricated Office-shaped runs at 2 seeds; this one covers 95-99% at 2, 3
and 5 seeds (benchmarks/evidence/interval_coverage.py, docs/results.md). The price is width: with 2 seeds the t
quantile is 12.7. Why not a bootstrap over seeds: with the 2-5 seeds a study has, resampling seeds only reshuffles
the observed ones (3 seeds: 10 distinct resamples), underestimates their variance by (S-1)/S and can never reach
past the most extreme seed.

Holm's correction runs over one family, defined once (:data:`HOLM_FAMILY`): every method compared with the
baseline on one metric of one dataset, at the seed level (comparisons with at least 2 seeds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_CONFIDENCE = 0.95
# the power a "seeds needed for a verdict" figure is computed for (two-sided test at 1 - DEFAULT_CONFIDENCE)
VERDICT_POWER = 0.8
MAX_SEEDS_NEEDED = 1000
HOLM_FAMILY = "every method vs the baseline on one metric of one dataset, comparisons over >= 2 seeds"
ONE_SEED = "1 seed: training variance not measured"
# what every printed difference is, for the surfaces that print one (report, grid, the study's table)
INTERVALS_NOTE = ("With >= 2 seeds: mean difference per test user, 95% CI and p-value at the seed level (the spread "
                  "of the per-seed mean differences plus the users' shared term, Student's t with seeds - 1 df), so "
                  "the interval counts training randomness even where the seeds happen to agree; "
                  f"Holm-corrected over {HOLM_FAMILY}. With 1 seed: the 95% percentile bootstrap CI over test users "
                  "only, which describes the two trained models and not the methods: no p-value, no verdict.")


@dataclass(frozen=True)
class Comparison:
    """One paired comparison ``method - baseline`` on ``num_users`` users and ``num_seeds`` seeds.

    Attributes:
        mean_difference: mean over seeds and users of (method - baseline).
        ci_low, ci_high: with 1 seed, the percentile bootstrap CI over users; with more, the CI of the
            seed-level interval of the crossed seeds x users
            model (module docstring).
        p_value: 1 seed: two-sided Wilcoxon signed-rank p over users (recorded, not printed: no verdict
            from one seed); more: the model's two-sided t p-value. 1.0 when every difference is 0.
        num_users: paired users.
        num_seeds: seeds both methods have.
        p_holm: ``p_value`` after Holm's correction in its family (None until corrected; never for 1 seed).
        holm_family: what ``p_holm`` corrects over, e.g. ``3 comparisons: ...``: printed beside it.
        seed_sd: with >= 2 seeds, the sample sd of the per-seed mean differences (the spread a seed adds).
        seeds_needed: with 1 seed, how many seeds a verdict needs at ``seed_sd`` measured by another study of
            the same cell (``VERDICT_POWER`` to detect this difference), when one did; ``MAX_SEEDS_NEEDED + 1``
            means more than that.
    """

    mean_difference: float
    ci_low: float
    ci_high: float
    p_value: float
    num_users: int
    num_seeds: int = 1
    p_holm: float | None = None
    holm_family: str = ""
    seed_sd: float | None = None
    seeds_needed: int | None = None

    def interval(self) -> str:
        """``+0.0041 [0.0012, 0.0070]``: the difference and its CI alone, where the heading says what they cover."""
        return f"{self.mean_difference:+.4f} [{self.ci_low:.4f}, {self.ci_high:.4f}]"

    @property
    def has_verdict(self) -> bool:
        """Whether a significance verdict may be printed: only where training variance was measured."""
        return self.num_seeds >= 2

    def text(self) -> str:
        """``+0.0041 [0.0012, 0.0070] over seeds and users (3 seeds), p_holm = 0.003 (Holm over ...)`` with
        >= 2 seeds; ``+0.0041 [0.0012, 0.0070] over test users, 1 seed: training variance not measured`` with one
        (and ``; a verdict needs ~N seeds at seed sd X`` where another study measured the spread)."""
        head = self.interval()
        if not self.has_verdict:
            text = f"{head} over test users, {ONE_SEED}"
            if self.seeds_needed is not None and self.seed_sd is not None:
                count = f"> {MAX_SEEDS_NEEDED}" if self.seeds_needed > MAX_SEEDS_NEEDED else f"~{self.seeds_needed}"
                text += f"; a verdict needs {count} seeds at seed sd {self.seed_sd:.4f}"
            return text
        head = f"{head} over seeds and users ({self.num_seeds} seeds)"
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


def seeds_comparison(methods: list[np.ndarray], baselines: list[np.ndarray],
                     num_resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                     seed: int = 0) -> Comparison:
    """``method - baseline`` over seeds: one (method, baseline) pair of per-user arrays per seed, every array
    aligned on the same users. One seed: :func:`paired_comparison` (users only, no verdict). Two or more: the
    seed-level t CI and p-value of the crossed seeds x users table (module docstring)."""
    if not methods or len(methods) != len(baselines):
        raise ValueError(f"a comparison over seeds needs one baseline per method seed, got {len(methods)} and "
                         f"{len(baselines)}")
    if len(methods) == 1:
        return paired_comparison(methods[0], baselines[0], num_resamples, confidence, seed)
    differences = np.stack([_paired(m, b) for m, b in zip(methods, baselines)])  # (S, U)
    mean, low, high, p_value = crossed_t(differences, confidence)
    return Comparison(mean, low, high, p_value, int(differences.shape[1]), num_seeds=int(differences.shape[0]),
                      seed_sd=float(differences.mean(axis=1).std(ddof=1)))


def crossed_t(differences: np.ndarray, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float, float, float]:
    """(mean, CI low, CI high, two-sided p of mean = 0) of a seeds x users table of differences at the seed level.

    The variance of the grand mean under the crossed model, ``var(a)/S + var(b)/U + var(e)/(S U)``, estimated as
    ``(MS_seed + max(MS_user - MS_e, 0)) / (S U)``: the seed mean square (``U`` times the variance of the
    per-seed mean differences) always counted, never cut, and the users' shared term (the sampling of the test
    users, common to every seed) added where the users differ beyond the residual. Student's t on
    the seed level's ``S - 1`` degrees of freedom whatever the sample variances do: seeds that happen to agree do
    not turn the interval into the users-only one (docs/results.md)."""
    from scipy.stats import t as student_t  # lazy: scipy.stats, only when a comparison is computed

    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    d = np.asarray(differences, dtype=float)
    if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 2:
        raise ValueError(f"the crossed model needs a (seeds >= 2, users >= 2) table, got shape {d.shape}")
    seeds, users = d.shape
    mean = float(d.mean())
    seed_means, user_means = d.mean(axis=1), d.mean(axis=0)
    seed_square = users * float(((seed_means - mean) ** 2).sum()) / (seeds - 1)
    user_square = seeds * float(((user_means - mean) ** 2).sum()) / (users - 1)
    residual = (float(((d - seed_means[:, None] - user_means[None, :] + mean) ** 2).sum())
                / ((seeds - 1) * (users - 1)))
    variance = (seed_square + max(user_square - residual, 0.0)) / (seeds * users)
    if variance <= 0:  # equal seed means and no user term (only in fabricated tables): no uncertainty left
        return mean, mean, mean, 1.0 if mean == 0 else 0.0
    error = math.sqrt(variance)
    quantile = float(student_t.ppf(0.5 + confidence / 2, seeds - 1))
    p_value = float(2 * student_t.sf(abs(mean) / error, seeds - 1))
    return mean, mean - quantile * error, mean + quantile * error, p_value


def seeds_for_verdict(difference: float, seed_sd: float, confidence: float = DEFAULT_CONFIDENCE,
                      power: float = VERDICT_POWER) -> int | None:
    """The fewest seeds at which a two-sided one-sample t-test over per-seed mean differences (level 1 -
    ``confidence``) detects a true ``difference`` with ``power``, when seeds spread with ``seed_sd``; ``None``
    without a difference or a spread, ``MAX_SEEDS_NEEDED + 1`` if more than that."""
    from scipy.stats import nct, t as student_t

    if difference == 0 or not seed_sd > 0:
        return None
    for n in range(2, MAX_SEEDS_NEEDED + 1):
        critical = student_t.ppf(0.5 + confidence / 2, n - 1)
        shift = abs(difference) / seed_sd * math.sqrt(n)
        if nct.sf(critical, n - 1, shift) + nct.cdf(-critical, n - 1, shift) >= power:
            return n
    return MAX_SEEDS_NEEDED + 1


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
    """The comparisons of one family (:data:`HOLM_FAMILY`) with ``p_holm`` filled in; ``family`` says what they
    are (``3 methods x 1 metric ...``), recorded as ``holm_family`` with their count. One-seed comparisons have
    no verdict: passing one is an error."""
    if any(not c.has_verdict for c in comparisons):
        raise ValueError("a Holm family holds comparisons over >= 2 seeds only; a 1-seed comparison has no verdict")
    size = f"{len(comparisons)} comparison{'s' if len(comparisons) != 1 else ''}"
    named = f"{size}: {family}" if family else size
    return [replace(c, p_holm=p, holm_family=named) for c, p in zip(comparisons, holm([c.p_value for c in comparisons]))]
