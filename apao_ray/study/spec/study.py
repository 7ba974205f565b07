"""``StudySpec``: what the user asked for, as plain frozen data, every input checked by pure code at construction
(no files, MLflow or Ray: ``api.prepare`` checks those, when the study starts or when asked).

The sweep CLI only turns flags into a StudySpec; a notebook builds one directly::

    spec = apao_ray.StudySpec(dataset="office", losses=("ce", "apao_pointwise"), budget="2h")
    result = apao_ray.run_study(spec)
    result.table
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, replace
from typing import Any

from ...config import BACKBONE_NAMES, FULL_SORT_TEST, PRECISIONS, PROTOCOL_NAMES, TrialConfig
from ...data.files import canonical_dataset, dataset_label, is_dataset_path, known_dataset_names
from ...paths import check_plain_name
from .duration import parse_duration
from .fields import check_bounds, document, option, table
from .space import SearchSpec, tunes
from ...protocol import apply_protocol

DEFAULT_LOSSES = ("ce", "apao_pointwise", "apao_pairwise")
# --quick / --smoke / StudySpec.quick(): a plumbing check in a few minutes on 2 CPUs, not a result
QUICK_SETTINGS = {"model_size": "tiny", "epochs": 2, "max_train_samples": 2048, "eval_max_users": 256,
                  "batch_size": 128, "effective_batch_size": 256, "losses": ("ce", "apao_pointwise"),
                  "retention_users": 32}
QUICK_NEGATIVES = (10, 20)
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


# the flags that give a paper knob's range, aliases of --knob NAME=LOW:HIGH
ALIAS_FLAGS = {"beta": "--beta", "eta": "--eta", "num_negatives": "--negatives"}


def quick_negatives(losses: tuple[str, ...]) -> tuple[int, int] | None:
    """The quick range of negatives where a loss tunes them (None otherwise: nothing to give)."""
    return QUICK_NEGATIVES if any(tunes(name, "num_negatives") for name in losses) else None


def quick_changes(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """What --quick (and ``StudySpec.quick``) changes in a study whose inputs are ``values``, leaving the inputs
    named in ``given`` as written: the settings above, 3 trials per tuned method, patience = epochs, ASHA's grace
    past the last epoch (2 epochs leave it nothing to compare: every trial reaches its test), and the quick range
    of negatives unless a --knob range of them is the one to search. The one definition both routes read."""
    changes = {name: value for name, value in {**QUICK_SETTINGS, "num_samples": 3}.items() if name not in given}
    now = {**values, **changes}
    derived = {"patience": now["epochs"], "asha_grace_period": now["epochs"] + 1}
    changes.update({name: value for name, value in derived.items() if name not in given})
    if "negatives" not in given and "num_negatives" not in dict(now.get("knob_ranges") or {}):
        changes["negatives"] = quick_negatives(tuple(now["losses"]))
    return changes


@dataclass(frozen=True)
class StudySpec:
    """A hyperparameter study: which methods, how searched, how long, on what, recorded where. One field per input,
    each declared once with its help and bounds (``spec/fields.py``): the ``sweep`` flags are built from them.

    Relative paths are the caller's: resolved once, where the study starts (``prepare``); the trials get absolute
    ones.
    """

    # what is trained and on what (the flags `train` shares)
    dataset: str = option("synthetic", f"one of {known_dataset_names()} (any case), or a dataset directory path "
                          "such as ./mydata (docs/own-data.md); default synthetic (no files needed)", group="trial")
    data_dir: str | None = option(None, "directory with <Name>/<Name>.inter.json (default: $APAO_DATA_DIR, ./data, "
                                  "then the user cache; downloaded when absent); given, it must hold the dataset "
                                  "(no download, no fall-back)", group="trial")
    address: str | None = option(None, "Ray cluster to join, e.g. 'auto' or ray://host:10001 (default: $RAY_ADDRESS, "
                                 "else a local Ray on this machine)", env="RAY_ADDRESS", group="trial")
    output_dir: str = option("apao_runs", "where runs and checkpoints are stored: a directory (default "
                             "./%(default)s; shared storage on a multi-node cluster) or a URI such as "
                             "s3://bucket/prefix or gs://bucket/prefix (docs/running.md)", group="trial")
    max_train_samples: int | None = option(None, "train on a fixed random subset (quick runs)", low=1, integer=True,
                                           group="trial")
    eval_max_users: int | None = option(None, "validate on a fixed random subset of users", low=1, integer=True,
                                        group="trial")
    epochs: int = option(20, "maximum epochs per trial (default %(default)s; the paper: 200, SPEC §5)", low=1,
                         integer=True, group="trial")
    patience: int = option(5, "early-stopping patience (default %(default)s; the paper: 20)", low=1, integer=True,
                           group="trial")
    batch_size: int | None = option(None, "micro-batch size, of each worker when data parallel (default: 128 on CPU, "
                                    "1024 with a GPU, the fastest measured on each at effective batch 1024: "
                                    "benchmarks/RESULTS.md); the optimizer step stays --effective-batch-size", low=1,
                                    integer=True, group="trial")
    effective_batch_size: int = option(1024, "samples per optimizer step via gradient accumulation (default "
                                       "%(default)s)", low=1, integer=True, group="trial")
    lr: float = option(5e-4, "AdamW learning rate (default %(default)s)", low=0, group="trial")
    beam_size: int = option(20, "beam size for evaluation (default %(default)s)", low=1, integer=True, group="trial")
    seed: int = option(0, "seed for init, data order and negatives (default %(default)s)", low=0, integer=True,
                       group="trial")
    model_size: str = option("paper", "paper: SPEC §2 sizes (~0.005B); tiny: a small model for smoke runs (default "
                             "%(default)s)", choices=("paper", "tiny"), group="trial")
    precision: str = option("auto", "auto (default): bf16 autocast on GPUs and on CPUs with native bf16 (AVX512-BF16 "
                            "or AMX), fp32 elsewhere; weights, optimizer and log-softmax normalisers stay float32. The "
                            "resolved precision is recorded in the checkpoint and MLflow (apao.precision)",
                            choices=PRECISIONS, group="trial")
    group_by_length: bool = option(False, "batch histories of similar length: less padding, faster epochs (Office: "
                                   "see benchmarks/RESULTS.md); the paper's runs used random batches", kind="switch",
                                   group="trial")
    # the methods and their search
    backbones: tuple[str, ...] = option(("tiger",), f"comma list of {list(BACKBONE_NAMES)} (default tiger)",
                                        kind="names")
    losses: tuple[str, ...] = option(DEFAULT_LOSSES, "comma list of %(names)s (default ce,apao_pointwise,"
                                     "apao_pairwise); losses with nothing to tune are baselines and run once per "
                                     "backbone", kind="names", lists="losses")
    num_samples: int = option(3, "Optuna trials per tuned (backbone, loss) (default %(default)s); one whose knobs "
                              "are all fixed (e.g. --beta 0.3 --eta 1e-4) runs once: --seeds repeats it",
                              low=1, integer=True)
    beta: tuple[float, float] | None = option(None, "LOW:HIGH, the same as --knob beta=LOW:HIGH (default: the "
                                              "knob's range, 0.05:0.4, the paper grid)", kind="range")
    eta: tuple[float, float] | None = option(None, "LOW:HIGH, log scale, the same as --knob eta=LOW:HIGH (default: "
                                             "the knob's range, 5e-6:5e-4)", kind="range")
    negatives: tuple[int, int] | None = option(None, "LOW:HIGH negatives, log scale, the same as --knob "
                                               "num_negatives=LOW:HIGH (default: the knob's range, 10:200; 10:20 with "
                                               "--quick)", kind="int_range")
    knob_ranges: dict[str, tuple[float, float]] = option(
        factory=dict, kind="knobs", flag="--knob", metavar="NAME=LOW:HIGH",
        help="search range of any knob a loss declares, built-in or plugin (Loss.knobs: %(names)s; repeatable; "
             "LOW=HIGH fixes it; default: the knob's own range; docs/own-loss.md)", lists="knobs")
    pretrain_ce_epochs: int | None = option(None, "CE epochs before a loss that needs a CE stage (dpo/dmpo/sdpo; "
                                            "default half the epochs)", low=0, integer=True)
    enqueue_paper_setting: bool = option(True, "each tuned (backbone, loss) starts with the paper's setting (Table 5) "
                                         "for the dataset, clipped to the ranges (default: %(default)s)", kind="toggle")
    seeds: tuple[int, ...] | None = option(None, "seeds as a study dimension, e.g. 0,1,2: the search runs on the "
                                           "first; then the best configuration of every (backbone, loss) trains again "
                                           "on each other seed (trials of the same study, resumable) and the table "
                                           "shows mean, std and significance over the seeds; not with --seed "
                                           "(default: --seed alone)", kind="seeds", metavar="S,S,...")
    retention_users: int = option(128, "test users whose beam retention is measured (paper Fig. 1c; 32 with "
                                  "--quick) (default %(default)s)", low=0, integer=True)
    full_sort_test: str = option("auto", "also rank every test user by the exact full sort at the kept epoch "
                                 "(test/full_sort_*: how much the beam's pruning costs; beam retention then covers "
                                 "every user): on, off, or auto = on a GPU (on a CPU ~40 min for Office's test "
                                 "users at 1 thread) (default %(default)s)", choices=FULL_SORT_TEST, group="trial")
    test_every_epoch: bool = option(False, "diagnosis only: also evaluate the test split after every epoch, logged "
                                    "as diagnosis/test/<metric> and never read by any selection rule (why validation "
                                    "and test disagree; one more beam pass per epoch)", kind="switch", group="trial")
    protocol: str = option("paper", "the training protocol preset (docs/PROTOCOLS.md)", choices=PROTOCOL_NAMES,
                           cli=False)
    protocol_knobs: dict[str, Any] = option(factory=dict, help="protocol knob overrides (--select-by, --weighting, "
                                            "...; docs/PROTOCOLS.md)", cli=False)
    # how long, and on what
    budget: str | float | None = option(None, "wall-clock budget, e.g. 3h, 90m, 1h30m or seconds: the study is fitted "
                                        "to it (fewer epochs, then fewer trials; methods whose trial of --min-epochs "
                                        "does not fit are deferred; ASHA rungs from the epochs) and stopped at it "
                                        "(default: none)", kind="duration", metavar="DURATION")
    min_epochs: int = option(3, "the fewest epochs --budget may cut a trial to; a method whose one trial of them does "
                             "not fit is deferred: a table row without trials, saying what it needs (default "
                             "%(default)s)", low=1, integer=True)
    max_concurrent: int | None = option(None, "trials at once (default: the cluster's CPUs // (cpus-per-trial x "
                                        "workers-per-trial))", low=1, integer=True)
    workers_per_trial: int = option(1, "data-parallel Ray Train workers per trial (DDP; each with --cpus-per-trial "
                                    "CPUs, --gpus-per-trial GPUs and --memory-per-trial); refused when the cluster "
                                    "cannot place them all (default %(default)s: the trial trains in its Tune actor; "
                                    "docs/parallelism.md)", low=1, integer=True)
    cpus_per_trial: float | None = option(None, "CPUs (and torch threads) per trial, per worker with "
                                          "--workers-per-trial; 0.5 packs two trials per CPU, each on 1 thread "
                                          "(default: this machine's CPUs shared by the trials that run at once, at "
                                          "least 1 each and no more than the CPUs not busy at the start: a lone trial "
                                          "on an idle 2-CPU machine gets 2; 1 on a cluster)", low=0, above=True)
    gpus_per_trial: float = option(0.0, "GPUs per trial; fractions share a GPU (0.25) (default %(default)s)", low=0)
    memory_per_trial_gib: float | None = option(
        None, flag="--memory-per-trial", metavar="GIB", low=0, above=True,
        help="memory cap per trial in GiB, counting what the trial itself allocates: the memory its worker maps past "
             "what it mapped when the trial started, torch and Ray loaded (0.5-2.5 GiB, by allocator; not counted), "
             "whether touched yet or not; the same under every allocator (APAO_RAY_ALLOCATOR). A trial that needs "
             "more fails as 'out of memory', naming the cap and what it held, instead of the node's OOM killer taking "
             "processes; Ray reserves the cap for the trial's scheduling (default: no cap)")
    cohort_size: int = option(1, "train the repeats of --seeds as fused cohorts of up to K trials of one backbone: "
                              "one batched model in one trial's slot, every member still its own trial, MLflow run "
                              "and table row (docs/parallelism.md); for a GPU, where separate trials share the card "
                              "by time-slicing. 1 = off (default %(default)s: on 2 CPUs a cohort trained at 0.2-0.4x "
                              "the samples/s of the same trials run separately, benchmarks/RESULTS.md)", low=1,
                              integer=True, metavar="K")
    max_failures: int = option(1, "restarts of a failed trial from its checkpoint (default %(default)s)", low=0,
                               integer=True)
    asha_grace_period: int = option(5, "epochs before ASHA may stop a trial (default %(default)s; a quarter of the "
                                    "epochs when --budget shortens them); a trial is only compared with trials of its "
                                    "own (backbone, loss), baselines are never stopped, and a pruned trial is tested "
                                    "on its best checkpoint", low=1, integer=True)
    ray_dashboard: bool = option(False, "start the dashboard of the local Ray this study starts (off by default: it "
                                 "holds ~1.1 GiB of memory in 12 processes; the progress lines, MLflow and "
                                 "optuna-dashboard show the study); a cluster given by --address keeps its own; "
                                 "always on with --workers-per-trial > 1", kind="switch")
    driver_resource: str | None = option(None, "on a cluster, run each trial's driver (Tune's trial actor) only on "
                                         "nodes that carry this custom Ray resource (Ray's 'safe nodes': "
                                         "`ray start --resources '{\"NAME\": 1}'` on nodes that are not "
                                         "preempted); each driver takes 0.01 of it. A one-worker trial trains in "
                                         "its driver, so it trains there too; --workers-per-trial > 1 puts its "
                                         "workers wherever they fit (default: any node)", metavar="NAME")
    # where it is recorded, and what happens to an earlier study of the same name
    study_name: str | None = option(None, "default <dataset>-study; re-running the same name resumes it")
    tracking_uri: str | None = option(None, "MLflow store the study records to (--tracking-uri)", cli=False)
    optuna_storage: str | None = option(None, "SQLAlchemy URL (or SQLite file path) of the searcher's Optuna study "
                                        "(default: optuna.db beside a SQLite MLflow database, else in --output-dir); "
                                        "open it with optuna-dashboard URL", metavar="URL")
    resume: bool = option(False, "continue an interrupted study (refused when there is none); re-running the same "
                          "command does the same", kind="switch")
    retry_failed: bool = option(False, "on a resume, also run again the trials that failed (e.g. killed for memory), "
                                "each from its last epoch checkpoint; without it they stay failed", kind="switch")
    overwrite: bool = option(False, "start the study again from scratch", kind="switch")

    @classmethod
    def quick(cls, **changes: Any) -> "StudySpec":
        """``--quick``: a plumbing check (tiny model, data subset, 2 epochs, no ASHA stopping; ``quick_changes``);
        ``changes`` win."""
        defaults = {entry.name: entry.default if entry.default is not MISSING else entry.default_factory()
                    for entry in table(cls)}
        return cls(**{**changes, **quick_changes({**defaults, **changes}, set(changes))})

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
        object.__setattr__(self, "_search", SearchSpec(
            self.backbones, self.losses, trials_per_tuned=self.num_samples,
            knob_ranges={**self.knob_ranges, **self._alias_ranges()}, dataset=canonical_dataset(self.dataset)))

    def _alias_ranges(self) -> dict[str, tuple[float, float]]:
        """The knob ranges given by --beta, --eta and --negatives: one route with --knob."""
        given = {name: tuple(value) for name, value in
                 (("beta", self.beta), ("eta", self.eta), ("num_negatives", self.negatives)) if value is not None}
        twice = sorted(set(given) & set(self.knob_ranges))
        if twice:
            raise ValueError(f"the range of {twice[0]!r} was given twice, by {ALIAS_FLAGS[twice[0]]} and by --knob "
                             f"{twice[0]}=...; give one")
        return given

    def _check_numbers(self) -> None:
        check_bounds(self)  # the table's bounds and choices (spec/fields.py)
        if self.cpus_per_trial is not None and self.cpus_per_trial <= 0.05:
            raise ValueError(f"--cpus-per-trial {self.cpus_per_trial} leaves the trial's worker nothing; give more "
                             "than 0.05")

    def _check_names(self) -> None:
        """Backbones, losses, names that become paths, and flags that contradict each other."""
        # lazy: the loss registry imports torch, which ``import apao_ray`` and --help never load
        from ...losses import LOSSES

        unknown = [b for b in self.backbones if b not in BACKBONE_NAMES]
        if unknown:
            raise ValueError(f"unknown backbone(s) {unknown}; choose from {list(BACKBONE_NAMES)}")
        unknown = [name for name in self.losses if name not in LOSSES]
        if unknown:
            raise ValueError(f"unknown loss(es) {unknown}; choose from {sorted(LOSSES)}")
        for name, flag in ALIAS_FLAGS.items():
            if getattr(self, "negatives" if name == "num_negatives" else name) is not None \
                    and not any(tunes(n, name) for n in self.losses):
                raise ValueError(f"{flag} was given, but none of the losses {list(self.losses)} tunes {name}; add one "
                                 f"of {sorted(n for n in LOSSES if tunes(n, name))}")
        if not is_dataset_path(self.dataset):
            check_plain_name("dataset", self.dataset)  # before the default study name is made from it
        check_plain_name("study", self.study_label)
        if self.cohort_size > 1 and self.workers_per_trial > 1:
            raise ValueError(f"--cohort-size {self.cohort_size} with --workers-per-trial {self.workers_per_trial}: a "
                             "cohort trains on one worker; give one of them")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other; give one")
        if self.driver_resource is not None and (self.driver_resource in RAY_BUILTIN_RESOURCES
                                                 or not self.driver_resource.replace("_", "").isalnum()):
            raise ValueError(f"--driver-resource {self.driver_resource!r} must name a custom Ray resource (letters, "
                             f"digits, _), not one of Ray's own {RAY_BUILTIN_RESOURCES}, e.g. trial_driver")
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


StudySpec.__doc__ += document(StudySpec)


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
