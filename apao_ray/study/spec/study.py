"""``StudySpec``: everything a study needs, every input checked at construction (before Ray starts).

The sweep CLI only turns flags into a StudySpec; a notebook builds one directly::

    spec = apao_ray.StudySpec(dataset="office", losses=("ce", "apao_pointwise"), budget="2h")
    result = apao_ray.run_study(spec)
    result.table
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...config import BACKBONE_NAMES, PRECISIONS, PROTOCOL_NAMES, TINY_MODEL

DEFAULT_LOSSES = ("ce", "apao_pointwise", "apao_pairwise")
# --quick / --smoke / StudySpec.quick(): a plumbing check in a few minutes on 2 CPUs, not a result
QUICK_SETTINGS = {"model_size": "tiny", "epochs": 2, "max_train_samples": 2048, "eval_max_users": 256,
                  "batch_size": 128, "effective_batch_size": 256, "losses": ("ce", "apao_pointwise"),
                  "retention_users": 32}
QUICK_NEGATIVES = (10, 20)


def quick_negatives(losses: tuple[str, ...]) -> tuple[int, int] | None:
    """The quick range of negatives where a loss tunes them (None otherwise: nothing to give)."""
    from .space import tunes

    return QUICK_NEGATIVES if any(tunes(name, "num_negatives") for name in losses) else None


@dataclass(frozen=True)
class StudySpec:
    """A hyperparameter study: which methods, how searched, how long, on what, recorded where.

    Args:
        dataset: a known dataset name (any case) or "synthetic".
        data_dir: directory holding the dataset; given, it must hold it (no download, no fall-back). Relative
            paths here and below are the caller's: resolved once, where the study starts; the trials get the
            absolute directory the dataset was found in.
        backbones, losses: the methods: every (backbone, loss) pair is studied.
        num_samples: Optuna trials per tuned (backbone, loss); baselines run once.
        beta, eta, negatives: search ranges (low, high); negatives only for losses that tune them
            (None: the loss's ``Knob`` range, 10..200).
        knob_ranges: search ranges of the losses' other knobs by name (``--knob NAME=LOW:HIGH``); a knob not
            named is searched over its ``Knob`` range (apao_ray/losses/knobs.py).
        epochs, patience: per-trial schedule (the sweep's 20 / 5, not the paper's 200 / 20).
        budget: wall-clock budget ("3h", "90m", "1h30m" or seconds): the study is fitted to it and
            stopped at it. None: no budget.
        min_epochs: the fewest epochs a budget may cut a trial to; a method whose one trial of them does
            not fit is deferred (a table row without trials).
        protocol, protocol_knobs: the training protocol preset and knob overrides (docs/PROTOCOLS.md).
        max_concurrent: trials at once (None: the cluster's CPUs // (cpus_per_trial x workers_per_trial)).
        workers_per_trial: data-parallel Ray Train workers per trial (DDP, docs/parallelism.md); each has
            ``cpus_per_trial`` CPUs, ``gpus_per_trial`` GPUs and ``memory_per_trial_gib``. 1: the trial trains
            in its Tune actor, without Ray Train.
        cpus_per_trial: CPUs (and torch threads) per trial, per worker when ``workers_per_trial`` > 1. None: on
            this machine, its CPUs shared by the workers of the trials that can run at once (min of the trials,
            max_concurrent and the CPUs), at least 1 each, and no more than the CPUs not busy now (load
            average), so a lone trial on an idle 2-CPU machine trains on both; 1 on a cluster.
        memory_per_trial_gib: a cap on what each trial allocates past its worker's start (torch and Ray loaded),
            the same under every allocator (training/memory.py MemoryCap); reserved in Ray's scheduling too.
        tracking_uri: MLflow tracking URI (None: $MLFLOW_TRACKING_URI, else sqlite:///$PWD/mlflow.db).
        output_dir: Ray Tune state and checkpoints.
        address: a Ray cluster to join (None: a local Ray on this machine).
        ray_dashboard: start the local Ray's dashboard (off: it holds ~1.1 GiB of memory in 12 processes,
            and the study's progress lines, MLflow and optuna-dashboard show the study); a cluster keeps its own.
            Always on with ``workers_per_trial`` > 1 (``starts_ray_dashboard``).
        resume, overwrite: continue the study of this name (refused if none) / start it again.
        retry_failed: on a resume, run the trials that failed (e.g. killed for memory) again, each
            from its last epoch checkpoint.
        enqueue_paper_setting: each tuned method's first trial is the paper's setting.
        optuna_storage: the searcher's Optuna storage (SQLAlchemy URL; None: optuna.db beside a
            SQLite MLflow database, else under output_dir).
        seeds: seeds as a study dimension (None: ``seed`` alone). The search runs on the first; then the
            best configuration of every (backbone, loss) is trained again on each other seed, as trials of
            the same study, and the table shows mean and spread over the seeds. Not together with ``seed``.
    """

    dataset: str = "synthetic"
    data_dir: str | None = None
    backbones: tuple[str, ...] = ("tiger",)
    losses: tuple[str, ...] = DEFAULT_LOSSES
    num_samples: int = 3
    beta: tuple[float, float] = (0.05, 0.4)
    eta: tuple[float, float] = (5e-6, 5e-4)
    negatives: tuple[int, int] | None = None
    pretrain_ce_epochs: int | None = None
    epochs: int = 20
    patience: int = 5
    batch_size: int | None = None  # None: 128 on CPU, 1024 with a GPU (config.default_micro_batch)
    effective_batch_size: int = 1024
    lr: float = 5e-4
    beam_size: int = 20
    seed: int = 0
    model_size: str = "paper"
    precision: str = "auto"
    group_by_length: bool = False
    max_train_samples: int | None = None
    eval_max_users: int | None = None
    retention_users: int = 128
    protocol: str = "paper"
    protocol_knobs: dict[str, Any] = field(default_factory=dict)
    budget: str | float | None = None
    min_epochs: int = 3
    max_concurrent: int | None = None
    workers_per_trial: int = 1
    cpus_per_trial: float | None = None
    gpus_per_trial: float = 0.0
    memory_per_trial_gib: float | None = None
    max_failures: int = 1
    asha_grace_period: int = 5
    study_name: str | None = None
    output_dir: str = "apao_runs"
    tracking_uri: str | None = None
    address: str | None = None
    ray_dashboard: bool = False
    resume: bool = False
    overwrite: bool = False
    retry_failed: bool = False
    enqueue_paper_setting: bool = True
    optuna_storage: str | None = None
    seeds: tuple[int, ...] | None = None
    knob_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)  # the losses' other knobs
    # resolved by the checks: the dataset, the base trial config, the search space, the URI
    resolved: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def quick(cls, **changes: Any) -> "StudySpec":
        """A plumbing check (tiny model, data subset, 2 epochs, no ASHA stopping); ``changes`` win."""
        values: dict[str, Any] = {**QUICK_SETTINGS, "num_samples": 2, **changes}
        values.setdefault("negatives", quick_negatives(tuple(values["losses"])))
        values.setdefault("patience", values["epochs"])
        values.setdefault("asha_grace_period", values["epochs"] + 1)  # 2 epochs leave ASHA nothing to compare
        return cls(**values)

    def replace(self, **changes: Any) -> "StudySpec":
        return replace(self, **changes)  # re-checked

    def __post_init__(self) -> None:
        for name in ("backbones", "losses"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if self.seeds is not None:
            object.__setattr__(self, "seeds", check_seeds(self.seeds, self.seed))
        self._check_numbers()
        self._resolve()

    def _check_numbers(self) -> None:
        def check(name: str, low: float, *, integer: bool = False, optional: bool = False, above: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            kind = "an integer" if integer else "a number"
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (value > low if above else value >= low) and (not integer or float(value).is_integer())
            if not ok:
                raise ValueError(f"{name}={value!r} must be {kind} {'>' if above else '>='} {low:g}")

        for name in ("num_samples", "epochs", "patience", "effective_batch_size", "beam_size", "asha_grace_period",
                     "min_epochs", "workers_per_trial"):
            check(name, 1, integer=True)
        check("batch_size", 1, integer=True, optional=True)
        for name in ("seed", "max_failures", "retention_users"):
            check(name, 0, integer=True)
        for name in ("max_train_samples", "eval_max_users", "max_concurrent"):
            check(name, 1, integer=True, optional=True)
        check("pretrain_ce_epochs", 0, integer=True, optional=True)
        check("lr", 0)
        check("gpus_per_trial", 0)
        check("memory_per_trial_gib", 0, optional=True, above=True)
        check("cpus_per_trial", 0, above=True, optional=True)
        if self.cpus_per_trial is not None and self.cpus_per_trial <= 0.05:
            raise ValueError(f"--cpus-per-trial {self.cpus_per_trial} leaves the trial's worker nothing; give more "
                             "than 0.05")
        for name, allowed in (("model_size", ("paper", "tiny")), ("precision", PRECISIONS),
                              ("protocol", PROTOCOL_NAMES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose from {list(allowed)}")
        if self.budget is not None:
            from ..plan.budget import parse_duration

            parse_duration(self.budget)

    @property
    def search_seed(self) -> int:
        """The seed the search runs on: the first of ``seeds``, else ``seed``."""
        return self.seeds[0] if self.seeds else self.seed

    @property
    def repeat_seeds(self) -> tuple[int, ...]:
        """The seeds the best configurations are trained again on, after the search."""
        return tuple(self.seeds[1:]) if self.seeds else ()

    @property
    def budget_s(self) -> float | None:
        from ..plan.budget import parse_duration

        return None if self.budget is None else parse_duration(self.budget)

    def _resolve(self) -> None:
        """The checks that need the loss registry, the dataset, MLflow and the Ray address."""
        from ...config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
        from ...data import load_dataset
        from ...losses import LOSSES
        from ...paths import check_plain_name
        from ...protocol import apply_protocol, check_select_by
        from ...tracking import check_tracking_uri, resolve_tracking_uri
        from ..cli.train import check_against_catalog
        from ..run.ray_cluster import check_ray_address
        from ...losses.knobs import NUM_NEGATIVES
        from .space import SearchSpec, tunes

        unknown = [b for b in self.backbones if b not in BACKBONE_NAMES]
        if unknown:
            raise ValueError(f"unknown backbone(s) {unknown}; choose from {list(BACKBONE_NAMES)}")
        unknown = [name for name in self.losses if name not in LOSSES]
        if unknown:
            raise ValueError(f"unknown loss(es) {unknown}; choose from {sorted(LOSSES)}")
        if self.negatives is not None and not any(tunes(n, "num_negatives") for n in self.losses):
            raise ValueError(f"--negatives was given, but none of the losses {list(self.losses)} uses negatives a study tunes; "
                             f"add one of {sorted(n for n in LOSSES if tunes(n, 'num_negatives'))}")
        negatives = tuple(self.negatives or (NUM_NEGATIVES.low, NUM_NEGATIVES.high))
        from ...data import canonical_dataset, dataset_label, is_dataset_path

        search = SearchSpec(self.backbones, self.losses, tuple(self.beta), tuple(self.eta), negatives,
                            self.num_samples, knob_ranges=dict(self.knob_ranges),
                            dataset=canonical_dataset(self.dataset))

        if not is_dataset_path(self.dataset):
            check_plain_name("dataset", self.dataset)  # before the default study name is made from it
        study_name = check_plain_name("study", self.study_name or f"{dataset_label(self.dataset)}-study")
        dataset = load_dataset(self.dataset, self.data_dir, allow_download=not self.data_dir)  # given: it is there
        workers = self.workers_per_trial  # a micro-batch on each of a trial's workers per optimizer step
        base = TrialConfig(
            # where the driver found the files: the trials read them there, from any working directory, never downloading
            DataConfig(dataset=canonical_dataset(self.dataset), data_dir=dataset.data_dir),
            ModelConfig(**(TINY_MODEL if self.model_size == "tiny" else {})),
            LossConfig(num_negatives=negatives[1]),
            TrainConfig(epochs=self.epochs, patience=self.patience, batch_size=self.batch_size,
                        effective_batch_size=max(self.effective_batch_size, (self.batch_size or 0) * workers),
                        lr=self.lr, num_workers=workers,
                        beam_size=self.beam_size, seed=self.search_seed, max_train_samples=self.max_train_samples,
                        eval_max_users=self.eval_max_users, precision=self.precision,
                        group_by_length=self.group_by_length, use_gpu=self.gpus_per_trial > 0,
                        retention_users=self.retention_users))
        # eta stays searched under every protocol; the preset's weighting and other knobs hold for all trials
        base = apply_protocol(base, self.protocol, {k: v for k, v in self.protocol_knobs.items() if k != "eta"})
        base = with_pretrain(base, self.losses, self.pretrain_ce_epochs)
        for name in self.losses:  # every loss against the catalog, with the most negatives asked for
            check_against_catalog(base.replace(loss=base.loss.replace(name=name).to_dict()), dataset.catalog)
        tracking_uri = resolve_tracking_uri(self.tracking_uri)
        check_tracking_uri(tracking_uri)
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other; give one")
        check_ray_address(self.address)  # an unreachable cluster is refused here, before any trial
        from ..run.mlflow_callback import dataset_record_of
        from ..run.optuna_storage import resolve_storage_url

        output_dir = Path(self.output_dir).resolve()
        cpus_per_trial = self.cpus_per_trial
        if cpus_per_trial is None:
            cpus_per_trial = 1.0 if self.address else local_cpus_per_trial(search.num_trials, self.max_concurrent,
                                                                            self.workers_per_trial)
        self.resolved.update(dataset=dataset, cpus_per_trial=cpus_per_trial, base=base, search=search, study_name=study_name,
                             tracking_uri=tracking_uri, output_dir=output_dir,
                             optuna_storage=resolve_storage_url(self.optuna_storage, tracking_uri, output_dir),
                             dataset_record=dataset_record_of(dataset, self.data_dir))
        from ..run.driver import check_resumable, study_state_exists

        options = self.options()
        if self.resume and not study_state_exists(options):
            raise ValueError(f"--resume: no study {study_name!r} to resume under {options.output_dir}; "
                             "check --study-name and --output-dir, or drop --resume to start it")
        if self.retry_failed and not study_state_exists(options):
            raise ValueError(f"--retry-failed: no study {study_name!r} under {options.output_dir} whose failed "
                             "trials could run again; check --study-name and --output-dir")
        if self.budget is None:  # a budget fits the schedule first: run_study checks the fitted one
            check_resumable(tracking_uri, options, dataset.checksums)
        # after the checks on the data: a changed dataset is the first thing to say on a resume
        check_select_by(base)  # e.g. ndcg_at_10 with --beam-size 2 names the metrics there are

    @property
    def starts_ray_dashboard(self) -> bool:
        """Whether the local Ray starts its dashboard: when asked, and always for data-parallel trials, whose Ray
        Train placement groups are freed by a cleaner that reads the dashboard's State API (without it the
        first trial's CPUs stayed reserved and the next trial's workers never started)."""
        return self.ray_dashboard or self.workers_per_trial > 1

    @property
    def trial_cpus(self) -> float:
        """CPUs per trial: ``cpus_per_trial``, or what None resolved to on this machine."""
        return self.resolved["cpus_per_trial"]

    @property
    def dataset_loaded(self) -> Any:
        return self.resolved["dataset"]

    def options(self, command_line: list[str] | None = None) -> Any:
        """The driver's ``StudyOptions`` for the study as asked (``api.planned_options`` gives it the plan's
        schedule)."""
        from ..run.driver import StudyOptions

        base, search = self.resolved["base"], self.resolved["search"]
        budget = self.budget_s
        extra = {} if command_line is None else {"command_line": command_line}
        return StudyOptions(
            base=base, spec=search, study_name=self.resolved["study_name"], output_dir=self.resolved["output_dir"],
            tracking_uri=self.resolved["tracking_uri"], address=self.address, ray_dashboard=self.starts_ray_dashboard,
            max_concurrent=self.max_concurrent or 1, cpus_per_trial=self.trial_cpus,
            gpus_per_trial=self.gpus_per_trial, time_budget_s=budget, max_failures=self.max_failures,
            memory_per_trial_bytes=int(self.memory_per_trial_gib * 2**30) if self.memory_per_trial_gib else None,
            asha_grace_period=self.asha_grace_period, seed=self.search_seed,
            repeat_seeds=self.repeat_seeds, overwrite=self.overwrite,
            retry_failed=self.retry_failed, enqueue_paper_setting=self.enqueue_paper_setting,
            optuna_storage=self.resolved["optuna_storage"], optuna_storage_given=self.optuna_storage is not None,
            dataset_record=self.resolved["dataset_record"], **extra)


def local_cpus_per_trial(num_trials: int, max_concurrent: int | None, workers_per_trial: int = 1) -> float:
    """This machine's CPUs shared by the workers of the trials that can run at once, but no more than the CPUs
    not busy now (1-minute load average, this process's start-up included): a 2-thread trial given one core's
    worth ran 10x slower than alone, 3.6x slower than on 1 thread (OpenMP threads waiting on each other;
    benchmarks/RESULTS.md, session 16). Per worker when ``workers_per_trial`` > 1."""
    from ..cli.train import available_cpus

    cpus = available_cpus()
    at_once = max(1, min(num_trials, max_concurrent or cpus, cpus // workers_per_trial))
    busy = int(os.getloadavg()[0] + 0.5) if hasattr(os, "getloadavg") else 0
    return float(max(1, min(cpus // (at_once * workers_per_trial), (cpus - busy) // workers_per_trial)))


def check_seeds(seeds: Any, seed: int) -> tuple[int, ...]:
    """``seeds`` as a tuple of distinct integers >= 0; refused next to a ``seed`` other than the default."""
    values = (seeds,) if isinstance(seeds, int) else tuple(seeds)
    if not values or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in values):
        raise ValueError(f"seeds={seeds!r} must be one or more integers >= 0, e.g. (0, 1, 2)")
    if len(set(values)) != len(values):
        raise ValueError(f"seeds={seeds!r} repeats a seed; give each once")
    if seed != 0:
        raise ValueError(f"seed={seed} and seeds={values} were both given; give seeds alone (the search runs on its "
                         "first seed) or seed alone")
    return values


def with_pretrain(base: Any, losses: tuple[str, ...], pretrain_ce_epochs: int | None) -> Any:
    """The CE stage of two-stage losses (``Loss.needs_ce_stage``): as given, else half the epochs (at least 1)."""
    from ...losses import LOSSES

    if not any(LOSSES[name].needs_ce_stage for name in losses if name in LOSSES):
        return base
    epochs = base.train.epochs
    pretrain = pretrain_ce_epochs if pretrain_ce_epochs is not None else max(1, epochs // 2)
    return base.replace(loss=base.loss.replace(pretrain_ce_epochs=pretrain).to_dict())
