"""The study driver: a Ray Tune ``Tuner`` over trials (one TorchTrainer each), searched by
Optuna TPE, early-stopped by ASHA, recorded in MLflow (one parent run, a child per trial)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from ..config import TrialConfig
from .space import SearchSpec, is_baseline, trial_choices

PARENT_ROLE_TAG = "apao.role"


@dataclass(frozen=True)
class StudyOptions:
    """Everything ``studies/sweep.py`` decides; see its --help for meanings."""

    base: TrialConfig
    spec: SearchSpec
    study_name: str
    output_dir: Path
    tracking_uri: str
    address: str | None = None
    max_concurrent: int = 1
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    time_budget_s: float | None = None
    max_failures: int = 1
    asha_grace_period: int = 5
    seed: int = 0
    overwrite: bool = False
    command_line: list[str] = field(default_factory=lambda: list(sys.argv))


def make_trial_function(base: TrialConfig, train_root: str, cpus_per_trial: float, gpus_per_trial: float,
                        max_failures: int) -> Any:
    """The Tune trainable: turns a sampled config into a TrialConfig and runs its TorchTrainer."""

    def apao_trial(config: dict[str, Any]) -> None:
        from ray import tune
        from ray.tune.integration.ray_train import TuneReportCallback

        from .trial import Resources, make_trainer

        choices = trial_choices(config)
        loss = base.loss.replace(name=choices["loss"], **{k: v for k, v in choices.items()
                                                          if k in ("beta", "eta", "num_negatives")})
        trial_config = TrialConfig(base.data, base.model.replace(backbone=choices["backbone"]), loss, base.train)
        # stable name from the trial id: a restored trial finds its checkpoints
        name = f"train-trial_id={tune.get_context().get_trial_id()}"
        resources = Resources(1, max(1.0, cpus_per_trial), gpus_per_trial)
        trainer = make_trainer(trial_config, name=name, storage_path=train_root, resources=resources,
                               max_failures=max_failures, callbacks=[TuneReportCallback()], verbose=False)
        trainer.fit()

    return apao_trial


def code_version() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from .. import __version__

        return __version__


def run_study(options: StudyOptions, dataset_checksums: dict[str, str], example_history: list[str]) -> list[dict[str, Any]]:
    """Runs (or resumes) the study and returns one summary row per trial."""
    import optuna
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from ..tracking import Tracker, experiment_name
    from .mlflow_callback import STUDY_TAG, MlflowStudyCallback
    from .progress import ProgressCallback
    from .runner import init_ray

    study_dir = options.output_dir / options.study_name
    if options.overwrite and study_dir.exists():
        shutil.rmtree(study_dir)
    init_ray(options.address)
    tracker = Tracker(options.tracking_uri, experiment_name(options.base.data.dataset))
    parent_tags = {STUDY_TAG: options.study_name, PARENT_ROLE_TAG: "study"}
    parent_id = None if options.overwrite else tracker.find_run(parent_tags)
    if parent_id is None:
        parent_id = tracker.start_run(f"study {options.study_name}", {**parent_tags, "dataset": options.base.data.dataset})
        tracker.log_params(parent_id, {"space": json.dumps(options.spec.__dict__, default=list),
                                       "dataset": options.base.data.dataset, "num_trials": options.spec.num_trials,
                                       "base": options.base.to_dict(), "max_concurrent": options.max_concurrent})
    else:
        tracker.reopen(parent_id)
    tracker.set_tags(parent_id, {"command_line": " ".join(options.command_line), "code_version": code_version(),
                                 "dataset_checksums": json.dumps(dataset_checksums, sort_keys=True),
                                 "study_dir": str(study_dir)})
    metric = f"best/val/{options.base.train.metric}"
    train_root = str(study_dir / "train_runs")
    callbacks = [MlflowStudyCallback(options.tracking_uri, experiment_name(options.base.data.dataset), parent_id,
                                     options.study_name, train_root, {"base": options.base.to_dict()}, example_history),
                 ProgressCallback(metric, options.spec.num_trials)]
    trainable = tune.with_resources(  # the trial's own driver needs almost nothing; workers hold the CPUs
        make_trial_function(options.base, train_root, options.cpus_per_trial, options.gpus_per_trial,
                            options.max_failures), {"cpu": 0.01})
    if tune.Tuner.can_restore(str(study_dir)):
        tuner = tune.Tuner.restore(str(study_dir), trainable, resume_unfinished=True, resume_errored=False)
    else:
        searcher = OptunaSearch(
            options.spec.define_by_run(), metric=metric, mode="max",
            points_to_evaluate=options.spec.points_to_evaluate(),
            sampler=optuna.samplers.TPESampler(seed=options.seed, n_startup_trials=max(2, options.spec.trials_per_tuned // 2)))
        # max_t: one report per epoch plus the final (test) report, which ASHA must not cut off
        scheduler = BaselineProtectingASHA(metric=metric, mode="max", max_t=options.base.train.epochs + 1,
                                           grace_period=options.asha_grace_period)
        tuner = tune.Tuner(trainable, tune_config=tune.TuneConfig(
            search_alg=searcher, scheduler=scheduler, num_samples=options.spec.num_trials,
            max_concurrent_trials=options.max_concurrent, time_budget_s=options.time_budget_s),
            run_config=tune.RunConfig(name=options.study_name, storage_path=str(options.output_dir),
                                      callbacks=callbacks, verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=0)))
    results = tuner.fit()
    rows = summarize(results)
    from .report import log_study_figures

    log_study_figures(tracker, parent_id, rows, options.base.train.beam_size)
    tracker.end_run(parent_id, "FINISHED")
    return rows


def summarize(results: Any) -> list[dict[str, Any]]:
    rows = []
    for result in results:
        config = result.config or {}
        if "loss" not in config:
            continue
        rows.append({"choices": trial_choices(config), "metrics": dict(result.metrics or {}),
                     "error": str(result.error) if result.error else None})
    return rows


class BaselineProtectingASHA(ASHAScheduler):
    """ASHA that never stops a baseline trial: the comparison needs every baseline to finish."""

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        decision = super().on_trial_result(tune_controller, trial, result)
        return TrialScheduler.CONTINUE if is_baseline(trial.config.get("loss", "")) else decision
