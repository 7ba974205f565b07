"""One trial's training loop (SPEC §5), with no Ray in it: train, validate, checkpoint,
early-stop, then test the best epoch once. ``TrainingHooks`` decide where it runs.

Determinism: the sample order, the negatives and dropout's random stream of epoch e are functions of
(seed, e) (and the rank: steps.py), so a run resumed from its epoch-e checkpoint continues exactly as an
uninterrupted one (same CPU, same thread count), on every data-parallel rank.
"""
from __future__ import annotations

import math
import time
from typing import Any

from torch import nn

from ..config import TrialConfig
from ..data import Dataset
from .epoch_end import end_epoch
from .final_test import finish
from .hooks import TrainingHooks
from .trial_setup import TrialSetup
from .weights import broadcast_from_rank0, frozen_copy, unwrap


def run_trial(config: TrialConfig, hooks: TrainingHooks, dataset: Dataset | None = None) -> dict[str, Any]:
    """Trains one trial to the end (or early stop) and returns its final metrics (incl. test/*)."""
    run = TrialRun(config, hooks, dataset)
    while run.final is None:
        epoch, loss_fn, reference = run.begin_epoch()
        tick = time.perf_counter()
        with run.memory_errors_named("training", epoch, loss_fn):
            train_metrics = run.runner.train_epoch(epoch, run.model, loss_fn, run.optimizer, run.scheduler,
                                                   reference, run.progress(epoch))
        run.end_epoch(train_metrics, time.perf_counter() - tick)
    return run.final


class TrialRun(TrialSetup):
    """One trial between its epochs: set up (or resumed from its latest checkpoint: trial_setup.py), then per
    epoch :meth:`begin_epoch`, its training (by :func:`run_trial`, or with other trials as one fused cohort:
    training/cohort.py), :meth:`end_epoch` (validation, selection, checkpoint, report: epoch_end.py), and once
    the last epoch or an early stop is reached the test of the kept epochs (final_test.py), whose metrics are
    ``final``.

    ``final`` is None while epochs remain; a run restored from a finished trial has it at once.
    """

    def __init__(self, config: TrialConfig, hooks: TrainingHooks, dataset: Dataset | None = None) -> None:
        super().__init__(config, hooks, dataset)
        if self.final is None and self.resumed_after and self.stops(self.resumed_after):
            self.final = finish(self)  # interrupted between its last epoch's checkpoint and its test

    def begin_epoch(self) -> tuple[int, Any, nn.Module | None]:
        """The next epoch, the loss it trains and the frozen reference that loss reads (or None)."""
        epoch, state = self.next_epoch, self.state
        if self.stage == "ce" and epoch > self.ce_epochs:
            # the second stage starts from the best CE epoch, with a fresh optimizer and schedule,
            # a frozen reference copied from that epoch, and its own best-epoch selection
            self.stage = state["stage"] = "main"
            unwrap(self.model).load_state_dict(self.best_weights)
            broadcast_from_rank0(self.model)  # only rank 0 knows the best CE epoch
            state["ce_best_epoch"] = state["best_epoch"]
            state["best_value"], state["best_epoch"] = -math.inf, self.ce_epochs  # patience counts from here
            state["rules"] = {rule: {"best_value": -math.inf, "best_epoch": self.ce_epochs} for rule in self.others}
            self.rule_weights = {rule: self.best_weights for rule in self.others}
            self.reference = (frozen_copy(unwrap(self.model), unwrap(self.model).state_dict())
                              if self.main_loss.needs_reference else None)
            self.optimizer, self.scheduler = self.stage_optimizer(self.stage)
        loss_fn = self.ce_loss if self.stage == "ce" else self.main_loss
        return epoch, loss_fn, self.reference if loss_fn.needs_reference else None

    def end_epoch(self, train_metrics: dict[str, Any], train_seconds: float) -> None:
        """After the epoch's training (which took ``train_seconds``): validation, the kept epochs, the
        checkpoint and the report; then, at the last epoch or an early stop, the test of the kept epochs."""
        end_epoch(self, train_metrics, train_seconds)
        if self.stops(self.state["epoch"]):
            self.final = finish(self)
