"""``StudySpec``: what the user asked for, as plain frozen data, every input checked by pure code at construction
(no files, MLflow or Ray: ``api.prepare`` checks those, when the study starts or when asked).

The sweep CLI only turns flags into a StudySpec; a notebook builds one directly::

    spec = apao_ray.StudySpec(dataset="office", losses=("ce", "apao_pointwise"), budget="2h")
    result = apao_ray.run_study(spec)
    result.table
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ...config import BACKBONE_NAMES, PRECISIONS, PROTOCOL_NAMES
from ...data.files import canonical_dataset, dataset_label, is_dataset_path
from ...paths import check_plain_name
from .duration import parse_duration
from .space import SearchSpec, tunes

DEFAULT_LOSSES = ("ce", "apao_pointwise", "apao_pairwise")
# --quick / --smoke / StudySpec.quick(): a plumbing check in a few minutes on 2 CPUs, not a result
QUICK_SETTINGS = {"model_size": "tiny", "epochs": 2, "max_train_samples": 2048, "eval_max_users": 256,
                  "batch_size": 128, "effective_batch_size": 256, "losses": ("ce", "apao_pointwise"),
                  "retention_users": 32}
QUICK_NEGATIVES = (10, 20)


def quick_negatives(losses: tuple[str, ...]) -> tuple[int, int] | None:
    """The quick range of negatives where a loss tunes them (None otherwise: nothing to give)."""
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
        self._check_names()
        # parsed and built once, here: what the plan and the driver read (``budget_s``, ``search``)
        object.__setattr__(self, "_budget_s", None if self.budget is None else parse_duration(self.budget))
        negatives = {"num_negatives": tuple(self.negatives)} if self.negatives else {}  # else SearchSpec's default
        object.__setattr__(self, "_search", SearchSpec(
            self.backbones, self.losses, tuple(self.beta), tuple(self.eta), trials_per_tuned=self.num_samples,
            knob_ranges=dict(self.knob_ranges), dataset=canonical_dataset(self.dataset), **negatives))

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

    def _check_names(self) -> None:
        """Backbones, losses, names that become paths, and flags that contradict each other."""
        # lazy: the registry and the protocol import torch, which ``import apao_ray`` and --help never load
        from ...config import TrialConfig
        from ...losses import LOSSES
        from ...protocol import apply_protocol

        unknown = [b for b in self.backbones if b not in BACKBONE_NAMES]
        if unknown:
            raise ValueError(f"unknown backbone(s) {unknown}; choose from {list(BACKBONE_NAMES)}")
        unknown = [name for name in self.losses if name not in LOSSES]
        if unknown:
            raise ValueError(f"unknown loss(es) {unknown}; choose from {sorted(LOSSES)}")
        if self.negatives is not None and not any(tunes(n, "num_negatives") for n in self.losses):
            raise ValueError(f"--negatives was given, but none of the losses {list(self.losses)} uses negatives a study "
                             f"tunes; add one of {sorted(n for n in LOSSES if tunes(n, 'num_negatives'))}")
        if not is_dataset_path(self.dataset):
            check_plain_name("dataset", self.dataset)  # before the default study name is made from it
        check_plain_name("study", self.study_label)
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other; give one")
        apply_protocol(TrialConfig(), self.protocol, self.protocol_knobs)  # unknown knobs or values, named

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
        """The budget in seconds (None: no budget)."""
        return self._budget_s

    @property
    def search(self) -> SearchSpec:
        """The search space as asked (the plan's copy carries its fitted trial count and start order)."""
        return self._search

    @property
    def study_label(self) -> str:
        """The study's name: ``study_name``, else ``<dataset>-study``."""
        return self.study_name or f"{dataset_label(self.dataset)}-study"

    @property
    def starts_ray_dashboard(self) -> bool:
        """Whether the local Ray starts its dashboard: when asked, and always for data-parallel trials, whose Ray
        Train placement groups are freed by a cleaner that reads the dashboard's State API (without it the
        first trial's CPUs stayed reserved and the next trial's workers never started)."""
        return self.ray_dashboard or self.workers_per_trial > 1


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
