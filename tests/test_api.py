"""The Python API (StudySpec, prepare, run_study, StudyResult): a spec's checks at construction, what prepare
and the plan derive, and real studies run end to end (the one CLI's flags and help: test_api_cli.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, run_script


def test_package_import_stays_light_and_exports_the_api():
    code = ("import sys, apao_ray; spec = apao_ray.StudySpec; heavy = [m for m in ('torch', 'ray', 'mlflow', 'pandas') "
            "if m in sys.modules]; print(heavy, sorted(n for n in apao_ray.__all__ if not n.startswith('_')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.stdout.strip() == "[] ['StudyResult', 'StudySetup', 'StudySpec', 'load_recommender', 'plan_study', 'prepare', 'run_study']", \
        done.stderr


@pytest.mark.parametrize("changes, problem", [
    ({"num_samples": 0}, "num_samples=0 must be an integer >= 1"),
    ({"epochs": 2.5}, "epochs=2.5 must be an integer >= 1"),
    ({"gpus_per_trial": -1}, "gpus_per_trial=-1 must be a number >= 0"),
    ({"max_concurrent": 0}, "max_concurrent=0 must be an integer >= 1"),
    ({"lr": float("nan")}, "lr=nan must be a number >= 0"),
    ({"memory_per_trial_gib": 0}, "memory_per_trial_gib=0 must be a number > 0"),
    ({"cpus_per_trial": 0.01}, "--cpus-per-trial 0.01 leaves the trial's worker nothing"),
    ({"precision": "fp16"}, "precision='fp16'; choose from ['auto', 'fp32', 'bf16']"),
    ({"budget": "3x"}, "budget '3x' is not a duration"),
    ({"budget": 0}, "budget 0 must be a duration > 0"),
    ({"losses": ("ce", "nope")}, "unknown loss(es) ['nope']"),
    ({"backbones": "gpt"}, "unknown backbone(s) ['gpt']"),
    ({"beta": (0.4, 0.1)}, "range of 'beta' 0.4:0.1 is empty, inverted"),
    ({"losses": ("ce",), "negatives": (10, 20)}, "--negatives was given, but none of the losses ['ce'] tunes num_negatives"),
    ({"losses": ("ce",), "beta": (0.1, 0.2)}, "--beta was given, but none of the losses ['ce'] tunes beta"),
    ({"beta": (0.1, 0.2), "knob_ranges": {"beta": (0.1, 0.3)}}, "range of 'beta' was given twice, by --beta and by --knob"),
    ({"knob_ranges": {"gamma": (0.1, 0.3)}}, "none of the losses ['ce', 'apao_pointwise', 'apao_pairwise'] tunes 'gamma'"),
    ({"study_name": "../x"}, "study name '../x' must be a plain name"),
    ({"protocol_knobs": {"weighting": "bogus"}}, "bogus"),
    ({"seeds": (0, 1), "seed": 3}, "seed=3 and seeds=(0, 1) were both given"),
    ({"seeds": (0, 0)}, "seeds=(0, 0) repeats a seed"),
    ({"seeds": (0, -1)}, "seeds=(0, -1) must be one or more integers >= 0"),
    ({"seeds": ()}, "seeds=() must be one or more integers >= 0"),
])
def test_a_spec_refuses_bad_input_at_construction_naming_it(isolated, changes, problem):
    from apao_ray import StudySpec

    with pytest.raises(ValueError) as error:
        StudySpec(output_dir=str(isolated / "runs"), **changes)
    assert problem in str(error.value)
    assert not (isolated / "runs").exists() and not (isolated / "mlflow.db").exists()


@pytest.mark.parametrize("changes, problem", [
    ({"losses": ("apao_pairwise",), "negatives": (10, 5000)}, "num_negatives=5000 must be < the 399 semantic IDs"),
    ({"tracking_uri": "file:./mlruns"}, "is not supported"),
    ({"address": "headnode"}, "Ray address 'headnode' must be HOST:PORT"),
    ({"resume": True}, "--resume: no study 'synthetic-study' to resume"),
])
def test_prepare_refuses_what_the_files_mlflow_and_ray_say_naming_it_and_creates_nothing(isolated, changes, problem):
    """What only the dataset, the MLflow store, the Ray address or a study's saved state can tell: not known when
    the spec is built (that touches nothing), refused by ``prepare`` before any plan or trial."""
    from apao_ray import StudySpec, prepare

    spec = StudySpec(output_dir=str(isolated / "runs"), **changes)
    with pytest.raises(ValueError) as error:
        prepare(spec)
    assert problem in str(error.value)
    assert not (isolated / "runs").exists() and not (isolated / "mlflow.db").exists()


def test_cpus_per_trial_defaults_to_this_machines_cpus_shared_by_the_trials_at_once(isolated, monkeypatch):
    """A lone trial gets every idle CPU, trials that run at once share them (at least 1 each), CPUs busy with
    other work are left to it; a given value wins."""
    import os

    from apao_ray import StudySpec, prepare
    from apao_ray.hardware import available_cpus

    def trial_cpus(**changes) -> float:
        return prepare(StudySpec(**{"losses": ("ce",), "output_dir": str(isolated / "runs"), **changes})).cpus_per_trial

    cpus = available_cpus()
    monkeypatch.setattr(os, "getloadavg", lambda: (cpus - 0.7, 0.0, 0.0))  # all but one CPU busy
    assert trial_cpus() == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.0, 0.0))  # idle
    lone = StudySpec(losses=("ce",), output_dir=str(isolated / "runs"))
    assert lone.cpus_per_trial is None and prepare(lone).cpus_per_trial == cpus
    assert StudySpec(losses=("ce", "apao_pointwise"), num_samples=3).search.num_trials == 4
    assert trial_cpus(losses=("ce", "apao_pointwise"), num_samples=3) == max(1, cpus // min(4, cpus))
    assert trial_cpus(losses=("ce", "apao_pointwise"), num_samples=3, max_concurrent=1) == cpus
    assert trial_cpus(cpus_per_trial=0.5) == 0.5


def test_the_micro_batch_defaults_to_the_fastest_for_the_trials_device_and_a_given_one_wins(isolated):
    """128 on CPU, 1024 with a GPU (benchmarks/RESULTS.md, 2026-11-26); the optimizer step stays 1024 either way.
    The evaluation batch likewise: 256 on CPU, 1024 with a GPU."""
    from apao_ray import StudySpec, prepare
    from apao_ray.config import TrainConfig

    assert TrainConfig().batch_size == 128 and TrainConfig(use_gpu=True).batch_size == 1024
    assert TrainConfig().eval_batch_size == 256 and TrainConfig(use_gpu=True).eval_batch_size == 1024
    assert TrainConfig(use_gpu=True, batch_size=256).batch_size == 256
    assert TrainConfig.from_dict(TrainConfig(use_gpu=True).to_dict()).batch_size == 1024  # a checkpoint keeps it
    trains = {gpus: prepare(StudySpec(losses=("ce",), gpus_per_trial=gpus, output_dir="runs")).base.train
              for gpus in (0, 0.5)}
    assert [(t.batch_size, t.effective_batch_size) for t in trains.values()] == [(128, 1024), (1024, 1024)]
    given = prepare(StudySpec(losses=("ce",), gpus_per_trial=1, batch_size=512, output_dir="runs")).base.train
    assert given.batch_size == 512
    with pytest.raises(ValueError, match="batch_size=0 must be an integer >= 1"):
        StudySpec(losses=("ce",), batch_size=0, output_dir="runs")


def test_a_spec_is_checked_without_io_and_the_plan_holds_the_schedule_it_fits(isolated):
    """A StudySpec is what was asked (built with no file, MLflow or Ray touched); ``prepare`` finds the rest; the
    plan derives the trials' schedule (``Plan.base``, ``Plan.search``) without writing anything back."""
    from apao_ray import StudySpec, prepare
    from apao_ray.study.plan.budget import Deferral, Fit, MethodCost
    from apao_ray.study.plan.plan import Plan
    from apao_ray.study.run.study import Study

    missing = StudySpec(dataset="office", data_dir=str(isolated / "nowhere"), output_dir="runs")  # nothing read yet
    assert missing.search.num_trials == 7 and not (isolated / "mlflow.db").exists()
    with pytest.raises((FileNotFoundError, ValueError), match="nowhere"):
        prepare(missing)
    spec = StudySpec.quick(losses=("ce", "apao_pairwise"), output_dir="runs", budget="1h30m", protocol="reference")
    assert spec.budget_s == 5400 and spec.negatives == (10, 20) and spec.epochs == 2 and spec.asha_grace_period == 3
    setup = prepare(spec)
    costs = [MethodCost("tiger", loss, loss == "ce", epoch_s=60.0, fixed_s=10.0) for loss in ("ce", "apao_pairwise")]

    def plan(fit: Fit) -> Plan:
        return Plan("synthetic", "reference", "fp32", 2, costs, 2, 2, fit, budget_s=5400,
                    effective_batch_size=256).scheduled(setup.base, spec.search, spec.losses, spec.pretrain_ce_epochs)

    fitted = plan(Fit(1, 1, 1, 100.0))
    assert fitted.base.train.epochs == 1 and fitted.search.num_trials == 2 and fitted.slots == 2
    assert fitted.fit.asha_grace_period == 1
    assert fitted.base.protocol.name == "reference" and fitted.base.model.d_model == 64
    assert setup.output_dir == str(isolated / "runs") and setup.tracking_uri == f"sqlite:///{isolated}/mlflow.db"
    assert fitted.base.train.max_train_samples == 2048  # --quick's
    assert setup.base.train.epochs == 2 and spec.epochs == 2  # as asked: the plan's schedule is the plan's
    subset = plan(Fit(1, 1, 1, 100.0, train_samples=1024))
    assert subset.base.train.max_train_samples == 1024  # a budget's training subset
    # a deferred method is a row without trials: the searcher never allocates it; the parent run records why
    deferral = Deferral("tiger", "apao_pairwise", 9000.0, 3000.0, 3)
    deferred = plan(Fit(2, 1, 1, 100.0, deferred=(deferral,), added_seeds=1))
    assert [a[1] for a in deferred.search.allocation()] == ["ce"] and deferred.search.num_trials == 1
    assert deferred.record()["deferred"] == {"tiger/apao_pairwise": deferral.reason}
    assert Study(spec, setup, deferred, []).seeds == [0, 1]  # the fill's seed after the search's 0
    # the local Ray's dashboard is off unless asked for, from the flag through to the spec the study runs
    from apao_ray.study.cli import sweep as cli_sweep

    for flags, wanted in (([], False), (["--ray-dashboard"], True)):
        args = cli_sweep.build_parser().parse_args(["--smoke", "--output-dir", "runs", *flags])
        assert cli_sweep.spec_from_args(args).starts_ray_dashboard is wanted


def test_seeds_put_the_search_on_the_first_and_the_repeats_on_the_others(isolated, capsys):
    from apao_ray import StudySpec, prepare
    from apao_ray.study.cli import sweep as cli_sweep

    spec = StudySpec.quick(seeds=[3, 1, 2], output_dir="runs")
    assert spec.seeds == (3, 1, 2) and spec.search_seed == 3 and spec.repeat_seeds == (1, 2)
    assert prepare(spec).base.train.seed == 3
    single = StudySpec.quick(seed=5, output_dir="runs")
    assert prepare(single).base.train.seed == 5 and single.repeat_seeds == ()
    with pytest.raises(SystemExit) as exit_info:  # --seed 0 is the default value, but written: refused all the same
        cli_sweep.main(["--smoke", "--seed", "0", "--seeds", "0,1", "--dry-run"])
    assert exit_info.value.code == 2
    assert "--seed 0 and --seeds 0,1 were both given" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_sweep.main(["--smoke", "--seeds", "0,x"])
    assert "'0,x' is not a comma list of integer seeds" in capsys.readouterr().err
    args = cli_sweep.build_parser().parse_args(["--seeds", "0,1"])
    assert cli_sweep.spec_from_args(args).__class__ is StudySpec and args.seeds == (0, 1)


@pytest.fixture(scope="module")
def probe_cache(tmp_path_factory):
    """One probe cache for this module's end-to-end tests (the first measures, later ones read it)."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.e2e
def test_dry_run_prints_the_plan_fits_a_budget_and_refuses_one_too_small(tmp_path, probe_cache):
    env = {"APAO_PROBE_CACHE": str(probe_cache / "probes.json")}
    command = ["-m", "apao_ray", "sweep", "--smoke", "--epochs", "8", "--output-dir", str(tmp_path / "runs"),
               "--dry-run"]
    result = run_script(command, cwd=tmp_path, env=env, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = result.stderr
    assert "plan: 4 trials on synthetic, protocol paper" in plan and "measured now" in plan
    from apao_ray.training.memory import find_tcmalloc

    # the probes ran on the allocator a trial's worker gets (training/memory.py)
    assert f"allocator {'tcmalloc' if find_tcmalloc() else 'glibc-cached'}, " in plan, plan
    assert re.search(r"tiger/ce +1 trial +8 epochs +epoch ~[\d.]+ (s|min) +trial ~.* peak ~[\d.]+ GiB", plan), plan
    assert re.search(r"tiger/apao_pointwise +3 trials +8 epochs", plan), plan
    assert (probe_cache / "probes.json").is_file()
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()  # nothing ran
    estimate = re.search(r"study ~([\d.]+) (s|min) wall", plan)
    seconds = float(estimate.group(1)) * (60 if estimate.group(2) == "min" else 1)

    fitted = run_script([*command, "--budget", f"{seconds * 0.7:.0f}"], cwd=tmp_path, env=env, timeout=400)
    assert fitted.returncode == 0 and "cached" in fitted.stderr, fitted.stderr[-3000:]
    # what is cut first depends on the probe's timings (per-trial overheads vs epochs): either is a fit,
    # and the fitted estimate must be within the budget
    fit = re.search(r"exceeds it; fitted: (epochs 8 -> \d+|trials per tuned method 3 -> \d+).*\(~([\d.]+) (s|min)\)",
                    fitted.stderr)
    assert fit, fitted.stderr
    assert float(fit.group(2)) * (60 if fit.group(3) == "min" else 1) <= round(seconds * 0.7), fitted.stderr

    refused = run_script([*command, "--budget", "1s"], cwd=tmp_path, env=env, timeout=400)
    assert refused.returncode == 2
    # --smoke trains on 2,048 samples an epoch: even the smallest training subset (1,024) does not fit 1 s; CE and
    # APAO-pointwise cost the same to within the probe's noise, so either may be named the slowest
    assert re.search(r"budget 1 s is too small for 3 epochs of any method: one trial of the cheapest, tiger/\w+ on "
                     r"1,024 training samples, is estimated at [\d.]+ (s|min) .* --budget \d+m or more",
                     refused.stderr), refused.stderr
    # --json: the plan as one JSON object on stdout, nothing else there
    as_json = run_script([*command, "--budget", f"{seconds * 0.7:.0f}", "--json"], cwd=tmp_path, env=env, timeout=400)
    data = json.loads(as_json.stdout)
    assert {m["status"] for m in data["methods"]} <= {"run", "deferred"} and data["estimate_s"] <= data["budget_s"]
    assert {"backbone", "loss", "status", "trials", "epochs", "train_samples", "estimate_s", "reason"} <= set(
        data["methods"][0]) and data["slots"] >= 1


def _smoke_spec(tmp_path, **changes):
    """The smallest real study: tiger x {ce, apao_pointwise}, one trial each, 1 epoch, 2 at a time."""
    import apao_ray

    return apao_ray.StudySpec.quick(losses=("ce", "apao_pointwise"), num_samples=1, epochs=1, lr=2e-3,
                                    max_concurrent=2, output_dir=str(tmp_path / "runs"),
                                    tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", **changes)


def _smoke_study(tmp_path, probe_cache, monkeypatch, **changes):
    monkeypatch.setenv("APAO_PROBE_CACHE", str(probe_cache / "probes.json"))
    import apao_ray

    try:
        return apao_ray.run_study(_smoke_spec(tmp_path, **changes))
    finally:
        import ray

        ray.shutdown()


@pytest.mark.e2e
def test_a_deferred_method_runs_no_trial_and_keeps_its_row_with_the_reason(tmp_path, monkeypatch, capsys):
    """Probe rates injected through the cache: APAO-pointwise ~1,000x slower than CE, so its one epoch does not
    fit 5 minutes; CE runs, APAO-pointwise is a row without trials that says what it needs."""
    import apao_ray
    from apao_ray.study.plan.make import trial_threads
    from apao_ray.study.plan.plan import method_config
    from apao_ray.study.plan.probe_cache import probe_key

    monkeypatch.setenv("APAO_PROBE_CACHE", str(tmp_path / "probes.json"))
    spec = _smoke_spec(tmp_path, budget="5m", protocol_knobs={"select_by": "loss"})
    setup = apao_ray.prepare(spec)
    base, threads = setup.base, trial_threads(setup.cpus_per_trial)
    rates = {"ce": 1e-4, "apao_pointwise": 1.0}  # seconds per training sample
    (tmp_path / "probes.json").write_text(json.dumps({probe_key(method_config(base, "tiger", loss), threads): {
        "train_s_per_sample": rate, "eval_s_per_user": 1e-3, "peak_bytes": 2**30, "precision": "fp32", "threads":
        threads, "device": "cpu", "timed_samples": 1024} for loss, rate in rates.items()}))
    plan = apao_ray.plan_study(spec, setup)
    assert [(m["loss"], m["status"]) for m in plan.to_dict()["methods"]] == [("ce", "run"), ("apao_pointwise", "deferred")]
    try:
        result = apao_ray.run_study(spec, plan=plan)
    finally:
        import ray

        ray.shutdown()
    # the deferred method was never launched; CE alone had time left for more seeds (the fill)
    assert set(result.trials["loss"]) == {"ce"} and len(result.trials) == plan.num_trials == 1 + plan.fit.added_seeds
    rows = {row["loss"]: row for row in result.table.to_dict("records")}
    assert rows["ce"]["status"] == "finished"
    assert rows["apao_pointwise"]["status"] == plan.fit.deferred[0].reason
    assert rows["apao_pointwise"]["status"].startswith("deferred: needs ~")
    from apao_ray.names import PLAN_TAG
    from apao_ray.tracking import Tracker

    parent = Tracker(result.tracking_uri, "apao-synthetic").client.get_run(result.parent_run_id)
    assert json.loads(parent.data.tags[PLAN_TAG])["answers"] == plan.answers()
    # the study's selection, recorded once with it where every surface reads it: MLflow's parent and Optuna's study
    import optuna

    from apao_ray.study.search.optuna_storage import OPTUNA_STUDY_TAG, STORAGE_TAG

    selection = {"metric": "ndcg_at_10", "rule": "loss"}
    assert json.loads(parent.data.tags["apao.selection"]) == selection
    searched = optuna.load_study(study_name=parent.data.tags[OPTUNA_STUDY_TAG], storage=parent.data.tags[STORAGE_TAG])
    assert searched.user_attrs["selection"] == selection and searched.direction.name == "MAXIMIZE"


@pytest.mark.e2e
def test_a_notebook_study_with_two_seeds_repeats_each_methods_best_and_tables_mean_spread_significance_and_cost(
        tmp_path, probe_cache, monkeypatch, capsys):
    """A study run from Python (a notebook's way) and its table read back; with seeds 0 and 1 each method's best
    trial is repeated on seed 1, and the table gives the mean, the spread, the seed-aware interval and the cost."""
    result = _smoke_study(tmp_path, probe_cache, monkeypatch, seeds=(0, 1))
    plan = capsys.readouterr().err
    assert "plan: 4 trials on synthetic" in plan and "again on seeds [1]: 2 trials of 1 epoch" in plan, plan
    assert not result.interrupted and sorted(result.trials["seed"]) == [0, 0, 1, 1]
    assert set(result.trials["status"]) == {"finished"}
    from apao_ray.tracking import Tracker

    children = {run.info.run_id: run for run in Tracker(result.tracking_uri, "apao-synthetic").child_runs()}
    assert {run.data.tags["mlflow.parentRunId"] for run in children.values()} == {result.parent_run_id}
    # the training-free baselines close the table, scored on the same test users: the bar the methods are read against
    trained = result.table[result.table["status"] != "training-free"]
    assert list(result.table["loss"][len(trained):]) == ["popularity (training-free)",
                                                         "last-item transitions (training-free)"]
    assert result.table["test/ndcg_at_10"].between(0, 1).all()
    assert [tuple(pair) for pair in trained[["backbone", "loss"]].values] == [("tiger", "apao_pointwise"),
                                                                              ("tiger", "ce")]
    assert list(trained["status"]) == ["finished", "finished"]
    assert trained["best/val/ndcg_at_10"].notna().all()
    table = trained.set_index("loss")
    assert table.loc["apao_pointwise", "beta"] == 0.3  # the paper's point goes first
    # the trials' measured rates went into this machine's probe cache: the next plan starts from them
    observed = [entry["observed"] for entry in json.loads((probe_cache / "probes.json").read_text()).values()
                if "observed" in entry]
    assert len(observed) >= 2 and all(o["trials"] >= 1 and o["train_s_per_sample"] > 0 for o in observed), observed
    import apao_ray

    assert "methods from finished trials" in apao_ray.plan_study(_smoke_spec(tmp_path)).text()
    for run in children.values():  # every selection rule's test metrics reach MLflow (the trial's own = test/*)
        assert {f"test_by/{rule}/{key}" for rule in ("val_ndcg_at_10", "val_loss", "last")
                for key in ("epoch", "ndcg_at_10")} <= set(run.data.metrics), sorted(run.data.metrics)
        assert run.data.metrics["test_by/val_ndcg_at_10/ndcg_at_10"] == run.data.metrics["test/ndcg_at_10"]
    repeats = [run for run in children.values() if "apao.repeats" in run.data.tags]
    # one repeat per method, on seed 1, of the run the table shows, with that run's knobs, in the same parent
    assert sorted(run.data.tags["apao.repeats"] for run in repeats) == sorted(table["run_id"])
    for run in repeats:
        origin = children[run.data.tags["apao.repeats"]]
        assert run.data.tags["apao.seed"] == "1" and run.data.params["base.train.seed"] == "1"
        assert origin.data.tags["apao.seed"] == "0" and origin.data.params["base.train.seed"] == "0"
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == result.parent_run_id
        assert {k: run.data.params.get(k) for k in ("loss", "beta", "eta")} == \
            {k: origin.data.params.get(k) for k in ("loss", "beta", "eta")}
    for loss, row in table.iterrows():
        values = [children[row["run_id"]].data.metrics["test/ndcg_at_10"]] + \
            [run.data.metrics["test/ndcg_at_10"] for run in repeats if run.data.tags["loss"] == loss]
        assert row["n_seeds"] == 2 and row["seeds"] == "0,1"
        assert row["test/ndcg_at_10"] == pytest.approx(sum(values) / 2)
        assert row["test/ndcg_at_10 std"] == pytest.approx(abs(values[0] - values[1]) / 2 ** 0.5)
        assert row["cost/wall_seconds"] > 0 and row["cost/cpu_seconds"] > 0 and row["cost/peak_rss_mb"] > 0
    assert table.loc["ce", "vs ce test/ndcg_at_10"] == "baseline"
    # the same answer on the study's page in the MLflow UI: its best runs, their intervals, what they cover
    note = Tracker(result.tracking_uri, "apao-synthetic").client.get_run(result.parent_run_id).data.tags[
        "mlflow.note.content"]
    assert all(run_id in note for run_id in table["run_id"]) and ", 2 seeds)" in note
    from apao_ray.study.record.answer import ANSWER_ARTIFACT, ANSWER_WIDTH, shown_width

    answer = [line for line in note.split("\n\n")[1].splitlines() if line.startswith("|")]  # the narrow table
    assert len(answer) == 6 and max(map(shown_width, answer)) <= ANSWER_WIDTH, answer
    assert "test/recall_at_20" not in note and ANSWER_ARTIFACT in note  # the wide table is the artifact
    assert "training randomness" in note and "| last-item transitions (training-free) |" in note
    # the methods on memorization and generalization cases, with the labels the trials wrote into their tables
    assert "**Memorization and generalization (test)**" in note and "labels read from the per-user tables" in note
    assert re.search(r"\| memorization \| \d+ \| tiger/ce \| 0,1 \(2 seeds\) \|", note), note
    client = Tracker(result.tracking_uri, "apao-synthetic").client
    assert {"memorization_generalization.md", ANSWER_ARTIFACT} <= {a.path for a in client.list_artifacts(result.parent_run_id)}
    fresh = {run.info.run_id: run for run in Tracker(result.tracking_uri, "apao-synthetic").child_runs()}
    for loss, row in table.iterrows():  # the verdict best and report read back, as the study computed it
        assert fresh[row["run_id"]].data.tags["apao.converged"] == row["converged"]
    # one epoch each: no slope to read, so the figure is one of early learning and says so
    assert table.loc["apao_pointwise", "converged"].startswith("one epoch only: 1 validation epoch")
    assert re.fullmatch(r"early learning \(not converged\): [+-]\d\.\d{4} \[-?\d\.\d{4}, -?\d\.\d{4}\] over seeds "
                        r"and users \(2 seeds\), p_holm = [\d.e+-]+ \(Holm over \d+ comparisons?: .+\)",
                        table.loc["apao_pointwise", "vs ce test/ndcg_at_10"]), table.loc["apao_pointwise"]
    assert re.search(r"tiger/apao_pointwise +[\d.]+ / [\d.]+ +[\d.]+ / [\d.]+ +\d+ / \d+", result.cost_summary), \
        result.cost_summary
    # the parent run's sums per method include the repeats, as the table's do
    parent = Tracker(result.tracking_uri, "apao-synthetic").client.get_run(result.parent_run_id).data.metrics
    for loss, row in table.iterrows():
        runs = [run for run in children.values() if run.data.tags["loss"] == loss]
        assert len(runs) == 2 and parent[f"cost/tiger/{loss}/wall_seconds"] == pytest.approx(
            row["cost/wall_seconds"]) == pytest.approx(sum(run.data.metrics["cost/wall_seconds"] for run in runs))
    from apao_ray.study.cli.sweep import best_main

    assert best_main(["--dataset", "synthetic", "--tracking-uri", result.tracking_uri, "--no-register",
                      "--format", "json"]) == 0
    printed = {row["loss"]: row for row in json.loads(capsys.readouterr().out)}
    assert printed["apao_pointwise"]["vs ce test/ndcg_at_10"] == table.loc["apao_pointwise", "vs ce test/ndcg_at_10"]
    assert printed["ce"]["n_seeds"] == 2 and printed["ce"]["test/ndcg_at_10 std"] is not None
