"""benchmarks/evidence/val_test_drift.py, the diagnosis of why validation and test disagree, on fabricated exports
of the synthetic dataset: the validation difference re-weighted to test's popularity mix, and the per-epoch
validation and test differences of a study that tested every epoch."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from apao_ray.data import load_dataset
from apao_ray.training.evaluation import write_per_user
from test_gpu_full_protocol import evidence_script


@pytest.fixture(scope="module")
def drift():
    return evidence_script("val_test_drift")


@pytest.fixture(scope="module")
def dataset():
    return load_dataset("synthetic")


def _table(users: list[str], ndcg: np.ndarray) -> dict[str, np.ndarray]:
    hit = (ndcg > 0).astype(float)
    return {"user": np.array(users, dtype=object), "rank": np.where(hit > 0, 1, -1), "recall_at_10": hit,
            "ndcg_at_10": ndcg, "recall_at_20": hit, "ndcg_at_20": ndcg}


def _export(root, dataset, drift, head_gain: float, valid_gaps: list[float], test_gaps: list[float],
            running: bool = False, seed: int = 0):
    """One seed of CE and APAO-pointwise: APAO's NDCG@10 is CE's plus ``head_gain`` for the users whose target
    is in the head band (test's edges), on both splits; per epoch, validation and test differences as given,
    both trials keeping the last epoch."""
    _, edges = drift._bands(dataset, "test")
    directory = root / f"study-s{seed}"
    for name in ("per_user", "per_user_valid"):
        (directory / name).mkdir(parents=True)
    rng = np.random.default_rng(0)
    trials, rows = [], []
    tables = {}
    for split in ("test", "valid"):
        band, _ = drift._bands(dataset, split, edges)
        users = [dataset.user_ids[u] for u in dataset.splits[split].users]
        ce = (rng.random(len(users)) < 0.1) * 0.5
        tables[split] = {"ce": ce, "apao_pointwise": ce + head_gain * np.array([band[u] == 2 for u in users])}
        tables[f"{split}_users"] = users
    for run_id, loss, gaps in (("c0", "ce", None), ("a0", "apao_pointwise", (valid_gaps, test_gaps))):
        record = {"run_id": run_id, "name": f"tiger/{loss}", "status": "RUNNING" if running else "FINISHED",
                  "tags": {"backbone": "tiger", "loss": loss}, "params": {"base.train.seed": str(seed), "loss": loss,
                                                                         "backbone": "tiger",
                                                                         "base.data.dataset": "synthetic"},
                  "metrics": {"test/ndcg_at_10": float(tables["test"][loss].mean()),
                              "best/val/ndcg_at_10": 0.01 * len(valid_gaps) + (valid_gaps[-1] if gaps else 0.0),
                              "best/epoch": float(len(valid_gaps)), "val/ndcg_at_10": 0.1},
                  "per_user": f"per_user/{run_id}.csv.gz", "per_user_valid": f"per_user_valid/{run_id}.csv.gz"}
        if running:  # still training: no test metrics, no tables yet
            record.update(per_user=None, per_user_valid=None)
            del record["metrics"]["test/ndcg_at_10"]
        else:
            write_per_user(directory / record["per_user"], _table(tables["test_users"], tables["test"][loss]))
            write_per_user(directory / record["per_user_valid"], _table(tables["valid_users"], tables["valid"][loss]))
        trials.append(record)
        for epoch in range(1, len(valid_gaps) + 1):
            base = 0.01 * epoch
            rows.append((run_id, "val/ndcg_at_10", epoch, base + (gaps[0][epoch - 1] if gaps else 0.0)))
            rows.append((run_id, "diagnosis/test/ndcg_at_10", epoch, base + (gaps[1][epoch - 1] if gaps else 0.0)))
    (directory / "study.json").write_text(json.dumps({"format_version": 1, "study": f"study-s{seed}", "parents": [],
                                                      "experiment": "apao-synthetic", "trials": trials}))
    with gzip.open(directory / "epochs.csv.gz", "wt") as handle:
        pd.DataFrame(rows, columns=["run_id", "key", "step", "value"]).to_csv(handle, index=False)
    return directory


def test_the_validation_lead_is_reweighted_to_tests_popularity_mix(tmp_path, dataset, drift):
    """A lead that sits in the head band alone: per band it shows there only, on both splits, and re-weighted
    it is the head lead times the test split's head share, which is what the test split shows overall."""
    export = _export(tmp_path, dataset, drift, 0.2, [0.0] * 3, [0.0] * 3)
    result = drift.by_band(dataset, [str(export)])
    (test,), (valid,) = result["per_seed"], result["valid"]["per_seed"]
    shares = result["valid"]["band_shares"]
    for row in (test, valid):
        assert row["head"] == pytest.approx(0.2) and row["middle"] == 0 and row["tail"] == 0
    assert valid["reweighted_to_test"] == pytest.approx(0.2 * shares["test"]["head"])
    assert valid["reweighted_to_test"] == pytest.approx(test["all"])
    assert valid["all"] == pytest.approx(0.2 * shares["valid"]["head"])
    assert sum(shares["valid"].values()) == pytest.approx(1) and 0.2 < shares["test"]["head"] < 0.5


def test_per_epoch_differences_say_whether_test_follows_validation(tmp_path, dataset, drift):
    """Test's difference following validation's, then parting from it: counted and correlated per epoch."""
    valid = [0.001, 0.002, 0.003, 0.004, 0.003, 0.004]
    follows = _export(tmp_path / "a", dataset, drift, 0.0, valid, [2 * v for v in valid])
    (curve,) = drift.per_epoch([str(follows)])
    assert curve["epochs"] == [1, 2, 3, 4, 5, 6] and curve["finished"]
    assert curve["valid"] == pytest.approx(valid) and curve["test"] == pytest.approx([2 * v for v in valid])
    assert curve["correlation"] == pytest.approx(1) and curve["valid_positive"] == curve["test_positive"] == 6
    parts = _export(tmp_path / "b", dataset, drift, 0.0, valid, [0.001, 0.002, 0.003, -0.001, -0.002, -0.003])
    (curve,) = drift.per_epoch([str(parts)])
    assert curve["test_positive"] == 3 and curve["correlation"] < 0.5
    assert curve["mean_last_20"]["test"] == pytest.approx(0.0)


def test_seeds_that_disagree_on_test_cannot_tell_test_from_validation(tmp_path, dataset, drift):
    """Validation ahead by 0.01 at every seed. Test ahead at one seed and behind at the other: the paired
    validation - test interval over seeds holds zero. Test behind validation by the same amount at both: it
    excludes zero."""
    def exports(root, gains):
        return [str(_export(root, dataset, drift, gain, [0.01] * 4, [0.0] * 4, seed=seed))
                for seed, gain in enumerate(gains)]

    level = drift.seed_level(exports(tmp_path / "a", [0.2, -0.2]), window=1)
    head = drift._bands(dataset, "test")[0]
    share = np.mean([b == 2 for b in head.values()])
    assert [r["test"] for r in level["per_seed"]] == pytest.approx([0.2 * share, -0.2 * share])
    assert [r["valid_kept"] for r in level["per_seed"]] == pytest.approx([0.01, 0.01])
    assert [r["valid_around_epochs"] for r in level["per_seed"]] == [2, 2]    # epochs 3, 4 of kept 4 +/- 1
    assert level["test"]["sd_over_seeds"] > 10 * level["valid_around"]["sd_over_seeds"]
    low, high = level["valid_around_minus_test"]["ci95"]
    assert low < 0 < high and level["valid_around_minus_test"]["p"] > 0.5
    level = drift.seed_level(exports(tmp_path / "b", [0.002, 0.0021]), window=1)
    low, high = level["valid_kept_minus_test"]["ci95"]
    assert 0 < low < 0.01 - 0.002 * share < high and level["valid_kept_minus_test"]["p"] < 0.05
    assert "test" not in drift.seed_level(exports(tmp_path / "c", [0.1]))    # one seed: no spread, no interval


def test_the_spread_test_pairs_the_two_splits_by_seed(drift):
    """Two equally spread splits give p 0.5; a second split three times
    as spread as the first, seed by seed, gives a small p."""
    first = np.array([1.0, 2.0, 3.0, 4.0])
    equal = drift.paired_variance_test(first, np.array([2.0, 1.0, 4.0, 3.0]))
    assert equal["ratio"] == pytest.approx(1.0) and equal["p_one_sided"] == pytest.approx(0.5)
    assert equal["p_two_sided"] == pytest.approx(1.0)
    wider = drift.paired_variance_test(first, 3 * first + np.array([0.1, -0.1, 0.0, 0.05]))
    assert wider["ratio"] > 8 and wider["p_one_sided"] < 0.01


def test_a_running_studys_export_prints_its_curves_so_far_and_no_band_table(tmp_path, dataset, drift, capsys,
                                                                            monkeypatch):
    """A study still training has per-epoch curves and no per-user tables: the script prints the curves."""
    export = _export(tmp_path, dataset, drift, 0.0, [0.001, 0.002, -0.001], [0.002, 0.001, 0.001], running=True)
    monkeypatch.setattr("sys.argv", ["val_test_drift.py", "--dataset", "synthetic", "--exports", str(export)])
    assert drift.main() == 0
    out = capsys.readouterr().out
    assert "no seed with both methods' per-user test tables" in out
    assert "seed 0 (still running), APAO - CE per epoch, validation / test:" in out
    assert "positive at 2/3 epochs on validation, 3/3 on test" in out
