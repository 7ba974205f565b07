"""Driver-side Tune callback: one MLflow child run per trial, metrics per epoch, the model.

Runs in the Tune driver only, so every MLflow write comes from one process: concurrent trials
never lock the SQLite store, and a trial's metrics are logged exactly once per result.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ray import tune

from ... import storage
from ...analysis.export import cost_totals, trial_record
from ...config import TrialConfig
from ...names import (ALLOCATOR_KEY, ENERGY_METHOD_KEY, ERROR_TAG, OUTCOME_TAG, PER_USER_FILE, PER_USER_VALID_FILE,
                     PRECISION_KEY, PRUNED, REPEATS_TAG, RESUMED_HISTORY_KEY, SEED_TAG, TEST_BY, WORKER_NODE_KEY,
                     remove_scratch, shown_knob, train_run_name)
from ...rank_metrics import AT_10_METRICS
from ...tracking import Tracker, dataset_record
from ...training.checkpoint import FINAL_METRICS_FILE, newest_checkpoint_at, say_on_stderr
from ..cluster import interrupt
from . import plots, rule_models
from .prefix_recall import log_trial_prefix_recall
from .outcomes import (ALLOCATOR_TAG, ENERGY_TAG, INTERRUPTED, NODE_TAG, PRECISION_TAG,
                       PREVIOUS_ERROR_TAG, PREVIOUS_OUTCOME_TAG, PRUNED_EPOCH_TAG, STOPPED_BY_TUNE,
                       STUDY_TAG, TERMINAL, TRIAL_TAG, describe, failure_outcome, is_final_report, pruned_epoch,
                       seed_tags)
from ..spec.space import trial_choices, trial_config
from .report import TEST_COLUMNS, study_selection, table_rows

MODEL_METRICS = ("test/", "best/val/")  # what a trial's logged model shows on its page: how it tests, why chosen


def final_checkpoint_dir(train_root: str, trial_id: str) -> str | None:
    """The Train run's final checkpoint (best weights, test metrics, catalog), if it finished: a location
    (``storage``) under ``train_root``, which loads (a damaged one is set aside, saying so, and an older one used)."""
    return newest_checkpoint_at(storage.join(train_root, train_run_name(trial_id)), say_on_stderr, final=True)


def child_params(config: TrialConfig, choices: dict[str, Any],
                 loss_knobs: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """A child run's params: the config the trial trained (``base.*``, the study's base with the trial's
    backbone, loss, knobs and seed in it) and its choices (``backbone``, ``loss``, ``beta``...), each value once:
    a ``base.loss.name`` or ``base.loss.beta`` beside ``loss`` and ``beta`` would show the study's base, not this trial.
    With ``loss_knobs`` (each registered loss's knob names), a knob of another loss is left out: a CE run has no
    ``beta``. Knobs are shown to ``KNOB_DIGITS`` significant digits (``trial_config.json`` keeps every digit)."""
    base = config.to_dict()
    del base["model"]["backbone"], base["loss"]["name"]
    others = {k for names in (loss_knobs or {}).values() for k in names} - set((loss_knobs or {}).get(choices["loss"], ()))
    for knob in {*choices, *others}:
        base["loss"].pop(knob, None)
        base["loss"]["extra"].pop(knob, None)
    return {"base": base, **{name: shown_knob(value) for name, value in choices.items()}}


class MlflowStudyCallback(tune.Callback):
    def __init__(self, tracking_uri: str, experiment: str, parent_run_id: str, study_name: str,
                 train_root: str, trial_params: dict[str, Any], example_history: list[str],
                 run_tags: dict[str, str] | None = None, dataset_record: dict[str, Any] | None = None) -> None:
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.parent_run_id, self.study_name = parent_run_id, study_name
        self.train_root = str(train_root)
        self.trial_params = trial_params
        self.example_history = example_history
        self.run_tags = dict(run_tags or {})  # on every child run (apao.protocol, apao.schedule)
        self.dataset_record = dataset_record  # each new child run's dataset input (the UI's Dataset column)
        self.run_ids: dict[str, str] = {}
        self.interrupted: list[str] = []  # trial ids left unfinished when the experiment ended
        self._nodes_tagged: set[str] = set()
        self._tracker: Tracker | None = None

    def __getstate__(self) -> dict[str, Any]:  # pickled into Tune's experiment state
        state = dict(self.__dict__)
        state["_tracker"] = None
        return state

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = Tracker(self.tracking_uri, self.experiment)
        return self._tracker

    def _run_for(self, trial: Any) -> str:
        run_id = self.run_ids.get(trial.trial_id)
        if run_id is None:  # a resumed study reuses the child run of the same trial
            run_id = self.tracker.find_run({TRIAL_TAG: trial.trial_id, STUDY_TAG: self.study_name})
            if run_id is not None:
                self._reopen(run_id)
        if run_id is None:
            choices = trial_choices(trial.config)
            config = trial_config(TrialConfig.from_dict(self.trial_params["base"]), trial.config)
            seeds = seed_tags(trial.config, config.train.seed)
            name = describe(choices) + (f" seed={seeds[SEED_TAG]}" if REPEATS_TAG in seeds else "")
            run_id = self.tracker.start_run(name, {TRIAL_TAG: trial.trial_id, STUDY_TAG: self.study_name,
                                                   "backbone": choices["backbone"], "loss": choices["loss"],
                                                   **seeds, **getattr(self, "run_tags", {})},
                                            child_params(config, choices, self.trial_params.get("knobs")),
                                            parent_run_id=self.parent_run_id)
            if self.dataset_record:
                self.tracker.log_dataset(run_id, self.dataset_record)
        self.run_ids[trial.trial_id] = run_id
        return run_id

    def _reopen(self, run_id: str) -> None:
        """A resumed or retried trial runs again in its own run: how its last attempt ended (interrupted, out of
        memory, ...) becomes its history, not its state, until this attempt ends."""
        tags = self.tracker.client.get_run(run_id).data.tags
        self.tracker.reopen(run_id)
        if OUTCOME_TAG in tags:
            self.tracker.set_tags(run_id, {PREVIOUS_OUTCOME_TAG: tags[OUTCOME_TAG],
                                           OUTCOME_TAG: f"running again (its last attempt: {tags[OUTCOME_TAG]})"})
        if ERROR_TAG in tags:
            self.tracker.set_tags(run_id, {PREVIOUS_ERROR_TAG: tags[ERROR_TAG]})
            self.tracker.client.delete_tag(run_id, ERROR_TAG)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._run_for(trial)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._nodes_tagged.discard(trial.trial_id)  # retried, perhaps elsewhere: its run names the node it ends on

    def _backfill(self, run_id: str, history: list[dict[str, Any]]) -> None:
        """Logs the epochs a resumed trial trained before a driver was killed but whose results never
        reached MLflow (the worker sends its history with the first report after a resume)."""
        # perf/epoch_seconds is in every epoch report (a two-stage trial logs train/ under ce_stage/ first)
        present = {step for step, _ in self.tracker.metric_history(run_id, "perf/epoch_seconds")}
        for entry in history:
            if int(entry.get("epoch", 0)) not in present:
                self.tracker.log_metrics(
                    run_id, {k: v for k, v in entry.items() if "/" in k}, int(entry["epoch"]))

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        run_id = self._run_for(trial)
        if result.get(RESUMED_HISTORY_KEY):
            self._backfill(run_id, result[RESUMED_HISTORY_KEY])
        metrics = {k: v for k, v in result.items() if "/" in k and not k.startswith("config/")}
        if is_final_report(result):  # it repeats the last epoch's values: log only what is new
            metrics = {k: v for k, v in metrics.items()
                       if k.startswith(("test/", f"{TEST_BY}/", "cost/")) or k == "perf/total_seconds"}
            if result.get(ENERGY_METHOD_KEY):
                self.tracker.set_tags(run_id, {ENERGY_TAG: result[ENERGY_METHOD_KEY]})
        step = int(result.get("epoch", result.get("training_iteration", 0)))
        if is_final_report(result) and self._tested_at(run_id, step):
            # the driver died after logging this final report and before the trial completed: resumed from its
            # final checkpoint, the trial tested the same weights again; its run keeps the one test it has
            metrics = {}
        self.tracker.log_metrics(run_id, metrics, step)
        if result.get(WORKER_NODE_KEY) and trial.trial_id not in self._nodes_tagged:
            self.tracker.set_tags(run_id, {NODE_TAG: result[WORKER_NODE_KEY], "apao.node_ip": result.get("node_ip", ""),
                                           PRECISION_TAG: result.get(PRECISION_KEY, ""),
                                           ALLOCATOR_TAG: result.get(ALLOCATOR_KEY, "")})
            self._nodes_tagged.add(trial.trial_id)

    def _tested_at(self, run_id: str, step: int) -> bool:
        """Whether ``run_id`` already holds a final report's test at ``step`` (perf/total_seconds is in every one)."""
        return any(logged == step for logged, _ in self.tracker.metric_history(run_id, "perf/total_seconds"))

    def _finished(self, trial: Any) -> bool:
        """Whether the trial trained to its end and was tested (its final report and checkpoint exist)."""
        return is_final_report(trial.last_result or {}) and final_checkpoint_dir(self.train_root, trial.trial_id) is not None

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self._run_for(trial)
        # left by its workers if the scheduler killed them
        remove_scratch(storage.join(self.train_root, train_run_name(trial.trial_id)))
        location = final_checkpoint_dir(self.train_root, trial.trial_id)
        if not self._finished(trial):
            epoch = pruned_epoch(trial.trial_id)
            tags = {OUTCOME_TAG: f"{PRUNED} {epoch}", PRUNED_EPOCH_TAG: epoch} if epoch is not None else \
                {OUTCOME_TAG: STOPPED_BY_TUNE}
            self.tracker.set_tags(run_id, tags)
            self.tracker.end_run(run_id, "KILLED")
            return
        with storage.local_copy(location) as checkpoint:  # a copy of a checkpoint on an object store
            model_uri = self._log_checkpoint(run_id, trial, checkpoint)
            log_trial_prefix_recall(self.tracker, run_id, json.loads((checkpoint / FINAL_METRICS_FILE).read_text()))
        weights = {key: self.tracker.metric_history(run_id, key) for key in
                   (f"train/apao_weight_m{m}" for m in range(1, 5))}
        if any(weights.values()):
            figure = plots.adaptive_weights_figure({k: v for k, v in weights.items() if v})
            self.tracker.log_figure(run_id, figure, "adaptive_weights.png")
            plots.close(figure)
        self.tracker.set_tags(run_id, {OUTCOME_TAG: "finished", "apao.checkpoint": location,
                                       "apao.model_uri": model_uri})
        self.tracker.end_run(run_id, "FINISHED")
        # the study's row answers while it runs: each method's best trial so far (the study's end logs it again)
        log_study_summary(self.tracker, self.parent_run_id, self.study_name)

    def _log_checkpoint(self, run_id: str, trial: Any, checkpoint: Path) -> str:
        """Logs a finished trial's final checkpoint (a local directory): its metrics, config and per-user tables
        as artifacts, its model and each other selection rule's (``rule_models``) unless a run before a resume
        logged them; returns the trial's own model's URI."""
        self.tracker.log_artifact(run_id, checkpoint / "final_metrics.json")
        self.tracker.log_artifact(run_id, checkpoint / "trial_config.json")
        for table in (PER_USER_FILE, PER_USER_VALID_FILE):
            if (checkpoint / table).exists():  # absent in checkpoints from before they existed
                self.tracker.log_artifact(run_id, checkpoint / table)
        # a trial completed again after a resume (the driver was killed before Tune saved its end) keeps its model
        model_uri = self.tracker.logged_model_uri(run_id)
        if model_uri is not None:  # its metrics too: the kill may have come between logging and linking them
            self.tracker.link_model_metrics(run_id, model_uri, MODEL_METRICS)
        config = trial_config(TrialConfig.from_dict(self.trial_params["base"]), trial.config)
        params = child_params(config, trial_choices(trial.config), self.trial_params.get("knobs"))
        if model_uri is None:
            own_tags = rule_models.model_tags(checkpoint, rule_models.own_rule(checkpoint))
            model_uri = self.tracker.log_recommender(run_id, checkpoint, self.example_history, params, MODEL_METRICS,
                                                     tags=own_tags)
        rule_models.log_rule_models(self.tracker, run_id, checkpoint, self.example_history, params)
        return model_uri

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self._run_for(trial)
        reason = "unknown error"
        error_file = getattr(trial, "error_file", None) or ""
        if error_file and Path(error_file).exists():
            lines = [line for line in Path(error_file).read_text().splitlines() if line.strip()]
            reason = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else reason)
        self.tracker.set_tags(run_id, {OUTCOME_TAG: failure_outcome(reason), ERROR_TAG: reason[-4000:]})
        self.tracker.end_run(run_id, "FAILED")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        """Leaves MLflow agreeing with Tune however the experiment ended (finished, Ctrl-C, or a
        resume after the driver was killed between a trial's end and its MLflow record)."""
        # a stop signal ends the running trials as TERMINATED (Tune's cleanup), like a scheduler's stop;
        # Tune saved them as RUNNING before that, so a resume continues them: they are interrupted
        stopped_by_signal = interrupt.received() is not None
        self.interrupted = [trial.trial_id for trial in trials if trial.status not in TERMINAL
                            or (stopped_by_signal and trial.status == "TERMINATED" and not self._finished(trial))]
        running = {run.data.tags.get(TRIAL_TAG): run.info.run_id
                   for run in self.tracker.child_runs(self.parent_run_id, "attributes.status = 'RUNNING'")}
        for trial in trials:
            run_id = running.pop(trial.trial_id, None)
            if run_id is None:  # already ended in MLflow, or never started
                continue
            if trial.trial_id in self.interrupted:
                self.tracker.set_tags(run_id, {OUTCOME_TAG: INTERRUPTED})
                self.tracker.end_run(run_id, "KILLED")
            elif trial.status == "TERMINATED":
                self.on_trial_complete(0, trials, trial)
            elif trial.status == "ERROR":
                self.on_trial_error(0, trials, trial)
        for trial in trials:  # workers that Tune's cleanup killed left theirs (this node only)
            remove_scratch(storage.join(self.train_root, train_run_name(trial.trial_id)))
        log_cost_per_method(self.tracker, self.parent_run_id)
        for run_id in running.values():  # created just before a kill, never saved by Tune
            self.tracker.set_tags(run_id, {OUTCOME_TAG: "lost: the driver was killed before Tune recorded this "
                                           "trial; a new trial replaced it"})
            self.tracker.end_run(run_id, "KILLED")


def log_cost_per_method(tracker: Tracker, parent_run_id: str) -> dict[str, dict[str, float]]:
    """Sums every child run's ``cost/*`` (wall and CPU seconds, energy; the largest peak memory) per
    (backbone, loss) and logs them on the parent run as ``cost/<backbone>/<loss>/<name>``."""
    totals = {f"{backbone}/{loss}": sums for (backbone, loss), sums in
              cost_totals([trial_record(run) for run in tracker.child_runs(parent_run_id)]).items()}
    tracker.log_metrics(parent_run_id, {f"cost/{method}/{key.removeprefix('cost/')}": value
                                        for method, sums in totals.items() for key, value in sums.items()}, 0)
    return totals


def dataset_record_of(dataset: Any, data_dir: str | None = None) -> dict[str, Any]:
    """The study's dataset as an MLflow dataset input (``tracking.dataset_record``): its name, the
    SHA-256 of its files (the checksums the study already verified), split sizes and where it is."""
    source = "apao_ray.data.synthetic (generated)"
    if dataset.checksums:
        from ...data.files import locate

        files = locate(dataset.name, data_dir, allow_download=False)  # found moments ago: no download
        source = str(files.inter_path.parent)
    sizes = {name: len(split) for name, split in dataset.splits.items()}
    return dataset_record(dataset.name, dataset.checksums, sizes, source,
                          {"num_items": dataset.catalog.num_items, "num_users": len(dataset.user_ids)})


def summary_metric_name(backbone: str, loss: str, metric: str) -> str:
    """``best/tiger/ce/val/ndcg_at_10`` for ``best/val/ndcg_at_10``; ``best/tiger/ce/test/recall_at_10``."""
    return f"best/{backbone}/{loss}/{metric.removeprefix('best/')}"


def study_columns(backbones: tuple[str, ...], losses: tuple[str, ...], metric: str,
                  knobs: tuple[str, ...] = ()) -> list[str]:
    """The runs table's columns for a study: per method, the parent's validation and test summary (the
    collapsed study row answers), then each trial's ``knobs`` (the params its losses tune), validation and test
    metric, its other registered test metrics at 10 (``rank_metrics``), outcome and model."""
    from ...mlflow_ui import column

    test = "test/" + metric.rsplit("/", 1)[-1]
    per_method = [column("metrics", summary_metric_name(backbone, loss, key))
                  for backbone in backbones for loss in losses for key in (metric, test)]
    others = [column("metrics", f"test/{name}") for name in AT_10_METRICS if f"test/{name}" != test]
    return [*per_method, *(column("params", knob) for knob in knobs), column("metrics", metric),
            column("metrics", test), *others, column("tags", OUTCOME_TAG), column("attributes", "Models")]


def log_study_summary(tracker: Tracker, parent_run_id: str, study_name: str) -> dict[str, float]:
    """Gives the parent run the study's result as metrics: per (backbone, loss), the best trial's (by the study's
    selection, as the table names it) validation and test metrics, so the parent's chart view is not empty.
    Returns them."""
    key = study_selection(tracker, study_name).key
    summary: dict[str, float] = {}
    for row in table_rows(tracker, study=study_name, baseline=None):  # means over seeds; no significance needed
        for column in (key, *TEST_COLUMNS):
            if row.get(column) is not None:
                summary[summary_metric_name(row["backbone"], row["loss"], column)] = row[column]
    tracker.log_metrics(parent_run_id, summary, step=0)
    return summary
