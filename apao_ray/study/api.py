"""``run_study(spec) -> StudyResult``: the Python API that ``python -m apao_ray sweep`` wraps."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ..names import CONVERGED_TAG, reached_test
from .record.outcomes import short_reason
from .plan.make import cost_summary, make_plan, validation_users
from .plan.plan import Plan, method_config
from .plan.probe_cache import record_observed
from .setup import StudySetup, prepare, study_state_exists
from .spec.study import StudySpec
from .run.study import Study, invocation


@dataclass
class StudyResult:
    """What a study produced.

    Attributes:
        table: one row per requested (backbone, loss): the best trial by validation with its knobs,
            validation metric, test metrics (mean over seeds, ``<metric> std``, ``seeds``, ``n_seeds``),
            the paired difference against CE (``vs ce test/ndcg_at_10``), the summed ``cost/*`` of the
            method's trials and ``status`` ("finished", "all N trials pruned", "failed: <reason>", ...),
            read back from MLflow.
        trials: one row per trial of this run (backbone, loss, knobs, seed, the run a repeat repeats,
            final metrics, error).
        parent_run_id: the study's MLflow parent run.
        plan: the plan printed before the first trial (the fitted schedule included).
        interrupted: stopped by a signal before every trial ended (re-run to resume).
    """

    table: Any
    trials: Any
    parent_run_id: str | None
    plan: Plan
    study_name: str
    tracking_uri: str
    interrupted: bool = False
    stop_signal: int | None = None
    optuna_summary: str = ""  # importances and the optuna-dashboard command
    cost_summary: str = ""  # per method, the plan's cost estimate next to the trials' recorded cost


def study_slots(spec: StudySpec, setup: StudySetup, start_ray: bool) -> int:
    """Trials at once: ``max_concurrent``, else the cluster's (or this machine's) CPUs // the CPUs of a trial's
    workers. Refuses a ``workers_per_trial`` that the cluster (or this machine) cannot place."""
    from .run.trial import Resources

    if spec.address or start_ray:
        import ray

        from .cluster.ray_cluster import cluster_cpus, init_ray

        init_ray(spec.address, dashboard=spec.starts_ray_dashboard)
        cpus, where = cluster_cpus(), "the Ray cluster"
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    else:
        from ..hardware import available_cpus

        cpus, where = available_cpus(), "this machine"
        nodes = [{"CPU": cpus, "GPU": local_gpus() if spec.gpus_per_trial else 0}]
    workers = spec.workers_per_trial
    if workers > 1:
        Resources(workers, setup.cpus_per_trial, spec.gpus_per_trial).check_placeable(nodes, where)
    if spec.driver_resource and not any(node.get(spec.driver_resource) for node in nodes):
        raise ValueError(f"--driver-resource {spec.driver_resource}: no node of {where} carries that resource; start "
                         f"the nodes for trial drivers with `ray start ... --resources '{{\"{spec.driver_resource}\": "
                         "1}'` and join them with --address")
    if spec.max_concurrent:
        return spec.max_concurrent
    return max(1, int(cpus // (setup.cpus_per_trial * workers)))


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def plan_study(spec: StudySpec, setup: StudySetup | None = None, start_ray: bool = False,
               use_cache: bool = True) -> Plan:
    """The plan (with its probe) of ``spec``, checked first (``prepare``) unless ``setup`` is given; Ray is not
    started unless asked (or a cluster given)."""
    setup = setup if setup is not None else prepare(spec)
    return make_plan(spec, setup, study_slots(spec, setup, start_ray), use_cache)


def run_study(spec: StudySpec, plan: Plan | None = None, command_line: list[str] | None = None,
              log: Any = None, setup: StudySetup | None = None) -> StudyResult:
    """Prints the plan, runs (or resumes) the study fitted to its budget, and reads back its table.

    Args:
        spec: the study as asked.
        plan: a plan already made (the CLI's), else one is made here.
        command_line: recorded on the parent run (default ``sys.argv``).
        log: where the plan and progress notes go (default: ``sys.stderr`` at the time of the call, not
            the stream that was ``sys.stderr`` when this module was imported).
        setup: what ``prepare(spec)`` found, if it already ran (else it runs here).
    """
    import pandas as pd

    log = log if log is not None else sys.stderr

    from ..analysis.bar import TRAINING_FREE, heuristic_tables
    from ..tracking import Tracker, experiment_name
    from .record.answer import ANSWER_ARTIFACT, DESCRIPTION_TAG, SUBSETS_ARTIFACT, study_description, wide_table
    from .record.report import RECORDED_KNOBS, subset_lines, table_rows
    from .run.driver import StudyOutcome, check_same_schedule
    from .run.driver import run_study as run_planned

    setup = setup if setup is not None else prepare(spec)
    if plan is None:
        plan = plan_study(spec, setup, start_ray=True)
        print(plan.text(), file=log)
    study = Study(spec, setup, plan, invocation(sys.argv) if command_line is None else command_line)
    check_same_schedule(study)  # with the fitted schedule
    dataset = setup.dataset
    example = [dataset.catalog.item_ids[i] for i in dataset.splits["train"].histories[0] if i >= 0]
    if study_state_exists(study.study_dir) and not spec.overwrite:
        print(f"resuming study {setup.study_name} from {study.study_dir}", file=log)
    try:
        outcome = run_planned(study, example)
    except KeyboardInterrupt:  # outside Tune's own handler (start-up, figures): the saved state still holds
        outcome = StudyOutcome([], interrupted=True)
    tracker = Tracker(setup.tracking_uri, experiment_name(setup.base.data.dataset))
    heuristics = heuristic_tables(dataset)
    rows = table_rows(tracker, study=setup.study_name, heuristics=heuristics)
    for row in rows:  # the verdict computed here with the dataset, for best and report to read
        if row.get("run_id") and row.get("converged"):
            tracker.set_tags(row["run_id"], {CONVERGED_TAG: row["converged"]})
    if outcome.parent_run_id and rows:  # the answer on the study's page in the MLflow UI
        subsets = subset_lines(tracker, setup.study_name, dataset, heuristics)
        if subsets:
            tracker.log_text(outcome.parent_run_id, "\n".join(subsets) + "\n", SUBSETS_ARTIFACT)
        tracker.log_text(outcome.parent_run_id, wide_table(rows), ANSWER_ARTIFACT)
        description = study_description(setup.study_name, rows, subsets, tracker.experiment_id)
        tracker.set_tags(outcome.parent_run_id, {DESCRIPTION_TAG: description})
        from .search.optuna_summary import save_answer_note  # and on the Optuna study's page in optuna-dashboard

        save_answer_note(tracker.client.get_run(outcome.parent_run_id).data.tags, setup.optuna_storage, description)
    record_rates(spec, setup, plan, outcome.rows)
    actual = {(row["backbone"], row["loss"]): {k: v for k, v in row.items() if k.startswith("cost/") and v is not None}
              for row in rows if row.get("status") != TRAINING_FREE}
    return StudyResult(table=pd.DataFrame(rows).drop(columns=[RECORDED_KNOBS], errors="ignore"), trials=pd.DataFrame([trial_row(row) for row in outcome.rows]),
                       parent_run_id=outcome.parent_run_id, plan=plan, study_name=setup.study_name,
                       tracking_uri=setup.tracking_uri, interrupted=outcome.interrupted,
                       stop_signal=outcome.stop_signal, optuna_summary=outcome.optuna_summary,
                       cost_summary=cost_summary(plan, actual))


def record_rates(spec: StudySpec, setup: StudySetup, plan: Plan, rows: list[dict[str, Any]]) -> int:
    """Gives the probe cache what this study's trials measured per method (training samples/s, validation
    seconds per user, peak RSS), so the next plan on this machine starts from real epochs; not for a cluster
    (its nodes are not this machine), nor for trials whose tuned negatives differ from the probed config.
    Returns the methods recorded."""
    if spec.address:
        return 0
    base, splits = setup.base, setup.dataset.splits
    valid_users = validation_users(base, splits)
    by_method: dict[tuple[str, str], list[dict[str, float]]] = {}
    for row in rows:
        choices, metrics = row["choices"], row["metrics"]
        if row["error"] or choices.get("num_negatives", base.loss.num_negatives) != base.loss.num_negatives:
            continue
        validation_s = metrics.get("perf/epoch_seconds", 0.0) - metrics.get("perf/train_seconds", 0.0)
        by_method.setdefault((choices["backbone"], choices["loss"]), []).append(
            {"perf/samples_per_second": metrics.get("perf/samples_per_second"),
             "valid_s_per_user": validation_s / valid_users if validation_s > 0 else None,
             "cost/peak_rss_mb": metrics.get("cost/peak_rss_mb"), "cost/energy_kwh": metrics.get("cost/energy_kwh"),
             "cost/cpu_seconds": metrics.get("cost/cpu_seconds")})
    return sum(record_observed(method_config(base, backbone, loss), plan.threads, trials)
               for (backbone, loss), trials in by_method.items())


def trial_row(row: dict[str, Any]) -> dict[str, Any]:
    """One trial's choices and final metrics, flat, with how it ended."""
    metrics = {k: v for k, v in row["metrics"].items() if "/" in k or k == "epoch"}
    if row["error"]:
        status = f"failed: {short_reason(row['error'])}"
    else:
        status = "finished" if reached_test(metrics) else "stopped"
    return {**row["choices"], "seed": row.get("seed"), "repeats": row.get("repeats"), **metrics, "status": status}


__all__ = ["StudyResult", "StudySetup", "StudySpec", "plan_study", "prepare", "run_study"]
