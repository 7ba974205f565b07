"""Seeds as a study dimension: after the search, the best configuration of every
(backbone, loss) is trained again on each other seed, as ordinary trials of the same study.

The repeats are a Tune experiment of their own (``<output_dir>/<study>/repeats``) over a fixed list
of configurations, so an interrupted repeat phase resumes the way the search does. Each repeat is one
MLflow child run of the study's parent run, tagged ``apao.seed`` and ``apao.repeats`` (the run id of
the search trial whose configuration it repeats); the table then groups a method's best search trial
with its repeats (report.py).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ... import storage
from ..spec.space import REPEATS_KEY, SEED_KEY, knobs_of, param_name
from . import cohorts
from ..cluster import interrupt
from ..record.outcomes import summarize_results

REPEATS_DIR = "repeats"


def repeat_configs(best: list[dict[str, Any]], seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    """Tune configs of the repeats: every best row (``backbone``, ``loss``, its knobs, ``run_id``) on
    every seed, in the search's own parameter names so that ``trial_choices`` reads them unchanged."""
    configs = []
    for row in best:
        knobs = {param_name(row["backbone"], row["loss"], k.name): row[k.name] for k in knobs_of(row["loss"])}
        configs += [{"backbone": row["backbone"], "loss": row["loss"], **knobs, SEED_KEY: int(seed),
                     REPEATS_KEY: row["run_id"]} for seed in seeds]
    return configs


if TYPE_CHECKING:
    from ...tracking import Tracker
    from .study import Study


def run_repeats(study: Study, tracker: Tracker, trainable: Any, callbacks: list[Any],
                time_budget_s: float | None) -> tuple[list[dict[str, Any]], bool]:
    """Runs (or resumes) the repeat phase; returns (one summary per repeat trial, whether it was stopped
    before every repeat ended). Nothing to repeat (no seeds, no finished method): ``([], False)``."""
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    from ..record import live_callbacks
    from ..record.live_callbacks import run_callbacks
    from ..record.report import best_rows

    spec, setup, plan = study.spec, study.setup, study.plan
    directory = storage.join(study.study_dir, REPEATS_DIR)
    live_callbacks.register(directory, callbacks)  # what the run's LiveCallbacks call, also after a restore
    if tune.Tuner.can_restore(directory):  # the configurations were chosen when the phase started
        tuner = tune.Tuner.restore(directory, trainable, resume_unfinished=True,
                                   resume_errored=spec.retry_failed)
    else:
        configs = repeat_configs(best_rows(tracker, study=setup.study_name), plan.run_repeat_seeds)
        if not configs:
            return [], False
        configs = cohorts.assign_cohorts(configs, plan.base, plan.cohort_size, prefix="repeat")
        fused = cohorts.cohorts_in(configs)
        print(f"repeating the best configuration of {len(configs) // len(plan.run_repeat_seeds)} method(s) on seeds "
              f"{list(plan.run_repeat_seeds)}: {len(configs)} trials"
              + (f", {sum(map(cohorts.is_member, configs))} of them in {fused} fused cohort(s)" if fused else ""),
              file=sys.stderr)
        # exactly these configurations, once each: points to evaluate over a space of constants that only
        # names their keys (Tune fills a point in by those names); a key of another method's knob stays None
        space = {key: None for config in configs for key in config}
        # a cohort's members start side by side (its followers hold a sliver of a CPU each)
        searcher = BasicVariantGenerator(points_to_evaluate=configs, max_concurrent=plan.slots * plan.cohort_size)
        tuner = tune.Tuner(trainable, param_space=space, tune_config=tune.TuneConfig(
            search_alg=searcher, num_samples=len(configs), time_budget_s=time_budget_s),
            run_config=tune.RunConfig(name=REPEATS_DIR, storage_path=study.study_dir,
                                      callbacks=run_callbacks(directory),
                                      verbose=0, failure_config=tune.FailureConfig(max_failures=spec.max_failures)))
    with interrupt.tune_running():
        results = tuner.fit()
    rows = summarize_results(results, plan.base.train.seed)
    recorder = callbacks[0]
    interrupted = bool(recorder.interrupted) or interrupt.received() is not None
    return rows, interrupted
