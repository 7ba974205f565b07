"""The study's search space as an Optuna define-by-run function.

Which (backbone, loss) a trial runs is fixed by its Optuna trial number: every baseline
(a loss with nothing to tune) runs once per backbone, then the tuned losses take turns. Each
tuned combination has its own parameter names (``tiger__apao_pairwise__beta``) so TPE models
each conditional space separately, and negatives are only suggested for losses that use them.
The first trial of each tuned combination evaluates the paper's setting (Table 5) for the study's
dataset when the study enqueues it (``--enqueue-paper-setting``, the default); else it is a startup draw
like the others. What a loss tunes, its ranges and its paper settings are the loss class's
(``Loss.knobs``, ``Loss.paper_settings``, apao_ray/losses/knobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...config import TrialConfig

if TYPE_CHECKING:  # apao_ray.losses imports torch, which the driver's callbacks do not load: see loss_class
    from ...losses.knobs import Knob

SEPARATOR = "__"
# keys of a repeat trial's config (repeats.py): the seed it trains on, the MLflow run it repeats
SEED_KEY, REPEATS_KEY = "seed", "repeats"
# and of a repeat trained in a fused cohort (run/cohorts.py): the cohort's id, the member's place, the cohort's size
COHORT_KEY, MEMBER_KEY, SIZE_KEY = "cohort", "cohort_member", "cohort_size"


@dataclass(frozen=True)
class SearchSpec:
    """What the study explores. Every knob takes one route: its range is the loss class's ``Knob`` range
    (losses/knobs.py) unless ``knob_ranges`` names another (``--knob NAME=LOW:HIGH``, with ``--beta``, ``--eta``
    and ``--negatives`` as aliases); ranges are inclusive, on the scale the ``Knob`` says (eta and negatives:
    log). ``dataset`` picks each tuned method's paper setting (Table 5)."""

    backbones: tuple[str, ...]
    losses: tuple[str, ...]
    trials_per_tuned: int = 8
    # (backbone, loss) pairs whose trials start first, in this order (the plan's slowest methods first, so
    # that the longest trials do not start last and overrun a budget); methods not named follow, baselines
    # first. Only a new study's order: a resumed study keeps the allocation its searcher was pickled with.
    first: tuple[tuple[str, str], ...] = ()
    # (backbone, loss) pairs the plan deferred (their trial does not fit the budget): no trials at all
    deferred: tuple[tuple[str, str], ...] = ()
    knob_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    dataset: str = ""

    def __post_init__(self) -> None:
        if not self.backbones or not self.losses:
            raise ValueError("a study needs at least one backbone and one loss")
        if self.trials_per_tuned < 1:
            raise ValueError(f"trials_per_tuned={self.trials_per_tuned} must be >= 1")
        check_knob_ranges(self.knob_ranges, self.losses)

    def allocation(self) -> list[tuple[str, str, bool]]:
        """(backbone, loss, is_paper_point) for every trial number, in order: one trial of every method
        (a tuned method's first is its paper point), then the methods whose knobs are searched take turns (a
        method whose every knob is fixed runs once, as a baseline does)."""
        methods = [(b, l) for b in self.backbones for l in self.losses if (b, l) not in self.deferred]
        order = {method: i for i, method in enumerate(self.first)}
        methods.sort(key=lambda m: (order.get(m, len(order)), bool(knobs_of(m[1]))))  # stable: as given otherwise
        searched = [(b, l) for b, l in methods if self.searches(l)]  # fixed knobs: one trial, as a baseline
        rest = [(b, l, False) for _ in range(self.trials_per_tuned - 1) for b, l in searched]
        return [(b, l, bool(knobs_of(l))) for b, l in methods] + rest

    def searches(self, loss: str) -> bool:
        """Whether ``loss`` has a knob left to search (a range wider than one value)."""
        return any(self.range_of(knob)[0] < self.range_of(knob)[1] for knob in knobs_of(loss))

    def range_of(self, knob: Knob) -> tuple[float, float]:
        """The range searched for ``knob``: the study's for it, else the ``Knob``'s own."""
        return tuple(self.knob_ranges.get(knob.name, (knob.low, knob.high)))  # type: ignore[return-value]

    def range_named(self, name: str) -> tuple[float, float]:
        """The range searched for the knob ``name``: as the study's first loss declaring it has it, else as any
        registered loss's (the space records the paper's knobs whatever the losses)."""
        knob = next((k for loss in (*self.losses, *registered_losses()) for k in knobs_of(loss) if k.name == name),
                    None)
        if knob is None:
            raise ValueError(f"no registered loss declares a knob {name!r}; declared: {list(knob_names())}")
        return self.range_of(knob)

    @property
    def num_trials(self) -> int:
        return len(self.allocation())

    def points_to_evaluate(self, enqueue_paper_setting: bool = True) -> list[dict[str, Any]]:
        """Enqueued first trials (Optuna numbers them first), one per method: a tuned method's paper
        setting clipped to the ranges searched when asked, else an empty point that only holds the trial
        number (its knobs are then drawn as in any other trial)."""
        first_round = [(b, l) for b, l, is_paper in self.allocation() if is_paper or not knobs_of(l)]
        points = [self._paper_point(b, l) if knobs_of(l) and enqueue_paper_setting else {}
                  for b, l in first_round]
        # up to the last baseline or paper setting: a tuned method's empty point after them holds nothing
        needed = [i + 1 for i, (point, (_, loss)) in enumerate(zip(points, first_round))
                  if point or not knobs_of(loss)]
        return points[:max(needed, default=0)]

    def paper_knobs(self, backbone: str, loss: str) -> dict[str, float]:
        """A tuned method's paper setting for the study's dataset (Table 5; Office's where the paper has none),
        by knob name, clipped to the ranges searched: what its enqueued first trial runs."""
        setting = loss_class(loss).paper_point(backbone, self.dataset)
        return {k.name: k.clip(setting[k.name], *self.range_of(k)) for k in knobs_of(loss)}

    def knob_source(self, backbone: str, loss: str, trials: int, paper_first: bool = True) -> str:
        """Where a tuned method's ``trials`` take their knobs from, with the values known before the study: fixed
        ranges, the paper's setting (the enqueued first trial, ``paper_first``) and from the second trial on
        Optuna TPE (ASHA stopping weak trials)."""
        from ...data.files import DATASETS  # lazy: this module stays free of the data layer at import

        values = ", ".join(f"{name} {value:g}" for name, value in self.paper_knobs(backbone, loss).items())
        if not self.searches(loss):
            return f"knobs fixed: {values}; one trial, --seeds repeats it"
        if not paper_first:
            return "Optuna TPE + ASHA, no paper setting enqueued"
        source = (f"the paper's {DATASETS[self.dataset.lower()]} setting" if self.dataset.lower() in DATASETS
                  else f"the paper's Office setting (none for {self.dataset})")
        if trials == 1:
            return f"{source}, {values}: 1 trial, no search"
        return f"first trial {source}, {values}; then Optuna TPE + ASHA"

    def _paper_point(self, backbone: str, loss: str) -> dict[str, Any]:
        return {param_name(backbone, loss, name): value for name, value in self.paper_knobs(backbone, loss).items()}

    def define_by_run(self) -> "DefineByRun":
        return DefineByRun(self)


class DefineByRun:
    """The Optuna define-by-run function (a picklable object: Tune checkpoints the searcher)."""

    def __init__(self, spec: SearchSpec) -> None:
        self.spec = spec
        self.allocation = spec.allocation()

    def __call__(self, trial: Any) -> dict[str, Any]:
        backbone, loss, _ = self.allocation[trial.number % len(self.allocation)]
        trial.set_user_attr("backbone", backbone)  # a baseline has no knobs: these say what it ran
        trial.set_user_attr("loss", loss)
        for knob in knobs_of(loss):
            name = param_name(backbone, loss, knob.name)
            low, high = self.spec.range_of(knob)
            if knob.integer:
                trial.suggest_int(name, int(low), int(high), log=knob.log)
            else:
                trial.suggest_float(name, low, high, log=knob.log)
        return {"backbone": backbone, "loss": loss}


def param_name(backbone: str, loss: str, knob: str) -> str:
    return SEPARATOR.join((backbone, loss, knob))


def trial_choices(config: dict[str, Any]) -> dict[str, Any]:
    """A Tune trial config -> ``{"backbone", "loss", <each tuned knob>...}`` (e.g. ``beta``, ``eta``), read from
    the config's own param names, so that the driver's callbacks need not load the registry (and torch)."""
    backbone, loss = config["backbone"], config["loss"]
    prefix = param_name(backbone, loss, "")
    return {"backbone": backbone, "loss": loss,
            **{key[len(prefix):]: value for key, value in config.items() if key.startswith(prefix)}}


def trial_config(base: TrialConfig, config: dict[str, Any]) -> TrialConfig:
    """What a trial trains: the study's base config with the trial's backbone, loss and knobs, and a
    repeat's seed (a search trial trains on the base's)."""
    choices = trial_choices(config)
    knobs = {k: v for k, v in choices.items() if k not in ("backbone", "loss")}
    loss = base.loss.replace(name=choices["loss"]).with_knobs(knobs)
    train = base.train.replace(seed=int(config[SEED_KEY])) if SEED_KEY in config else base.train
    return TrialConfig(base.data, base.model.replace(backbone=choices["backbone"]), loss, train, base.protocol)


# the paper's knobs: first among the table's columns, and always recorded in a study's space (space_param), in
# this order, so a study recorded before every knob took one route resumes. Order and record only: their ranges
# come from their Knob, or knob_ranges, like any other knob's
PAPER_KNOBS = ("beta", "eta", "num_negatives")


def loss_class(loss: str) -> Any:
    """The registered class of ``loss`` (``LOSSES``), None for an unknown name."""
    # here, not at the top: the registry imports torch, which the driver's callbacks do not load
    # (tests/test_tracking.py) though they read this module's trial_choices
    from ...losses import LOSSES

    return LOSSES.get(loss)


def knobs_of(loss: str) -> tuple[Knob, ...]:
    """What a study tunes for ``loss`` (its class's ``knobs``); none for a baseline."""
    registered = loss_class(loss)
    return registered.knobs if registered is not None else ()


def registered_losses() -> tuple[str, ...]:
    from ...losses import LOSSES  # the registry imports torch: see loss_class

    return tuple(LOSSES)


def loss_knobs() -> dict[str, list[str]]:
    """Each registered loss's knob names (none for a baseline): which knob params apply to which loss's runs."""
    return {loss: [knob.name for knob in knobs_of(loss)] for loss in registered_losses()}


def knob_names() -> tuple[str, ...]:
    """Every registered loss's knob names: ``PAPER_KNOBS`` first (the table's columns), then the others."""
    declared = {k.name for loss in registered_losses() for k in knobs_of(loss)}
    return (*(k for k in PAPER_KNOBS if k in declared), *sorted(declared - set(PAPER_KNOBS)))


def is_baseline(loss: str) -> bool:
    return not knobs_of(loss)


def tunes(loss: str, knob: str) -> bool:
    return any(k.name == knob for k in knobs_of(loss))


def check_knob_ranges(ranges: dict[str, tuple[float, float]], losses: tuple[str, ...]) -> None:
    """Each range names a knob one of ``losses`` tunes and fits its scale."""
    from ...losses.knobs import check_range  # torch: see loss_class

    declared = {k.name: k for loss in losses for k in knobs_of(loss)}
    for name, bounds in ranges.items():
        if name not in declared:
            raise ValueError(f"knob range {name}={bounds!r}: none of the losses {list(losses)} tunes {name!r}; "
                             f"their knobs: {sorted(declared) or 'none'}")
        check_range(name, bounds, log=declared[name].log, integer=declared[name].integer)
