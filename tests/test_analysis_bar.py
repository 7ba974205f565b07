"""The training-free heuristics as the bar: fabricated exports on the synthetic dataset's test users, CE below the
last-item heuristic and APAO above it; the report's tables and the study's answer table say which is which."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from apao_ray.analysis.bar import BAR_HEURISTIC, bar_words, heuristic_paired, heuristic_tables
from apao_ray.analysis.export import load_export
from apao_ray.analysis.report import build_report
from apao_ray.analysis.results import finished_trials, group_methods
from apao_ray.data import load_dataset
from apao_ray.training.evaluation import write_per_user
from test_analysis_report import _per_user, _section, _trial


def _export(root: Path, seed: int, users: list[str], ranks: dict[str, np.ndarray], dataset: str = "synthetic") -> Path:
    """One seed's study export on ``dataset``: a trial per loss with the given per-user ranks."""
    directory = root / f"{dataset}-s{seed}"
    (directory / "per_user").mkdir(parents=True)
    trials, rows = [], []
    for loss, loss_ranks in ranks.items():
        record, table = _trial(f"{loss}{seed}", loss, seed, loss_ranks, "paper", {})
        record["params"]["base.data.dataset"] = dataset
        table["user"] = np.array(users, dtype=object)
        write_per_user(directory / record["per_user"], table)
        trials.append(record)
        rows += [(record["run_id"], "val/ndcg_at_10", epoch, value) for epoch, value in ((1, 0.01), (2, 0.0198), (3, 0.02))]
    record = {"format_version": 1, "study": f"{dataset}-s{seed}", "experiment": f"apao-{dataset}",
              "tracking_uri": "sqlite:///x", "exported_at": "2026-12-01T00:00:00Z",
              "parents": [{"run_id": f"p{seed}", "tags": {"command_line": "sweep", "code_version": "abc"}}],
              "trials": trials}
    (directory / "study.json").write_text(json.dumps(record))
    with gzip.open(directory / "epochs.csv.gz", "wt") as handle:
        pd.DataFrame(rows, columns=["run_id", "key", "step", "value"]).to_csv(handle, index=False)
    return directory


@pytest.fixture(scope="module")
def synthetic():
    dataset = load_dataset("synthetic")
    return dataset, heuristic_tables(dataset)


def _exports(tmp_path, synthetic):
    """Two seeds: CE hits 20% of the users at rank 2 (N@10 ~0.13, far below the heuristic's ~0.80), APAO every
    user at rank 1 (N@10 1.0, above it)."""
    dataset, tables = synthetic
    users = sorted(tables[BAR_HEURISTIC]["user"])
    exports = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        ce = np.where(rng.random(len(users)) < 0.2, 2, 0)
        exports.append(load_export(_export(tmp_path, seed, users, {"ce": ce, "apao_pointwise": np.ones(len(users), int)})))
    return exports


def test_a_method_below_the_last_item_heuristic_says_so_and_one_above_it_does_not(tmp_path, synthetic):
    _, tables = synthetic
    methods = group_methods(finished_trials(_exports(tmp_path, synthetic)))
    ce = next(m for m in methods if m.loss == "ce")
    apao = next(m for m in methods if m.loss == "apao_pointwise")
    bar = tables[BAR_HEURISTIC]["ndcg_at_10"].mean()
    pooled = np.concatenate([t.per_user()["ndcg_at_10"].to_numpy() for t in ce.trials]).mean()
    assert bar_words(ce, tables) == f"below the last-item heuristic: test ndcg_at_10 {pooled:.4f} vs {bar:.4f}"
    assert bar_words(apao, tables) == ""
    assert bar_words(ce, None) == ""  # no dataset here: nothing to say

    paired = heuristic_paired(methods, {"synthetic": tables}, metrics=("ndcg_at_10",), num_resamples=200)
    assert [(p.method.loss, p.baseline.loss) for p in paired] == [("popularity", "ce"), ("last_item", "ce")]
    last = paired[1]
    expected = np.mean([bar - t.per_user()["ndcg_at_10"].mean() for t in ce.trials])
    assert last.over_seeds.num_seeds == 2 and last.over_seeds.mean_difference == pytest.approx(expected)
    assert sorted(last.per_seed) == [0, 1] and last.over_seeds.p_holm is not None


def test_the_report_ranks_methods_beside_the_heuristics_with_the_same_metrics(tmp_path, synthetic):
    _, tables = synthetic
    text = build_report(_exports(tmp_path, synthetic), tmp_path / "out", num_resamples=200).read_text()
    rows = _section(text, "Test metrics")
    ce_row = next(r for r in rows if "| ce |" in r)
    apao_row = next(r for r in rows if "| apao_pointwise" in r)
    assert re.search(r"\| converged; below the last-item heuristic: test ndcg_at_10 0\.1\d{3} vs "
                     rf"{tables[BAR_HEURISTIC]['ndcg_at_10'].mean():.4f} \|$", ce_row)
    assert apao_row.endswith("| converged |")
    heuristic_row = next(r for r in rows if "last-item transitions (training-free)" in r)
    means = [f"{tables[BAR_HEURISTIC][m].mean():.4f}" for m in ("recall_at_10", "recall_at_20", "ndcg_at_10", "ndcg_at_20")]
    assert heuristic_row.startswith(f"| synthetic | - | last-item transitions (training-free) | - | {' | '.join(means)} |")
    assert heuristic_row.endswith("| training-free |")
    differences = _section(text, "Paired differences")
    assert any("| last-item transitions (training-free) - ce | ndcg_at_10 | +" in r and "p_holm" in r
               for r in differences)
    assert any("| popularity (training-free) - ce | recall_at_10 |" in r for r in differences)
