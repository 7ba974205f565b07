"""The study's search space as an Optuna define-by-run function.

Which (backbone, loss) a trial runs is fixed by its Optuna trial number: every baseline
(a loss with nothing to tune) runs once per backbone, then the tuned losses take turns. Each
tuned combination has its own parameter names (``tiger__apao_pairwise__beta``) so TPE models
each conditional space separately, and negatives are only suggested for losses that use them.
The first trial of each tuned combination evaluates the paper's setting (Table 5) when the study
enqueues it (``--enqueue-paper-setting``, the default); else it is a startup draw like the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config import TrialConfig

# loss -> the knobs a study tunes for it (SPEC §3, §5); losses absent here are baselines
TUNED_KNOBS: dict[str, tuple[str, ...]] = {
    "apao_pointwise": ("beta", "eta"),
    "apao_pairwise": ("beta", "eta", "num_negatives"),
    "ce_sdpo": ("beta", "num_negatives"),
    "dmpo": ("num_negatives",),
    "sdpo": ("num_negatives",),
}
# paper Table 5 (Office) as the first point of each tuned combination
PAPER_SETTINGS: dict[tuple[str, str], dict[str, float]] = {
    ("tiger", "apao_pointwise"): {"beta": 0.3, "eta": 1e-4},
    ("tiger", "apao_pairwise"): {"beta": 0.2, "eta": 3e-5, "num_negatives": 100},
    ("llama", "apao_pointwise"): {"beta": 0.4, "eta": 5e-4},
    ("llama", "apao_pairwise"): {"beta": 0.4, "eta": 5e-5, "num_negatives": 100},
}
DEFAULT_SETTING = {"beta": 0.1, "eta": 1e-4, "num_negatives": 100}
SEPARATOR = "__"
# keys of a repeat trial's config (repeats.py): the seed it trains on, the MLflow run it repeats
SEED_KEY, REPEATS_KEY = "seed", "repeats"


@dataclass(frozen=True)
class SearchSpec:
    """What the study explores. Ranges are inclusive (low, high); eta and negatives on a log scale."""

    backbones: tuple[str, ...]
    losses: tuple[str, ...]
    beta: tuple[float, float] = (0.05, 0.4)
    eta: tuple[float, float] = (5e-6, 5e-4)
    num_negatives: tuple[int, int] = (10, 200)
    trials_per_tuned: int = 8
    # (backbone, loss) pairs whose trials start first, in this order (the plan's slowest methods first, so
    # that the longest trials do not start last and overrun a budget); methods not named follow, baselines
    # first. Only a new study's order: a resumed study keeps the allocation its searcher was pickled with.
    first: tuple[tuple[str, str], ...] = ()
    # (backbone, loss) pairs the plan deferred (their trial does not fit the budget): no trials at all
    deferred: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, (low, high) in (("beta", self.beta), ("eta", self.eta), ("num_negatives", self.num_negatives)):
            if not low <= high:
                raise ValueError(f"--{name.replace('_', '-')} range {low}:{high} is empty or inverted; give LOW:HIGH "
                                 "with LOW <= HIGH")
        if self.eta[0] <= 0 or self.num_negatives[0] < 1 or self.beta[0] < 0:
            raise ValueError(f"ranges must be positive: eta {self.eta}, num_negatives {self.num_negatives}, "
                             f"beta {self.beta}")
        if not self.backbones or not self.losses:
            raise ValueError("a study needs at least one backbone and one loss")
        if self.trials_per_tuned < 1:
            raise ValueError(f"trials_per_tuned={self.trials_per_tuned} must be >= 1")

    def allocation(self) -> list[tuple[str, str, bool]]:
        """(backbone, loss, is_paper_point) for every trial number, in order: one trial of every method
        (a tuned method's first is its paper point), then the tuned methods take turns."""
        methods = [(b, l) for b in self.backbones for l in self.losses if (b, l) not in self.deferred]
        order = {method: i for i, method in enumerate(self.first)}
        methods.sort(key=lambda m: (order.get(m, len(order)), m[1] in TUNED_KNOBS))  # stable: as given otherwise
        tuned = [(b, l) for b, l in methods if l in TUNED_KNOBS]
        rest = [(b, l, False) for _ in range(self.trials_per_tuned - 1) for b, l in tuned]
        return [(b, l, l in TUNED_KNOBS) for b, l in methods] + rest

    def searches(self, loss: str) -> bool:
        """Whether ``loss`` has a knob left to search (a range wider than one value)."""
        return any(getattr(self, knob)[0] < getattr(self, knob)[1] for knob in TUNED_KNOBS.get(loss, ()))

    @property
    def num_trials(self) -> int:
        return len(self.allocation())

    def points_to_evaluate(self, enqueue_paper_setting: bool = True) -> list[dict[str, Any]]:
        """Enqueued first trials (Optuna numbers them first), one per method: a tuned method's paper
        setting clipped to the ranges searched when asked, else an empty point that only holds the trial
        number (its knobs are then drawn as in any other trial)."""
        first_round = [(b, l) for b, l, is_paper in self.allocation() if is_paper or l not in TUNED_KNOBS]
        points = [self._paper_point(b, l) if l in TUNED_KNOBS and enqueue_paper_setting else {}
                  for b, l in first_round]
        # up to the last baseline or paper setting: a tuned method's empty point after them holds nothing
        needed = [i + 1 for i, (point, (_, loss)) in enumerate(zip(points, first_round))
                  if point or loss not in TUNED_KNOBS]
        return points[:max(needed, default=0)]

    def _paper_point(self, backbone: str, loss: str) -> dict[str, Any]:
        setting = {**DEFAULT_SETTING, **PAPER_SETTINGS.get((backbone, loss), {})}
        return {param_name(backbone, loss, k): self._clip(k, setting[k]) for k in TUNED_KNOBS[loss]}

    def _clip(self, knob: str, value: float) -> float:
        low, high = getattr(self, knob)
        return type(low)(min(max(value, low), high))

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
        for knob in TUNED_KNOBS.get(loss, ()):
            name = param_name(backbone, loss, knob)
            low, high = getattr(self.spec, knob)
            if knob == "num_negatives":
                trial.suggest_int(name, low, high, log=True)
            else:
                trial.suggest_float(name, low, high, log=knob == "eta")
        return {"backbone": backbone, "loss": loss}


def param_name(backbone: str, loss: str, knob: str) -> str:
    return SEPARATOR.join((backbone, loss, knob))


def trial_choices(config: dict[str, Any]) -> dict[str, Any]:
    """A Tune trial config -> ``{"backbone", "loss", "beta"?, "eta"?, "num_negatives"?}``."""
    backbone, loss = config["backbone"], config["loss"]
    choices: dict[str, Any] = {"backbone": backbone, "loss": loss}
    for knob in TUNED_KNOBS.get(loss, ()):
        choices[knob] = config[param_name(backbone, loss, knob)]
    return choices


def trial_config(base: TrialConfig, config: dict[str, Any]) -> TrialConfig:
    """What a trial trains: the study's base config with the trial's backbone, loss and knobs, and a
    repeat's seed (a search trial trains on the base's)."""
    choices = trial_choices(config)
    loss = base.loss.replace(name=choices["loss"], **{k: v for k, v in choices.items() if k in _KNOB_NAMES})
    train = base.train.replace(seed=int(config[SEED_KEY])) if SEED_KEY in config else base.train
    return TrialConfig(base.data, base.model.replace(backbone=choices["backbone"]), loss, train, base.protocol)


_KNOB_NAMES = {knob for knobs in TUNED_KNOBS.values() for knob in knobs}


def is_baseline(loss: str) -> bool:
    return loss not in TUNED_KNOBS
