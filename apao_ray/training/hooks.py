"""How the training loop talks to whatever runs it: plain Python (tests, notebooks) or Ray.

The loop itself never imports Ray; ``training/worker.py`` provides the Ray versions (a trial in Ray Tune's
trial actor, a Ray Train worker).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import storage
from ..names import REPORTS_FILE
from .checkpoint import RESTARTS, check_checkpoint, latest_checkpoint_in


def append_report(run_dir: str | Path, metrics: dict[str, Any]) -> None:
    """Appends a report to the run's ``REPORTS_FILE`` (a resumed study's scheduler reads it back); ``run_dir``
    a local directory or a URI (``storage``)."""
    storage.append_text(storage.join(run_dir, REPORTS_FILE), json.dumps(metrics) + "\n")


class TrainingHooks:
    """Single-process defaults: CPU (or the given device), checkpoints under ``output_dir``."""

    def __init__(self, output_dir: str | Path, device: str | torch.device = "cpu", keep_checkpoints: int = 2,
                 resume: bool = True, verbose: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device)
        self.keep_checkpoints = keep_checkpoints
        self.resume = resume
        self.verbose = verbose
        self.reports: list[dict[str, Any]] = []

    rank = 0
    world_size = 1

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def restore_checkpoint(self) -> Path | None:
        return latest_checkpoint_in(self.output_dir / "checkpoints", self.warn, RESTARTS) if self.resume else None

    def new_checkpoint_dir(self, epoch: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"apao-ckpt-{epoch:04d}-"))

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is not None:
            root = self.output_dir / "checkpoints"
            root.mkdir(exist_ok=True)
            # the final checkpoint (best weights + test metrics) sorts after its last epoch's
            target = root / (f"epoch_{int(metrics['epoch']):04d}" + ("_final" if metrics.get("done") else ""))
            incoming = root / f".incoming-{target.name}"  # a move across filesystems copies: renamed when whole
            shutil.rmtree(incoming, ignore_errors=True)
            shutil.move(str(checkpoint_dir), incoming)
            check_checkpoint(incoming)  # verified where it was written before it takes an older one's place
            shutil.rmtree(target, ignore_errors=True)
            os.replace(incoming, target)
            for old in sorted(root.glob("epoch_*"))[:-self.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        # after the checkpoint is in place: whoever reads the report (a cohort's follower) finds it there
        append_report(self.output_dir, metrics)

    progress_label = ""  # set in a study: progress lines name their trial among the others'
    show_progress = True  # in-epoch progress lines even when not verbose (a study's trials)

    def log(self, line: str) -> None:
        if self.verbose and self.rank == 0:
            print(line, file=sys.stderr, flush=True)

    def warn(self, line: str) -> None:
        """A line printed whatever the verbosity (a checkpoint set aside): rank 0's, named as its progress."""
        if self.rank == 0:
            print(f"{self.progress_label}{line}", file=sys.stderr, flush=True)

    def progress(self, line: str) -> None:
        """An in-epoch progress line: printed when verbose, or in a study where the driver only hears of
        finished epochs (a long epoch would otherwise be silent for many minutes)."""
        if (self.verbose or self.show_progress) and self.rank == 0:
            print(f"{self.progress_label}{line}", file=sys.stderr, flush=True)
