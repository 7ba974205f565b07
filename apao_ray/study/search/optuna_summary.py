"""What a finished study's Optuna trials say: per-method importances (``optuna.importance``), Optuna's plots and
the ``optuna-dashboard`` command, logged to the study's MLflow run; the study's own attributes that explain it in
optuna-dashboard. The storage and the searcher: ``optuna_storage.py``."""
from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

from ...paths import pip_install_hint
from ...tracking import redact
from ..spec.space import SEPARATOR, knob_names
from .optuna_storage import OPTUNA_STUDY_TAG, STORAGE_TAG, dashboard_command, open_storage

# PED-ANOVA (optuna.importance's default) compares a method's top 10% of trials with all of them: below 10
# trials that "top" is one trial, and the shares say which knob that one trial happened to move
MIN_TRIALS_FOR_IMPORTANCE = 10


def load_study(storage_url: str, study_name: str) -> optuna.Study:
    return optuna.load_study(study_name=study_name, storage=open_storage(storage_url))


def method_studies(study: optuna.Study) -> dict[str, optuna.Study]:
    """``"tiger/apao_pointwise"`` -> an in-memory study of that method's COMPLETE trials, its parameters
    named by knob (``beta``), so importance and plots speak of one method at a time."""
    grouped: dict[str, list[optuna.trial.FrozenTrial]] = {}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if not trial.params:  # a baseline
            continue
        backbone, loss, _ = next(iter(trial.params)).split(SEPARATOR)
        grouped.setdefault(f"{backbone}/{loss}", []).append(trial)
    studies = {}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created in memory" per method
    for method, trials in sorted(grouped.items()):
        sub = optuna.create_study(direction=study.direction, study_name=method)
        for trial in trials:
            sub.add_trial(optuna.trial.create_trial(
                params={k.rsplit(SEPARATOR, 1)[1]: v for k, v in trial.params.items()},
                distributions={k.rsplit(SEPARATOR, 1)[1]: d for k, d in trial.distributions.items()},
                value=trial.value, user_attrs={"number": trial.number}))
        studies[method] = sub
    optuna.logging.set_verbosity(verbosity)
    return studies


def varied_params(study: optuna.Study) -> list[str]:
    values: dict[str, set] = {}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        for name, value in trial.params.items():
            values.setdefault(name, set()).add(value)
    return sorted(name for name, seen in values.items() if len(seen) >= 2)


def param_importances(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Per method: ``{"num_trials", "importances": {knob: share}}`` from ``optuna.importance``
    (its default evaluator, PED-ANOVA), or ``"skipped"`` saying why there are none (fewer than
    ``MIN_TRIALS_FOR_IMPORTANCE`` complete trials, or fewer than 2 knobs that varied: importance ranks knobs
    against each other)."""
    result: dict[str, dict[str, Any]] = {}
    for method, sub in method_studies(study).items():
        num_trials, varied = len(sub.trials), varied_params(sub)
        entry: dict[str, Any] = {"num_trials": num_trials}
        if num_trials < MIN_TRIALS_FOR_IMPORTANCE or len(varied) < 2:
            entry["skipped"] = (f"{num_trials} complete trial(s), {len(varied)} varied knob(s): needs "
                                f"{MIN_TRIALS_FOR_IMPORTANCE} and 2")
        else:
            try:
                entry["importances"] = dict(optuna.importance.get_param_importances(sub, params=varied))
            except (ValueError, RuntimeError) as error:
                entry["skipped"] = f"optuna.importance failed: {error}"
        result[method] = entry
    return result


def importance_table(importances: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per method that has importances, one column per knob (shares sum to 1)."""
    rows = {m: e["importances"] for m, e in importances.items() if "importances" in e}
    if not rows:
        return ""
    knobs = [k for k in knob_names() if any(k in r for r in rows.values())]
    lines = ["| method | trials | " + " | ".join(knobs) + " |", "|---|---|" + "---|" * len(knobs)]
    for method, row in rows.items():
        cells = [f"{row[k]:.2f}" if k in row else "-" for k in knobs]
        lines.append(f"| {method} | {importances[method]['num_trials']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def log_study_artifacts(tracker: Any, parent_run_id: str, storage_url: str, study_name: str) -> str:
    """Logs ``optuna/param_importances.json`` and Optuna's matplotlib plots (optimization history;
    slice and param importances per method) to the parent run; returns the summary to print: the
    importance table (when there is one) and the ``optuna-dashboard`` command."""
    from ..record import plots

    try:
        study = load_study(storage_url, study_name)
    except KeyError:  # the storage was replaced or cleared while the study ran: its trials are in MLflow still
        return f"Optuna study {study_name!r} is not in {redact(storage_url)}: no importances or Optuna plots"
    importances = param_importances(study)
    tracker.log_dict(parent_run_id, importances, "optuna/param_importances.json")
    figures = plots.optuna_figures(study, method_studies(study),
                                   {method for method, entry in importances.items() if "importances" in entry})
    for name, figure in figures.items():
        tracker.log_figure(parent_run_id, figure, f"optuna/{name}.png")
        plots.close(figure)
    table = importance_table(importances)
    lines = [f"Optuna parameter importances (optuna.importance, share per knob, per method):\n{table}"] if table else []
    skipped = "; ".join(f"{method}: {entry['skipped']}" for method, entry in importances.items() if "skipped" in entry)
    if skipped:
        lines.append(f"no parameter importance where a method has too few trials to mean something ({skipped})")
    note = importance_note(importances)
    explain_study(study, note, parent_run_id)
    lines.append(f"Optuna study {study_name!r}: {dashboard_command(storage_url)}  ({pip_install_hint('dashboard')} "
                 f"installs it; its importance panel pools every method's trials)")
    return "\n".join(lines)


def importance_note(importances: dict[str, dict[str, Any]]) -> str:
    """What optuna-dashboard's study page says of importance: which methods have enough trials for it."""
    enough = [method for method, entry in importances.items() if "importances" in entry]
    return (f"Parameter importance means something per method with at least {MIN_TRIALS_FOR_IMPORTANCE} trials: "
            f"{', '.join(enough) if enough else 'no method here has that many'}.\n"
            "optuna-dashboard's Hyperparameter Importance panel pools every method's trials; read the per-method "
            "importances (optuna/param_importances.json on the MLflow study run) instead")


def explain_study(study: optuna.Study, note: str, parent_run_id: str) -> None:
    """Study user attributes, the box optuna-dashboard shows beside the study's importance panel: what
    importance means here, and the MLflow run that holds the study."""
    study.set_user_attr("parameter importance", note)
    study.set_user_attr("mlflow_study_run_id", parent_run_id)


def save_answer_note(parent_tags: dict[str, str], given_url: str | None, markdown: str) -> bool:
    """Saves the study's answer (``markdown``: the table its MLflow parent run's description holds) as the note of
    its Optuna study, which optuna-dashboard shows on the study's page. The study is the one the parent's tags name
    (its storage's URL: ``given_url``, the one the study was started with, where the tag hides a password).
    Returns whether it was saved: not without optuna-dashboard (its ``save_note`` writes the note, in its own
    layout), nor for a study started without an Optuna storage or missing from it."""
    try:
        from optuna_dashboard import save_note  # the dashboard extra: nothing to show a note without it
    except ImportError:
        return False
    recorded, name = parent_tags.get(STORAGE_TAG), parent_tags.get(OPTUNA_STUDY_TAG)
    url = given_url if recorded is not None and "***" in recorded else recorded
    if not url or not name:
        return False
    try:
        study = load_study(url, name)
    except KeyError:  # the storage was replaced or cleared while the study ran
        return False
    save_note(study, markdown)
    return True
