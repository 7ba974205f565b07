"""The metric registry (apao_ray/rank_metrics.py): one entry per metric, read by evaluation, the per-user tables,
select_by, the training-free baselines, the report, the grid, ``best`` and the MLflow columns. MRR@10, one entry,
is checked on each of them against MRR computed by hand; tables written before it stay readable."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from apao_ray.analysis.per_user import read_per_user
from apao_ray.rank_metrics import (PER_USER_METRICS, RANK_METRICS, metric_label, mrr_from_ranks, rank_metric_values,
                                   rank_metrics_at)

ROOT = Path(__file__).resolve().parents[1]


def brute_mrr_at_10(ranks) -> float:
    """MRR@10 as SPEC §4 words it, one user at a time: 1/rank if the target is in the top 10, else 0 (a missing
    target has rank 0 or -1)."""
    return float(np.mean([1.0 / r if 1 <= r <= 10 else 0.0 for r in np.asarray(ranks).tolist()]))


def test_mrr_by_hand_and_the_names_each_cutoff_reports():
    ranks = np.array([1, 2, 10, 11, 0, -1])
    assert mrr_from_ranks(ranks, 10).tolist() == [1.0, 0.5, 0.1, 0.0, 0.0, 0.0]
    assert float(mrr_from_ranks(ranks, 10).mean()) == pytest.approx(brute_mrr_at_10(ranks))
    assert "mrr" in RANK_METRICS and RANK_METRICS["mrr"].is_higher_better and RANK_METRICS["mrr"].is_selectable
    # recall and NDCG at each of the run's cutoffs; MRR at its own 10, where the beam is that long
    assert list(rank_metrics_at((5, 10, 20), 20)) == ["recall_at_5", "recall_at_10", "recall_at_20", "ndcg_at_5",
                                                      "ndcg_at_10", "ndcg_at_20", "mrr_at_10"]
    assert list(rank_metrics_at((5,), 5)) == ["recall_at_5", "ndcg_at_5"]
    assert PER_USER_METRICS == ("recall_at_10", "recall_at_20", "ndcg_at_10", "ndcg_at_20", "mrr_at_10")
    assert [metric_label(n) for n in ("recall_at_20", "ndcg_at_10", "mrr_at_10", "loss")] == ["R@20", "N@10",
                                                                                               "MRR@10", "loss"]
    values = rank_metric_values(ranks, (10,))
    assert values["ndcg_at_10"][1] == pytest.approx(1 / np.log2(3))
    assert values["recall_at_10"].tolist() == [1, 1, 1, 0, 0, 0]


def test_every_surface_names_the_registered_metrics():
    from apao_ray.analysis.grid import GRID_METRICS
    from apao_ray.analysis.results import TEST_METRICS
    from apao_ray.config import TrainConfig, TrialConfig
    from apao_ray.protocol import selectable_metrics
    from apao_ray.study.record.mlflow_callback import study_columns
    from apao_ray.study.record.seeds import TEST_COLUMNS

    assert TEST_COLUMNS == TEST_METRICS == tuple(f"test/{name}" for name in PER_USER_METRICS)
    assert GRID_METRICS == ("test/recall_at_10", "test/ndcg_at_10", "test/mrr_at_10")
    assert "mrr_at_10" in selectable_metrics(TrialConfig())
    narrow = TrialConfig(train=TrainConfig(beam_size=5, topk=(5,)))
    assert "mrr_at_10" not in selectable_metrics(narrow) and "ndcg_at_5" in selectable_metrics(narrow)
    columns = study_columns(("tiger",), ("ce",), "best/val/ndcg_at_10")
    assert "metrics.`test/mrr_at_10`" in columns and "metrics.`test/recall_at_10`" in columns


def test_a_table_written_before_a_metric_was_registered_reads_it_from_its_ranks(tmp_path):
    from apao_ray.training.evaluation import write_per_user

    ranks = np.array([3, -1, 12, 1, 10])
    old = {"user": np.array(["007", "b", "c", "d", "e"], dtype=object), "rank": ranks,
           "recall_at_10": (ranks >= 1) & (ranks <= 10), "recall_at_20": ranks >= 1,
           "ndcg_at_10": np.zeros(5), "ndcg_at_20": np.zeros(5)}  # as stored: never recomputed
    table = read_per_user(write_per_user(tmp_path / "old.csv.gz", old))
    assert table["mrr_at_10"].tolist() == pytest.approx([1 / 3, 0, 0, 1, 0.1])
    assert table["ndcg_at_10"].tolist() == [0] * 5 and table["user"].tolist()[0] == "007"


def test_every_committed_per_user_table_loads_with_every_registered_metric():
    """The tables under benchmarks/results predate MRR@10: each loads, its MRR@10 is the hand MRR of its ranks, and
    recomputing the metrics it did store from its ranks gives what it stored (so a recomputed metric is the one
    the table would have held)."""
    paths = sorted((ROOT / "benchmarks" / "results").glob("*/per_user*/*.csv.gz"))
    assert len(paths) >= 30
    for path in paths:
        table = read_per_user(path)
        assert set(PER_USER_METRICS) <= set(table.columns), path
        assert table["mrr_at_10"].mean() == pytest.approx(brute_mrr_at_10(table["rank"]), abs=1e-12), path
        stored = pd.read_csv(path, nrows=0).columns
        for name, values in rank_metric_values(table["rank"].to_numpy(), (10, 20)).items():
            if name in stored:
                np.testing.assert_allclose(table[name].to_numpy(float), values, atol=1e-6, err_msg=f"{path} {name}")


def test_the_baselines_report_mrr_not_ndcg_under_its_name(synthetic):
    """Popularity and last-item MRR@10, against MRR found by hand in each user's list of semantic IDs."""
    from apao_ray.analysis.heuristics import HEURISTICS, heuristic_per_user
    from test_heuristics import dataset

    assert heuristic_per_user(dataset(), "popularity")["mrr_at_10"].tolist() == pytest.approx([1 / 2, 1 / 4, 1 / 5, 1])
    item_sem, split = synthetic.catalog.item_sem, synthetic.splits["test"]
    for name in HEURISTICS:
        lists = HEURISTICS[name](synthetic.splits, item_sem, "test")
        by_hand = []
        for ranked, target in zip(lists.tolist(), item_sem[split.targets].tolist()):
            top = ranked[:10]
            by_hand.append(1.0 / (top.index(target) + 1) if target in top else 0.0)
        table = heuristic_per_user(synthetic, name)
        order = np.argsort(split.users, kind="stable")
        assert table["mrr_at_10"].tolist() == pytest.approx(np.asarray(by_hand)[order].tolist(), abs=1e-12), name
        assert 0 < table["mrr_at_10"].mean() != pytest.approx(table["ndcg_at_10"].mean()), name  # not NDCG renamed


def test_the_report_and_the_grid_show_mrr(tmp_path, monkeypatch):
    """Fabricated two-seed exports (tests/test_analysis_report.py): APAO's ranks are CE's with 3% of the users moved
    from a miss to rank 1, so its MRR@10 is higher by exactly 0.03. Then the same studies as if logged before MRR@10
    was registered: no test/mrr_at_10, tables without the column; the paired difference still comes from the ranks."""
    from apao_ray.analysis.export import load_export
    from apao_ray.analysis.grid import build_grid
    from apao_ray.analysis.report import build_report
    from apao_ray.training.evaluation import write_per_user
    from test_analysis_grid import _rows
    from test_analysis_report import _fabricate, _section

    monkeypatch.delenv("APAO_DATA_DIR", raising=False)  # no dataset files: no training-free rows
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))
    exports = [load_export(_fabricate(tmp_path / "exports", seed, effect=0.03)) for seed in (0, 1)]
    ce = [export.trials[0]["metrics"]["test/mrr_at_10"] for export in exports]
    assert ce == pytest.approx([brute_mrr_at_10(export.per_user(export.trials[0])["rank"]) for export in exports])
    mrr = f"{np.mean(ce):.4f} ± {np.std(ce, ddof=1):.4f}"
    report = build_report(exports, tmp_path / "out", num_resamples=300).read_text()
    header, *rows = _section(report, "Test metrics")
    assert "| R@10 | R@20 | N@10 | N@20 | MRR@10 |" in header
    assert f"| {mrr} |" in next(line for line in rows if "| ce |" in line)
    paired = next(line for line in _section(report, "Paired differences") if "| mrr_at_10 |" in line)
    assert "| +0.0300 [" in paired
    grid = build_grid(exports, tmp_path / "grid", num_resamples=200).read_text()
    assert "ours R@10 / N@10 / MRR@10 (mean ± std, n seeds)" in grid
    assert _rows(grid)[("office", "tiger", "ce")][0].split(" / ")[2] == f"{mrr} (n=2)"

    for export in exports:  # as logged before MRR@10 was registered
        for trial in export.trials:
            del trial["metrics"]["test/mrr_at_10"]
            table = pd.read_csv(export.directory / trial["per_user"], dtype={"user": str}).drop(columns="mrr_at_10")
            write_per_user(export.directory / trial["per_user"], {c: table[c].to_numpy() for c in table.columns})
    older = build_report(exports, tmp_path / "older", num_resamples=300).read_text()
    assert next(line for line in _section(older, "Test metrics") if "| ce |" in line).split(" | ")[8] == "-"
    assert "| +0.0300 [" in next(line for line in _section(older, "Paired differences") if "| mrr_at_10 |" in line)
