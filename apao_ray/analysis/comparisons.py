"""Paired comparisons of methods: each method against the baseline of its (dataset, backbone), a seed matched with
the baseline's same seed and the same test users (``stats``: over seeds and users with >= 2 seeds, users only with
one); Holm's correction per (dataset, metric); the seeds a one-seed comparison would need for a verdict."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..rank_metrics import PER_USER_METRICS
from .results import Method, Trial
from .stats import Comparison, paired_comparison, seeds_comparison, seeds_for_verdict, with_holm


@dataclass
class Paired:
    """A method against the baseline of its (dataset, backbone) on one metric: over its seeds (``over_seeds``: the
    seeds x users model with >= 2 seeds, users only with 1) and per seed (users only)."""

    method: Method
    baseline: Method
    metric: str
    over_seeds: Comparison | None
    per_seed: dict[int, Comparison]
    note: str = ""


def _aligned(trial: Trial, baseline: Trial, metric: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]] | None:
    """(method values, baseline values, users), sorted by user: pooling over seeds averages the same user's
    differences, whatever order each seed's table was written in."""
    ours, theirs = trial.per_user(), baseline.per_user()
    if ours is None or theirs is None:
        return None
    joined = ours[["user", metric]].merge(theirs[["user", metric]], on="user", suffixes=("", "_baseline"))
    joined = joined.sort_values("user", kind="stable")
    return joined[metric].to_numpy(float), joined[f"{metric}_baseline"].to_numpy(float), tuple(joined["user"])


def compare_methods(methods: list[Method], baseline_loss: str = "ce", metrics: tuple[str, ...] = PER_USER_METRICS,
                    num_resamples: int = 10_000) -> list[Paired]:
    """Every method against the ``baseline_loss`` method of its (dataset, backbone), per metric, on the
    seeds both have. Holm's correction runs over ``stats.HOLM_FAMILY``; a one-seed comparison gets no verdict,
    and, where another method of the same (dataset, backbone, loss) measured the seed spread, the seeds a
    verdict would need."""
    results: list[Paired] = []
    for method in methods:
        baselines = [m for m in methods if (m.dataset, m.backbone, m.loss) == (method.dataset, method.backbone,
                                                                                baseline_loss)]
        if method.loss == baseline_loss or not baselines:
            continue
        baseline = baselines[0]
        by_seed = {trial.seed: trial for trial in baseline.trials}
        for metric in metrics:
            per_seed, pairs, missing = {}, [], []
            for trial in method.trials:
                aligned = _aligned(trial, by_seed[trial.seed], metric) if trial.seed in by_seed else None
                if aligned is None or len(aligned[0]) < 2:
                    missing.append(trial.seed)
                    continue
                per_seed[trial.seed] = paired_comparison(*aligned[:2], num_resamples=num_resamples, seed=trial.seed)
                pairs.append(aligned)
            over_seeds = None
            if pairs and len({p[2] for p in pairs}) == 1:  # the same users under every seed
                over_seeds = seeds_comparison([p[0] for p in pairs], [p[1] for p in pairs], num_resamples=num_resamples)
            note = f"seeds {missing}: no paired per-user tables" if missing else ""
            results.append(Paired(method, baseline, metric, over_seeds, per_seed, note))
    holm_per_dataset(results)
    _seeds_needed(results)
    return results


def _cell(r: Paired) -> tuple[str, str, str, str, str]:
    return r.method.dataset, r.method.backbone, r.method.loss, r.baseline.loss, r.metric


def holm_per_dataset(results: list[Paired]) -> None:
    """Holm over ``HOLM_FAMILY``: per (dataset, metric), the comparisons with >= 2 seeds."""
    for dataset, metric in {(r.method.dataset, r.metric) for r in results}:
        family = [r for r in results if (r.method.dataset, r.metric) == (dataset, metric)
                  and r.over_seeds is not None and r.over_seeds.has_verdict]
        for r, corrected in zip(family, with_holm([r.over_seeds for r in family], _family(family, dataset))):
            r.over_seeds = corrected


def _seeds_needed(results: list[Paired]) -> None:
    """A one-seed comparison's seeds for a verdict, at the largest seed sd measured for its cell elsewhere."""
    spreads: dict[tuple[str, ...], float] = {}
    for r in results:
        if r.over_seeds is not None and r.over_seeds.seed_sd is not None:
            spreads[_cell(r)] = max(spreads.get(_cell(r), 0.0), r.over_seeds.seed_sd)
    for r in results:
        if r.over_seeds is not None and not r.over_seeds.has_verdict and _cell(r) in spreads:
            sd = spreads[_cell(r)]
            r.over_seeds = replace(r.over_seeds, seed_sd=sd, seeds_needed=seeds_for_verdict(r.over_seeds.mean_difference, sd))


def _family(results: list[Paired], dataset: str) -> str:
    """``3 methods x 1 metric (ndcg_at_10) vs ce, office, >= 2 seeds each``: what one Holm family holds."""
    methods = {(r.method.backbone, r.method.label) for r in results}
    metrics = sorted({r.metric for r in results})
    baselines = sorted({r.baseline.loss for r in results})
    return (f"{len(methods)} method{'s' if len(methods) != 1 else ''} x {len(metrics)} "
            f"metric{'s' if len(metrics) != 1 else ''} ({', '.join(metrics)}) vs {', '.join(baselines)}, {dataset}, "
            ">= 2 seeds each")

