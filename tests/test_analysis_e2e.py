"""Per-user test tables, export-study and the report on two real --smoke studies (seeds 0 and 1)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from apao_ray.rank_metrics import AT_10_METRICS, PER_USER_METRICS
from conftest import ROOT, mlflow_sqlite, run_script

pytestmark = pytest.mark.e2e
SWEEP = str(ROOT / "studies" / "sweep.py")
STUDIES = ("smoke-s0", "smoke-s1")


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """Two --smoke studies (tiger CE and APAO-pointwise at the paper's Office knobs, 2 epochs), one per seed,
    in one MLflow store: how seeds are run today (a study flag)."""
    workdir = tmp_path_factory.mktemp("seeds")
    uri = mlflow_sqlite(workdir)
    for seed, study in enumerate(STUDIES):
        # RAY_ADDRESS=local: a Ray of its own, never one already running on the machine (a long study beside)
        result = run_script([SWEEP, "--smoke", "--num-samples", "1", "--beta", "0.3", "--eta", "1e-4", "--seed", str(seed),
                             "--study-name", study, "--output-dir", str(workdir / "runs"), "--tracking-uri", uri],
                            cwd=workdir, env={"RAY_ADDRESS": "local"})
        assert result.returncode == 0, result.stderr[-4000:]
    from apao_ray.tracking import Tracker

    return {"dir": workdir, "uri": uri, "tracker": Tracker(uri, "apao-synthetic")}


def _cli(args: list[str], cwd: Path):
    result = run_script(["-m", "apao_ray", *args], cwd=cwd)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_every_finished_trial_logs_a_per_user_table_that_averages_to_its_test_metrics(studies, tmp_path):
    from apao_ray.analysis.per_user import read_per_user
    from apao_ray.analysis.subsets import transition_labels
    from apao_ray.data import load_dataset

    tracker = studies["tracker"]
    runs = tracker.child_runs()
    assert len(runs) == 4 and all(run.info.status == "FINISHED" for run in runs)
    for run in runs:
        table = read_per_user(tracker.client.download_artifacts(run.info.run_id, "per_user_test.csv.gz", str(tmp_path)))
        assert len(table) == 600 and table["user"].is_unique  # every synthetic test user, once
        for name in ("recall_at_10", "recall_at_20", "ndcg_at_10", "ndcg_at_20"):
            assert table[name].mean() == pytest.approx(run.data.metrics[f"test/{name}"], abs=1e-6)
        assert table["prefix_hit_m4"].mean() == pytest.approx(run.data.metrics["test/prefix_recall_at_20_m4"], abs=1e-9)
        hits = table["rank"].between(1, 10)
        assert (hits == (table["recall_at_10"] == 1)).all() and (table.loc[~table["rank"].between(1, 20), "rank"] == -1).all()
        labels = transition_labels(load_dataset("synthetic")).set_index("user").loc[table["user"]]
        assert (table["is_memorization"].to_numpy() == labels["is_memorization"].to_numpy()).all()  # as the trial wrote them


def test_every_trial_records_its_cost_and_the_parent_sums_it_per_method(studies):
    tracker = studies["tracker"]
    for parent in tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'"):
        children = tracker.child_runs(parent.info.run_id)
        for run in children:
            metrics = run.data.metrics
            assert 0 < metrics["cost/cpu_seconds"] and metrics["cost/peak_rss_mb"] > 100, metrics
            assert metrics["cost/wall_seconds"] >= metrics["perf/total_seconds"]  # setup and test included
            assert run.data.tags["apao.energy_method"]  # measured, estimated, or why not
        for loss in ("ce", "apao_pointwise"):
            cpu = [r.data.metrics["cost/cpu_seconds"] for r in children if r.data.tags["loss"] == loss]
            assert parent.data.metrics[f"cost/tiger/{loss}/cpu_seconds"] == pytest.approx(sum(cpu))


def test_export_is_compact_and_holds_what_the_report_needs(studies, tmp_path):
    out = tmp_path / "smoke-s0"
    printed = _cli(["export-study", "--study", "smoke-s0", "--tracking-uri", studies["uri"], "--to", str(out)],
                   studies["dir"]).stdout
    assert "2 trials (2 with a per-user test table)" in printed
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 300_000
    from apao_ray.analysis.export import load_export

    export = load_export(out)
    assert {t["tags"]["loss"] for t in export.trials} == {"ce", "apao_pointwise"}
    from apao_ray.training.memory import find_tcmalloc

    for trial in export.trials:
        assert trial["params"]["base.train.seed"] == "0" and trial["tags"]["apao.protocol"] == "paper"
        # the worker ran on the allocator that auto picks on this machine (training/memory.py)
        assert trial["tags"]["apao.allocator"] == ("tcmalloc" if find_tcmalloc() else "glibc-cached")
        assert trial["tags"]["apao.precision"] in ("fp32", "bf16") and "test/beam_retention_at_20" in trial["metrics"]
        assert list(export.history(trial["run_id"], "val/ndcg_at_10").index) == [1, 2]
        assert len(export.per_user(trial)) == 600
        # the kept model's validation per user: its mean is the best epoch's validation NDCG@10
        valid = export.per_user(trial, "valid")
        assert valid["ndcg_at_10"].mean() == pytest.approx(trial["metrics"]["best/val/ndcg_at_10"], abs=1e-6)
    apao = next(t for t in export.trials if t["tags"]["loss"] == "apao_pointwise")
    assert apao["params"]["beta"] == "0.3" and len(export.history(apao["run_id"], "train/apao_weight_m1")) == 2
    assert "--seed 0" in export.record["parents"][0]["tags"]["command_line"]
    with pytest.raises(ValueError, match=r"no study 'nope' .* studies there: \['smoke-s0', 'smoke-s1'\]"):
        from apao_ray.analysis.export import export_study

        export_study(studies["uri"], "nope", tmp_path / "nope")


def test_per_user_table_recomputed_from_the_checkpoint_for_runs_that_predate_it(studies, tmp_path):
    """A copy of the store whose trials never logged the table (as before it existed) and whose checkpoints
    lack it: --recompute-per-user tests the best weights again and gets the same table."""
    from apao_ray.analysis.per_user import read_per_user
    from apao_ray.training.checkpoint import MANIFEST_FILE

    copy = tmp_path / "old"
    shutil.copytree(studies["dir"], copy, ignore=shutil.ignore_patterns("mlflow.db-*"))
    for path in copy.rglob("per_user_test.csv.gz"):
        path.unlink()
    for path in copy.rglob(MANIFEST_FILE):  # checkpoints from before the table predate their manifests too
        path.unlink()
    # the copied store still points at the original artifact and checkpoint paths: repoint them into the copy
    import sqlite3

    with sqlite3.connect(copy / "mlflow.db") as db:
        for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri"), ("tags", "value")):
            db.execute(f"update {table} set {column} = replace({column}, ?, ?)", (str(studies["dir"]), str(copy)))
    uri = f"sqlite:///{copy}/mlflow.db"
    printed = _cli(["export-study", "--study", "smoke-s1", "--tracking-uri", uri, "--to", str(tmp_path / "export"),
                    "--recompute-per-user"], copy).stdout
    assert "2 trials (2 with a per-user test table)" in printed and printed.count("equals the logged") == 2, printed
    original = {r.info.run_id: r for r in studies["tracker"].child_runs()}
    record = json.loads((tmp_path / "export" / "study.json").read_text())
    for trial in record["trials"]:
        assert trial["per_user_source"].startswith(f"recomputed from {copy}")
        again = read_per_user(tmp_path / "export" / trial["per_user"])
        logged = read_per_user(studies["tracker"].client.download_artifacts(
            original[trial["run_id"]].info.run_id, "per_user_test.csv.gz", str(tmp_path)))
        # the kept epoch's columns: the other selection rules' epochs are not in a final checkpoint (runs that
        # predate per-user tables predate those columns too)
        assert again.equals(logged[list(again.columns)])
        assert {"ndcg_at_10_by_val_loss", "ndcg_at_10_by_last"} <= set(logged.columns) - set(again.columns)


def test_report_from_mlflow_equals_the_report_from_the_exports(studies, tmp_path):
    from_mlflow = tmp_path / "from_mlflow"
    _cli(["report", "--study", STUDIES[0], "--study", STUDIES[1], "--tracking-uri", studies["uri"], "--out",
          str(from_mlflow), "--resamples", "2000"], studies["dir"])
    from_exports = tmp_path / "from_exports"
    _cli(["report", "--exports", str(from_mlflow / "exports"), "--out", str(from_exports), "--resamples", "2000"],
         studies["dir"])

    def tables(path: Path) -> list[str]:
        return [line for line in (path / "report.md").read_text().splitlines() if line.startswith("| ")]

    rows = tables(from_mlflow)
    assert rows == tables(from_exports)
    ce = next(r for r in rows if "| ce | 0,1 (2 seeds) |" in r)
    assert "2 epochs / patience 2" in ce and "| - |" in ce  # synthetic: no paper numbers
    runs = [r for r in studies["tracker"].child_runs() if r.data.tags["loss"] == "ce"]
    values = sorted(r.data.metrics["test/ndcg_at_10"] for r in runs)
    import numpy as np

    assert f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}" in ce
    compared = [r for r in rows if "apao_pointwise b=0.3 eta=0.0001 - ce" in r]
    paired = [r for r in compared if r.split("|")[4].strip() in PER_USER_METRICS]  # every registered metric
    # a verdict over both seeds; none per seed (one seed does not measure training variance)
    assert len(paired) == len(PER_USER_METRICS) == 5 and all(r.count("p_holm = ") == 1 and "over seeds and users (2 seeds)" in r
                                    and r.endswith("| 600 |") for r in paired)
    # and the same at the epoch of each selection rule every trial recorded (the metrics at 10; no full sort on a CPU)
    assert sorted(r.split("|")[4].strip() for r in compared if r not in paired) == sorted(
        f"{metric}_by_{rule}" for metric in AT_10_METRICS for rule in ("last", "val_loss", "val_ndcg_at_10"))
    cost = next(r for r in rows if "| ce | 0,1 (2 seeds) |" in r and r.count("|") == 13)  # the cost table's row
    assert cost.split("|")[7].strip() != "-"  # CPU minutes summed over every trial of both seeds' studies
    for name in ("prefix_recall.png", "beam_retention.png", "adaptive_weights.png", "val_ndcg_at_10.png"):
        assert (from_exports / name).stat().st_size > 5000
