"""How a trial ended and what it measured, read from its run record (``analysis.export.trial_record``: an MLflow run
or an export's entry alike): the one reading of a trial that the study's table, ``best``, ``report``, the seeds, the
pruned trials' tests and the figures share, and the one choice of a method's best trial (``best_trial``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

from ..names import ERROR_TAG, OUTCOME_TAG, PRUNED, REPEATS_TAG, reached_test, test_by_key
from ..protocol import Selection

T = TypeVar("T")
FINISHED, PRUNED_STATE, FAILED, RUNNING, STOPPED = "finished", "pruned", "failed", "running", "stopped"


class Outcome:
    """One trial's ending and metrics.

    ``state``: ``finished`` (ended and tested its kept model), ``pruned`` (stopped by ASHA; ``tested`` once its best
    checkpoint was tested at the study's end), ``failed``, ``running``, or ``stopped`` (interrupted, or stopped by
    Tune's time budget). A method without any trial (deferred by the plan) has no outcome: its reason is the plan's.
    ``analysis.results.Trial`` is one, with its study beside it.
    """

    record: dict[str, Any]

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    @property
    def status(self) -> str:
        """MLflow's run status: FINISHED, KILLED, FAILED, RUNNING."""
        return self.record["status"]

    @property
    def tags(self) -> dict[str, str]:
        return self.record["tags"]

    @property
    def metrics(self) -> dict[str, float]:
        return self.record["metrics"]

    @property
    def tested(self) -> bool:
        """Whether its kept model was tested (a finished trial, or a pruned one tested on its best checkpoint)."""
        return reached_test(self.metrics)

    @property
    def finished(self) -> bool:
        """Ended on its own and tested: a candidate for its method's best."""
        return self.status == "FINISHED" and self.tested

    @property
    def trained(self) -> bool:
        """Validated at least one epoch (its curve can be shown)."""
        return any(key.startswith("val/") for key in self.metrics)

    @property
    def is_repeat(self) -> bool:
        """A repeat of a chosen configuration on another seed (``--seeds``): never a candidate itself."""
        return REPEATS_TAG in self.tags

    @property
    def state(self) -> str:
        if self.finished:
            return FINISHED
        if self.status == "FAILED":
            return FAILED
        if self.tags.get(OUTCOME_TAG, "").startswith(PRUNED):
            return PRUNED_STATE
        return RUNNING if self.status == "RUNNING" else STOPPED

    @property
    def reason(self) -> str:
        """How it ended, in words: its outcome tag (a failed trial's error where it has one), else its status."""
        if self.state == FAILED:
            return self.tags.get(ERROR_TAG) or self.tags.get(OUTCOME_TAG, "unknown error")
        return self.tags.get(OUTCOME_TAG, self.status.lower())

    @property
    def started(self) -> float:
        return self.record.get("start_time") or 0

    def test(self, metric: str, rule: str | None = None, selection: Selection | None = None) -> float | None:
        """Test ``metric`` (``ndcg_at_10`` or ``test/ndcg_at_10``) of the model kept by epoch ``rule`` (a validation
        metric, ``loss`` or ``last``; None or the trial's own rule, ``selection.rule``: the kept model's ``test/``)."""
        if rule is None or (selection is not None and rule == selection.rule):
            return self.metrics.get(f"test/{metric.removeprefix('test/')}")
        return self.metrics.get(test_by_key(rule, metric))


def best_of(candidates: Iterable[T], value: Callable[[T], float | None], started: Callable[[T], float]) -> T | None:
    """The candidate with the highest ``value`` (None: not a candidate); a tie goes to the one that started first (a
    tuned method's enqueued paper setting before the searcher's draws). The one tie rule."""
    ranked = [(v, -started(c), i, c) for i, c in enumerate(candidates) if (v := value(c)) is not None]
    return max(ranked, key=lambda entry: entry[:3])[3] if ranked else None


def best_trial(candidates: Iterable[T], selection: Selection, record: Callable[[T], dict[str, Any]]) -> T | None:
    """The best of ``candidates`` (each read through ``record``: its run record) by the study's ``selection``: the
    one choice by which the study's table, ``best``, the registered ``@best`` model, the parent run's answer,
    ``report`` and the grid name a method's best trial."""
    outcomes = [(Outcome(record(c)), c) for c in candidates]
    chosen = best_of(outcomes, lambda pair: selection.score(pair[0].metrics), lambda pair: pair[0].started)
    return chosen[1] if chosen else None
