"""Ties on the selection metric: how many trials a method's best one tied with, named with the rule that broke them
(``outcome.best_of``: the first started), in the words every surface uses (sweep's and best's table, the study's
MLflow page, its registered model, the report)."""
from __future__ import annotations

import math
from typing import Callable, Iterable, TypeVar

from ..names import REPEATS_TAG
from .export import StudyExport
from .results import finished_trials, selection_of

T = TypeVar("T")

# the rule by which best_of breaks a tie, as every surface that names a tie says it
TIE_RULE = "kept the first started"


def tied(candidates: Iterable[T], value: Callable[[T], float | None], chosen: T) -> int:
    """How many ``candidates`` besides ``chosen`` have exactly its ``value`` (the ones ``best_of`` passed over)."""
    mine = value(chosen)
    return sum(1 for c in candidates if c is not chosen and mine is not None and value(c) == mine)


def tie_text(num_others: int, metric: str, value: float) -> str:
    """``3 trials tied on best/val/ndcg_at_10 0.5000: kept the first started``; empty when none tied."""
    return f"{num_others + 1} trials tied on {metric} {value:.4f}: {TIE_RULE}" if num_others else ""


def selection_ties(exports: list[StudyExport]) -> list[str]:
    """Per (study, backbone, loss) whose best trial tied others on its study's selection metric:
    ``s: tiger/ce: <tie_text>``."""
    candidates = [t for t in finished_trials(exports, "all") if REPEATS_TAG not in t.tags]
    lines = []
    for chosen in finished_trials(exports):
        if REPEATS_TAG in chosen.tags:
            continue
        group = [t if t.run_id != chosen.run_id else chosen for t in candidates
                 if (t.export.name, t.backbone, t.loss) == (chosen.export.name, chosen.backbone, chosen.loss)]
        key = selection_of(chosen.export).key
        text = tie_text(tied(group, lambda t: t.metrics.get(key), chosen), key, chosen.metrics.get(key, math.nan))
        if text:
            lines.append(f"{chosen.export.name}: {chosen.backbone}/{chosen.loss}: {text}")
    return lines
