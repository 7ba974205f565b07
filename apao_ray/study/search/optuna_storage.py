"""The searcher's Optuna study in an RDB storage (SQLite beside the MLflow database by default).

Persisting the study is what makes ``optuna-dashboard <url>``, ``optuna.importance`` and Optuna's
own plots work on a study, running or finished. Tune still owns the trials: ``Tuner.restore``
restores the searcher from its pickle, which reconnects to the same storage (an ``RDBStorage``
pickles as its URL), so a resumed study keeps its Optuna trials, never re-creates them.

Two things the storage changes, handled here:
- a driver killed between the searcher's ``ask`` and Tune's next save leaves a RUNNING Optuna trial
  that the restored searcher does not know. It is put back to WAITING, so the next ``ask`` takes it
  again, with its number: the trial number decides which (backbone, loss) runs (``space.py``), and a
  skipped number would shift every later trial to another method.
- a fresh start (no Tune state) under a study name that the storage already holds drops the old
  Optuna study: its trials belong to a Tune run that no longer exists.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import optuna
from optuna.samplers import BaseSampler, TPESampler
from optuna.trial import TrialState
from ray.tune.search.optuna import OptunaSearch

from ...paths import tool_command
from ...protocol import Selection
from ...tracking import Tracker, redact, require_database_driver
from ...tracking.store import first_line, opened_despite_schema_race
from .scheduler import TIME_ATTR
from ..spec.space import SEPARATOR, SearchSpec
from ... import storage
from ...names import train_run_name
from ..record.outcomes import STUDY_TAG, TRIAL_TAG, failure_outcome

OPTUNA_DB_NAME = "optuna.db"
STORAGE_TAG = "apao.optuna_storage"  # on the parent run: where the study's Optuna trials are
OPTUNA_STUDY_TAG = "apao.optuna_study"
SELECTION_ATTR = "selection"  # the Optuna study's user attribute: the study's protocol.Selection
# TPE samples at random until a (backbone, loss) has this many COMPLETE or PRUNED trials (its paper
# setting counts as one). Why 4: with Optuna's gamma(n) = ceil(0.1 n), TPE's "good" density holds one
# trial up to n = 10 and its "bad" density the rest; with 4 observations the first TPE proposal is
# drawn near the best of them and away from 3 others. With fewer, the bad density is mostly Optuna's
# prior and TPE is a random draw with extra steps.
STARTUP_TRIALS_PER_METHOD = 4
# the constraint an out-of-memory trial violates (its own memory, or its --memory-per-trial-gib cap): its knobs
# are infeasible there, which TPE learns from (mark_infeasible); optuna-dashboard shows it on the trial
OUT_OF_MEMORY = "out_of_memory"


def resolve_storage_url(url: str | None, tracking_uri: str, output_dir: Path) -> str:
    """``--optuna-storage`` (a SQLAlchemy URL or a plain path to a SQLite file), else ``optuna.db``
    beside a SQLite MLflow database, else ``<output_dir>/optuna.db``; SQLite paths made absolute
    (a trial's working directory is not the driver's)."""
    if url is None:
        if tracking_uri.startswith("sqlite:///"):
            return "sqlite:///" + str(Path(tracking_uri[len("sqlite:///"):]).parent / OPTUNA_DB_NAME)
        return "sqlite:///" + str(Path(output_dir).resolve() / OPTUNA_DB_NAME)
    if "://" not in url:  # a plain path
        return "sqlite:///" + str(Path(url).expanduser().resolve())
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        return url if path.startswith("/") else "sqlite:///" + str(Path(path).expanduser().resolve())
    require_database_driver(url, "--optuna-storage")  # a bad URL or a missing driver: refused before Ray starts
    return url


def optuna_study_name(dataset: str, study_name: str) -> str:
    """One storage can hold the studies of several datasets, which may share a study name."""
    return f"apao-{dataset}/{study_name}"


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """An ``RDBStorage`` (``OptunaSearch`` refuses a URL string); creates a SQLite file's directory. Optuna creates
    its tables when it first opens a database: two studies started together into a new one both do."""
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    try:
        return opened_despite_schema_race(lambda: optuna.storages.RDBStorage(url))
    except Exception as error:  # a server that does not answer, a password refused
        raise ValueError(f"cannot open the Optuna storage {redact(url)!r}: {first_line(error)}") from None


def drop_stale_study(storage: optuna.storages.RDBStorage, name: str) -> int:
    """Deletes Optuna study ``name`` if it exists; returns how many trials it had (0 if none)."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return 0
    num_trials = len(storage.get_all_trials(study_id, deepcopy=False))
    storage.delete_study(study_id)
    return num_trials


def dashboard_command(url: str) -> str:
    return f"{tool_command('optuna-dashboard')} {redact(url)}"


class _MethodView:
    """A study as one (backbone, loss) sees it: only the trials that have its parameters."""

    def __init__(self, study: optuna.Study, prefix: str) -> None:
        self._study, self._prefix = study, prefix

    def _get_trials(self, *args: Any, **kwargs: Any) -> list[optuna.trial.FrozenTrial]:
        trials = self._study._get_trials(*args, **kwargs)
        return [t for t in trials if any(name.startswith(self._prefix) for name in t.distributions)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


class PerMethodTPESampler(BaseSampler):
    """Independent TPE per (backbone, loss), each with its own startup trials.

    Optuna's TPE counts startup trials over the whole study and splits all trials into good and bad
    by value: in a study of several methods (baselines included) one method's knobs would be modelled
    from whether *other* methods scored well. Here each method's parameters (named
    ``backbone__loss__knob``) are sampled from that method's trials alone.

    Each trial's draws come from a generator seeded by (seed, trial number), not from one generator
    that runs through the study: a searcher restored from an older pickle would otherwise replay the
    draws of trials it asked after that pickle (and a re-asked lost trial keeps its params anyway).
    """

    def __init__(self, seed: int | None = None, n_startup_trials: int = STARTUP_TRIALS_PER_METHOD) -> None:
        self.seed, self.n_startup_trials = seed, n_startup_trials
        self._current: tuple[int, TPESampler] | None = None

    def _tpe_for(self, trial_number: int) -> TPESampler:
        if self._current is None or self._current[0] != trial_number:
            seed = None if self.seed is None else (self.seed * 1_000_003 + trial_number) % 2**32
            self._current = (trial_number, TPESampler(seed=seed, n_startup_trials=self.n_startup_trials,
                                                      multivariate=False))
        return self._current[1]

    def reseed_rng(self) -> None:
        self._current = None

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        prefix = param_name.rsplit(SEPARATOR, 1)[0] + SEPARATOR
        return self._tpe_for(trial.number).sample_independent(_MethodView(study, prefix), trial, param_name,
                                                               param_distribution)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        self._tpe_for(trial.number).after_trial(study, trial, state, values)


def objective_name(metric: str) -> str:
    """What optuna-dashboard calls the objective: ``val/ndcg_at_10`` for the searched ``best/val/ndcg_at_10``
    (each trial's value is its best epoch's)."""
    return metric.removeprefix("best/")


class PersistentOptunaSearch(OptunaSearch):
    """``OptunaSearch`` whose restore puts back the Optuna trials a killed driver left behind, whose
    intermediate values are keyed by epoch (Ray's are by ``training_iteration``, which restarts at 1 when a
    trial resumes: Optuna then ignored the resumed epochs as steps already reported), and whose trials say
    what they ran: the objective's name, and user attributes (``backbone`` and ``loss`` from the space; ``seed``,
    ``tune_trial_id`` and ``mlflow_run_id`` here) set while the trial runs (Optuna refuses to change a finished trial)."""

    def set_run_record(self, tracking_uri: str, experiment: str, study_name: str, seed: int) -> None:
        """Where each trial's MLflow run is (found by its Tune trial id) and the seed search trials train on."""
        self._run_record = (tracking_uri, experiment, study_name, seed)

    def set_failure_record(self, train_root: str, failure_file: str) -> None:
        """Where a trial that failed for good left its reason: ``<train_root>/<train run name>/<failure_file>``
        (training/worker.py ``leave_failure``); it tells an infeasible trial from any other failure."""
        self._failure_record = (train_root, failure_file)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if error and trial_id not in self._completed_trials and trial_id in self._ot_trials:
            constraint = self._infeasible_for(trial_id)
            if constraint is not None:
                mark_infeasible(self._ot_study, self._ot_trials[trial_id], constraint)
                self._completed_trials.add(trial_id)
                return
        super().on_trial_complete(trial_id, result, error)

    def _infeasible_for(self, trial_id: str) -> str | None:
        """The constraint a failed trial broke (``OUT_OF_MEMORY``), or None: a failure that says nothing of its
        knobs (a crashed node, a bug) stays a FAIL, which the sampler leaves out."""
        record = getattr(self, "_failure_record", None)  # None in a searcher pickled before it existed
        if record is None:
            return None

        train_root, failure_file = record
        reason = storage.read_text(storage.join(storage.absolute(train_root), train_run_name(trial_id), failure_file))
        return OUT_OF_MEMORY if reason is not None and failure_outcome(reason) == "out of memory" else None

    def suggest(self, trial_id: str) -> dict | None:
        config = super().suggest(trial_id)
        if self._ot_study.metric_names is None:
            with warnings.catch_warnings():  # experimental since Optuna 3.2, still in 5.0
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self._ot_study.set_metric_names([objective_name(self.metric)])
        return config

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if result.get("done") or TIME_ATTR not in result or self.metric not in result:
            return  # the final (test) report repeats the last epoch; its value reaches on_trial_complete
        if trial_id in self._completed_trials:
            return super().on_trial_result(trial_id, result)  # Ray's own warning
        trial = self._ot_trials[trial_id]
        if "mlflow_run_id" not in trial.user_attrs:  # the MLflow run exists once the trial reports
            for key, value in self._trial_attrs(trial_id).items():
                trial.set_user_attr(key, value)
        trial.report(result[self.metric], int(result[TIME_ATTR]))

    def _trial_attrs(self, trial_id: str) -> dict[str, Any]:
        record = getattr(self, "_run_record", None)  # None in a searcher pickled before it existed
        if record is None:
            return {}

        tracking_uri, experiment, study_name, seed = record
        try:  # a label: a tracking server that does not answer this once must not stop the search
            run_id = Tracker(tracking_uri, experiment).find_run({TRIAL_TAG: trial_id, STUDY_TAG: study_name})
        except Exception as error:  # MlflowException, a connection error
            print(f"Optuna trial of {trial_id}: its MLflow run was not found ({error})", file=sys.stderr)
            run_id = None
        return {"seed": seed, "tune_trial_id": trial_id, **({"mlflow_run_id": run_id} if run_id else {})}

    def restore(self, checkpoint_path: str) -> None:
        super().restore(checkpoint_path)
        requeue_lost_trials(self._ot_study, {t._trial_id for t in self._ot_trials.values()})


def mark_infeasible(study: optuna.Study, trial: optuna.Trial, constraint: str) -> None:
    """Ends a running Optuna trial as infeasible: ``constraint`` violated (Optuna's ``Trial.set_constraint``, value
    1 > 0), told PRUNED as it has no objective value. TPE leaves a FAIL out of what it learns; an infeasible
    trial it ranks below every feasible one, so its knobs' region is drawn less."""
    trial.set_constraint(constraint, 1.0)
    study.tell(trial, state=TrialState.PRUNED)


def requeue_lost_trials(study: optuna.Study, known_trial_ids: set[int]) -> list[int]:
    """RUNNING trials that no Tune trial holds -> WAITING (asked again, same number); returns their numbers."""
    storage = study._storage  # the storage the restored study writes to (a cache over the RDB)
    lost = [t for t in storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.RUNNING,))
            if t._trial_id not in known_trial_ids]
    for trial in lost:
        storage.set_trial_state_values(trial._trial_id, TrialState.WAITING)
    if lost:
        print(f"Optuna: trial(s) {[t.number for t in lost]} were asked by a driver that was killed before Tune "
              "saved them; they are asked again", file=sys.stderr)
    return [t.number for t in lost]


def make_searcher(spec: SearchSpec, selection: Selection, storage_url: str, study_name: str, seed: int,
                  enqueue_paper_setting: bool = True) -> PersistentOptunaSearch:
    """The searcher of a fresh study: its Optuna study in ``storage_url`` (an old one of the same name
    is dropped), baselines and (when asked) the paper settings enqueued first; it searches on the study's
    ``selection`` (its key and direction), recorded as the Optuna study's user attribute ``selection``."""
    storage = open_storage(storage_url)
    dropped = drop_stale_study(storage, study_name)
    if dropped:
        print(f"Optuna: dropped the {dropped} trial(s) of an earlier study {study_name!r} in {redact(storage_url)} "
              "(its Tune state is gone; this study starts afresh)", file=sys.stderr)
    searcher = PersistentOptunaSearch(spec.define_by_run(), metric=selection.key, mode=selection.mode,
                                      points_to_evaluate=spec.points_to_evaluate(enqueue_paper_setting),
                                      sampler=PerMethodTPESampler(seed=seed), study_name=study_name, storage=storage)
    searcher._ot_study.set_user_attr(SELECTION_ATTR, asdict(selection))
    return searcher


def startup_note(spec: SearchSpec) -> str | None:
    """Says so when the budget leaves TPE nothing to do (every tuned trial a startup trial); silent when
    every tuned knob is fixed (nothing to search)."""
    if spec.num_trials and any(spec.searches(loss) for loss in spec.losses) \
            and spec.trials_per_tuned <= STARTUP_TRIALS_PER_METHOD:
        return (f"note: TPE proposes a method's knobs once it has {STARTUP_TRIALS_PER_METHOD} finished trials; with "
                f"{spec.trials_per_tuned} trials per tuned method this study is the paper setting plus random draws "
                f"(--num-samples {2 * STARTUP_TRIALS_PER_METHOD} gives TPE {STARTUP_TRIALS_PER_METHOD} proposals)")
    return None
