"""``python -m apao_ray best`` on a real SQLite store holding real logged models: it prints the registered
``models:/<name>@best`` URIs, registering an unchanged best again adds no version, and the seeds column
says which seeds and how many."""
from __future__ import annotations

import json

import pytest

from apao_ray.study.cli import sweep as cli_sweep
from conftest import mlflow_sqlite, train_tiny

pytestmark = pytest.mark.e2e  # trains a tiny model and logs MLflow models: ~30 s on 2 CPUs
NAME = "apao-synthetic-tiger-ce"


def _trial(tracker, parent, checkpoint, example, value: float, seed: int) -> str:
    """A finished CE trial of study ``s`` with ``checkpoint`` logged as its model."""
    run = tracker.start_run(f"t{value}", {"apao.study": "s", "backbone": "tiger", "loss": "ce"},
                            {"base.train.seed": seed, "base.data.dataset": "synthetic"}, parent_run_id=parent)
    tracker.log_metrics(run, {"best/val/ndcg_at_10": value, "test/ndcg_at_10": value / 2,
                              "test/recall_at_10": value}, 1)
    tracker.set_tags(run, {"apao.model_uri": tracker.log_recommender(run, checkpoint, example)})
    tracker.end_run(run)
    return run


def _best(uri: str, capsys, *flags: str) -> tuple[str, str]:
    assert cli_sweep.best_main(["--dataset", "synthetic", "--tracking-uri", uri, *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_best_prints_uris_registers_once_per_run_and_names_its_seeds(synthetic, tmp_path, capsys):
    from apao_ray.tracking import Tracker

    checkpoint = train_tiny("tiger", tmp_path / "trial", synthetic)
    tracker = Tracker(mlflow_sqlite(tmp_path), "apao-synthetic")
    space = {"backbones": ["tiger"], "losses": ["ce"]}
    parent = tracker.start_run("study s", {"apao.study": "s", "apao.role": "study"}, {"space": json.dumps(space)})
    example = list(synthetic.catalog.item_ids[:3])
    first = _trial(tracker, parent, checkpoint, example, 0.3, seed=7)

    out, err = _best(tracker.tracking_uri, capsys)
    assert f"models:/{NAME}@best: version 1 registered" in err, err
    header, _, row = out.splitlines()[:3]
    cells = dict(zip(header.strip("|").split(" | "), row.strip("|").split(" | ")))
    assert cells["registered_model"].strip() == f"models:/{NAME}@best"
    assert cells["seeds"].strip() == "7 (1 seed)"  # a bare 7 reads as a count

    out, err = _best(tracker.tracking_uri, capsys, "--format", "json")  # the same best again: no new version
    assert f"models:/{NAME}@best: version 1 unchanged" in err, err
    assert json.loads(out)[0]["registered_model"] == f"models:/{NAME}@best"
    versions = tracker.client.search_model_versions(f"name = '{NAME}'")
    assert [(int(v.version), v.run_id) for v in versions] == [(1, first)]

    better = _trial(tracker, parent, checkpoint, example, 0.5, seed=7)  # a new best: a new version, the alias moves
    out, err = _best(tracker.tracking_uri, capsys, "--format", "csv")
    assert f"models:/{NAME}@best: version 2 registered" in err, err
    assert tracker.client.get_model_version_by_alias(NAME, "best").run_id == better
    header, row = out.splitlines()[:2]
    assert dict(zip(header.split(","), row.split(",")))["n_seeds"] == "1"

    # a tie on the selection metric goes to the trial that started first, on every surface
    tied = _trial(tracker, parent, checkpoint, example, 0.5, seed=7)
    out, err = _best(tracker.tracking_uri, capsys, "--format", "json")
    assert json.loads(out)[0]["run_id"] == better != tied and f"models:/{NAME}@best: version 2 unchanged" in err, err
    tie = "2 trials tied on best/val/ndcg_at_10 0.5000: kept the first started"
    assert json.loads(out)[0]["tie"] == tie  # named, with the rule that broke it, on the table and the model
    version = tracker.client.get_model_version(NAME, "2")
    assert version.tags["apao.tie"] == tie and version.tags["apao.study"] == "s"
    assert version.tags["apao.selection_rule"] == "the best trial per (backbone, loss) by best/val/ndcg_at_10; " \
        "a tie: kept the first started"
    assert (version.tags["apao.run_id"], version.tags["apao.parent_run_id"]) == (better, parent)
    assert version.tags["best/val/ndcg_at_10"] == "0.5000" and version.tags["apao.verdict"] == "-"  # CE: the baseline
    assert f"#/experiments/{tracker.experiment_id}/runs/{parent}?workflowType=machine_learning)" in version.description
    assert f"| tiger/ce | - | 0.5000 | 0.2500 | baseline | - | [{better[:8]}]" in version.description
    model = tracker.client.get_registered_model(NAME)
    assert model.tags["apao.method"] == "tiger/ce" and "@best" in model.description
    from apao_ray.analysis.export import trial_record
    from apao_ray.analysis.results import finished_trials
    from apao_ray.study.record.seeds import RunSource

    records = [trial_record(run) for run in tracker.child_runs()]
    for order in (records, records[::-1]):  # whatever order the runs are listed in
        assert [t.run_id for t in finished_trials([RunSource("s", order)])] == [better]


def _tied_study(tracker, checkpoint, example, selected: str) -> tuple[str, str, str]:
    """Study ``s`` recording the selection ``selected`` (its validation metric, at the epoch it keeps), with two
    finished CE trials that tie on validation NDCG@10 and differ on validation Recall@20: ``first`` started first and
    is behind on Recall@20. Returns (parent, first, second)."""
    space = {"backbones": ["tiger"], "losses": ["ce"]}
    parent = tracker.start_run("study s", {"apao.study": "s", "apao.role": "study",
                                           "apao.selection": json.dumps({"metric": selected, "rule": selected})},
                               {"space": json.dumps(space)})
    runs = []
    for recall, test in ((0.5, 0.2), (0.7, 0.25)):
        run = tracker.start_run(f"r{recall}", {"apao.study": "s", "backbone": "tiger", "loss": "ce"},
                                {"base.train.seed": 0, "base.data.dataset": "synthetic"}, parent_run_id=parent)
        tracker.log_metrics(run, {"best/val/ndcg_at_10": 0.4, "best/val/recall_at_20": recall,
                                  "test/ndcg_at_10": test, "test/recall_at_10": 2 * test}, 1)
        tracker.set_tags(run, {"apao.model_uri": tracker.log_recommender(run, checkpoint, example)})
        tracker.end_run(run)
        runs.append(run)
    return parent, *runs


def test_best_report_registry_and_parent_name_the_studys_winner_whatever_metric_says(synthetic, tmp_path, capsys):
    """One selection per study, recorded with it, names the winner on every surface: ``best`` with or without
    ``--metric``, the registered @best model, ``report`` (an export's best trials) and the parent run's answer (its
    description and summary metrics). A tie goes to the trial that started first; ``--metric`` only shows."""
    from apao_ray.analysis.export import export_study, load_export
    from apao_ray.analysis.results import finished_trials
    from apao_ray.study.record.mlflow_callback import log_study_summary
    from apao_ray.study.record.answer import study_description
    from apao_ray.study.record.report import table_rows
    from apao_ray.tracking import Tracker

    checkpoint = train_tiny("tiger", tmp_path / "trial", synthetic)
    example = list(synthetic.catalog.item_ids[:3])
    for selected in ("ndcg_at_10", "recall_at_20"):
        tracker = Tracker(mlflow_sqlite(tmp_path / selected), "apao-synthetic")
        parent, first, second = _tied_study(tracker, checkpoint, example, selected)
        winner, loser = (first, second) if selected == "ndcg_at_10" else (second, first)
        shown = {}
        for metric in ((), ("--metric", "best/val/recall_at_20"), ("--metric", "ndcg_at_10")):
            out, err = _best(tracker.tracking_uri, capsys, "--format", "json", *metric)
            shown[metric] = json.loads(out)
        assert {metric: [row.get("run_id") for row in rows] for metric, rows in shown.items()} == \
            {metric: [winner] for metric in shown}, selected
        assert shown[("--metric", "best/val/recall_at_20")][0]["best/val/recall_at_20"] is not None  # a column more
        assert f"by the study's selection: best/val/{selected} (max)" in err and "it does not choose" in err, err
        assert tracker.client.get_model_version_by_alias(NAME, "best").run_id == winner
        export_study(tracker.tracking_uri, "s", tmp_path / f"export-{selected}")
        assert [t.run_id for t in finished_trials([load_export(tmp_path / f"export-{selected}")])] == [winner]
        rows = table_rows(tracker, "best/val/recall_at_20", "s", baseline=None)
        assert [row["run_id"] for row in rows] == [winner]
        description = study_description("s", table_rows(tracker, study="s", baseline=None),
                                        experiment_id=tracker.experiment_id)  # its rows link each run by id
        assert winner in description and loser not in description
        summary = log_study_summary(tracker, parent, "s")
        expected = tracker.client.get_run(winner).data.metrics
        assert summary["best/tiger/ce/test/ndcg_at_10"] == expected["test/ndcg_at_10"]
        assert summary[f"best/tiger/ce/val/{selected}"] == expected[f"best/val/{selected}"]
        versions = tracker.client.search_model_versions(f"name = '{NAME}'")
        assert {v.run_id for v in versions} == {winner}  # no other trial was ever registered as @best
