"""Best configurations out of MLflow alone (no Ray): tables, registry aliases, study figures."""
from __future__ import annotations

import csv
import io
import json
from typing import Any

from ...analysis.bar import TRAINING_FREE, bar_words, metric_means, with_bar
from ...analysis.heuristics import HEURISTIC_LABELS
from ...analysis.export import cost_totals, trial_record
from ...analysis.outcome import FAILED, PRUNED_STATE, Outcome, best_trial
from ...analysis.results import EARLY_LEARNING, is_early_learning, joined_verdicts, popularity_check, recorded_knobs, \
    seeds_text
from ...analysis.ties import tie_text, tied
from ...names import PLAN_TAG, WALL
from ...protocol import PROTOCOL_TAG, Selection, recorded_selection, schedule_label
from ...rank_metrics import PER_USER_METRICS
from ...tracking import Tracker
from ..spec.space import PAPER_KNOBS, knob_names
from .outcomes import short_reason
from .seeds import STD_SUFFIX, TEST_COLUMNS, RunSource, seed_columns, seed_methods, significance_cells, \
    significance_column
from ...analysis.subsets import method_labels, subset_table

COST_COLUMNS = ("cost/wall_seconds", "cost/cpu_seconds", "cost/peak_rss_mb", "cost/energy_kwh")
CHOSEN_TIME = "chosen_trial/wall_seconds"  # the chosen trial's own wall time, beside the cost of all the method's


def study_parents(tracker: Tracker, study: str | None = None) -> list[Any]:
    """The parent run of ``study`` (of every study in the experiment without one)."""
    study_filter = f" and tags.`apao.study` = '{study}'" if study else ""
    return tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'" + study_filter,
                                      max_results=1000)


def study_selection(tracker: Tracker, study: str | None = None) -> Selection:
    """The selection ``study`` recorded (``protocol.recorded_selection``: every study read must share it)."""
    return recorded_selection((parent.data.tags, parent.data.params) for parent in study_parents(tracker, study))


def shown_key(metric: str | None, selection: Selection) -> str:
    """The validation column a table shows: ``metric`` (``recall_at_20`` or ``best/val/recall_at_20``), else the
    selection's. It shows; the winner is always the selection's."""
    if not metric:
        return selection.key
    return metric if "/" in metric else f"best/val/{metric}"


def best_rows(tracker: Tracker, metric: str | None = None, study: str | None = None,
              selection: Selection | None = None) -> list[dict[str, Any]]:
    """For each (backbone, loss): the finished search trial (not a repeat on another seed) that the study's
    ``selection`` (default: the one it recorded) names best; ``metric`` adds that validation column to the row
    and never changes the winner."""
    selection = selection or study_selection(tracker, study)
    query = "attributes.status = 'FINISHED'" + (f" and tags.`apao.study` = '{study}'" if study else "")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in map(trial_record, tracker.child_runs(filter_string=query)):
        if Outcome(record).finished and not Outcome(record).is_repeat:
            groups.setdefault((record["tags"].get("backbone", "?"), record["tags"].get("loss", "?")), []).append(record)
    best = {key: best_trial(records, selection, lambda r: r) for key, records in groups.items()}
    rows = []
    for (backbone, loss), record in sorted((key, record) for key, record in best.items() if record is not None):
        tags, metrics = record["tags"], record["metrics"]
        row: dict[str, Any] = {"backbone": backbone, "loss": loss}
        row.update(run_knobs(record["params"]))
        row.update({key: metrics.get(key) for key in dict.fromkeys((selection.key, shown_key(metric, selection)))})
        row["tie"] = tie_text(tied(groups[(backbone, loss)], lambda r: r["metrics"].get(selection.key), record),
                              selection.key, metrics[selection.key]) or None
        row.update({k: metrics.get(k) for k in TEST_COLUMNS})
        row[CHOSEN_TIME] = metrics.get(WALL)  # its own; cost/* are all the method's trials (table_rows)
        # MLflow 3 keeps models as LoggedModels (models:/m-...); runs:/<id>/model also loads
        model_uri = tags.get("apao.model_uri", f"runs:/{record['run_id']}/model")
        row.update({"run_id": record["run_id"], "model_uri": model_uri, "study": tags.get("apao.study"),
                    # runs from before protocols existed followed the paper's knobs
                    "protocol": tags.get(PROTOCOL_TAG, "paper"), "schedule": _schedule(record["params"])})
        rows.append(row)
    return rows


def _schedule(params: dict[str, str]) -> str:
    epochs, patience = params.get("base.train.epochs"), params.get("base.train.patience")
    return schedule_label(int(epochs), int(patience)) if epochs and patience else "unknown"


def paper_comparability(rows: list[dict[str, Any]]) -> str:
    """One line saying whether the test columns compare with paper Table 1: only when every row
    trained on the paper's schedule (200 epochs, patience 20), whichever protocol it followed."""
    rows = [row for row in rows if row.get("schedule")]  # a method without a finished trial has no test columns
    if not rows:
        return "test columns: none, no trial finished"
    short = sorted({str(row["schedule"]) for row in rows if row["schedule"] != "paper"})
    protocols = sorted({str(row.get("protocol")) for row in rows})
    if not short:
        return (f"test columns: the paper's schedule (200 epochs, patience 20), protocol {protocols}: "
                "comparable to paper Table 1")
    return (f"test columns NOT comparable to paper Table 1: trained with schedule {short} (protocol {protocols}); "
            "the paper trained up to 200 epochs with patience 20, and a shorter run also ends its cosine schedule sooner")


def table_rows(tracker: Tracker, metric: str | None = None, study: str | None = None,
               baseline: str | None = "ce", num_resamples: int = 10_000,
               heuristics: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A row for every (backbone, loss) that the studies asked for: the best finished trial's by the study's
    recorded selection (``study_selection``; ``metric`` only adds its validation column, and picks the test metric
    compared), else one whose ``status`` says why none finished ("all 3 trials pruned", "failed: <reason>", ...).

    A finished row's test columns are the mean over its seeds (the best trial and its repeats with
    ``--seeds``; one seed: the trial's own values), with ``<metric> std``, ``seeds`` and ``n_seeds``, the
    paired difference against ``baseline`` on the test metric that matches ``metric`` (over seeds and users with
    a Holm-corrected p, or users only labelled ``1 seed``: ``analysis.stats``; None: not computed; labelled ``early learning (not converged)`` when either method had not
    converged), ``converged`` (``analysis.results.convergence`` of its seeds' validation curves; with
    ``heuristics``, the training-free baselines' per-user test tables by name (``analysis.bar.heuristic_tables``),
    also ``popularity_check`` and the last-item bar, ``analysis.bar``), and the
    ``cost/*`` of every trial of the method summed (peak memory: the largest). A method the plan deferred has a
    row whose ``status`` is the plan's reason. A method whose trials were all pruned keeps the validation (and,
    once tested on its best checkpoint, test) metrics of its best pruned trial, so the table shows how far behind
    it was. With ``heuristics``, each heuristic follows as a row of its own (``status`` ``training-free``) with
    the same test columns.
    """
    selection = study_selection(tracker, study)
    rows, records, methods = _best_methods(tracker, selection, study, metric)
    # the test metric that matches the shown metric (per-user tables hold every registered one)
    shown = shown_key(metric, selection).rsplit("/", 1)[-1]
    compared = shown if shown in PER_USER_METRICS else "ndcg_at_10"
    cells = significance_cells(methods, baseline, compared, num_resamples) if baseline else {}
    converged = {(m.backbone, m.loss): _convergence(m, heuristics) for m in methods}
    for row, method in zip(rows, methods):  # both in best_rows' order
        row.update(seed_columns(method))
        row["converged"] = converged[(method.backbone, method.loss)]
        if baseline:
            cell = cells[(method.backbone, method.loss)]
            if method.loss != baseline and is_early_learning(row["converged"],
                                                             converged.get((method.backbone, baseline), "")):
                cell = f"{EARLY_LEARNING}: {cell}"  # a short run's figure: never shown bare
            row[significance_column(baseline, compared)] = cell
    rows = _requested_rows(tracker, rows, records, selection, study)
    costs = cost_totals(records)
    for row in rows:
        row.update({key: costs.get((row["backbone"], row["loss"]), {}).get(key) for key in COST_COLUMNS})
    return rows + _heuristic_rows(heuristics)


def _best_methods(tracker: Tracker, selection: Selection, study: str | None, metric: str | None = None
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """The best rows (``best_rows``, status ``finished``), the records of the study's child runs, and a ``Method``
    per best row with its seeds (in the rows' order)."""
    rows = [{**row, "status": "finished"} for row in best_rows(tracker, metric, study, selection)]
    children = tracker.child_runs(filter_string=f"tags.`apao.study` = '{study}'" if study else "")
    records = [trial_record(run) for run in children]
    return rows, records, seed_methods(RunSource(study or "all", records, tracker, selection=selection),
                                       [row["run_id"] for row in rows])


def subset_lines(tracker: Tracker, study: str, dataset: Any, heuristics: dict[str, Any], baseline: str = "ce",
                 num_resamples: int = 10_000) -> list[str]:
    """The study's best methods on memorization and generalization test cases (``analysis.subsets``) beside the
    training-free baselines (per-user tables ``heuristics`` by name), as markdown; nothing without per-user tables."""
    methods = _best_methods(tracker, study_selection(tracker, study), study)[2]
    tables = [t for m in methods for t in (trial.per_user() for trial in m.trials) if t is not None]
    found = method_labels(tables, dataset) if tables else None
    if found is None:
        return []
    labels, source = found
    named = {HEURISTIC_LABELS[name]: table for name, table in heuristics.items()}
    return [f"**Memorization and generalization (test)**: a case is `memorization` when its history's last item "
            f"followed by its target occurs in training (labels {source})", "",
            *subset_table(methods, labels, named, baseline, num_resamples)]


def _heuristic_rows(heuristics: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The training-free baselines as rows with the methods' test columns: the bar the table is read against."""
    metrics = [column.removeprefix("test/") for column in TEST_COLUMNS]
    return [{"backbone": "-", "loss": HEURISTIC_LABELS[name], **dict(zip(TEST_COLUMNS, metric_means(table, metrics))),
             "converged": TRAINING_FREE, "status": TRAINING_FREE} for name, table in (heuristics or {}).items()]


def _convergence(method: Any, heuristics: dict[str, Any] | None) -> str:
    """A method still learning steeply at its last epoch (``still rising``), or no better than recommending the
    most popular items (``heuristics``' popularity, when given: ``no better than popularity``), has not converged,
    each reason in its own words; one not clearly above the last-item heuristic says so too (``analysis.bar``)."""
    verdicts = [method.convergence]
    if heuristics and "popularity" in heuristics:
        verdicts.append(popularity_check(method, heuristics["popularity"]["ndcg_at_10"].to_numpy(float)))
    return with_bar(joined_verdicts(v for v in verdicts if v), bar_words(method, heuristics))


def _requested_rows(tracker: Tracker, rows: list[dict[str, Any]], records: list[dict[str, Any]],
                    selection: Selection, study: str | None) -> list[dict[str, Any]]:
    """``rows`` and a row for every requested (backbone, loss) without a finished trial, sorted."""
    requested: dict[tuple[str, str], None] = {}
    deferred: dict[tuple[str, str], str] = {}  # the plan's reason a method has no trials
    for parent in study_parents(tracker, study):
        space = json.loads(parent.data.params.get("space", "{}"))
        requested.update({(b, l): None for b in space.get("backbones", ()) for l in space.get("losses", ())})
        for name, reason in json.loads(parent.data.tags.get(PLAN_TAG, "{}")).get("deferred", {}).items():
            deferred[tuple(name.split("/", 1))] = reason
    for backbone, loss in sorted(set(requested) - {(row["backbone"], row["loss"]) for row in rows}):
        runs = [r for r in records if (r["tags"].get("backbone"), r["tags"].get("loss")) == (backbone, loss)]
        status = deferred[(backbone, loss)] if not runs and (backbone, loss) in deferred else why_none_finished(runs)
        row: dict[str, Any] = {"backbone": backbone, "loss": loss, "status": status}
        record = best_trial(runs, selection, lambda r: r)
        if record is not None:
            row.update(run_knobs(record["params"]))
            row[selection.key] = record["metrics"][selection.key]
            row.update({k: record["metrics"].get(k) for k in TEST_COLUMNS})
            row.update({"run_id": record["run_id"], "study": record["tags"].get("apao.study")})
        rows.append(row)
    return sorted(rows, key=lambda r: (r["backbone"], r["loss"]))


def why_none_finished(records: list[dict[str, Any]]) -> str:
    """``all N trials pruned`` / ``failed: <reason>`` / counts of each ending, for a method without a finished trial
    (its runs' records, ``analysis.export.trial_record``)."""
    if not records:
        return "no trial ran"
    outcomes = [Outcome(record) for record in records]
    failed = [outcome for outcome in outcomes if outcome.state == FAILED]
    if all(outcome.state == PRUNED_STATE for outcome in outcomes):
        return f"all {len(outcomes)} trials pruned"
    if failed:
        counts = f"{len(failed)} of {len(outcomes)} trials " if len(outcomes) > 1 else ""
        return f"{counts}failed: {short_reason(failed[0].reason)}"
    kinds: dict[str, int] = {}
    for outcome in outcomes:
        kind = outcome.reason.split(":")[0].split(" at epoch")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{count} {kind}" for kind, count in kinds.items())


def _number(text: str | None) -> float | int | None:
    if text is None or text == "None":
        return None
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


# a row's names of the knobs its run recorded (internal: never printed)
RECORDED_KNOBS = "_knobs"


def run_knobs(params: dict[str, str]) -> dict[str, Any]:
    """A run's knobs as the table's columns: every registered knob (None where the run has none) and whatever else
    it recorded as a choice (a plugin's knob, whether or not its loss is loaded here), named in ``RECORDED_KNOBS``."""
    recorded = {k: _number(v) for k, v in recorded_knobs(params).items()}
    return {**{k: None for k in knob_names()}, **recorded, RECORDED_KNOBS: sorted(recorded)}


def format_rows(rows: list[dict[str, Any]], fmt: str = "markdown") -> str:
    if fmt == "json":
        return json.dumps([{k: v for k, v in row.items() if k != RECORDED_KNOBS} for row in rows], indent=2)
    selection = [k for k in rows[0] if k.startswith("best/")] if rows else []
    spread = [k + STD_SUFFIX for k in TEST_COLUMNS] if any((row.get("n_seeds") or 0) > 1 for row in rows) else []
    significance = sorted({k for row in rows for k in row if k.startswith("vs ")})
    costs = [k for k in (*COST_COLUMNS, CHOSEN_TIME) if any(row.get(k) is not None for row in rows)]
    registered = ["registered_model"] if any(row.get("registered_model") for row in rows) else []
    ties = ["tie"] if any(row.get("tie") for row in rows) else []
    # the paper's knobs always (the table's columns before knobs moved to the losses), others where a row has one
    recorded = {k for row in rows for k in row.get(RECORDED_KNOBS, ())}
    knobs = [k for k in knob_names() if k in PAPER_KNOBS or any(row.get(k) is not None for row in rows)]
    knobs += sorted(recorded - set(knobs))  # a plugin's knob the registry loaded here does not declare
    columns = ["backbone", "loss", *knobs, *selection, *TEST_COLUMNS, *spread, "seeds", *significance, *costs,
               "protocol", "schedule", "converged", *ties, "run_id", *registered]
    if any("status" in row for row in rows):
        columns.append("status")
    if fmt == "csv":
        columns.insert(columns.index("seeds") + 1, "n_seeds")
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()
    if fmt != "markdown":
        raise ValueError(f"unknown format {fmt!r}; choose from ['csv', 'json', 'markdown']")
    cell = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_seeds_cell(row) if c == "seeds" else cell(row.get(c)) for c in columns) + " |"
              for row in rows]
    return "\n".join(lines + ["", paper_comparability(rows)])


def _seeds_cell(row: dict[str, Any]) -> str:
    return seeds_text(str(row.get("seeds") or ""), row.get("n_seeds"))


def log_study_figures(tracker: Tracker, parent_run_id: str, rows: list[dict[str, Any]], beam_size: int,
                      study: str) -> None:
    """Per-prefix recall per method, its trials' knobs in the legend, ranked by the study's selection (Optuna's
    own plots come from optuna_storage.py)."""
    from .prefix_recall import log_study_prefix_recall

    log_study_prefix_recall(tracker, parent_run_id, rows, beam_size, study_selection(tracker, study))
