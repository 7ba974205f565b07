"""Running one trial: in the calling Ray Tune trial actor (a study's trials: one worker each), or as a Ray Train
``TorchTrainer`` job (``apao train``, data parallel over ``--num-workers``).

Both keep a trial's checkpoints under ``storage_path/name`` (``name`` from ``names.train_run_name``), where a
restarted or resumed trial finds them and the study's driver reads the final one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import TrialConfig
from ..names import remove_scratch, scratch_prefix
from ..training.checkpoint import FINAL_METRICS_FILE
from ..training.worker import TrialFailedError, train_in_tune_actor, train_loop_per_worker
from .runner import RAY_TRAIN_LOG_LEVEL_ENV, WORKER_START_TIMEOUT_ENV

if TYPE_CHECKING:  # Ray Train is imported where a TorchTrainer is made: a trial in Tune's actor does without it
    import ray.train
    from ray.train.torch import TorchTrainer

FAILURE_FILE = "trial_failure.txt"
# tries to start a trial's worker group before the trial fails (Ray's default is to try forever, and a
# worker group that cannot start on a loaded or too small machine then hangs the study)
MAX_START_RETRIES = 3
RAY_TRAIN_LOG_LEVEL = "WARNING"  # on the console; $APAO_RAY_TRAIN_LOG_LEVEL=INFO brings Ray Train's lines back


class TrialStartError(RuntimeError):
    """A trial's Ray Train workers could not be started (resources never freed, machine overloaded)."""


@dataclass(frozen=True)
class Resources:
    """Per-trial compute: workers (data parallel), CPUs, (fractional) GPUs and a memory cap per worker.

    ``memory_bytes`` is reserved in Ray's scheduling and enforced in the worker on what the trial allocates past
    the worker's start (training/memory.py MemoryCap).
    """

    num_workers: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    memory_bytes: int | None = None

    def tune_resources(self) -> dict[str, float]:
        """The reservation of a Tune trial actor that trains the trial itself (one worker)."""
        if self.num_workers != 1:
            raise ValueError(f"a trial trained in Tune's actor has one worker, not num_workers={self.num_workers}")
        resources = {"cpu": self.cpus_per_worker, "gpu": self.gpus_per_worker}
        if self.memory_bytes:
            resources["memory"] = self.memory_bytes
        return resources

    def scaling_config(self) -> ray.train.ScalingConfig:
        import ray.train

        resources: dict[str, float] = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            resources["GPU"] = self.gpus_per_worker
        if self.memory_bytes:
            resources["memory"] = self.memory_bytes
        return ray.train.ScalingConfig(num_workers=self.num_workers, use_gpu=self.gpus_per_worker > 0,
                                       resources_per_worker=resources)


def make_loop_config(config: TrialConfig, *, name: str, storage_path: str | Path, resources: Resources,
                     verbose: bool, progress_label: str) -> dict[str, Any]:
    """What the process that trains a trial is given (training/worker.py reads it)."""
    run_dir = Path(storage_path).resolve() / name
    return {"trial": config.to_dict(), "verbose": verbose, "progress_label": progress_label,
            "max_memory_bytes": resources.memory_bytes, "output_dir": str(run_dir),
            "failure_file": str(run_dir / FAILURE_FILE),
            "cpus_per_worker": max(1, round(resources.cpus_per_worker)), "scratch_prefix": scratch_prefix(name)}


def run_in_tune_actor(config: TrialConfig, *, name: str, storage_path: str | Path, resources: Resources,
                      progress_label: str = "") -> dict[str, Any]:
    """Trains the trial in the calling Tune trial actor, reporting each epoch to Tune, and returns its final
    metrics. No Ray Train controller, worker group and their helper actors: 7.0 s of Ray machinery per trial
    instead of 30.5 s on 2 CPUs (benchmarks/bench_trial_overhead.py, RESULTS.md session 14). ``name`` must be
    stable across restarts, as for make_trainer.

    Raises TrialFailedError (also on each retry) when the trial failed for a reason its checkpoint would meet
    again; ``forget_failures`` lets a resume with --retry-failed run such trials again.
    """
    loop_config = make_loop_config(config, name=name, storage_path=storage_path, resources=resources,
                                   verbose=False, progress_label=progress_label)
    try:
        return train_in_tune_actor(loop_config)
    finally:  # what an earlier attempt, killed mid-way, left in the system temp directory
        remove_scratch(name)


def forget_failures(storage_path: str | Path) -> int:
    """Removes the failure records of the trials under ``storage_path`` so that they run again; returns how many."""
    paths = list(Path(storage_path).glob(f"*/{FAILURE_FILE}"))
    for path in paths:
        path.unlink()
    return len(paths)


def make_trainer(config: TrialConfig, *, name: str, storage_path: str | Path, resources: Resources,
                 max_failures: int = 0, callbacks: list[Any] | None = None, verbose: bool = True,
                 progress_label: str = "") -> TorchTrainer:
    """Builds (does not run) the trial's ``TorchTrainer``.

    ``name`` must be stable across restarts (derive it from the Tune trial id, never a
    timestamp): Ray finds the run's checkpoints to resume from by (storage_path, name).
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    log_level = os.environ.get(RAY_TRAIN_LOG_LEVEL_ENV, RAY_TRAIN_LOG_LEVEL)
    loop_config = {**make_loop_config(config, name=name, storage_path=storage_path, resources=resources,
                                      verbose=verbose, progress_label=progress_label), "ray_log_level": log_level}
    run_config = ray.train.RunConfig(
        name=name, storage_path=str(Path(storage_path).resolve()),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        failure_config=ray.train.FailureConfig(max_failures=max_failures, controller_failure_limit=MAX_START_RETRIES),
        callbacks=callbacks or None,
        # Ray Train's own INFO lines (every report's whole metrics dict, each checkpoint, worker-group
        # start-up) would bury our progress lines; its session log files keep every level
        logging_config=ray.train.LoggingConfig(log_level=log_level),
    )
    return TorchTrainer(train_loop_per_worker, train_loop_config=loop_config,
                        scaling_config=resources.scaling_config(), run_config=run_config)


def start_failure_message(run_name: str, failure: BaseException) -> str:
    """Why a trial's workers could not be started, told as it happened: Ray Train gives up after
    ``MAX_START_RETRIES + 1`` failed starts, each a timeout (the machine too busy or too small) or a failure
    (e.g. workers killed by Ray's memory monitor while starting, which happens within seconds)."""
    cause = str(failure).split(". ")[0]
    timed_out = isinstance(failure, TimeoutError) or "Timeout" in type(failure).__name__
    each = f" of {os.environ.get(WORKER_START_TIMEOUT_ENV, '60')} s each" if timed_out else ""
    return (f"{run_name}: its Ray Train workers could not be started in {MAX_START_RETRIES + 1} tries{each} "
            f"(the last: {type(failure).__name__}: {cause}); free CPUs/memory on the machine, or lower --max-concurrent")


def fit(trainer: TorchTrainer) -> ray.train.Result:
    """Runs the trainer; raises TrialFailedError when its worker gave up for a deterministic reason
    (it leaves the reason in the run's ``failure_file``, next to the checkpoints)."""
    import ray.train

    path = Path(trainer.train_loop_config["failure_file"])
    path.unlink(missing_ok=True)  # from an earlier attempt of a resumed run
    try:
        result = trainer.fit()
    except ray.train.ControllerError as error:  # the worker group could not be (re)started, on every try
        raise TrialStartError(start_failure_message(trainer.run_config.name, error.controller_failure)) from error
    finally:  # what workers on this node left when killed mid-way (a restart, a stop)
        remove_scratch(trainer.run_config.name)
    if path.exists():
        raise TrialFailedError(path.read_text())
    return result


def read_final_metrics(result: ray.train.Result) -> dict[str, Any]:
    """Final metrics of a finished run: from its final checkpoint when present, else the last report."""
    checkpoint = result.checkpoint
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            path = Path(directory) / FINAL_METRICS_FILE
            if path.exists():
                return json.loads(path.read_text())
    return dict(result.metrics or {})
