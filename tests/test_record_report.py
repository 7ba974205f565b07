"""study/record/report.py on a real SQLite MLflow store: the table has a row for every method requested."""
from __future__ import annotations

import json
import re

import pytest

from apao_ray.rank_metrics import AT_10_METRICS
from conftest import mlflow_sqlite


def _study(tmp_path):
    """A study of tiger x {ce, apao_pointwise, apao_pairwise}: CE finished; both APAO-pointwise trials
    were pruned (one tested on its best checkpoint); the APAO-pairwise trial failed."""
    from apao_ray.tracking import Tracker

    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-tiny")
    space = {"backbones": ["tiger"], "losses": ["ce", "apao_pointwise", "apao_pairwise"]}
    parent = tracker.start_run("study s", {"apao.study": "s", "apao.role": "study"}, {"space": json.dumps(space)})

    def child(trial_id, loss, status, outcome, metrics, **tags):
        run = tracker.start_run(trial_id, {"apao.study": "s", "apao.trial_id": trial_id, "backbone": "tiger",
                                           "loss": loss, "apao.outcome": outcome, **tags}, {"beta": 0.3},
                                parent_run_id=parent)
        tracker.log_metrics(run, metrics, 1)
        tracker.end_run(run, status)
        return run

    child("t1", "ce", "FINISHED", "finished", {"best/val/ndcg_at_10": 0.5, "test/ndcg_at_10": 0.4})
    tested = child("t2", "apao_pointwise", "KILLED", "pruned at epoch 2",
                   {"best/val/ndcg_at_10": 0.3, "test/ndcg_at_10": 0.25})
    child("t3", "apao_pointwise", "KILLED", "pruned at epoch 1", {"best/val/ndcg_at_10": 0.2})
    child("t4", "apao_pairwise", "FAILED", "out of memory", {},
          **{"apao.error": "Traceback\nTrialOutOfMemoryError: out of memory while training in epoch 1"})
    return tracker, tested


def test_a_method_whose_trials_were_all_pruned_or_failed_still_has_its_row(tmp_path):
    from apao_ray.study.record.report import best_rows, format_rows, table_rows

    tracker, tested = _study(tmp_path)
    assert [row["loss"] for row in best_rows(tracker, study="s")] == ["ce"]  # only finished trials
    rows = {row["loss"]: row for row in table_rows(tracker, study="s")}
    assert set(rows) == {"ce", "apao_pointwise", "apao_pairwise"}
    assert rows["ce"]["status"] == "finished"
    assert rows["apao_pointwise"]["status"] == "all 2 trials pruned"
    # the best pruned trial by validation, with the test metrics of its best checkpoint
    assert rows["apao_pointwise"]["run_id"] == tested and rows["apao_pointwise"]["test/ndcg_at_10"] == 0.25
    assert rows["apao_pairwise"]["status"] == "failed: TrialOutOfMemoryError: out of memory while training in epoch 1"
    table = format_rows(table_rows(tracker, study="s"))
    assert "| all 2 trials pruned |" in table and table.splitlines()[0].endswith("| run_id | status |")
    # what `sweep` prints: the rows through its DataFrame, where a seed count beside a missing one is a float
    import pandas as pd

    from apao_ray.study.cli.sweep import table_records
    from apao_ray.study.record.report import RECORDED_KNOBS

    frame = pd.DataFrame(table_rows(tracker, study="s")).drop(columns=[RECORDED_KNOBS])  # as run_study's table
    printed = format_rows(table_records(frame))
    assert "(1 seed) |" in printed and "1.0 seed" not in printed, printed


def test_convergence_reads_the_validation_curves_last_slope():
    from apao_ray.analysis.results import convergence, is_early_learning

    assert convergence([0.010, 0.020, 0.0205]) == "converged"  # +2% at the last epoch: levelled off
    assert convergence([0.010, 0.020, 0.030]) == "still rising: val/ndcg_at_10 +33% at its last epoch (3)"
    assert convergence([0.004]) == "one epoch only: 1 validation epoch, no slope to read"
    assert convergence([0.030, 0.020]) == "converged"  # falling: past its best, not still learning
    assert is_early_learning("converged", "one epoch only: 1 validation epoch, no slope to read")
    assert is_early_learning("no better than popularity: test ndcg_at_10 0.0010 below popularity's 0.0100")
    assert is_early_learning("not converged: 1 validation epoch")  # a verdict an older study recorded
    assert not is_early_learning("converged")
    from apao_ray.analysis.results import joined_verdicts  # both reasons, each once, where both hold

    assert joined_verdicts(["still rising: a", "converged", "no better than popularity: b", "still rising: a"]) == \
        "still rising: a; no better than popularity: b"
    assert joined_verdicts(["converged", "converged"]) == "converged"


def test_a_deferred_method_keeps_the_plans_row_and_an_unconverged_comparison_is_labelled_early_learning(tmp_path):
    from apao_ray.names import PLAN_TAG
    from apao_ray.study.record.report import format_rows, table_rows
    from apao_ray.tracking import Tracker

    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-tiny")
    space = {"backbones": ["tiger"], "losses": ["ce", "apao_pointwise", "apao_pairwise"]}
    reason = ("deferred: needs ~13h04m here (~4h21m per epoch) for one trial of 3 epochs; run --backbones tiger "
              "--losses apao_pairwise --budget 14h, or on a GPU")
    parent = tracker.start_run("study s", {"apao.study": "s", "apao.role": "study",
                                           PLAN_TAG: json.dumps({"deferred": {"tiger/apao_pairwise": reason}})},
                               {"space": json.dumps(space)})
    for trial_id, loss, curve in (("t1", "ce", [0.010, 0.020, 0.021]), ("t2", "apao_pointwise", [0.010, 0.020, 0.030])):
        run = tracker.start_run(trial_id, {"apao.study": "s", "apao.trial_id": trial_id, "backbone": "tiger",
                                           "loss": loss, "apao.outcome": "finished"}, {"beta": 0.3}, parent_run_id=parent)
        for epoch, value in enumerate(curve, 1):
            tracker.log_metrics(run, {"val/ndcg_at_10": value}, epoch)
        tracker.log_metrics(run, {"best/val/ndcg_at_10": max(curve), "test/ndcg_at_10": 0.02}, len(curve))
        tracker.end_run(run, "FINISHED")
    rows = {row["loss"]: row for row in table_rows(tracker, study="s", num_resamples=100)}
    assert rows["apao_pairwise"]["status"] == reason and rows["apao_pairwise"].get("run_id") is None
    assert rows["ce"]["converged"] == "converged" and rows["ce"]["vs ce test/ndcg_at_10"] == "baseline"
    assert rows["apao_pointwise"]["converged"] == "still rising: val/ndcg_at_10 +33% at its last epoch (3)"
    assert rows["apao_pointwise"]["vs ce test/ndcg_at_10"].startswith("early learning (not converged): ")
    table = format_rows(list(rows.values()))
    assert f"| {reason} |" in table and "| converged |" in table


def test_a_method_within_noise_of_or_below_the_popularity_baseline_is_not_converged():
    import numpy as np
    import pandas as pd

    from apao_ray.analysis.results import popularity_check
    from apao_ray.study.record.seeds import RunSource, seed_methods

    rng = np.random.default_rng(0)
    popularity = (rng.random(4000) < 0.01) * 1.0  # NDCG@10 ~0.01: a hit at rank 1 for 1% of the users

    def method(hit_rate):
        record = {"run_id": "r", "status": "FINISHED", "tags": {"backbone": "tiger", "loss": "ce"},
                  "params": {}, "metrics": {"test/ndcg_at_10": hit_rate}}
        table = pd.DataFrame({"user": [str(u) for u in range(4000)], "ndcg_at_10": (rng.random(4000) < hit_rate) * 1.0})
        return seed_methods(RunSource("s", [record], tables={"r": table}), ["r"])[0]

    assert re.fullmatch(r"no better than popularity: test ndcg_at_10 0\.0\d{3} within noise of popularity's 0\.0\d{3}",
                        popularity_check(method(0.011), popularity))
    assert popularity_check(method(0.05), popularity) == ""  # well above it
    assert re.fullmatch(r"no better than popularity: test ndcg_at_10 0\.00\d{2} below popularity's 0\.0\d{3}",
                        popularity_check(method(0.002), popularity))  # well below it: not "within noise"


def test_failed_trials_are_listed_by_their_method_and_knobs_not_by_the_rows_other_columns(capsys):
    """The list after the table names each failed trial as the progress lines do; the row's result columns
    (text such as the status, numbers such as metrics) are not knobs (they once crashed the name's formatting)."""
    import pandas as pd

    from apao_ray.study.cli.sweep import print_failures

    trials = pd.DataFrame([
        {"backbone": "tiger", "loss": "apao_pointwise", "beta": 0.2, "eta": 3e-5, "num_negatives": float("nan"),
         "best/val/ndcg_at_10": 0.0123, "run_id": "abc", "status": "failed: out of memory (memory cap 1.00 GiB)"},
        {"backbone": "tiger", "loss": "ce", "beta": float("nan"), "eta": float("nan"), "num_negatives": float("nan"),
         "best/val/ndcg_at_10": 0.02, "run_id": "def", "status": "finished"}])
    print_failures(trials)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["failed trials (1):", "  tiger/apao_pointwise b=0.2 eta=3e-05: failed: out of memory (memory cap "
                                          "1.00 GiB)"]


def test_a_command_given_no_study_reads_the_stores_only_one_and_names_them_where_there_are_several(tmp_path):
    from apao_ray.analysis.export import sole_study

    tracker, _ = _study(tmp_path)
    assert sole_study(tracker.tracking_uri) == "s"
    tracker.start_run("study t", {"apao.study": "t", "apao.role": "study"}, {})
    with pytest.raises(ValueError, match=r"--study NAME is needed: sqlite:///.* holds 2 studies \['s', 't'\]"):
        sole_study(tracker.tracking_uri)


def test_the_studys_answer_table_has_the_heuristics_as_rows_and_a_method_below_the_bar_says_so(tmp_path):
    """CE's per-user tables (logged as a trial logs them) hit at rank 2 for a fifth of the users, APAO's at rank 1
    for all; a last-item heuristic fabricated between them: CE's verdict names it, APAO's does not, and both
    heuristics stand as rows with the same test columns, in the table and in the MLflow description."""
    import numpy as np
    import pandas as pd

    from apao_ray.names import PER_USER_FILE
    from apao_ray.study.record.answer import DESCRIPTION_LIMIT, SUBSETS_ARTIFACT, study_description
    from apao_ray.study.record.report import format_rows, subset_lines, table_rows
    from apao_ray.tracking import Tracker
    from apao_ray.training.evaluation import write_per_user
    from test_analysis_report import _per_user

    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-tiny")
    space = {"backbones": ["tiger"], "losses": ["ce", "apao_pointwise"]}
    parent = tracker.start_run("study s", {"apao.study": "s", "apao.role": "study"}, {"space": json.dumps(space)})
    rng = np.random.default_rng(0)
    users = 2000
    for trial_id, loss, ranks in (("t1", "ce", np.where(rng.random(users) < 0.2, 2, 0)),
                                  ("t2", "apao_pointwise", np.ones(users, int))):
        table = {**_per_user(ranks), "is_memorization": (np.arange(users) < 300).astype(int),  # as a trial writes it
                 "is_seen_target": np.ones(users, int)}
        run = tracker.start_run(trial_id, {"apao.study": "s", "apao.trial_id": trial_id, "backbone": "tiger",
                                           "loss": loss, "apao.outcome": "finished"}, {"beta": 0.3}, parent_run_id=parent)
        for epoch, value in ((1, 0.01), (2, 0.0199), (3, 0.02)):
            tracker.log_metrics(run, {"val/ndcg_at_10": value}, epoch)
        tracker.log_metrics(run, {"best/val/ndcg_at_10": 0.02, **{f"test/{k}": float(v.mean()) for k, v in table.items()
                                                                  if k.endswith(("_at_10", "_at_20"))}}, 3)
        (tmp_path / trial_id).mkdir()
        tracker.log_artifact(run, write_per_user(tmp_path / trial_id / PER_USER_FILE, table))
        tracker.end_run(run, "FINISHED")
    heuristics = {"popularity": pd.DataFrame(_per_user(np.where(rng.random(users) < 0.01, 1, 0))),
                  "last_item": pd.DataFrame(_per_user(np.where(rng.random(users) < 0.5, 1, 0)))}
    rows = table_rows(tracker, study="s", num_resamples=100, heuristics=heuristics)
    by_loss = {row["loss"]: row for row in rows}
    bar = heuristics["last_item"]["ndcg_at_10"].mean()
    assert re.fullmatch(rf"converged; below the last-item heuristic: test ndcg_at_10 0\.1\d{{3}} vs {bar:.4f}",
                        by_loss["ce"]["converged"])
    assert by_loss["apao_pointwise"]["converged"] == "converged"
    last = by_loss["last-item transitions (training-free)"]
    assert last["test/ndcg_at_10"] == pytest.approx(bar) and last["status"] == "training-free"
    assert by_loss["popularity (training-free)"]["test/recall_at_10"] == pytest.approx(
        heuristics["popularity"]["recall_at_10"].mean())
    assert [row["loss"] for row in rows][-2:] == ["popularity (training-free)", "last-item transitions (training-free)"]
    table = format_rows(rows)
    assert "| - | last-item transitions (training-free) |" in table and "below the last-item heuristic" in table
    subsets = subset_lines(tracker, "s", None, heuristics, num_resamples=100)  # the labels the tables hold
    assert "labels read from the per-user tables" in subsets[0]
    memorization = [line for line in subsets if line.startswith("| memorization | 300 |")]
    on_memo = " | ".join(f"{heuristics['last_item'][metric][:300].mean():.4f}" for metric in AT_10_METRICS)
    assert memorization[1] == f"| memorization | 300 | last-item transitions (training-free) | - | {on_memo} | |"
    assert any(line.startswith("| memorization | 300 | tiger/apao_pointwise ") and "over seeds" not in line
               and "1 seed" in line for line in memorization)  # one seed: users only, said so
    description = study_description("s", rows, subsets)
    assert "last-item transitions (training-free)" in description and "below the last-item heuristic" in description
    assert "| generalization | 1700 | tiger/ce b=0.3 |" in description and len(description) <= DESCRIPTION_LIMIT
    crowded = study_description("s", rows, subsets * 40)  # too long to fit: the artifact is named instead
    assert crowded.endswith(f"the parent run's artifact `{SUBSETS_ARTIFACT}`") and len(crowded) <= DESCRIPTION_LIMIT


def test_each_study_is_read_by_its_own_selection_and_best_refuses_to_mix_two(tmp_path, capsys):
    """Two studies of one dataset recorded before the selection tag (their base config's metric says it): each
    names its winner by its own metric; ``best`` over both refuses in one line instead of ranking across them."""
    from apao_ray.study.cli.sweep import best_main
    from apao_ray.study.record.report import best_rows
    from apao_ray.tracking import Tracker

    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-tiny")
    for study, metric in (("a", "ndcg_at_10"), ("b", "recall_at_20")):
        parent = tracker.start_run(f"study {study}", {"apao.study": study, "apao.role": "study"},
                                   {"space": json.dumps({"backbones": ["tiger"], "losses": ["ce"]}),
                                    "base.train.metric": metric})
        for ndcg, recall in ((0.3, 0.6), (0.4, 0.5)):
            run = tracker.start_run(f"{study}{ndcg}", {"apao.study": study, "backbone": "tiger", "loss": "ce"}, {},
                                    parent_run_id=parent)
            tracker.log_metrics(run, {"best/val/ndcg_at_10": ndcg, "best/val/recall_at_20": recall,
                                      "test/ndcg_at_10": ndcg / 2}, 1)
            tracker.end_run(run)
    assert [row["best/val/ndcg_at_10"] for row in best_rows(tracker, study="a")] == [0.4]
    assert [row["best/val/recall_at_20"] for row in best_rows(tracker, study="b")] == [0.6]
    with pytest.raises(SystemExit) as exit_info:
        best_main(["--dataset", "tiny", "--tracking-uri", tracker.tracking_uri, "--no-register"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("studies/best.py: error: these studies select their best trial differently") \
        and "best/val/recall_at_20 (max)" in error and error.endswith("(--study-name)"), error


def test_a_tie_is_named_with_its_rule_and_cost_is_all_a_methods_trials_in_best_the_description_and_the_report(
        tmp_path, monkeypatch):
    """Two CE trials tie exactly on the selection metric: the first started is kept, and the table, the study's
    MLflow description and the report all say so, with the rule. Cost is every trial of the method (the pruned one
    too) on each surface; the chosen trial's own time goes by its own name. The description's table stays narrow."""
    import time

    from apao_ray.analysis.export import export_study, load_export
    from apao_ray.analysis.report import build_report
    from apao_ray.study.record.answer import ANSWER_WIDTH, shown_width, study_description
    from apao_ray.study.record.report import format_rows, table_rows
    from apao_ray.tracking import Tracker

    monkeypatch.delenv("APAO_DATA_DIR", raising=False)  # a fabricated 'tiny' dataset: no heuristics' rows
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))
    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-tiny")
    space = {"backbones": ["tiger"], "losses": ["ce", "apao_pointwise"]}
    parent = tracker.start_run("study s", {"apao.study": "s", "apao.role": "study"}, {"space": json.dumps(space)})

    def child(loss, status, val, wall, knobs=None):
        time.sleep(0.01)  # distinct start times: the tie's rule reads them
        run = tracker.start_run(loss, {"apao.study": "s", "backbone": "tiger", "loss": loss}, knobs or {},
                                parent_run_id=parent)
        tracker.log_metrics(run, {"best/val/ndcg_at_10": val, "cost/wall_seconds": wall,
                                  **({"test/ndcg_at_10": val / 2} if status == "FINISHED" else {})}, 1)
        tracker.end_run(run, status)
        return run

    first = child("ce", "FINISHED", 0.5, 60.0)
    child("ce", "FINISHED", 0.5, 90.0)  # ties the first exactly
    child("ce", "KILLED", 0.2, 30.0)  # pruned: it cost too
    child("apao_pointwise", "FINISHED", 0.45, 120.0, {"beta": 0.20259821574970133, "eta": 0.000130412345})
    tie = "2 trials tied on best/val/ndcg_at_10 0.5000: kept the first started"

    rows = table_rows(tracker, study="s", num_resamples=100)
    ce = next(row for row in rows if row["loss"] == "ce")
    assert ce["run_id"] == first and ce["tie"] == tie
    assert (ce["cost/wall_seconds"], ce["chosen_trial/wall_seconds"]) == (180.0, 60.0)
    assert f"| {tie} |" in format_rows(rows)

    description = study_description("s", rows, experiment_id=tracker.experiment_id)
    assert f"**Ties**: tiger/ce: {tie}" in description and "kept the first started" in description.splitlines()[0]
    assert "tiger/ce 3.0 min (chosen trial's time 1.0 min)" in description
    table = [line for line in description.splitlines() if line.startswith("|")]
    assert len(table) == 4 and max(map(shown_width, table)) <= ANSWER_WIDTH, table
    assert f"[{first[:8]}](#/experiments/{tracker.experiment_id}/runs/{first}?workflowType=machine_learning)" in table[3]  # the rows: apao, ce
    assert "| b=0.203 eta=0.00013 | 0.4500 | 0.2250 |" in table[2] and "0.2025982" not in description

    export_study(tracker.tracking_uri, "s", tmp_path / "export")
    report = build_report([load_export(tmp_path / "export")], tmp_path / "out", num_resamples=100).read_text()
    assert f"- s: tiger/ce: {tie}" in report
    costs = report.split("## Cost per method", 1)[1].split("\n## ", 1)[0]
    cost = next(line for line in costs.splitlines() if "| tiger | ce |" in line)
    cells = [cell.strip() for cell in cost.strip("|").split("|")]
    assert cells[4:6] == ["3", "3.0"] and cells[-1] == "1.0", cells  # trials, wall min of all; the chosen's own


def test_the_study_pages_verdict_reads_the_significance_cell_as_sweep_prints_it():
    from apao_ray.study.record.answer import difference_and_verdict

    holm = "over seeds and users (3 seeds), p_holm = {} (Holm over 2 comparisons: every method vs the baseline)"
    assert difference_and_verdict("+0.0041 [0.0012, 0.0070] " + holm.format("0.003")) == \
        ("+0.0041 [0.0012, 0.0070]", "better (p_holm 0.003, 3 seeds)")
    assert difference_and_verdict("-0.0041 [-0.0070, -0.0012] " + holm.format("2.0e-04"))[1] == \
        "worse (p_holm 2.0e-04, 3 seeds)"
    assert difference_and_verdict("early learning (not converged): +0.0010 [-0.0020, 0.0040] " + holm.format("0.310")) \
        == ("+0.0010 [-0.0020, 0.0040]", "early learning (p_holm 0.310, 3 seeds)")
    assert difference_and_verdict("early learning (not converged): +0.0024 [0.0013, 0.0035] over test users, "
                                  "1 seed: training variance not measured")[1] == "early learning (1 seed)"
    one = "+0.0024 [0.0013, 0.0035] over test users, 1 seed: training variance not measured"
    assert difference_and_verdict(one) == ("+0.0024 [0.0013, 0.0035]", "none (1 seed)")
    assert difference_and_verdict(one + "; a verdict needs ~24 seeds at seed sd 0.0040")[1] == \
        "none (1 seed; a verdict needs ~24)"
    assert difference_and_verdict("baseline") == ("baseline", "-")
    assert difference_and_verdict("- (no ce trial to compare with)") == ("-", "no ce trial to compare with")
