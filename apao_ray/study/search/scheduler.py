"""Early stopping that never hides a method: ASHA within each (backbone, loss), baselines exempt.

One ASHA over every trial compared APAO trials with CE at the grace epoch, so with few trials every
APAO trial behind CE was stopped, and a method whose trials were all stopped vanished from the
result. Here each tuned (backbone, loss) has its own ASHA rungs (a trial is only ever compared with
its own method's trials), and baselines (nothing to tune, one trial each) run to the end without
entering any rung.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler

from ...names import read_reports
from ..record.outcomes import mark_pruned
from ..spec.space import is_baseline

# what the rungs count: every report of a trial (each epoch's and the final test one) carries its epoch
TIME_ATTR = "epoch"

def method_of(trial: Any) -> tuple[str, str]:
    return trial.config.get("backbone", "?"), trial.config.get("loss", "?")


class PerMethodASHA(FIFOScheduler):
    """ASHA per (backbone, loss); baselines always continue and are recorded in no rung.

    Args:
        metric, mode, max_t, grace_period, reduction_factor: as for ``ray.tune.schedulers.ASHAScheduler``;
            ``max_t`` and ``grace_period`` count epochs (the results' ``epoch``; ``max_t`` one past the last
            epoch, so that the last epoch's report is not taken for the end and stopped before its test).
            Not Tune's ``training_iteration``: it counts a trial's reports since it last started, so a trial
            resumed at epoch 15 reports iteration 1 and would meet the rungs again from the start.
        train_root: where the trials' runs write their reports (``names.read_reports``); a resumed study's
            trials are put back in their rungs from it as Tune adds them.
    """

    def __init__(self, metric: str, mode: str, max_t: int, grace_period: int, reduction_factor: float = 4,
                 train_root: str | Path | None = None) -> None:
        super().__init__()
        self._metric, self._mode = metric, mode
        self.train_root = train_root
        self.asha_options = dict(metric=metric, mode=mode, max_t=max_t, grace_period=min(grace_period, max_t),
                                 reduction_factor=reduction_factor)
        self.per_method: dict[tuple[str, str], ASHAScheduler] = {}

    def _asha(self, trial: Any) -> ASHAScheduler | None:
        if is_baseline(trial.config.get("loss", "")):
            return None
        key = method_of(trial)
        if key not in self.per_method:
            # time_attr here, not in asha_options: a study started before it, restored (Tune unpickles its
            # scheduler), counts epochs too
            self.per_method[key] = ASHAScheduler(time_attr=TIME_ATTR, **self.asha_options)
        return self.per_method[key]

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        asha = self._asha(trial)
        if asha is not None:
            asha.on_trial_add(tune_controller, trial)
            self._replay(asha, tune_controller, trial)

    def _replay(self, asha: ASHAScheduler, tune_controller: Any, trial: Any) -> None:
        """Puts back in the rungs what a resumed study's trial reported before the interruption (Tune saves
        no scheduler state): its epochs' results from ``train_root``, the stop decisions ignored (taken then)."""
        train_root = getattr(self, "train_root", None)  # None in a study pickled before it existed
        if train_root is None:
            return
        by_epoch = {int(r[TIME_ATTR]): r[self._metric] for r in read_reports(train_root, trial.trial_id)
                    if TIME_ATTR in r and self._metric in r and not r.get("done")}
        for epoch in sorted(by_epoch):
            asha.on_trial_result(tune_controller, trial, {TIME_ATTR: epoch, self._metric: by_epoch[epoch]})

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        asha = self._asha(trial)
        if asha is None:
            return TrialScheduler.CONTINUE
        decision = asha.on_trial_result(tune_controller, trial, result)
        if decision == TrialScheduler.STOP and not result.get("done"):
            mark_pruned(trial.trial_id, int(result[TIME_ATTR]))  # read by the MLflow and progress callbacks
        return decision

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        asha = self._asha(trial)
        if asha is not None:
            asha.on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        asha = self._asha(trial)
        if asha is not None:
            asha.on_trial_remove(tune_controller, trial)

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        asha = self._asha(trial)
        if asha is not None:
            asha.on_trial_error(tune_controller, trial)

    def debug_string(self) -> str:
        return "PerMethodASHA: " + "; ".join(f"{b}/{l}: {a.debug_string()}" for (b, l), a in self.per_method.items())
