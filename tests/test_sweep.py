"""studies/sweep.py + studies/best.py end to end: real local Ray, real SQLite MLflow store."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys

import numpy as np
import pytest

from apao_ray.names import shown_knob
from conftest import (BEST, ROOT, SWEEP, best_rows, launch_until, mid_trial, mlflow_sqlite, run_script, runs_state,
                      study_runs)
from mlflow_names import MLFLOW_NAMES, UPDATE_NAMES_ENV, logged_names, names_diff


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """One --smoke study (tiger x {ce, apao_pointwise}, 4 trials, 2 at a time, 3 epochs each), stopped three
    times the ways it happens in practice: Ctrl-C (SIGINT to the process group) mid-trial, re-run; SIGTERM to
    the driver alone once a trial trained on, resumed with --resume; then SIGKILL of the whole process group
    once a trial has finished and another is mid-way, resumed by re-running the same command. Every test of
    this module checks the resumed study."""
    workdir = tmp_path_factory.mktemp("study")
    uri = mlflow_sqlite(workdir)
    command = [sys.executable, SWEEP, "--smoke", "--epochs", "3", "--output-dir", str(workdir / "runs"),
               "--tracking-uri", uri, "--lr", "2e-3"]
    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-synthetic")
    process, at_sigint = launch_until(command, workdir, mid_trial)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr_interrupted = process.communicate(timeout=180)
    sigint = {"returncode": process.returncode, "stderr": stderr_interrupted, "before": at_sigint,
              "after": runs_state(workdir / "mlflow.db"), "runs": study_runs(tracker)}
    # re-run; once a trial trained on past where it stopped, SIGTERM to the driver alone (as `kill PID` or a
    # scheduler sends it): Ray's processes and the trials' workers get nothing
    stopped_at = {trial: epoch for trial, _, epoch in sigint["after"]}
    process, at_sigterm = launch_until(command, workdir, lambda state: any(
        status == "RUNNING" and epoch > stopped_at.get(trial, 0) for trial, status, epoch in state))
    os.kill(process.pid, signal.SIGTERM)
    _, stderr_terminated = process.communicate(timeout=180)
    sigterm = {"returncode": process.returncode, "stderr": stderr_terminated, "before": at_sigterm,
               "runs": study_runs(tracker)}
    process, at_sigkill = launch_until([*command, "--resume"], workdir, lambda state: mid_trial(state) and any(
        status == "FINISHED" for _, status, _ in state))
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    result = run_script(command[1:], cwd=workdir)
    assert result.returncode == 0, result.stderr[-4000:]
    return {"dir": workdir, "uri": uri, "stdout": result.stdout, "stderr": result.stderr, "command": command,
            "tracker": tracker, "sigint": sigint, "sigterm": sigterm, "at_sigkill": at_sigkill}


def _children(study):
    return study["tracker"].child_runs()


@pytest.mark.e2e
def test_parent_and_one_child_per_trial(study):
    tracker = study["tracker"]
    parents = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.data.tags["command_line"].endswith("--lr 2e-3") and parent.data.tags["code_version"]
    assert "num_trials" in parent.data.params and json.loads(parent.data.params["space"])["losses"] == ["ce", "apao_pointwise"]
    children = _children(study)
    assert len(children) == int(parent.data.params["num_trials"]) == 4
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert len({c.data.tags["apao.trial_id"] for c in children}) == 4  # no duplicates
    assert {c.data.tags["loss"] for c in children} == {"ce", "apao_pointwise"}
    # the protocol and the (short) schedule are named on the parent and every child, knobs are params
    for run in (parent, *children):
        assert run.data.tags["apao.protocol"] == "paper"
        assert run.data.tags["apao.schedule"].startswith("3 epochs / patience ")  # not the paper's 200 / 20
    assert all(c.data.params["base.protocol.select_by"] == "ndcg_at_10" for c in children)
    assert all(c.data.params["base.model.llama_history_eos"] == "True" for c in children)
    assert "NOT comparable to paper Table 1" in study["stdout"]
    assert all(c.info.status in ("FINISHED", "KILLED") for c in children)  # KILLED = stopped by ASHA
    names = {c.info.run_name for c in children}
    assert "tiger/ce" in names and any(n.startswith("tiger/apao_pointwise b=") and "eta=" in n for n in names)


@pytest.mark.e2e
def test_the_study_logs_the_committed_mlflow_names(study):
    """The names of the params, metrics and tags a --smoke study logs (parent, and children together)
    are the ones in tests/mlflow_names.json: dashboards, ``best``, the exports and studies written before
    read them by name, so a rename must be deliberate.

    Names only: values, steps and per-epoch points do not matter. Every name here is fixed by the code (the
    trial id, study name and run ids are values, never part of a name; the methods in the parent's
    ``best/<backbone>/<loss>/...`` names are the smoke study's own), so none is normalised. Left out, as
    present or absent by machine: tags MLflow adds from the environment a run starts in
    (``mlflow.source.*``, ``mlflow.user``, git) and the cost metrics a machine may not measure
    (``cost/energy_kwh`` without CodeCarbon, ``cost/peak_gpu_memory_mb`` and ``system/gpu_*`` without CUDA). The names that
    come from the fixture's interruption (``train/resumed_after_epoch``, ``apao.previous_outcome``) are
    in: the fixture always interrupts a trial mid-way. To accept a deliberate change, rewrite the file
    from a real run and review its diff:

        APAO_UPDATE_MLFLOW_NAMES=1 ./apao test -n 0 tests/test_sweep.py -k committed_mlflow_names
    """
    tracker = study["tracker"]
    parents = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")
    found = {f"{role}_{kind}": names for role, runs in (("parent", parents), ("child", _children(study)))
             for kind, names in logged_names(runs).items()}
    if os.environ.get(UPDATE_NAMES_ENV) == "1":
        MLFLOW_NAMES.write_text(json.dumps(found, indent=1) + "\n")
    expected = json.loads(MLFLOW_NAMES.read_text())
    changes = names_diff(expected, found)
    assert not changes, (f"MLflow names differ from {MLFLOW_NAMES.name} (if deliberate: {UPDATE_NAMES_ENV}=1 "
                         "rewrites it):\n" + "\n".join(changes))


@pytest.mark.e2e
def test_interrupted_study_resumed_without_rerun_duplicate_or_orphan(study):
    sigint = study["sigint"]
    assert sigint["returncode"] == 130 and "re-run the same command (or add --resume)" in sigint["stderr"]
    assert sigint["after"] and all(status in ("KILLED", "FINISHED") for _, status, _ in sigint["after"])  # none RUNNING
    # each stop exits 130 / 143 naming its signal and the command that resumes, and leaves the parent and the
    # unfinished trials interrupted: never pruned (nothing pruned them), none RUNNING
    for stop, name in ((sigint, "SIGINT"), (study["sigterm"], "SIGTERM")):
        assert stop["returncode"] == {"SIGINT": 130, "SIGTERM": 143}[name], stop["stderr"][-4000:]
        assert f"stopped by {name}" in stop["stderr"] and shlex.join(study["command"]) in stop["stderr"], \
            stop["stderr"][-3000:]
        status, outcome = stop["runs"]["parent"]
        assert status == "KILLED" and outcome.startswith("interrupted"), (name, status, outcome)
        children = stop["runs"]["children"]
        assert children and all(status in ("FINISHED", "KILLED") for status, _ in children), (name, children)
        unfinished = [outcome for status, outcome in children if status == "KILLED"]
        assert unfinished and all(outcome.startswith("interrupted") for outcome in unfinished), (name, children)
    tracker = study["tracker"]
    children = {c.data.tags["apao.trial_id"]: c for c in _children(study)}
    assert len(children) == 4 and all(c.info.status == "FINISHED" for c in children.values())
    # Tune's state and the Optuna searcher were restored: the same trials, not new ones
    assert {trial for trial, _, _ in study["at_sigkill"]} <= set(children)
    assert {trial for trial, _, _ in sigint["before"]} <= set(children)
    params = [(c.data.params["beta"], c.data.params["eta"]) for c in children.values() if "beta" in c.data.params]
    assert len(params) == 3 and len(set(params)) == 3, params  # a restarted searcher would repeat its first point
    for trial_id, run in children.items():  # every epoch logged exactly once: nothing re-trained
        steps = [step for step, _ in tracker.metric_history(run.info.run_id, "val/ndcg_at_10")]
        assert steps == [1, 2, 3], (trial_id, steps)
    # trials cut mid-way continued from their last checkpoint, not from scratch. (Which ones cannot be
    # pinned down: Ray's workers outlive a SIGKILLed driver for a moment and may train on past what
    # MLflow showed; the exact-once epochs above hold either way.)
    resumed = {trial_id: tracker.metric_history(run.info.run_id, "train/resumed_after_epoch")
               for trial_id, run in children.items()}
    assert any(resumed.values()), "no trial resumed from a checkpoint"
    assert all(1 <= value < step for history in resumed.values() for step, value in history), resumed
    # a resumed trial's first report carries its earlier epochs (a list, for MLflow's backfill); Tune's
    # TensorBoard logger would print all of it in a warning per resumed trial
    assert "TBXLoggerCallback" not in study["stderr"] and not list(study["dir"].rglob("events.out.tfevents*"))
    # nor does Ray Train print each report's metrics dict, nor MLflow a download bar per logged model
    assert "Reporting training result" not in study["stderr"] and "Downloading artifacts" not in study["stderr"]
    # a local Ray starts no preemption watcher per trial (a process each, and an error line on the console)
    assert "PreemptionWatcher" not in study["stderr"]
    parent = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")[0]
    assert parent.data.tags["apao.outcome"] == "finished"


@pytest.mark.e2e
def test_per_epoch_and_per_prefix_metrics_are_logged_without_loss(study):
    tracker = study["tracker"]
    finished = [c for c in _children(study) if c.info.status == "FINISHED"]
    assert len(finished) >= 2  # the CE baseline is never stopped early
    for run in finished:
        history = tracker.metric_history(run.info.run_id, "val/ndcg_at_10")
        assert sorted(step for step, _ in history) == [1, 2, 3], history  # every epoch, exactly once
        for m in range(1, 5):
            assert len(tracker.metric_history(run.info.run_id, f"val/prefix_recall_at_20_m{m}")) == 3
        metrics = run.data.metrics
        for key in ("test/recall_at_10", "test/ndcg_at_10", "test/prefix_recall_at_20_m4", "test/beam_retention_at_20",
                    "perf/samples_per_second", "train/loss"):
            assert key in metrics, key
        # prefix recall cannot grow with depth: a length-m prefix survives only if its parent did
        recalls = [metrics[f"test/prefix_recall_at_20_m{m}"] for m in range(1, 5)]
        assert recalls == sorted(recalls, reverse=True)
        # the machine's use per epoch, relayed from the Ray worker: the run's System metrics tab
        for key in ("system/cpu_utilization_percentage", "system/process_rss_megabytes"):
            values = [value for _, value in tracker.metric_history(run.info.run_id, key)]
            assert len(values) == 3 and all(value > 0 for value in values), (key, values)
        assert metrics["system/process_rss_megabytes"] > 50  # a worker with torch and a model loaded
        if run.data.tags["loss"] == "apao_pointwise":
            weights = [metrics[f"train/apao_weight_m{m}"] for m in range(1, 5)]
            assert sum(weights) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.e2e
def test_checkpoint_model_and_plots_are_artifacts(study):
    client = study["tracker"].client
    finished = [c for c in _children(study) if c.info.status == "FINISHED"]
    for run in finished:
        files = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"final_metrics.json", "trial_config.json"} <= files, files
        if run.data.tags["loss"] == "apao_pointwise":
            assert "adaptive_weights.png" in files
        assert {"prefix_recall.png", "prefix_recall.json"} <= files, files
        # a model per selection rule: the trial's own and one per other rule, each an output of the run
        outputs = client.get_run(run.info.run_id).outputs.model_outputs
        names = {client.get_logged_model(output.model_id).name for output in outputs}
        assert names == {"model", "model_by_val_loss", "model_by_last"}, names
    parent = client.search_runs([study["tracker"].experiment_id], "tags.`apao.role` = 'study'")[0]
    assert "prefix_recall_per_method.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    optuna_files = {a.path for a in client.list_artifacts(parent.info.run_id, "optuna")}
    assert {"optuna/param_importances.json", "optuna/optimization_history.png",
            "optuna/slice_tiger_apao_pointwise.png"} <= optuna_files, optuna_files


@pytest.mark.e2e
def test_best_table_registers_models_and_recommender_matches_the_trial(study):
    rows = best_rows(study["uri"], study["dir"])
    for row in rows:  # chosen by validation, reported with test metrics
        runs = [c for c in _children(study) if c.data.tags["loss"] == row["loss"] and c.info.status == "FINISHED"]
        assert row["best/val/ndcg_at_10"] == max(c.data.metrics["best/val/ndcg_at_10"] for c in runs)
        assert 0 <= row["test/ndcg_at_10"] <= row["test/recall_at_10"] <= 1
    markdown = run_script([BEST, "--dataset", "synthetic", "--tracking-uri", study["uri"], "--no-register"],
                          cwd=study["dir"], timeout=300)
    assert markdown.stdout.startswith("| backbone | loss | beta | eta | num_negatives |")

    import mlflow
    import pandas as pd

    import apao_ray
    from apao_ray.data import load_dataset
    from apao_ray.decoding import beam_search
    from apao_ray.data.batches import iter_batches
    from apao_ray.reuse.inference import Recommender, items_of_semantic_ids
    from apao_ray.training.precision import autocast

    mlflow.set_tracking_uri(study["uri"])
    # precision="trial": decoding as the trial evaluated (load_recommender's default is fp32, test_export.py)
    recommender = apao_ray.load_recommender("models:/apao-synthetic-tiger-apao_pointwise@best", precision="trial")
    # the trial's own evaluation path: its final checkpoint's weights through beam_search on test batches
    run = study["tracker"].client.get_run(next(r["run_id"] for r in rows if r["loss"] == "apao_pointwise"))
    trial = Recommender.from_checkpoint(run.data.tags["apao.checkpoint"], precision="trial")
    dataset = load_dataset("synthetic")
    batch = next(iter_batches(dataset.catalog, dataset.splits["test"], 8))
    with autocast(trial.precision, "cpu"):  # the trial evaluated in its own precision
        beam = beam_search(trial.model, batch.history_ids, batch.history_mask, dataset.catalog.tensors(), 20)
    items_of = items_of_semantic_ids(dataset.catalog)  # every item of a semantic ID, with its score
    expected = [[(item, score) for sem, score in zip(sems[:10], scores[:10]) for item in items_of[sem]]
                for sems, scores in zip(beam.sem_ids.tolist(), beam.scores.tolist())]
    histories = [[dataset.catalog.item_ids[i] for i in h if i >= 0] for h in dataset.splits["test"].histories[:8]]
    got = recommender.recommend(histories, k=10)
    assert [[item for item, _ in row] for row in got] == [[item for item, _ in row] for row in expected]
    for row, wanted in zip(got, expected):
        assert np.allclose([score for _, score in row], [score for _, score in wanted], atol=1e-5)
    # the same model as a plain MLflow pyfunc on a DataFrame: load_recommender's default (fp32) decoding
    frame = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model").predict(
        pd.DataFrame({"history": histories[:3]}), params={"k": 5})
    in_fp32 = apao_ray.load_recommender("models:/apao-synthetic-tiger-apao_pointwise@best").recommend(histories[:3], k=5)
    assert [list(items) for items in frame["items"]] == [[item for item, _ in row] for row in in_fp32]
    with pytest.raises(ValueError, match="not in the model's catalog"):
        recommender.recommend([["no-such-item"]])


@pytest.mark.e2e
def test_optuna_storage_holds_each_trial_once_with_the_validation_metric_mlflow_has(study):
    """The study was interrupted twice (Ctrl-C, SIGKILL) and resumed: its Optuna storage (beside
    mlflow.db) has each trial once, with the value that MLflow's child run reports."""
    import optuna

    parent = study["tracker"].client.search_runs([study["tracker"].experiment_id], "tags.`apao.role` = 'study'")[0]
    url = f"sqlite:///{study['dir']}/optuna.db"
    assert parent.data.tags["apao.optuna_storage"] == url
    optuna_study = optuna.load_study(study_name="apao-synthetic/synthetic-study", storage=url)
    trials = optuna_study.trials
    assert [t.number for t in trials] == list(range(int(parent.data.params["num_trials"]))), trials
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), [t.state for t in trials]
    by_params = {tuple(sorted((k.rsplit("__", 1)[1], shown_knob(v)) for k, v in t.params.items())): t.value
                 for t in trials}  # MLflow shows a knob to 3 significant digits, Optuna holds what the trial ran
    assert len(by_params) == len(trials)  # no trial repeated
    for child in _children(study):
        knobs = tuple(sorted((k, float(child.data.params[k])) for k in ("beta", "eta") if k in child.data.params))
        assert by_params[knobs] == pytest.approx(child.data.metrics["best/val/ndcg_at_10"], rel=1e-9), knobs
    # the paper setting was enqueued as the first apao_pointwise trial (the plan orders the methods by cost)
    first_tuned = next(t for t in trials if t.params)
    assert first_tuned.params == {"tiger__apao_pointwise__beta": 0.3, "tiger__apao_pointwise__eta": 1e-4}
    assert f"optuna-dashboard {url}" in study["stdout"]
    # 3 apao_pointwise trials: too few for importance, and the study says so
    assert "no parameter importance where a method has too few trials to mean something (tiger/apao_pointwise: " \
        "3 complete trial(s)" in study["stdout"]
    # what optuna-dashboard shows: the objective's name, and what each trial ran (baselines too) and where it is
    assert optuna_study.metric_names == ["val/ndcg_at_10"]
    assert "no method here has that many" in optuna_study.user_attrs["parameter importance"]
    runs = {child.info.run_id: child for child in _children(study)}
    for trial in trials:
        run = runs[trial.user_attrs["mlflow_run_id"]]
        assert (trial.user_attrs["backbone"], trial.user_attrs["loss"], trial.user_attrs["seed"]) == \
            (run.data.tags["backbone"], run.data.tags["loss"], 0)
        assert trial.user_attrs["tune_trial_id"] == run.data.tags["apao.trial_id"]
        assert trial.value == pytest.approx(run.data.metrics["best/val/ndcg_at_10"], rel=1e-9)
    assert {t.user_attrs["loss"] for t in trials if not t.params} == {"ce"}


@pytest.mark.e2e
def test_the_answer_table_is_the_optuna_studys_note_in_optuna_dashboard(study):
    """optuna-dashboard shows the study's note on its page: the answer the parent run's description holds."""
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard (the dashboard extra) is not installed")
    from optuna_dashboard._note import get_note_from_system_attrs

    from apao_ray.study.search.optuna_storage import open_storage

    parent = study["tracker"].client.search_runs([study["tracker"].experiment_id], "tags.`apao.role` = 'study'")[0]
    storage = open_storage(f"sqlite:///{study['dir']}/optuna.db")
    attrs = storage.get_study_system_attrs(storage.get_study_id_from_name("apao-synthetic/synthetic-study"))
    note = get_note_from_system_attrs(attrs, None)["body"]
    assert note == parent.data.tags["mlflow.note.content"] and "| tiger/apao_pointwise |" in note, note


@pytest.mark.e2e
def test_a_clean_study_prints_no_traceback_and_no_ray_auth_warning(study):
    """The run that finished the study (exit 0): its terminal holds no worker traceback (a trial actor's exit at
    its teardown goes to Ray's session logs) and no Ray token-authentication warning (the suite's Ray has a token,
    so Ray would warn at its start)."""
    terminal = study["stdout"] + study["stderr"]
    assert "Traceback" not in terminal and "SystemExit" not in terminal, terminal[-3000:]
    assert "Token authentication is" not in terminal, terminal[-3000:]


@pytest.mark.e2e
def test_mlflow_opens_on_runs_with_datasets_and_the_parent_has_the_summary_metrics(study):
    tracker = study["tracker"]
    assert tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    parent = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")[0]
    children = _children(study)
    for run in (parent, *children):  # the runs table's Dataset column
        (dataset,) = [d.dataset for d in run.inputs.dataset_inputs]
        assert dataset.name == "synthetic" and len(dataset.digest) == 36
        assert json.loads(dataset.profile)["train_samples"] > 0
    for loss in ("ce", "apao_pointwise"):
        runs = [run for run in children if run.data.tags["loss"] == loss and run.info.status == "FINISHED"]
        best = max(runs, key=lambda run: run.data.metrics["best/val/ndcg_at_10"])
        assert parent.data.metrics[f"best/tiger/{loss}/val/ndcg_at_10"] == best.data.metrics["best/val/ndcg_at_10"]
        assert parent.data.metrics[f"best/tiger/{loss}/test/recall_at_10"] == best.data.metrics["test/recall_at_10"]


@pytest.mark.e2e
def test_mlflow_names_say_what_each_trial_ran_and_the_study_row_answers(study):
    """The names a user reads in the MLflow UI: a child's params are its own config (no study-base value
    beside its real one), its name says method and knobs, its model carries them; the parent holds each
    method's headline metrics and the printed link opens a view with those columns."""
    from apao_ray.config import TrialConfig
    from apao_ray.study.spec.space import knob_names
    from apao_ray.tracking import flatten

    tracker = study["tracker"]
    parent = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")[0]
    every_base_param = {f"base.{name}" for name in flatten(TrialConfig().to_dict())}
    for child in _children(study):
        params, loss = child.data.params, child.data.tags["loss"]
        knobs = {"beta", "eta"} if loss == "apao_pointwise" else set()
        # no knob of another loss either: a CE run has no beta (every registered loss's knobs, here beta and eta)
        assert set(params) == (every_base_param - {"base.loss.name", "base.model.backbone"}
                               - {f"base.loss.{knob}" for knob in knob_names()}) | {"backbone", "loss"} | knobs
        assert all(float(params[knob]) == float(f"{float(params[knob]):.3g}") for knob in knobs)  # 3 digits shown
        assert (params["backbone"], params["loss"], params["base.train.epochs"]) == ("tiger", loss, "3")
        expected_name = "tiger/ce" if loss == "ce" else \
            f"tiger/apao_pointwise b={float(params['beta']):.3g} eta={float(params['eta']):.2g}"
        assert child.info.run_name == expected_name
        if child.info.status != "FINISHED":
            continue
        # the run's page lists its model: the one the run's tag names, the one `best` registers, is complete; a
        # model the SIGKILL left half-logged is marked FAILED on the resume, wherever MLflow lists it
        # (beside it, one complete model per other selection rule)
        model_id = child.data.tags["apao.model_uri"].removeprefix("models:/")
        models = [tracker.client.get_logged_model(o.model_id) for o in child.outputs.model_outputs]
        ready = {m.model_id: m.name for m in models if m.status == "READY"}
        assert ready[model_id] == "model" and sorted(ready.values()) == ["model", "model_by_last", "model_by_val_loss"]
        assert all(m.status == "FAILED" for m in models if m.model_id not in ready)
        model = tracker.client.get_logged_model(model_id)
        assert model.status == "READY" and model.params == params
        assert {m.key: m.value for m in model.metrics} == {k: v for k, v in child.data.metrics.items()
                                                           if k.startswith(("test/", "best/val/"))}
    for loss in ("ce", "apao_pointwise"):
        assert {f"best/tiger/{loss}/{key}" for key in ("val/ndcg_at_10", "test/ndcg_at_10", "test/recall_at_10")} \
            <= set(parent.data.metrics)
    link = f"/#/experiments/{tracker.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=synthetic-study"
    assert link in study["stdout"]
    view = json.loads(tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.sharedViewState.synthetic-study"])
    assert view["selectedColumns"][:4] == ["metrics.`best/tiger/ce/val/ndcg_at_10`", "metrics.`best/tiger/ce/test/ndcg_at_10`",
                                           "metrics.`best/tiger/apao_pointwise/val/ndcg_at_10`",
                                           "metrics.`best/tiger/apao_pointwise/test/ndcg_at_10`"]
    assert view["columnOrder"][:3] == ["attributes.`Run Name`", "runDateAndNestInfo", "duration"]
    assert view["selectedColumns"][4:6] == ["params.`beta`", "params.`eta`"]  # the knobs the study's losses tune


@pytest.mark.e2e
@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
                    reason="no chromium on PATH (apt-get install chromium): the study's pages are not opened")
def test_the_study_page_shows_the_whole_answer_table_at_1600_px_and_optuna_dashboard_the_note(study):
    """Headless Chromium (docs/make_screenshots.py's pages): the answer table fits; the dashboard shows the note."""
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard (the dashboard extra) is not installed")
    sys.path.insert(0, str(ROOT / "docs"))
    facts = __import__("make_screenshots").study_pages(study["dir"], study["stdout"])
    assert facts["headers"][:2] == ["method", "knobs"] and "verdict" in facts["headers"], facts
    assert facts["table_right"] <= facts["width"] == 1600 and facts["about_left"] < 1600, facts
    assert facts["note_shown"], facts
