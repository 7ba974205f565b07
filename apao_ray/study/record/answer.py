"""The study's answer where MLflow shows it: the parent run's description (a narrow table that fits a 1600-px
window, the notes under it), the wide table as the parent's artifact, and the registered best models
(``register_best``) with their words and tags.

The narrow table keeps what answers the question (method, knobs, validation, test, the difference from the baseline
with its interval, the verdict, a link to the run); each row shows at most ``ANSWER_WIDTH`` characters. What
explains a row (ties, convergence, why a method has no trial, cost) follows as notes; every column is in
``ANSWER_ARTIFACT`` and in what ``sweep`` and ``best`` print.
"""
from __future__ import annotations

import re
from typing import Any

from ...analysis.results import knobs_label
from ...analysis.stats import DEFAULT_CONFIDENCE, INTERVALS_NOTE, ONE_SEED
from ...analysis.ties import TIE_RULE
from ...mlflow_ui import run_link
from ...names import WALL, shown_metric
from ...paths import apao_command
from ...tracking import Tracker
from .report import CHOSEN_TIME, RECORDED_KNOBS, format_rows, paper_comparability

# MLflow keeps a tag value of up to 8,000 characters; the description is the run's page's first text
DESCRIPTION_TAG, DESCRIPTION_LIMIT = "mlflow.note.content", 8000
SUBSETS_ARTIFACT = "memorization_generalization.md"  # on the parent run: the subsets, whole
ANSWER_ARTIFACT = "answer_table.md"  # on the parent run: the table sweep and best print, every column
# the characters a row of the description's table shows (a link shows its label): at ~7 px a character and the
# cells' padding, 150 fit the description's column of a 1600-px window beside MLflow's "About this run"
ANSWER_WIDTH = 150
_DIFFERENCE = re.compile(r"^(?P<early>early learning \(not converged\): )?"
                         r"(?P<interval>[+-]\d+\.\d+ \[-?\d+\.\d+, -?\d+\.\d+\])(?P<rest>.*)$")


def selection_rule(metric: str) -> str:
    """``the best trial per (backbone, loss) by best/val/ndcg_at_10; a tie: kept the first started``."""
    return f"the best trial per (backbone, loss) by {metric}; a tie: {TIE_RULE}"


def method_name(row: dict[str, Any]) -> str:
    return row["loss"] if row.get("backbone") in (None, "-") else f"{row['backbone']}/{row['loss']}"


def row_knobs(row: dict[str, Any]) -> str:
    """The knobs the row's run recorded, 3 significant digits (``b=0.203 eta=0.00013``); ``-`` for none."""
    return knobs_label({k: row[k] for k in row.get(RECORDED_KNOBS, ()) if row.get(k) is not None}) or "-"


def difference_and_verdict(cell: str | None) -> tuple[str, str]:
    """A significance cell (``seeds.significance_cells``) as (difference with its 95% CI, verdict): ``better``/
    ``worse`` where >= 2 seeds and Holm's p is under 1 - confidence, ``no difference shown`` above it, ``none (1
    seed)`` where training variance was not measured; ``early learning (...)`` where a method had not converged
    (the table's notes say why)."""
    if not cell:
        return "-", "-"
    if cell == "baseline":
        return "baseline", "-"
    found = _DIFFERENCE.match(cell)
    if found is None:  # "- (no paired users)": no comparison
        return "-", cell.removeprefix("- ").strip("()")
    rest = found["rest"]
    p_value = re.search(r"\bp(?:_holm)? = (\S+?)[,;)]?(?:\s|$)", rest)
    early = "early learning" if found["early"] else ""  # a comparison of models still learning: no verdict on methods
    if ONE_SEED in rest or p_value is None:
        needed = re.search(r"a verdict needs (.+?) seeds", rest)
        return found["interval"], f"{early or 'none'} (1 seed" + (f"; a verdict needs {needed[1]})" if needed else ")")
    alpha, p = 1 - DEFAULT_CONFIDENCE, float(p_value[1])
    sign = "better" if found["interval"].startswith("+") else "worse"
    seeds = re.search(r"\((\d+) seeds\)", rest)
    detail = f"({'p_holm' if 'p_holm' in rest else 'p'} {p_value[1]}" + (f", {seeds[1]} seeds)" if seeds else ")")
    return found["interval"], f"{early or (sign if p < alpha else 'no difference shown')} {detail}"


def _keys(rows: list[dict[str, Any]]) -> tuple[str | None, str, str | None]:
    """(the selection metric, the matching test metric, the significance column) of ``rows``."""
    selection = next((k for row in rows for k in row if k.startswith("best/")), None)
    test = "test/" + selection.rsplit("/", 1)[-1] if selection else "test/ndcg_at_10"
    if not any(test in row for row in rows):
        test = "test/ndcg_at_10"
    significance = next((k for row in rows for k in row if k.startswith("vs ")), None)
    return selection, test, significance


def answer_table(rows: list[dict[str, Any]], experiment_id: str | None = None) -> list[str]:
    """The narrow table: one line per row, each at most ``ANSWER_WIDTH`` characters shown; the run's link opens
    it in the same MLflow UI (``#/experiments/<id>/runs/<run id>``)."""
    selection, test, significance = _keys(rows)
    baseline = significance.split()[1] if significance else "baseline"
    header = ["method", "knobs", "val " + (selection or "-").rsplit("/", 1)[-1], test.replace("/", " "),
              f"vs {baseline} (95% CI)", "verdict", "run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        difference, verdict = difference_and_verdict(row.get(significance) if significance else None)
        run_id = row.get("run_id")
        link = "-" if not run_id else run_link(experiment_id, run_id) if experiment_id else run_id[:8]
        cells = [method_name(row), row_knobs(row), shown_metric(row.get(selection)) if selection else "-",
                 shown_metric(row.get(test)), difference, verdict, link]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def shown_width(line: str) -> int:
    """The characters a markdown table line shows: a link ``[label](target)`` shows its label."""
    return len(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line))


def answer_notes(rows: list[dict[str, Any]]) -> list[str]:
    """What explains the table's rows, one line per kind: ties, methods that had not converged (each reason in its
    words), methods without a finished trial, and cost (all of a method's trials; the chosen trial's own time)."""
    trained = [row for row in rows if row.get("status") != "training-free"]
    ties = [f"{method_name(row)}: {row['tie']}" for row in trained if row.get("tie")]
    unconverged = [f"{method_name(row)}: {row['converged']}" for row in trained
                   if row.get("converged") and row["converged"] != "converged"]
    unfinished = [f"{method_name(row)}: {row['status']}" for row in trained
                  if row.get("status") not in (None, "finished")]
    costs = [f"{method_name(row)} {_minutes(row[WALL])}" + (f" (chosen trial's time {_minutes(row[CHOSEN_TIME])})"
                                                           if row.get(CHOSEN_TIME) is not None else "")
             for row in trained if row.get(WALL) is not None]
    notes = [("Ties", ties), ("Not converged", unconverged), ("No finished trial", unfinished),
             ("Cost, wall time of all a method's trials (the price of its answer)", costs)]
    return [f"- **{title}**: " + "; ".join(items) for title, items in notes if items]


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def study_description(study: str, rows: list[dict[str, Any]], subsets: list[str] | None = None,
                      experiment_id: str | None = None) -> str:
    """The study's answer as the MLflow UI shows it on the parent run's page (its description): the narrow table
    (``answer_table``: the same best trials, differences and verdicts as ``sweep`` and ``best`` print), its notes,
    what the intervals cover and whether the test columns compare with paper Table 1; then ``subsets``
    (``subset_lines``) where they fit, else a line naming the parent's artifact ``SUBSETS_ARTIFACT``."""
    selection = _keys(rows)[0] or "best/val/ndcg_at_10"
    note = paper_comparability(rows)
    tail = (f"\n\nEvery column (recall, seeds, spread, cost, protocol, run ids): the artifact `{ANSWER_ARTIFACT}`, or "
            f"`{apao_command()} best --study-name {study}`.\n\n{note}\n\n{INTERVALS_NOTE}")
    head = f"**{study}**: {selection_rule(selection)}\n\n"
    table = "\n".join(answer_table(rows, experiment_id) + [""] + answer_notes(rows))
    if subsets:
        section = "\n\n" + "\n".join(subsets)
        if len(head) + len(table) + len(tail) + len(section) > DESCRIPTION_LIMIT:
            section = f"\n\nMemorization and generalization (test): the parent run's artifact `{SUBSETS_ARTIFACT}`"
        tail += section
    text = head + table + tail
    if len(text) > DESCRIPTION_LIMIT:
        cut = f"\n\n(table cut: the artifact `{ANSWER_ARTIFACT}` holds it whole)"
        text = text[:DESCRIPTION_LIMIT - len(tail) - len(cut)].rsplit("\n", 1)[0] + cut + tail
    return text


def register_best(tracker: Tracker, rows: list[dict[str, Any]], dataset: str,
                  alias: str = "best") -> list[tuple[str, int, bool] | None]:
    """Points ``apao-<dataset>-<backbone>-<loss>@best`` at each row's model; per row, its
    ``(models:/<name>@best, version, whether the version is new)``, None without a model. The model and the
    version say what chose it (``answer.registered_words``: study, knobs, selection rule, tie, verdict, runs)."""
    registered: list[tuple[str, int, bool] | None] = []
    for row in rows:
        if not row.get("model_uri"):  # a method without a finished trial has no model
            registered.append(None)
            continue
        name = f"apao-{dataset}-{row['backbone']}-{row['loss']}"
        version, is_new = tracker.register_best(row["model_uri"], name, alias)
        parent = tracker.find_run({"apao.study": row.get("study") or "", "apao.role": "study"})
        tracker.describe_registered(name, version, *registered_words(row, dataset, alias, parent,
                                                                      tracker.experiment_id))
        registered.append((f"models:/{name}@{alias}", version, is_new))
    return registered


def registered_words(row: dict[str, Any], dataset: str, alias: str, parent_run_id: str | None,
                     experiment_id: str) -> tuple[tuple[str, dict[str, str]], tuple[str, dict[str, str]]]:
    """(description, tags) of a method's registered model and of the version ``row`` (a ``table_rows`` row)
    registers: the study, the knobs (3 digits), the selection rule and any tie, validation and test, the difference
    from the baseline and its verdict, and links to the trial's run and the study's parent run."""
    selection, test, significance = _keys([row])
    difference, verdict = difference_and_verdict(row.get(significance) if significance else None)
    method, knobs, study = method_name(row), row_knobs(row), row.get("study") or "-"
    rule = selection_rule(selection or "best/val/ndcg_at_10")
    run = run_link(experiment_id, row["run_id"])
    parent = run_link(experiment_id, parent_run_id) if parent_run_id else "-"
    lines = [f"**{method}** chosen by study **{study}**: {rule}.", "",
             *answer_table([row], experiment_id), "",
             f"Tie: {row.get('tie') or 'none'}. Trial's run: {run}; the study's run (its whole answer): {parent}."]
    version_tags = {"apao.study": study, "apao.knobs": knobs, "apao.selection_rule": rule,
                    "apao.tie": row.get("tie") or "none", "apao.verdict": verdict, "apao.difference": difference,
                    "apao.run_id": row["run_id"], "apao.parent_run_id": parent_run_id or "-",
                    **({selection: shown_metric(row.get(selection))} if selection else {}),
                    test: shown_metric(row.get(test))}
    model = (f"The best {method} on {dataset}: `@{alias}` points at the version of the latest `best` (each version's "
             f"description and tags say which study, knobs, rule and verdict chose it).",
             {"apao.dataset": dataset, "apao.method": method, "apao.study": study, "apao.knobs": knobs,
              "apao.verdict": verdict, "apao.selection_rule": rule})
    return model, ("\n".join(lines), version_tags)


def wide_table(rows: list[dict[str, Any]]) -> str:
    """``ANSWER_ARTIFACT``'s text: the table ``sweep`` and ``best`` print, every column."""
    return format_rows(rows, "markdown") + "\n"
