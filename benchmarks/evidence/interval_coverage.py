"""How often the report's interval over seeds covers a true difference of 0, on fabricated Office-shaped tables.

Each replicate fabricates one test set and ``k`` training seeds of two methods whose true difference is 0, and
calls the product's own comparison (``analysis.stats.seeds_comparison``) on the per-user NDCG@10 tables:

* 4,905 test users (Office's test split). A user is reachable with probability ``REACHABLE`` (a trained model can
  hit them at all); a reachable user has a per-method hit probability drawn once per replicate
  (``0.2 + 0.6 Beta(4, 4)``, so the two methods differ user by user but not on average) and every seed draws its
  hits from it: about 6.8% of users hit per model and about half of one model's hits shared by the next, as the
  committed Office/TIGER tables show (6.7-7.1% hit, 3.5-3.9% hit by both of two models).
* A hit's rank is drawn from Office's observed ranks 1-10 (CE seed 0), NDCG@10 = 1 / log2(rank + 1).
* The seed effect: each seed shifts the method's hit probability of reachable users by one draw, scaled so that
  the NDCG@10 difference moves by a normal draw with sd ``seed_sd`` (0.0035: the spread measured between the
  Office/TIGER full-protocol seeds); 0 for no seed effect.

Printed per seed count: the share of replicates whose 95% interval covers 0, the median interval width, and the
median width of the users-only interval (the t interval over users of the seed-averaged per-user differences,
which is what an interval that ignores training randomness reports).

    python benchmarks/evidence/interval_coverage.py --seeds 2 3 5 --replicates 1000
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from apao_ray.analysis.stats import seeds_comparison  # noqa: E402

NUM_USERS = 4905
REACHABLE = 0.135
OFFICE_SEED_SD = 0.0035
# Office/TIGER CE seed 0: test users hit at rank 1..10 (per_user tables of office-full-tiger-seed0)
RANK_COUNTS = np.array([49, 36, 44, 33, 43, 28, 25, 28, 28, 17], dtype=float)
GAINS = 1.0 / np.log2(np.arange(1, 11) + 1.0)
MEAN_GAIN = float((RANK_COUNTS * GAINS).sum() / RANK_COUNTS.sum())


def fabricate(rng: np.random.Generator, num_seeds: int, seed_sd: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One replicate: ``num_seeds`` (method, baseline) pairs of per-user NDCG@10 arrays, true difference 0."""
    reachable = rng.random(NUM_USERS) < REACHABLE
    chance = np.where(reachable, 0.2 + 0.6 * rng.beta(4.0, 4.0, (2, NUM_USERS)), 0.0)  # (2 methods, U)
    # a shift of the hit probability by x moves the mean NDCG@10 by x * REACHABLE * MEAN_GAIN
    shifts = rng.normal(0.0, seed_sd, num_seeds) / (REACHABLE * MEAN_GAIN)
    methods, baselines = [], []
    for shift in shifts:
        chances = np.stack([np.clip(chance[0] + shift * reachable, 0.0, 1.0), chance[1]])  # (2, U)
        hits = rng.random(chances.shape) < chances
        gains = GAINS[rng.choice(10, size=chances.shape, p=RANK_COUNTS / RANK_COUNTS.sum())]
        ndcg = np.where(hits, gains, 0.0)
        methods.append(ndcg[0])
        baselines.append(ndcg[1])
    return methods, baselines


def coverage(num_seeds: int, seed_sd: float, replicates: int, seed: int = 0) -> dict[str, float]:
    """Share of ``replicates`` whose interval covers 0, its median width, and the users-only median width."""
    rng = np.random.default_rng([seed, num_seeds, int(seed_sd * 1e6)])
    covered, widths, users_widths = 0, [], []
    quantile = float(student_t.ppf(0.975, NUM_USERS - 1))
    for _ in range(replicates):
        methods, baselines = fabricate(rng, num_seeds, seed_sd)
        result = seeds_comparison(methods, baselines)
        covered += result.ci_low <= 0.0 <= result.ci_high
        widths.append(result.ci_high - result.ci_low)
        per_user = np.mean(methods, axis=0) - np.mean(baselines, axis=0)  # (U,)
        users_widths.append(2 * quantile * per_user.std(ddof=1) / np.sqrt(NUM_USERS))
    return {"seeds": num_seeds, "seed_sd": seed_sd, "coverage": covered / replicates,
            "median_width": float(np.median(widths)), "users_only_median_width": float(np.median(users_widths))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--replicates", type=int, default=1000)
    parser.add_argument("--seed-sd", type=float, nargs="+", default=[OFFICE_SEED_SD, 0.0])
    args = parser.parse_args(argv)
    print("| seed sd | seeds | coverage of 0 | median width | users-only median width |")
    print("|---|---|---|---|---|")
    for seed_sd in args.seed_sd:
        for num_seeds in args.seeds:
            row = coverage(num_seeds, seed_sd, args.replicates)
            print(f"| {seed_sd:.4f} | {num_seeds} | {row['coverage']:.3f} | {row['median_width']:.4f} | "
                  f"{row['users_only_median_width']:.4f} |")


if __name__ == "__main__":
    main()
