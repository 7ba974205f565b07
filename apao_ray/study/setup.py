"""``prepare(spec) -> StudySetup``: a ``StudySpec`` checked against the world before any trial.

A ``StudySpec`` is what the user asked, checked by pure code when it is built. Whether it can run here is
another question, answered once, when the study starts (``api.run_study`` and ``api.plan_study`` call
``prepare``) or when asked (``apao_ray.prepare(spec)``, e.g. in a notebook before a long study): the dataset
files load and hold what every loss needs, the MLflow store answers, the Ray cluster is reachable, a resumed
study's dataset and Optuna storage are the ones it started with. What that finds is a ``StudySetup``; the
plan (``plan.make.make_plan``) then fits the trials' schedule to the budget.

Where it sits: above ``cluster`` (``check_ray_address``), ``record`` (``dataset_record_of``: the dataset as each run
logs it) and ``search`` (``resolve_storage_url``, ``STORAGE_TAG``), which it asks; below the plan and the driver,
which take the ``StudySetup`` (the driver also reuses ``study_state_exists`` and ``parent_run`` on a resume).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import storage
from ..config import LossConfig, TrialConfig
from ..hardware import available_cpus
from .spec.study import StudySpec, with_pretrain
from .spec.trial import trial_config
from ..data import load_dataset
from ..protocol import apply_protocol, check_select_by
from .cluster.ray_cluster import check_ray_address
from .record.outcomes import STUDY_TAG

PARENT_ROLE_TAG = "apao.role"  # with the study tag, what finds a study's MLflow parent run


@dataclass(frozen=True)
class StudySetup:
    """What checking a ``StudySpec`` found.

    Attributes:
        dataset: the loaded dataset (catalog, splits, checksums).
        base: every trial's config as asked: the dataset where its files were found (absolute), the model,
            the schedule, the protocol preset; each trial sets its backbone, loss and knobs, the plan its
            schedule (``Plan.base``).
        study_name: the study's name (``StudySpec.study_label``).
        tracking_uri: the MLflow store, resolved (``$MLFLOW_TRACKING_URI``, else ``sqlite:///$PWD/mlflow.db``)
            and answering.
        output_dir: Ray Tune's state and checkpoints: an absolute local directory, or a URI of a filesystem pyarrow
            reads (``s3://bucket/prefix``; ``storage``), where every read and write of the study's files goes.
        optuna_storage: the searcher's Optuna storage URL (given, else beside a SQLite MLflow database).
        dataset_record: the dataset as each MLflow run logs it.
        cpus_per_trial: CPUs (and torch threads) per trial worker: as given, else what this machine affords.
    """

    dataset: Any
    base: TrialConfig
    study_name: str
    tracking_uri: str
    output_dir: str
    optuna_storage: str
    dataset_record: dict[str, Any]
    cpus_per_trial: float

    @property
    def study_dir(self) -> str:
        return storage.join(self.output_dir, self.study_name)


def prepare(spec: StudySpec) -> StudySetup:
    """Checks ``spec`` against the files, MLflow, Ray and a resumed study's records; nothing is created.

    Raises:
        ValueError, FileNotFoundError, ConnectionError: naming what is wrong and what would do.
    """
    # lazy: torch, MLflow and Ray load when a study is checked, not when apao_ray or a StudySpec is imported
    from ..tracking import check_tracking_uri, resolve_tracking_uri
    from ..training.checks import check_against_catalog
    from .record.mlflow_callback import dataset_record_of
    from .search.optuna_storage import resolve_storage_url

    dataset = load_dataset(spec.dataset, spec.data_dir, allow_download=not spec.data_dir)  # given: it is there
    base = with_pretrain(trial_base(spec, dataset.data_dir), spec.losses, spec.pretrain_ce_epochs)
    for name in spec.losses:  # every loss against the catalog, with the most negatives asked for
        check_against_catalog(base.replace(loss=base.loss.replace(name=name).to_dict()), dataset.catalog)
    tracking_uri = resolve_tracking_uri(spec.tracking_uri)
    check_tracking_uri(tracking_uri)
    check_ray_address(spec.address)  # an unreachable cluster is refused here, before any trial
    output_dir = checked_output_dir(spec, tracking_uri)
    cpus_per_trial = spec.cpus_per_trial
    if cpus_per_trial is None:
        cpus_per_trial = 1.0 if spec.address else local_cpus_per_trial(spec.search.num_trials, spec.max_concurrent,
                                                                        spec.workers_per_trial)
    setup = StudySetup(dataset=dataset, base=base, study_name=spec.study_label, tracking_uri=tracking_uri,
                       output_dir=output_dir, cpus_per_trial=cpus_per_trial,
                       optuna_storage=resolve_storage_url(spec.optuna_storage, tracking_uri, output_dir),
                       dataset_record=dataset_record_of(dataset, spec.data_dir))
    if (spec.resume or spec.retry_failed) and not study_state_exists(setup.study_dir):
        flag = "--resume" if spec.resume else "--retry-failed"
        raise ValueError(f"{flag}: no study {setup.study_name!r} to {'resume' if spec.resume else 'retry'} under "
                         f"{output_dir}; check --study-name and --output-dir, or drop {flag} to start it")
    check_resumable(setup, spec)  # a changed dataset is the first thing to say on a resume
    check_select_by(base)  # e.g. ndcg_at_10 with --beam-size 2 names the metrics there are
    return setup


def checked_output_dir(spec: StudySpec, tracking_uri: str) -> str:
    """``--output-dir`` as a location (``storage.absolute``); a remote one must answer, and hold what the study
    keeps there: no fused cohorts (their members meet in files on one disk) and no default Optuna store when
    MLflow's is not a local SQLite file (``resolve_storage_url`` puts it beside that file, else in the output
    directory, where SQLite cannot live on an object store).

    Raises:
        ValueError: naming the output directory and what would do.
    """
    output_dir = storage.absolute(spec.output_dir)
    if not storage.is_remote(output_dir):
        return output_dir
    root = storage.bucket(output_dir)  # a study never creates one
    try:
        if not storage.exists(root):
            raise FileNotFoundError(f"{root} does not exist")
    except Exception as error:  # pyarrow's OSError / ValueError: an unknown scheme, a store that does not answer
        reason = " ".join(str(error).split())[:300]
        raise ValueError(f"--output-dir {output_dir!r} cannot be read ({reason}); give a local directory or a URI "
                         "pyarrow reads (s3://bucket/prefix, gs://bucket/prefix) with its credentials (S3: "
                         "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for an S3-compatible store)") from None
    if spec.cohort_size > 1:
        raise ValueError(f"--cohort-size {spec.cohort_size} with --output-dir {output_dir!r}: a fused cohort's trials "
                         "meet in files on one disk; give a local or shared --output-dir, or drop --cohort-size")
    if spec.optuna_storage is None and not tracking_uri.startswith("sqlite:///"):
        raise ValueError(f"--output-dir {output_dir!r}: the Optuna store cannot default to a SQLite file there (the "
                         "MLflow store is not a local SQLite file to keep it beside); pass --optuna-storage, e.g. "
                         "postgresql://host/db or a path on this machine")
    return output_dir


def trial_base(spec: StudySpec, data_dir: str) -> TrialConfig:
    """Every trial's config as asked, reading the dataset from ``data_dir`` (where the driver found it: the
    trials read it there, from any working directory, never downloading)."""
    base = trial_config(spec, LossConfig(num_negatives=int(spec.search.range_named("num_negatives")[1])),
                        seed=spec.search_seed, workers=spec.workers_per_trial, use_gpu=spec.gpus_per_trial > 0,
                        data_dir=data_dir, retention_users=spec.retention_users)
    # eta stays searched under every protocol; the preset's weighting and other knobs hold for all trials
    return apply_protocol(base, spec.protocol, {k: v for k, v in spec.protocol_knobs.items() if k != "eta"})


def local_cpus_per_trial(num_trials: int, max_concurrent: int | None, workers_per_trial: int = 1) -> float:
    """This machine's CPUs shared by the workers of the trials that can run at once, but no more than the CPUs
    not busy now (1-minute load average, this process's start-up included): a 2-thread trial given one core's
    worth ran 10x slower than alone, 3.6x slower than on 1 thread (OpenMP threads waiting on each other;
    benchmarks/RESULTS.md, 2026-11-25). Per worker when ``workers_per_trial`` > 1."""
    cpus = available_cpus()
    at_once = max(1, min(num_trials, max_concurrent or cpus, cpus // workers_per_trial))
    busy = int(os.getloadavg()[0] + 0.5) if hasattr(os, "getloadavg") else 0
    return float(max(1, min(cpus // (at_once * workers_per_trial), (cpus - busy) // workers_per_trial)))


def study_state_exists(study_dir: str | Path) -> bool:
    """Whether Tune saved a study's state in ``study_dir`` (``<output_dir>/<study name>``): it can be resumed."""
    from ray import tune

    return tune.Tuner.can_restore(str(study_dir))


def parent_tags(study_name: str) -> dict[str, str]:
    """The tags that identify a study's MLflow parent run."""
    return {STUDY_TAG: study_name, PARENT_ROLE_TAG: "study"}


def check_resumable(setup: StudySetup, spec: StudySpec) -> None:
    """Refuses to resume a study whose dataset files or named Optuna storage changed (what the plan does not
    decide: checked before the plan's probe). Tune restores the searcher from its own state, so a changed
    storage would be silently ignored, and a changed dataset would mix two datasets in one comparison."""
    from ..tracking import redact

    if spec.overwrite:
        return
    run = parent_run(setup)
    if run is None:
        return
    recorded, now = json.loads(run.data.tags.get("dataset_checksums", "{}")), setup.dataset.checksums
    changed = sorted(name for name in set(recorded) | set(now) if recorded.get(name) != now.get(name))
    if changed:
        details = "; ".join(f"{name}: recorded {str(recorded.get(name))[:12]}, now {str(now.get(name))[:12]}"
                            for name in changed)
        raise ValueError(f"dataset files changed since study {setup.study_name!r} started ({details}); restore "
                         "the original files, or start a new study with --study-name NAME or --overwrite")
    if spec.optuna_storage is not None and study_state_exists(setup.study_dir):
        from .search.optuna_storage import STORAGE_TAG

        storage = run.data.tags.get(STORAGE_TAG)
        if storage != redact(setup.optuna_storage):  # the restored searcher writes where it was started
            started = f"with Optuna storage {storage!r}" if storage else "without an Optuna storage"
            raise ValueError(f"study {setup.study_name!r} was started {started}; --optuna-storage now gives "
                             f"{redact(setup.optuna_storage)!r}: a resumed study keeps its storage, so drop "
                             "--optuna-storage (or give the recorded one), or start a new --study-name")


def parent_run(setup: StudySetup) -> Any:
    """The MLflow parent run of the study ``setup`` names, if the store and the run exist (nothing is created)."""
    from ..tracking import Tracker, experiment_name

    tracker = Tracker.existing(setup.tracking_uri, experiment_name(setup.base.data.dataset))
    parent_id = tracker.find_run(parent_tags(setup.study_name)) if tracker else None
    return None if parent_id is None else tracker.client.get_run(parent_id)
