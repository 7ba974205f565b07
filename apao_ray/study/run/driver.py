"""The study driver: a Ray Tune ``Tuner`` over trials (each trained in its own Tune trial actor), searched by
Optuna TPE, early-stopped by ASHA, recorded in MLflow (one parent run, a child per trial)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import storage
from ...config import TrialConfig
from ...names import OUTCOME_TAG, PLAN_TAG, SELECTION_TAG, train_run_name
from ...protocol import Selection, recorded_selection, run_tags
from ...tracking import Tracker, experiment_name, redact
from ..cluster import interrupt, worker_output
from ..cluster.ray_cluster import init_ray, session_log
from ..record.live_callbacks import run_callbacks
from ..record.outcomes import BUDGET_PROTOCOL_TAG, INTERRUPTED, STUDY_TAG, describe, summarize_results
from ..search.scheduler import PerMethodASHA
from ..setup import parent_run, parent_tags, study_state_exists
from ..spec import space
from ..spec.space import PAPER_KNOBS, SearchSpec, loss_knobs, trial_choices
from . import cohorts
from .study import Study
from .trial import Resources, run_in_ray_train, run_in_tune_actor
from ...mlflow_ui import save_runs_view, view_key
from ..record import live_callbacks
from ..record.progress import ProgressCallback
from ...data.shipped import pack
from .pruned import evaluate_pruned_trials
from ..record.report import log_study_figures

if TYPE_CHECKING:  # the types only
    from ..spec.study import StudySpec


def memory_bytes(spec: StudySpec) -> int | None:
    """The per-trial memory cap in bytes (``memory_per_trial_gib``), None without one."""
    return int(spec.memory_per_trial_gib * 2**30) if spec.memory_per_trial_gib else None


def make_trial_function(base: TrialConfig, train_root: str, resources: Resources) -> Any:
    """The Tune trainable: turns a sampled config into a TrialConfig and trains it in the trial's actor (one
    worker) or on ``resources.num_workers`` Ray Train workers driven from there; ``dataset_files``: the dataset's
    files the driver ships (``make_trainable``), None where each node makes the dataset itself (synthetic)."""

    def apao_trial(config: dict[str, Any], dataset_files: Any = None) -> None:
        from ray import tune

        name = train_run_name(tune.get_context().get_trial_id())  # stable: a restored trial finds its checkpoints
        label = f"[{describe(trial_choices(config))}] "
        if cohorts.is_member(config):  # a repeat trained in a fused cohort (--cohort-size)
            cohorts.run_member(config, base, name=name, train_root=train_root, resources=resources, label=label,
                               dataset_files=dataset_files)
            return
        run = run_in_ray_train if resources.num_workers > 1 else run_in_tune_actor
        run(space.trial_config(base, config), name=name, storage_path=train_root, resources=resources,
            progress_label=label, dataset_files=dataset_files)

    return apao_trial


def make_trainable(base: TrialConfig, train_root: str, resources: Resources,
                   driver_resource: str | None = None, dataset_files: Any = None) -> Any:
    """The Tune trainable with its reservation: a trial's (``Resources.tune_resources``), a cohort's for a cohort
    leader, a sliver for a follower (run/cohorts.py); on nodes carrying ``driver_resource`` where given. The
    dataset's files (``dataset_files``, data/shipped.py), where given, go once into Ray's object store, from
    where each trial's actor fetches them: no node needs them on its disk."""
    from ray import tune

    trial = resources.tune_resources()
    trainable = make_trial_function(base, train_root, resources)
    if dataset_files is not None:
        trainable = tune.with_parameters(trainable, dataset_files=dataset_files)
    return tune.with_resources(trainable, lambda config: Resources.placement(cohorts.tune_resources(config, trial),
                                                                             driver_resource))


def code_version() -> str:
    root = Path(__file__).resolve().parents[3]
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from ... import __version__

        return __version__


def check_same_schedule(study: Study) -> None:
    """Refuses to resume a study whose search space, trial count or seeds (as planned) changed: Tune restores
    them from its own state, so a change would be silently ignored."""
    spec, setup, plan = study.spec, study.setup, study.plan
    run = None if spec.overwrite or not study_state_exists(study.study_dir) else parent_run(setup)
    if run is None:
        return
    name, search = setup.study_name, plan.search
    before = {"space": run.data.params.get("space"), "num_trials": run.data.params.get("num_trials")}
    now = {"space": space_param(search), "num_trials": str(search.num_trials)}
    if before != now:
        raise ValueError(f"study {name!r} was started with search space {before['space']} and "
                         f"{before['num_trials']} trials; now {now['space']} and {now['num_trials']}: a resumed study "
                         "keeps its space, so use a new --study-name or --overwrite")
    selected, selection = recorded_selection([(run.data.tags, run.data.params)]), Selection.of(plan.base)
    if selected != selection:
        raise ValueError(f"study {name!r} names its best trial by {selected.text()}; now by {selection.text()}: a "
                         "resumed study keeps its selection, so use a new --study-name or --overwrite")
    seeds_before, seeds_now = run.data.params.get("seeds"), json.dumps(study.seeds)
    if seeds_before is not None and seeds_before != seeds_now:
        raise ValueError(f"study {name!r} was started with seeds {seeds_before}; now {seeds_now}: a "
                         "resumed study keeps its seeds, so use a new --study-name or --overwrite")


def space_param(spec: SearchSpec) -> str:
    """The searched space as the parent run records it; not the start order, which a resume may plan
    anew (the restored searcher keeps its own), nor the dataset (a resume checks its files). The paper's knobs'
    ranges stand where they stood when they were fields of their own, every other knob's range under
    ``knob_ranges``, and what was added later is left out while empty, so a study recorded before resumes."""
    others = {name: list(bounds) for name, bounds in spec.knob_ranges.items() if name not in PAPER_KNOBS}
    record = {"backbones": list(spec.backbones), "losses": list(spec.losses),
              **{name: list(spec.range_named(name)) for name in PAPER_KNOBS},
              "trials_per_tuned": spec.trials_per_tuned,
              **({"deferred": [list(m) for m in spec.deferred]} if spec.deferred else {}),
              **({"knob_ranges": others} if others else {})}
    return json.dumps(record)


def open_parent_run(tracker: Tracker, study: Study) -> str:
    """The study's MLflow parent run: reopened when the study resumes, else created with its space."""
    spec, setup, plan = study.spec, study.setup, study.plan
    tags = parent_tags(setup.study_name)
    parent_id = tracker.find_run(tags)
    if parent_id is not None and spec.overwrite:  # the old runs stay in MLflow under a name of their own
        retired = f"{setup.study_name}.overwritten-{parent_id[:8]}"
        for run_id in [parent_id, *(run.info.run_id for run in tracker.child_runs(parent_id))]:
            tracker.set_tags(run_id, {STUDY_TAG: retired})
        parent_id = None
    if parent_id is None:
        parent_id = tracker.start_run(f"study {setup.study_name}", {**tags, "dataset": plan.base.data.dataset})
        if setup.dataset_record:
            tracker.log_dataset(parent_id, setup.dataset_record)
        tracker.log_params(parent_id, {"space": space_param(plan.search),
                                       "dataset": plan.base.data.dataset, "num_trials": plan.search.num_trials,
                                       "base": plan.base.to_dict(), "max_concurrent": plan.slots,
                                       "workers_per_trial": plan.base.train.num_workers,
                                       "seeds": json.dumps(study.seeds)})
    else:
        tracker.reopen(parent_id)

    record = plan.record()
    tracker.set_tags(parent_id, {PLAN_TAG: json.dumps(record), BUDGET_PROTOCOL_TAG: record.get("budget_protocol") or "none",
                                 # what every surface names the best trial by (a resume keeps it: check_same_schedule)
                                 SELECTION_TAG: Selection.of(plan.base).to_json()})
    from ..record.mlflow_callback import study_columns

    knobs = loss_knobs()
    save_runs_view(tracker, view_key(setup.study_name), study_columns(
        plan.search.backbones, plan.search.losses, Selection.of(plan.base).key,
        tuple(dict.fromkeys(knob for loss in plan.search.losses for knob in knobs.get(loss, ())))))
    tracker.set_tags(parent_id, {**run_tags(plan.base),
                                 "command_line": redact(" ".join(study.command_line)), "code_version": code_version(),
                                 "dataset_checksums": json.dumps(setup.dataset.checksums, sort_keys=True),
                                 "study_dir": str(study.study_dir)})
    return parent_id


@dataclass
class StudyOutcome:
    rows: list[dict[str, Any]]     # one summary per trial
    interrupted: bool = False      # stopped before every trial ended: resumable
    optuna_summary: str = ""       # parameter importances and the optuna-dashboard command
    stop_signal: int | None = None  # the signal that stopped it (SIGINT, SIGTERM), if one did
    parent_run_id: str | None = None  # the study's MLflow parent run


def run_study(study: Study, example_history: list[str]) -> StudyOutcome:
    """Runs (or resumes) the study. On SIGINT or SIGTERM it saves its state, records the unfinished
    trials and the parent run as interrupted, and returns ``interrupted=True`` with the signal."""
    spec, setup, plan = study.spec, study.setup, study.plan
    study_dir = study.study_dir
    if spec.overwrite:
        storage.delete(study_dir)
    # before our handlers: ray.init installs a SIGTERM handler of its own
    init_ray(spec.address, dashboard=spec.starts_ray_dashboard)
    with interrupt.stop_signals():
        tracker = Tracker(setup.tracking_uri, experiment_name(plan.base.data.dataset))
        parent_id = open_parent_run(tracker, study)
        try:
            outcome = _run_tuner(study, tracker, parent_id, example_history)
        except KeyboardInterrupt:  # a signal outside Tune's loop (start-up, figures): Tune's saved state holds
            outcome = StudyOutcome([], interrupted=True)
        outcome.stop_signal = interrupt.received()
        outcome.parent_run_id = parent_id
        if outcome.interrupted:
            tracker.set_tags(parent_id, {OUTCOME_TAG: INTERRUPTED})
            tracker.end_run(parent_id, "KILLED")
        return outcome


def _run_tuner(study: Study, tracker: Tracker, parent_id: str, example_history: list[str]) -> StudyOutcome:
    """Builds (or restores) the Tuner, runs it, and records the study's end in the parent run."""
    from ray import tune

    from ..record.mlflow_callback import MlflowStudyCallback, log_study_summary
    from ..search import optuna_storage, optuna_summary

    spec, setup, plan = study.spec, study.setup, study.plan
    study_dir = study.study_dir
    started = time.monotonic()
    selection = Selection.of(plan.base)  # the one value Optuna, ASHA, the progress lines and every table read
    train_root = storage.join(study_dir, "train_runs")

    def make_callbacks(num_trials: int) -> list[Any]:  # the recorder first (repeats.py reads it)
        recorder = MlflowStudyCallback(setup.tracking_uri, experiment_name(plan.base.data.dataset), parent_id,
                                       setup.study_name, train_root,
                                       {"base": plan.base.to_dict(), "knobs": loss_knobs()},
                                       example_history, run_tags(plan.base), setup.dataset_record)
        return [recorder, ProgressCallback(selection.key, num_trials)]

    # per worker; a trial has the base config's num_workers (--workers-per-trial)
    resources = Resources(plan.base.train.num_workers, setup.cpus_per_trial, spec.gpus_per_trial,
                          memory_bytes(spec))
    callbacks = make_callbacks(plan.search.num_trials)
    recorder = callbacks[0]

    shipped = pack(plan.base.data)  # read once here: trials on any node load it from Ray's object store
    trainable = make_trainable(plan.base, train_root, resources, spec.driver_resource, shipped)
    storage_url = setup.optuna_storage or optuna_storage.resolve_storage_url(None, setup.tracking_uri,
                                                                              setup.output_dir)
    optuna_name = optuna_storage.optuna_study_name(plan.base.data.dataset, setup.study_name)
    if spec.retry_failed:  # trials that failed for their own reason (non-finite loss, memory) run again
        from .trial import forget_failures

        forget_failures(train_root)
    live_callbacks.register(str(study_dir), callbacks)  # what the run's LiveCallbacks call, also after a restore
    if study_state_exists(study.study_dir):  # the restored searcher keeps the storage it was started with
        recorded = tracker.client.get_run(parent_id).data.tags.get(optuna_storage.STORAGE_TAG)
        if recorded is None:  # started before studies had an Optuna storage: its searcher has none
            storage_url = None
        elif "***" not in recorded:  # the tag is the URL unless it held a password
            storage_url = recorded
        tuner = tune.Tuner.restore(str(study_dir), trainable, resume_unfinished=True,
                                   resume_errored=spec.retry_failed)
    else:
        tracker.set_tags(parent_id, {optuna_storage.STORAGE_TAG: redact(storage_url),
                                     optuna_storage.OPTUNA_STUDY_TAG: optuna_name})
        searcher = optuna_storage.make_searcher(plan.search, selection, storage_url, optuna_name, spec.search_seed,
                                                spec.enqueue_paper_setting)
        searcher.set_run_record(setup.tracking_uri, experiment_name(plan.base.data.dataset), setup.study_name,
                                plan.base.train.seed)
        from .trial import FAILURE_FILE

        searcher.set_failure_record(train_root, FAILURE_FILE)  # an out-of-memory trial: infeasible, not vanished
        note = optuna_storage.startup_note(plan.search)
        if note:
            print(note, file=sys.stderr)
        # rungs count epochs; max_t one past the last, so that ASHA never cuts the last epoch off from its test
        scheduler = PerMethodASHA(metric=selection.key, mode=selection.mode, max_t=plan.base.train.epochs + 1,
                                  grace_period=plan.fit.asha_grace_period, train_root=train_root)
        tuner = tune.Tuner(trainable, tune_config=tune.TuneConfig(
            search_alg=searcher, scheduler=scheduler, num_samples=plan.search.num_trials,
            max_concurrent_trials=plan.slots, time_budget_s=spec.budget_s),
            run_config=tune.RunConfig(name=setup.study_name, storage_path=setup.output_dir,
                                      callbacks=run_callbacks(str(study_dir)), verbose=0,
                                      # a crashed trial restarts from its last checkpoint (trial.py)
                                      failure_config=tune.FailureConfig(max_failures=spec.max_failures)))
    # a trial actor's exit traceback at its teardown: into the Ray session's logs, not before the result table
    worker_output.exit_tracebacks_to_log(session_log)
    with interrupt.tune_running():
        results = tuner.fit()
    rows = summarize_results(results, plan.base.train.seed)
    interrupted = (bool(recorder.interrupted) or interrupt.received() is not None
                   or (spec.budget_s is None and len(rows) < plan.search.num_trials))
    if interrupted:
        return StudyOutcome(rows, interrupted=True)

    evaluate_pruned_trials(tracker, parent_id, train_root, resources.cpus_per_worker, resources.gpus_per_worker,
                           shipped)
    if plan.run_repeat_seeds:
        from .repeats import run_repeats

        remaining = None if spec.budget_s is None else spec.budget_s - (time.monotonic() - started)
        if remaining is not None and remaining <= 0:
            print("the budget ran out in the search: no repeats on seeds "
                  f"{list(plan.run_repeat_seeds)}", file=sys.stderr)
        else:
            methods = len(plan.search.backbones) * len(plan.search.losses)
            repeat_callbacks = make_callbacks(methods * len(plan.run_repeat_seeds))
            repeated, interrupted = run_repeats(study, tracker, trainable, repeat_callbacks, remaining)
            rows += repeated
            if interrupted:
                return StudyOutcome(rows, interrupted=True)

    log_study_figures(tracker, parent_id, rows, plan.base.train.beam_size, setup.study_name)
    log_study_summary(tracker, parent_id, setup.study_name)
    summary = optuna_summary.log_study_artifacts(tracker, parent_id, storage_url, optuna_name) \
        if storage_url else "this study was started without an Optuna storage: no importances or Optuna plots"
    tracker.set_tags(parent_id, {OUTCOME_TAG: "finished"})
    tracker.end_run(parent_id, "FINISHED")
    return StudyOutcome(rows, optuna_summary=summary)

