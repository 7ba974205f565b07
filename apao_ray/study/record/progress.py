"""Concise study progress in the driver: one line per finished epoch and per finished trial."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from ray import tune

from ...names import PRUNED, TESTED_KEY, reached_test
from .outcomes import TERMINAL, describe, is_final_report, pruned_epoch
from ..spec.space import trial_choices


class ProgressCallback(tune.Callback):
    def __init__(self, metric: str, num_trials: int) -> None:
        self.metric, self.num_trials = metric, num_trials
        self.done: set[str] = set()
        self.started = time.time()

    def _line(self, text: str, trials: list) -> None:
        # a resumed study counts the trials it restored as finished
        self.done.update(t.trial_id for t in trials if t.status in TERMINAL)
        elapsed = (time.time() - self.started) / 60
        print(f"[{elapsed:6.1f} min | {len(self.done)}/{self.num_trials} trials done] {text}", file=sys.stderr, flush=True)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if is_final_report(result):
            return
        self._line(f"{describe(trial_choices(trial.config))} epoch {result.get('epoch')}: "
                   f"{self.metric} {result.get(self.metric, float('nan')):.4f}, "
                   f"{result.get('perf/samples_per_second', 0):.0f} samples/s", trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.done.add(trial.trial_id)
        last = trial.last_result or {}
        finished, epoch = reached_test(last), pruned_epoch(trial.trial_id)
        ending = f", test ndcg_at_10 {last[TESTED_KEY]:.4f}" if finished else \
            (f" ({PRUNED} {epoch}; tested on its best checkpoint at the end)" if epoch is not None else " (stopped)")
        self._line(f"{'finished' if finished else 'ended'} {describe(trial_choices(trial.config))}: "
                   f"{self.metric} {last.get(self.metric, float('nan')):.4f}" + ending, trials)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.done.add(trial.trial_id)
        self._line(f"FAILED {describe(trial_choices(trial.config))} (see MLflow tag apao.error)", trials)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """A trial whose process or node was lost, started again by Tune (--max-failures): it continues from its
        newest checkpoint, wherever Ray places it."""
        self._line(f"{describe(trial_choices(trial.config))} (trial {trial.trial_id}) {lost_how(trial)}: retry "
                   f"{trial.num_failures} of {trial.max_failures} (--max-failures), from its newest checkpoint", trials)


def lost_how(trial: Any) -> str:
    """How a trial's last attempt ended, in a few words, from the error Tune recorded for it."""
    error_file = getattr(trial, "error_file", None) or ""
    text = Path(error_file).read_text() if error_file and Path(error_file).exists() else ""
    last = text.rsplit("Failure # ", 1)[-1]
    if "node has died" in last or "NodeDiedError" in last:
        return "lost its Ray node"
    if "actor" in last.lower() and ("unavailable" in last or "died" in last):  # Ray's words when either is lost
        return "lost its process or its Ray node"
    lines = [line.strip() for line in last.splitlines() if "Error" in line]
    return f"failed ({lines[0][:200]})" if lines else "lost its process"
