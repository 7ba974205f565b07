"""Progress lines inside a long epoch (a trial's epochs can take many minutes on a CPU)."""
from __future__ import annotations

import time

from .hooks import TrainingHooks


class EpochProgress:
    """Progress lines inside a long epoch: samples done, samples/s, ETA of the epoch and the trial.

    At most one line every ``interval`` seconds (the first after ``interval``), so short epochs
    print nothing extra and long ones are never silent for long.
    """

    def __init__(self, hooks: TrainingHooks, epoch: int, num_epochs: int, seconds_per_other_epoch: float | None,
                 interval: float = 60.0) -> None:
        self.hooks, self.epoch, self.num_epochs = hooks, epoch, num_epochs
        self.seconds_per_other_epoch = seconds_per_other_epoch
        self.interval = interval
        self.started = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval or done >= total:
            return
        self.last = now
        rate = done / (now - self.started)
        epoch_left = (total - done) / rate
        # later epochs take what this one is taking (validation included once measured)
        per_epoch = self.seconds_per_other_epoch or total / rate
        trial_left = epoch_left + (self.num_epochs - self.epoch) * per_epoch
        self.hooks.progress(f"epoch {self.epoch}/{self.num_epochs}: {done:,}/{total:,} samples, {rate:.0f} samples/s, "
                       f"epoch ETA {epoch_left / 60:.1f} min, trial ETA <= {trial_left / 60:.0f} min")
