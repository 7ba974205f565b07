"""What the driver records of a finished trial beyond its metrics: a logged model per selection rule, each loading
the epoch that rule kept (study/record/rule_models.py), and its per-prefix recall as one chart and one table
(study/record/prefix_recall.py)."""
from __future__ import annotations

import json

import pytest
import torch

from apao_ray import load_recommender
from apao_ray.config import TrialConfig
from apao_ray.models import build_model
from apao_ray.reuse.inference import Recommender
from apao_ray.training.checkpoint import STATE_FILE, load_checkpoint, rule_checkpoint
from conftest import mlflow_sqlite, train_tiny

pytestmark = pytest.mark.e2e  # trains a tiny model: seconds, more on a busy machine


@pytest.fixture(scope="module")
def logged(synthetic, tmp_path_factory):
    """A tiny CE trial (2 epochs: NDCG kept epoch 1, the loss and the last epoch 2) logged as the study's driver
    logs it: its own model and one per other rule."""
    from apao_ray.study.record import rule_models
    from apao_ray.tracking import Tracker

    root = tmp_path_factory.mktemp("rules")
    checkpoint = train_tiny("tiger", root / "trial", synthetic)
    tracker = Tracker(mlflow_sqlite(root), "apao-synthetic")
    run_id = tracker.start_run("tiger/ce", {})
    final = json.loads((checkpoint / "final_metrics.json").read_text())
    tracker.log_metrics(run_id, {k: v for k, v in final.items() if "/" in k and isinstance(v, (int, float))}, 2)
    example = list(synthetic.catalog.item_ids[:3])
    own = rule_models.own_rule(checkpoint)
    uris = {own: tracker.log_recommender(run_id, checkpoint, example, tags=rule_models.model_tags(checkpoint, own))}
    uris.update(rule_models.log_rule_models(tracker, run_id, checkpoint, example, {}))
    tracker.end_run(run_id)
    return {"checkpoint": checkpoint, "tracker": tracker, "run_id": run_id, "uris": uris, "own": own, "final": final}


def weights_of_epoch(checkpoint, epoch: int) -> dict:
    """The weights after ``epoch`` as training left them: that epoch's own checkpoint (the model it trained on with),
    or for the kept epoch, the final checkpoint's best model."""
    epoch_dir = checkpoint.parent / f"epoch_{epoch:04d}"
    if epoch_dir.is_dir():
        return torch.load(epoch_dir / STATE_FILE, map_location="cpu", weights_only=False)["model"]
    final = json.loads((checkpoint / "final_metrics.json").read_text())
    assert final["best/epoch"] == epoch, (epoch, final["best/epoch"])
    return load_checkpoint(checkpoint)[1]


def test_each_rules_model_loads_the_epoch_that_rule_kept(logged, synthetic):
    from apao_ray.study.record.rule_models import rule_epochs

    checkpoint, tracker, run_id = logged["checkpoint"], logged["tracker"], logged["run_id"]
    epochs = rule_epochs(checkpoint)
    assert set(epochs) == {"val_ndcg_at_10", "val_loss", "last"} and logged["own"] == "val_ndcg_at_10"
    assert len(set(epochs.values())) == 2, epochs  # two different epochs kept: a wrong model cannot pass
    names = {model.name: model for model in tracker.client.search_logged_models([tracker.experiment_id])}
    assert set(names) == {"model", "model_by_val_loss", "model_by_last"}
    config = TrialConfig.from_dict(json.loads((checkpoint / "trial_config.json").read_text()))
    histories = [[synthetic.catalog.item_ids[i] for i in row if i >= 0] for row in synthetic.splits["test"].histories[:4]]
    top10 = {}
    for rule, epoch in epochs.items():
        name = "model" if rule == logged["own"] else f"model_by_{rule}"
        assert names[name].tags["apao.selection_rule"] == rule and names[name].tags["apao.epoch"] == str(epoch)
        loaded = load_recommender(f"runs:/{run_id}/{name}", tracking_uri=tracker.tracking_uri)
        model = build_model(config.model, synthetic.catalog.vocab_size, synthetic.catalog.num_levels)
        model.load_state_dict(weights_of_epoch(checkpoint, epoch))
        expected = Recommender(model, synthetic.catalog, config)
        top10[rule] = [[item for item, _ in row] for row in loaded.recommend(histories, k=10)]
        assert top10[rule] == [[item for item, _ in row] for row in expected.recommend(histories, k=10)], rule
    # the rules that kept different epochs recommend differently here: each model is its own epoch's
    assert top10["val_ndcg_at_10"] != top10["last"]
    assert top10["val_loss"] == top10["last"] and epochs["val_loss"] == epochs["last"]
    # each model's page shows the test metrics of its own rule's epoch
    linked = {m.key for m in tracker.client.get_logged_model(names["model_by_val_loss"].model_id).metrics}
    assert linked and all(key.startswith("test_by/val_loss/") for key in linked), linked


def test_a_rule_the_checkpoint_does_not_hold_is_named_with_those_it_holds(logged, tmp_path):
    with pytest.raises(ValueError, match=r"no weights of selection rule 'val_recall_at_10'; it holds "
                                         r"\['last', 'val_loss'\]"):
        rule_checkpoint(logged["checkpoint"], "val_recall_at_10", tmp_path / "out")


def test_a_runs_prefix_recall_is_one_table_and_one_chart_of_every_rule(logged, tmp_path):
    import pandas as pd

    from apao_ray.study.record.prefix_recall import CHART_FILE, TABLE_FILE, log_trial_prefix_recall

    tracker, run_id, final = logged["tracker"], logged["run_id"], logged["final"]
    for _ in range(2):  # a trial completed again after a resume: the table is not appended to
        log_trial_prefix_recall(tracker, run_id, final)
    assert {CHART_FILE, TABLE_FILE} <= {a.path for a in tracker.client.list_artifacts(run_id)}
    assert {"path": TABLE_FILE, "type": "table"} in json.loads(tracker.client.get_run(run_id).data.tags[
        "mlflow.loggedArtifacts"])  # what makes MLflow show it as a table
    table = pd.read_json(tracker.client.download_artifacts(run_id, TABLE_FILE, str(tmp_path)), orient="split")
    assert list(table["selection_rule"]) == ["val_ndcg_at_10", "last", "val_loss"]  # the kept model's rule first
    assert list(table["kept"]) == [True, False, False]
    for row in table.to_dict("records"):
        assert row["epoch"] == final[f"test_by/{row['selection_rule']}/epoch"]
        for m in range(1, 5):  # the numbers MLflow holds as metrics, each in its cell
            assert row[f"m{m}"] == pytest.approx(final[f"test_by/{row['selection_rule']}/prefix_recall_at_20_m{m}"])
    assert [column for column in table.columns if column.startswith("m")] == ["m1", "m2", "m3", "m4"]


def test_the_studys_prefix_recall_chart_has_a_panel_per_method_and_the_knobs_in_its_legend(logged):
    from apao_ray.study.record.prefix_recall import STUDY_CHART_FILE, log_study_prefix_recall

    tracker, final = logged["tracker"], logged["final"]
    parent = tracker.start_run("study", {})
    worse = {**final, "best/val/ndcg_at_10": final["best/val/ndcg_at_10"] - 0.01}
    rows = [{"choices": {"backbone": "tiger", "loss": "ce"}, "metrics": final, "seed": 0},
            {"choices": {"backbone": "tiger", "loss": "apao_pointwise", "beta": 0.123456, "eta": 3.3e-5},
             "metrics": worse, "seed": 0},
            {"choices": {"backbone": "tiger", "loss": "apao_pointwise", "beta": 0.5, "eta": 1e-4}, "metrics": final,
             "seed": 0},
            {"choices": {"backbone": "tiger", "loss": "apao_pointwise", "beta": 0.9, "eta": 1e-4},
             "metrics": {"best/val/ndcg_at_10": 0.9}, "seed": 0}]  # never tested: not drawn
    legends = log_study_prefix_recall(tracker, parent, rows, beam_size=20)
    assert legends == {"tiger/ce": ["no knobs (best)"],
                       "tiger/apao_pointwise": ["b=0.5 eta=0.0001 (best)", "b=0.123 eta=3.3e-05"]}
    assert STUDY_CHART_FILE in {a.path for a in tracker.client.list_artifacts(parent)}


def test_each_epoch_reports_the_machines_and_the_trials_cpu_and_memory(logged):
    """The system/ metrics MLflow files under a run's System metrics tab, as the tiny trial reported them (it trained
    in this process, so its resident set is this process's order of size)."""
    import psutil

    final, tracker = logged["final"], logged["tracker"]
    system = {key: value for key, value in final.items() if key.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
            "system/system_memory_usage_percentage", "system/process_cpu_utilization_percentage",
            "system/process_rss_megabytes"} <= set(system), sorted(system)
    assert 0 < system["system/cpu_utilization_percentage"] <= 100
    assert 0 < system["system/process_cpu_utilization_percentage"] <= 100 * psutil.cpu_count()  # it trained: busy
    rss_now = psutil.Process().memory_info().rss / 1e6
    assert rss_now / 5 < system["system/process_rss_megabytes"] < rss_now * 5, (system, rss_now)
    assert system["system/process_rss_megabytes"] < system["system/system_memory_usage_megabytes"]
    assert 0 < system["system/system_memory_usage_percentage"] < 100
    assert not any(key.startswith("system/gpu_") for key in system)  # a CPU trial samples no GPU
    history = tracker.metric_history(logged["run_id"], "system/process_rss_megabytes")
    assert history and history[0][1] == system["system/process_rss_megabytes"]
