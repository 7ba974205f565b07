"""The study driver: a Ray Tune ``Tuner`` over trials (each trained in its own Tune trial actor), searched by
Optuna TPE, early-stopped by ASHA, recorded in MLflow (one parent run, a child per trial)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import TrialConfig
from ...protocol import run_tags
from ...tracking import redact
from . import interrupt
from ..spec import space
from .live_callbacks import run_callbacks
from ..record.outcomes import summarize_results
from .scheduler import PerMethodASHA
from ..spec.space import SearchSpec, trial_choices
from .trial import Resources

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
    ray_dashboard: bool = False  # start the local Ray's dashboard (a cluster's is its own)
    max_concurrent: int = 1
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    time_budget_s: float | None = None
    max_failures: int = 1
    memory_per_trial_bytes: int | None = None
    asha_grace_period: int = 5
    seed: int = 0
    repeat_seeds: tuple[int, ...] = ()  # after the search, each method's best configuration on these seeds (repeats.py)
    overwrite: bool = False
    retry_failed: bool = False  # on a resume, run the trials that failed again (from their last checkpoint)
    optuna_storage: str | None = None  # SQLAlchemy URL; None: optuna.db beside a SQLite MLflow DB (optuna_storage.py)
    optuna_storage_given: bool = False  # the user named the storage (--optuna-storage): a resume must not swap it
    enqueue_paper_setting: bool = True  # each tuned method's first trial is the paper's setting
    dataset_record: dict[str, Any] | None = None  # logged as each run's MLflow dataset input
    plan_record: dict[str, Any] | None = None  # the plan's record (Plan.record), a tag of the parent run
    command_line: list[str] = field(default_factory=lambda: invocation(sys.argv))


def invocation(argv: list[str]) -> list[str]:
    """The command as a user would type it again: ``python -m apao_ray sweep ...`` rather than the absolute
    path of ``apao_ray/__main__.py`` that ``sys.argv[0]`` holds under ``-m``."""
    if argv and Path(argv[0]).parts[-2:] == ("apao_ray", "__main__.py"):
        return ["python", "-m", "apao_ray", *argv[1:]]
    return list(argv)


def make_trial_function(base: TrialConfig, train_root: str, resources: Resources) -> Any:
    """The Tune trainable: turns a sampled config into a TrialConfig and trains it in the trial's actor (one
    worker) or on ``resources.num_workers`` Ray Train workers driven from there."""

    def apao_trial(config: dict[str, Any]) -> None:
        from ray import tune

        from ..record.outcomes import describe
        from .trial import run_in_ray_train, run_in_tune_actor

        from ...names import train_run_name

        name = train_run_name(tune.get_context().get_trial_id())  # stable: a restored trial finds its checkpoints
        run = run_in_ray_train if resources.num_workers > 1 else run_in_tune_actor
        run(space.trial_config(base, config), name=name, storage_path=train_root, resources=resources,
            progress_label=f"[{describe(trial_choices(config))}] ")

    return apao_trial


def code_version() -> str:
    root = Path(__file__).resolve().parents[3]
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from ... import __version__

        return __version__


def study_state_exists(options: StudyOptions) -> bool:
    """Whether Tune saved this study's state under the output directory (it can be resumed)."""
    from ray import tune

    return tune.Tuner.can_restore(str(options.output_dir / options.study_name))


def parent_tags(study_name: str) -> dict[str, str]:
    """The tags that identify a study's MLflow parent run."""
    from ..record.outcomes import STUDY_TAG

    return {STUDY_TAG: study_name, PARENT_ROLE_TAG: "study"}


def check_resumable(tracking_uri: str, options: StudyOptions, dataset_checksums: dict[str, str]) -> None:
    """Refuses to resume a study whose dataset files, search space or named Optuna storage changed.

    Tune restores the search space, trial count and searcher from its own state, so a changed space or
    storage would be silently ignored, and a changed dataset would mix two datasets in one comparison.
    """
    from ...tracking import Tracker, experiment_name

    if options.overwrite:
        return
    tracker = Tracker.existing(tracking_uri, experiment_name(options.base.data.dataset))
    parent_id = tracker.find_run(parent_tags(options.study_name)) if tracker else None
    if parent_id is None:
        return
    run = tracker.client.get_run(parent_id)
    recorded = json.loads(run.data.tags.get("dataset_checksums", "{}"))
    changed = sorted(name for name in set(recorded) | set(dataset_checksums)
                     if recorded.get(name) != dataset_checksums.get(name))
    if changed:
        details = "; ".join(f"{name}: recorded {str(recorded.get(name))[:12]}, now {str(dataset_checksums.get(name))[:12]}"
                            for name in changed)
        raise ValueError(f"dataset files changed since study {options.study_name!r} started ({details}); restore "
                         "the original files, or start a new study with --study-name NAME or --overwrite")
    if options.optuna_storage_given and options.optuna_storage and study_state_exists(options):
        from .optuna_storage import STORAGE_TAG

        storage = run.data.tags.get(STORAGE_TAG)
        if storage != redact(options.optuna_storage):  # the restored searcher writes where it was started
            started = f"with Optuna storage {storage!r}" if storage else "without an Optuna storage"
            raise ValueError(f"study {options.study_name!r} was started {started}; --optuna-storage now gives "
                             f"{redact(options.optuna_storage)!r}: a resumed study keeps its storage, so drop "
                             "--optuna-storage (or give the recorded one), or start a new --study-name")
    before = {"space": run.data.params.get("space"), "num_trials": run.data.params.get("num_trials")}
    now = {"space": space_param(options.spec), "num_trials": str(options.spec.num_trials)}
    if study_state_exists(options) and before != now:
        raise ValueError(f"study {options.study_name!r} was started with search space {before['space']} and "
                         f"{before['num_trials']} trials; now {now['space']} and {now['num_trials']}: a resumed study "
                         "keeps its space, so use a new --study-name or --overwrite")
    seeds_before, seeds_now = run.data.params.get("seeds"), seeds_param(options)
    if study_state_exists(options) and seeds_before is not None and seeds_before != seeds_now:
        raise ValueError(f"study {options.study_name!r} was started with seeds {seeds_before}; now {seeds_now}: a "
                         "resumed study keeps its seeds, so use a new --study-name or --overwrite")


def space_param(spec: SearchSpec) -> str:
    """The searched space as the parent run records it; not the start order, which a resume may plan
    anew (the restored searcher keeps its own), nor the dataset (a resume checks its files). Fields added
    later are left out while empty, so a study recorded before them resumes."""
    return json.dumps({k: v for k, v in spec.__dict__.items()
                       if k not in ("first", "dataset") and (k not in ("deferred", "knob_ranges") or v)}, default=list)


def seeds_param(options: StudyOptions) -> str:
    """The study's seeds as recorded on its parent run: the search's first, then the repeats'."""
    return json.dumps([options.base.train.seed, *options.repeat_seeds])


def open_parent_run(tracker: Any, options: StudyOptions, dataset_checksums: dict[str, str]) -> str:
    """The study's MLflow parent run: reopened when the study resumes, else created with its space."""
    from ..record.outcomes import STUDY_TAG

    tags = parent_tags(options.study_name)
    parent_id = tracker.find_run(tags)
    if parent_id is not None and options.overwrite:  # the old runs stay in MLflow under a name of their own
        retired = f"{options.study_name}.overwritten-{parent_id[:8]}"
        for run_id in [parent_id, *(run.info.run_id for run in tracker.child_runs(parent_id))]:
            tracker.set_tags(run_id, {STUDY_TAG: retired})
        parent_id = None
    if parent_id is None:
        parent_id = tracker.start_run(f"study {options.study_name}", {**tags, "dataset": options.base.data.dataset})
        if options.dataset_record:
            tracker.log_dataset(parent_id, options.dataset_record)
        tracker.log_params(parent_id, {"space": space_param(options.spec),
                                       "dataset": options.base.data.dataset, "num_trials": options.spec.num_trials,
                                       "base": options.base.to_dict(), "max_concurrent": options.max_concurrent,
                                       "workers_per_trial": options.base.train.num_workers,
                                       "seeds": seeds_param(options)})
    else:
        tracker.reopen(parent_id)
    if options.plan_record:
        from ...names import PLAN_TAG
        from ..record.outcomes import BUDGET_PROTOCOL_TAG

        tracker.set_tags(parent_id, {PLAN_TAG: json.dumps(options.plan_record),
                                     BUDGET_PROTOCOL_TAG: options.plan_record.get("budget_protocol") or "none"})
    from ...mlflow_ui import save_runs_view, view_key
    from .mlflow_callback import study_columns

    save_runs_view(tracker, view_key(options.study_name), study_columns(
        options.spec.backbones, options.spec.losses, f"best/val/{options.base.train.metric}"))
    tracker.set_tags(parent_id, {**run_tags(options.base),
                                 "command_line": redact(" ".join(options.command_line)), "code_version": code_version(),
                                 "dataset_checksums": json.dumps(dataset_checksums, sort_keys=True),
                                 "study_dir": str(options.output_dir / options.study_name)})
    return parent_id


@dataclass
class StudyOutcome:
    rows: list[dict[str, Any]]     # one summary per trial
    interrupted: bool = False      # stopped before every trial ended: resumable
    optuna_summary: str = ""       # parameter importances and the optuna-dashboard command
    stop_signal: int | None = None  # the signal that stopped it (SIGINT, SIGTERM), if one did
    parent_run_id: str | None = None  # the study's MLflow parent run


def run_study(options: StudyOptions, dataset_checksums: dict[str, str], example_history: list[str]) -> StudyOutcome:
    """Runs (or resumes) the study. On SIGINT or SIGTERM it saves its state, records the unfinished
    trials and the parent run as interrupted, and returns ``interrupted=True`` with the signal."""
    from ...tracking import Tracker, experiment_name
    from ..record.outcomes import INTERRUPTED, OUTCOME_TAG
    from .ray_cluster import init_ray

    study_dir = options.output_dir / options.study_name
    if options.overwrite and study_dir.exists():
        shutil.rmtree(study_dir)
    # before our handlers: ray.init installs a SIGTERM handler of its own
    init_ray(options.address, dashboard=options.ray_dashboard)
    with interrupt.stop_signals():
        tracker = Tracker(options.tracking_uri, experiment_name(options.base.data.dataset))
        parent_id = open_parent_run(tracker, options, dataset_checksums)
        try:
            outcome = _run_tuner(options, tracker, parent_id, example_history)
        except KeyboardInterrupt:  # a signal outside Tune's loop (start-up, figures): Tune's saved state holds
            outcome = StudyOutcome([], interrupted=True)
        outcome.stop_signal = interrupt.received()
        outcome.parent_run_id = parent_id
        if outcome.interrupted:
            tracker.set_tags(parent_id, {OUTCOME_TAG: INTERRUPTED})
            tracker.end_run(parent_id, "KILLED")
        return outcome


def _run_tuner(options: StudyOptions, tracker: Any, parent_id: str, example_history: list[str]) -> StudyOutcome:
    """Builds (or restores) the Tuner, runs it, and records the study's end in the parent run."""
    from ray import tune

    from ...tracking import experiment_name
    from . import live_callbacks, optuna_storage
    from .mlflow_callback import MlflowStudyCallback, log_study_summary
    from ..record.outcomes import OUTCOME_TAG
    from .progress import ProgressCallback

    study_dir = options.output_dir / options.study_name
    started = time.monotonic()
    metric = f"best/val/{options.base.train.metric}"
    train_root = str(study_dir / "train_runs")

    def make_callbacks(num_trials: int) -> list[Any]:  # the recorder first (repeats.py reads it)
        recorder = MlflowStudyCallback(options.tracking_uri, experiment_name(options.base.data.dataset), parent_id,
                                       options.study_name, train_root,
                                       {"base": options.base.to_dict()},
                                       example_history, run_tags(options.base), options.dataset_record)
        return [recorder, ProgressCallback(metric, num_trials)]

    # per worker; a trial has the base config's num_workers (--workers-per-trial)
    resources = Resources(options.base.train.num_workers, options.cpus_per_trial, options.gpus_per_trial,
                          options.memory_per_trial_bytes)
    callbacks = make_callbacks(options.spec.num_trials)
    recorder = callbacks[0]
    trainable = tune.with_resources(make_trial_function(options.base, train_root, resources),
                                    resources.tune_resources())
    storage_url = options.optuna_storage or optuna_storage.resolve_storage_url(None, options.tracking_uri,
                                                                              options.output_dir)
    optuna_name = optuna_storage.optuna_study_name(options.base.data.dataset, options.study_name)
    if options.retry_failed:  # trials that failed for their own reason (non-finite loss, memory) run again
        from .trial import forget_failures

        forget_failures(train_root)
    live_callbacks.register(str(study_dir), callbacks)  # what the run's LiveCallbacks call, also after a restore
    if study_state_exists(options):  # the restored searcher keeps the storage it was started with
        recorded = tracker.client.get_run(parent_id).data.tags.get(optuna_storage.STORAGE_TAG)
        if recorded is None:  # started before studies had an Optuna storage: its searcher has none
            storage_url = None
        elif "***" not in recorded:  # the tag is the URL unless it held a password
            storage_url = recorded
        tuner = tune.Tuner.restore(str(study_dir), trainable, resume_unfinished=True,
                                   resume_errored=options.retry_failed)
    else:
        tracker.set_tags(parent_id, {optuna_storage.STORAGE_TAG: redact(storage_url),
                                     optuna_storage.OPTUNA_STUDY_TAG: optuna_name})
        searcher = optuna_storage.make_searcher(options.spec, metric, storage_url, optuna_name, options.seed,
                                                options.enqueue_paper_setting)
        searcher.set_run_record(options.tracking_uri, experiment_name(options.base.data.dataset), options.study_name,
                                options.base.train.seed)
        note = optuna_storage.startup_note(options.spec)
        if note:
            print(note, file=sys.stderr)
        # rungs count epochs; max_t one past the last, so that ASHA never cuts the last epoch off from its test
        scheduler = PerMethodASHA(metric=metric, mode="max", max_t=options.base.train.epochs + 1,
                                  grace_period=options.asha_grace_period, train_root=train_root)
        tuner = tune.Tuner(trainable, tune_config=tune.TuneConfig(
            search_alg=searcher, scheduler=scheduler, num_samples=options.spec.num_trials,
            max_concurrent_trials=options.max_concurrent, time_budget_s=options.time_budget_s),
            run_config=tune.RunConfig(name=options.study_name, storage_path=str(options.output_dir),
                                      callbacks=run_callbacks(str(study_dir)), verbose=0,
                                      # a crashed trial restarts from its last checkpoint (trial.py)
                                      failure_config=tune.FailureConfig(max_failures=options.max_failures)))
    with interrupt.tune_running():
        results = tuner.fit()
    rows = summarize_results(results, options.base.train.seed)
    interrupted = (bool(recorder.interrupted) or interrupt.received() is not None
                   or (options.time_budget_s is None and len(rows) < options.spec.num_trials))
    if interrupted:
        return StudyOutcome(rows, interrupted=True)
    from .pruned import evaluate_pruned_trials
    from ..record.report import log_study_figures

    evaluate_pruned_trials(tracker, parent_id, train_root, resources.cpus_per_worker, resources.gpus_per_worker)
    if options.repeat_seeds:
        from .repeats import run_repeats

        remaining = None if options.time_budget_s is None else options.time_budget_s - (time.monotonic() - started)
        if remaining is not None and remaining <= 0:
            print("the budget ran out in the search: no repeats on seeds "
                  f"{list(options.repeat_seeds)}", file=sys.stderr)
        else:
            methods = len(options.spec.backbones) * len(options.spec.losses)
            repeat_callbacks = make_callbacks(methods * len(options.repeat_seeds))
            repeated, interrupted = run_repeats(options, tracker, trainable, repeat_callbacks, metric, remaining)
            rows += repeated
            if interrupted:
                return StudyOutcome(rows, interrupted=True)

    log_study_figures(tracker, parent_id, rows, options.base.train.beam_size)
    log_study_summary(tracker, parent_id, options.study_name, metric)
    optuna_summary = optuna_storage.log_study_artifacts(tracker, parent_id, storage_url, optuna_name) \
        if storage_url else "this study was started without an Optuna storage: no importances or Optuna plots"
    tracker.set_tags(parent_id, {OUTCOME_TAG: "finished"})
    tracker.end_run(parent_id, "FINISHED")
    return StudyOutcome(rows, optuna_summary=optuna_summary)

