"""A loss's tuned knobs and its paper settings, declared on the loss class (``Loss.knobs``,
``Loss.paper_settings``) and read from there by the search space, the CLI, the plan and the report.

Torch-free, so the sweep's ``--help`` and the search space can read them without loading a model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Knob:
    """One tuned knob of a loss and its default search range (inclusive).

    Args:
        name: the ``LossConfig`` field it sets, or any other name (carried in ``LossConfig.extra`` and read
            with ``Loss.knob``). It is the MLflow param of a study's child runs and the last part of the
            Optuna param ``backbone__loss__name``.
        low, high: the range a study searches unless told otherwise (``--knob NAME=LOW:HIGH``).
        default: the value where a paper setting does not name it (and a trial that does not tune it).
        log: searched on a log scale (then ``low`` must be > 0).
        integer: searched as an integer.
        help: one line for ``--help`` and the docs.
    """

    name: str
    low: float
    high: float
    default: float
    log: bool = False
    integer: bool = False
    help: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or "__" in self.name:
            raise ValueError(f"knob name {self.name!r} must be a Python identifier without '__' (the Optuna "
                             "param separator)")
        check_range(self.name, (self.low, self.high), log=self.log, integer=self.integer)

    def clip(self, value: float, low: float, high: float) -> float | int:
        """``value`` clipped to [low, high], an int for an integer knob."""
        clipped = min(max(value, low), high)
        return int(round(clipped)) if self.integer else float(clipped)


def check_range(name: str, bounds: tuple[float, float], *, log: bool, integer: bool) -> tuple[float, float]:
    """``bounds`` as (low, high) when it is a usable search range for the knob ``name``; else a ValueError naming it."""
    try:
        low, high = bounds
    except (TypeError, ValueError):
        raise ValueError(f"range of {name!r} must be (LOW, HIGH); got {bounds!r}") from None
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (low, high))
    if not numbers or not low <= high:
        raise ValueError(f"range of {name!r} {low}:{high} is empty, inverted or not numbers; give LOW:HIGH with "
                         "LOW <= HIGH")
    if log and low <= 0:
        raise ValueError(f"range of {name!r} {low}:{high} is on a log scale: LOW must be > 0")
    if integer and not (float(low).is_integer() and float(high).is_integer()):
        raise ValueError(f"range of {name!r} {low}:{high} must be integers")
    return (int(low), int(high)) if integer else (low, high)


# the knobs of the paper's losses, with the ranges a study searched before they moved here (SPEC §3, §5)
BETA = Knob("beta", 0.05, 0.4, 0.1, help="weight of the prefix loss (APAO) / lambda of CE + S-DPO")
ETA = Knob("eta", 5e-6, 5e-4, 1e-4, log=True, help="step size of APAO's adaptive prefix weights")
NUM_NEGATIVES = Knob("num_negatives", 10, 200, 100, log=True, integer=True, help="sampled negatives per target")

# backbone -> dataset -> knob values; a dataset not named takes OFFICE's
PaperSettings = Mapping[str, Mapping[str, Mapping[str, float]]]
OFFICE = "office"


def paper_setting(settings: PaperSettings, knobs: tuple[Knob, ...], backbone: str, dataset: str) -> dict[str, float]:
    """Every knob's value in ``settings`` for (backbone, dataset): the dataset's, else Office's (own data and
    synthetic have no paper setting: Office's is the paper's first dataset), else the knob's default."""
    per_dataset = settings.get(backbone, {})
    named = per_dataset.get(dataset.lower(), per_dataset.get(OFFICE, {}))
    return {knob.name: named.get(knob.name, knob.default) for knob in knobs}
