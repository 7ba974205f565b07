"""benchmarks/evidence/: gpu_full_protocol.py's trial files, written by a real (tiny) trial, become a study
export that the report reads like a sweep's (a GPU machine without Ray or MLflow cannot record them); and
diagnose_full.py re-evaluates finished trials' checkpoints as their own test metrics say."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from apao_ray.rank_metrics import PER_USER_METRICS
from conftest import ROOT


def evidence_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "evidence" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_script():
    return evidence_script("gpu_full_protocol")


def tiny_trial_args(gpu_script, out, work, extra=" --eval-max-users 100"):
    return gpu_script.build_parser().parse_args([
        "--dataset", "synthetic", "--device", "cpu", "--out", str(out), "--work", str(work), "--threads", "1",
        "--train-flags", "--model-size tiny --epochs 2 --batch-size 128 --effective-batch-size 128 --lr 2e-3 "
        "--max-train-samples 512" + extra])


@pytest.mark.e2e
def test_trial_files_export_to_what_the_report_reads(tmp_path, gpu_script, one_torch_thread):
    from apao_ray.analysis.export import load_export
    from apao_ray.analysis.report import build_report

    out, work, to_dir = tmp_path / "out", tmp_path / "work", tmp_path / "export"
    args = tiny_trial_args(gpu_script, out, work)
    out.mkdir()
    gpu_script.one("ce", 0, args)  # what each trial's subprocess runs
    finished = json.loads((out / "ce-seed0.json").read_text())
    assert finished["finished"] and len(finished["epochs"]) == 2
    # a trial its --deadline stopped: its epochs only (gpu_script.partial writes these from metrics.jsonl)
    stopped = [{**epoch, "val/ndcg_at_10": value} for epoch, value in zip(finished["epochs"], (0.03, 0.05))]
    (out / "apao_pointwise-seed0.json").write_text(json.dumps({"loss": "apao_pointwise", "seed": 0, "finished": False,
                                                                "epochs": stopped}))

    gpu_script.write_export(out, "gpu-try", to_dir, args)
    export = load_export(to_dir)
    trials = {trial["params"]["loss"]: trial for trial in export.trials}
    ce, pointwise = trials["ce"], trials["apao_pointwise"]
    assert ce["status"] == "FINISHED" and pointwise["status"] == "KILLED"
    for key in ("test/ndcg_at_10", "test/recall_at_20", "best/val/ndcg_at_10"):
        assert ce["metrics"][key] == finished["final"][key]
    # the params and tags a sweep's child run carries, from the trial's resolved config
    assert ce["params"]["base.data.dataset"] == "synthetic" and ce["params"]["base.train.seed"] == "0"
    assert ce["tags"]["apao.protocol"] == "paper" and ce["tags"]["apao.schedule"] == "2 epochs / patience 20"
    assert pointwise["params"]["beta"] == "0.3" and pointwise["params"]["eta"] == "0.0001"  # paper Table 5, TIGER
    table = export.per_user(ce)
    assert len(table) == finished["final"]["test/num_users"]
    assert table["ndcg_at_10"].mean() == pytest.approx(finished["final"]["test/ndcg_at_10"], abs=1e-5)
    assert export.per_user(pointwise) is None
    assert pointwise["metrics"]["best/val/ndcg_at_10"] == 0.05 and pointwise["metrics"]["best/epoch"] == 2
    curve = export.history(ce["run_id"], "val/ndcg_at_10")
    assert list(curve.index) == [1, 2]
    assert np.allclose(curve.values, [e["val/ndcg_at_10"] for e in finished["epochs"]], atol=1e-6)

    report = build_report([export], tmp_path / "report").read_text()
    assert "| synthetic | tiger | ce | 0 (1 seed) |" in report  # the finished trial's test metrics
    assert "stopped at its --deadline | 2 |" in report  # the stopped one among the unfinished


@pytest.mark.e2e
def test_cohort_flag_trains_every_trial_in_one_process_with_its_own_file(tmp_path, gpu_script):
    """--cohort 3: the four (loss, seed) trials as fused cohorts of 3 and 1 in two subprocesses, each member's own
    file as a trial alone writes it (the members equal their solo trials: tests/test_cohort.py)."""
    import subprocess
    import sys

    out, work = tmp_path / "out", tmp_path / "work"
    args = tiny_trial_args(gpu_script, out, work)
    command = [sys.executable, str(ROOT / "benchmarks" / "evidence" / "gpu_full_protocol.py"), "--cohort", "3",
               "--losses", "ce,apao_pointwise", "--seeds", "0,1", "--dataset", "synthetic", "--device", "cpu",
               "--out", str(out), "--work", str(work), "--threads", "1", f"--train-flags={args.train_flags}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("exit 0") == 2  # a process for each cohort
    files = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert sorted(files) == ["apao_pointwise-seed0", "apao_pointwise-seed1", "ce-seed0", "ce-seed1"]
    for name, trial in files.items():
        assert trial["finished"] and [e["epoch"] for e in trial["epochs"]] == [1, 2]
        assert trial["config"]["train"]["seed"] == trial["seed"] and trial["config"]["loss"]["name"] == trial["loss"]
        # loss-major order: ce seeds 0, 1 and apao_pointwise seed 0 together, apao_pointwise seed 1 alone
        alone = name == "apao_pointwise-seed1"
        assert [e.get("perf/cohort_members", 1) for e in trial["epochs"]] == ([1, 1] if alone else [3, 3])
        assert trial["per_user_test_csv"].count("\n") > 1
    losses = {name: trial["final"]["test/loss_ce"] for name, trial in files.items()}
    assert len(set(losses.values())) == 4, losses  # four different models


@pytest.mark.e2e
def test_diagnosis_re_evaluates_each_trials_selected_weights_as_its_test_metrics(tmp_path, gpu_script,
                                                                                 one_torch_thread):
    """diagnose_full.py on two finished trials: the selected weights in the trials' precision give back each
    trial's own test and validation metrics, the last epoch's weights its last validation (every user is
    validated), and the paired differences are APAO - CE."""
    out, work = tmp_path / "out", tmp_path / "work"
    args = tiny_trial_args(gpu_script, out, work, " --precision fp32")
    out.mkdir()
    for loss in ("ce", "apao_pointwise"):
        gpu_script.one(loss, 0, args)
    trials = {loss: json.loads((out / f"{loss}-seed0.json").read_text()) for loss in ("ce", "apao_pointwise")}
    final = {loss: trial["final"] for loss, trial in trials.items()}

    gpu_script.write_export(out, "tiny", tmp_path / "export", args)
    result = evidence_script("diagnose_full").main([
        "--study-dir", str(work), "--precisions", "fp32", "--splits", "valid,test", "--export",
        str(tmp_path / "export"), "--json", str(tmp_path / "diagnosis.json")])
    for row in result["selection"]:  # the epoch selection by validation loss would keep, from the export
        epochs = trials[row["loss"]]["epochs"]
        by_loss = min(epochs, key=lambda e: e["val/loss_ce"])
        assert row["loss_epoch"] == by_loss["epoch"] and row["ndcg_epoch"] == final[row["loss"]]["best/epoch"]
        assert row["loss_ndcg_at_10"] == pytest.approx(by_loss["val/ndcg_at_10"], abs=1e-6)
    assert len(result["selection"]) == 2
    assert json.loads((tmp_path / "diagnosis.json").read_text())["rows"] == result["rows"]
    rows = {(r["loss"], r["weights"], r["split"]): r for r in result["rows"]}
    assert len(rows) == 8
    for loss, metrics in final.items():
        selected = rows[(loss, "selected", "test")]
        assert selected["epoch"] == metrics["best/epoch"] and rows[(loss, "last", "test")]["epoch"] == 2
        for name in ("recall_at_10", "ndcg_at_10", "ndcg_at_20", "mrr_at_10"):  # every registered metric
            assert selected[name] == pytest.approx(metrics[f"test/{name}"], abs=1e-6)
        assert rows[(loss, "selected", "valid")]["ndcg_at_10"] == pytest.approx(metrics["best/val/ndcg_at_10"], abs=1e-6)
        last_epoch = trials[loss]["epochs"][-1]
        assert last_epoch["epoch"] == 2
        for name in ("recall_at_20", "ndcg_at_10"):
            assert rows[(loss, "last", "valid")][name] == pytest.approx(last_epoch[f"val/{name}"], abs=1e-6)
    differences = {(c["weights"], c["split"], c["metric"]): c for c in result["comparisons"]}
    assert {c["method"] for c in result["comparisons"]} == {"apao_pointwise"}
    assert len(differences) == 2 * 2 * len(PER_USER_METRICS)  # (selected, last) x (valid, test) x every metric
    for weights in ("selected", "last"):
        for metric in ("recall_at_20", "ndcg_at_10"):
            c = differences[(weights, "test", metric)]
            expected = rows[("apao_pointwise", weights, "test")][metric] - rows[("ce", weights, "test")][metric]
            assert c["difference"] == pytest.approx(expected, abs=1e-9) and c["ci_low"] <= c["difference"] <= c["ci_high"]


def test_the_gpu_queue_names_studies_as_office_full_sh_and_skips_the_finished_ones():
    """benchmarks/gpu/next_job.py: a study run on a GPU must be the same study (name, flags) as office_full.sh's on
    a CPU, and the committed exports decide what is done: Office TIGER seeds 0-2 are, the reference CE is not."""
    import os
    import re
    import subprocess

    spec = importlib.util.spec_from_file_location("next_job", ROOT / "benchmarks" / "gpu" / "next_job.py")
    next_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(next_job)
    script = (ROOT / "benchmarks" / "evidence" / "office_full.sh").read_text()
    for dataset, backbone, losses, protocol in (("office", "tiger", "ce,apao_pointwise", "paper"),
                                                ("office", "tiger", "ce", "reference"),
                                                ("grocery", "llama", "ce,apao_pointwise,apao_pairwise", "paper")):
        env = {**os.environ, "DATASET": dataset, "BACKBONE": backbone, "LOSSES": losses, "PROTOCOL": protocol,
               "SEED": "3"}
        prelude = script[:script.index("export APAO_DATA_DIR")]  # the name's lines, before anything runs
        printed = subprocess.run(["bash", "-c", re.sub(r"^cd .*$", "", prelude, flags=re.M) + 'echo "$study"'],
                                 env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert next_job.study_name(dataset, backbone, tuple(losses.split(",")), protocol, 3) == printed
    assert all(next_job.is_done(f"office-full-tiger-seed{seed}", ("ce", "apao_pointwise")) for seed in (0, 1, 2))
    assert next_job.is_done("office-full-tiger-reference-ce-seed0", ("ce",))
    studies = [row["study"] for row in next_job.pending()]
    assert not {"office-full-tiger-seed1", "office-full-tiger-reference-ce-seed0"} & set(studies)
    first = json.loads((ROOT / "benchmarks" / "evidence" / "queue.json").read_text())["items"][0]
    assert studies[0] == next_job.study_name(first["dataset"], first["backbone"], tuple(first["losses"]),
                                              first["protocol"], first["seeds"][0])
    assert not next_job.is_done("office-full-tiger-seed0", ("ce", "apao_pairwise"))


def test_a_gpu_jobs_export_lands_as_a_study_the_grid_reads(tmp_path):
    """next_job.py --land: the files a job copies back (export.tar.gz, gpu.csv, ...) become <results>/<study>,
    the grid counts it, and a study already there is never overwritten."""
    import shutil
    import tarfile

    spec = importlib.util.spec_from_file_location("next_job", ROOT / "benchmarks" / "gpu" / "next_job.py")
    next_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(next_job)
    job_out, results = tmp_path / "gpu_out", tmp_path / "results"
    job_out.mkdir()
    with tarfile.open(job_out / "export.tar.gz", "w:gz") as archive:  # as study.sh packs it
        archive.add(ROOT / "benchmarks" / "results" / "office-full-tiger-seed1", arcname="export")
    (job_out / "gpu.csv").write_text("timestamp, name, utilization.gpu [%], memory.used [MiB]\n")
    results.mkdir()
    shutil.copytree(ROOT / "benchmarks" / "results" / "office-full-tiger-seed0", results / "office-full-tiger-seed0")
    target = next_job.land(job_out, "office-full-tiger-seed1", results, tmp_path / "grid")
    assert json.loads((target / "study.json").read_text())["study"] == "office-full-tiger-seed1"
    assert (target / "gpu_h200.csv").exists() and sorted(p.name for p in (target / "per_user").iterdir())
    grid = (tmp_path / "grid" / "grid.md").read_text()
    ce = next(line for line in grid.splitlines() if line.startswith("| office | tiger | ce |"))
    # where Office's files are here the verdict goes on (below the last-item heuristic, ...): the count is the point
    assert "(n=2)" in ce and "| done (seeds 0,1)" in ce, ce
    with pytest.raises(SystemExit, match="exists"):
        next_job.land(job_out, "office-full-tiger-seed1", results, tmp_path / "grid")
