"""Running one trial: in the calling Ray Tune trial actor (a study's one-worker trials), or as a Ray Train
``TorchTrainer`` job (``apao train``, data parallel over ``--num-workers``; a study's trials with
``--workers-per-trial`` > 1, driven from their Tune trial actor).

Both keep a trial's checkpoints under ``storage_path/name`` (``name`` from ``names.train_run_name``), where a
restarted or resumed trial finds them and the study's driver reads the final one.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import storage
from ...config import TrialConfig
from ...names import remove_scratch, scratch_prefix
from ...training.checkpoint import FINAL_METRICS_FILE
from ...training.failures import TrialFailedError
from ...training.worker import DATASET_FILES_KEY, train_in_tune_actor, train_loop_per_worker
from ..cluster.interrupt import stop_signals_end_the_run
from ..cluster.ray_cluster import RAY_TRAIN_LOG_LEVEL_ENV, WORKER_START_TIMEOUT_ENV, init_ray
from ...data.shipped import pack

if TYPE_CHECKING:  # Ray Train is imported where a TorchTrainer is made: a trial in Tune's actor does without it
    import ray.train
    from ray.train.torch import TorchTrainer

FAILURE_FILE = "trial_failure.txt"
# tries to start a trial's worker group before the trial fails (Ray's default is to try forever, and a
# worker group that cannot start on a loaded or too small machine then hangs the study)
MAX_START_RETRIES = 3
# a data-parallel study trial's Tune actor only drives its TorchTrainer (Ray 2.60's Train-in-Tune: the actor
# holds 1 CPU unless told otherwise, and 2 such trials starve their workers on 2 CPUs)
TRIAL_DRIVER_CPUS = 0.01
RAY_TRAIN_LOG_LEVEL = "WARNING"  # on the console; $APAO_RAY_TRAIN_LOG_LEVEL=INFO brings Ray Train's lines back
# what a trial's driver takes of the custom resource of --driver-resource: a node given 1 of it holds 100 drivers
DRIVER_RESOURCE_SHARE = 0.01


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
        """The reservation of a study's Tune trial actor: all of a one-worker trial, which it trains itself;
        a sliver for the driver of a data-parallel trial, whose Ray Train workers reserve their own
        (``for_ray_train``)."""
        if self.num_workers > 1:
            return {"cpu": TRIAL_DRIVER_CPUS}
        resources = {"cpu": self.cpus_per_worker, "gpu": self.gpus_per_worker}
        if self.memory_bytes:
            resources["memory"] = self.memory_bytes
        return resources

    @staticmethod
    def placement(reservation: dict[str, float], driver_resource: str | None = None) -> Any:
        """A Tune trial's placement group (one bundle) for ``reservation`` (``tune_resources``' keys: cpu, gpu,
        memory), with ``DRIVER_RESOURCE_SHARE`` of ``driver_resource`` where given: the trial's driver then runs
        only on nodes that carry it."""
        from ray import tune

        bundle = {"CPU": reservation.get("cpu", 0.0), "GPU": reservation.get("gpu", 0.0),
                  "memory": reservation.get("memory", 0.0)}
        if driver_resource:
            bundle[driver_resource] = DRIVER_RESOURCE_SHARE
        return tune.PlacementGroupFactory([bundle])

    def for_ray_train(self) -> "Resources":
        """A data-parallel study trial's workers: each gives up ``TRIAL_DRIVER_CPUS`` for its Tune driver, so
        that N workers and the driver fit the N x cpus_per_worker CPUs the plan counts (N 1-CPU workers on an
        N-CPU node)."""
        return replace(self, cpus_per_worker=self.cpus_per_worker - TRIAL_DRIVER_CPUS)

    def check_placeable(self, nodes: list[dict[str, float]], where: str) -> None:
        """Refuses workers that ``nodes`` (each node's total resources, Ray's names: CPU, GPU) cannot hold all
        at once: each worker on one node, several to a node where they fit.

        Raises:
            ValueError: naming the workers asked for, how many fit, and ``where`` (the cluster, this machine).
        """
        def fits(node: dict[str, float]) -> int:
            counts = [node.get("CPU", 0.0) // self.cpus_per_worker if self.cpus_per_worker else math.inf]
            if self.gpus_per_worker:
                counts.append(node.get("GPU", 0.0) // self.gpus_per_worker)
            return int(min(min(counts), self.num_workers))

        placeable = sum(fits(node) for node in nodes)
        if placeable < self.num_workers:
            gpus = f" and {self.gpus_per_worker:g} GPU" if self.gpus_per_worker else ""
            held = ", ".join(f"{node.get('CPU', 0):g} CPU" + (f" {node.get('GPU', 0):g} GPU" if self.gpus_per_worker
                                                               else "") for node in nodes)
            raise ValueError(f"--workers-per-trial {self.num_workers}: each worker needs {self.cpus_per_worker:g} CPU"
                             f"{gpus}, and {where} ({held or 'no nodes'}) can place {placeable} at once; lower "
                             "--workers-per-trial or --cpus-per-trial/--gpus-per-trial, or add nodes")

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
                     verbose: bool, progress_label: str, dataset_files: Any = None) -> dict[str, Any]:
    """What the process that trains a trial is given (training/worker.py reads it); ``storage_path`` a local
    directory or a URI (``storage``); ``dataset_files`` the dataset's files the driver ships (data/shipped.py), if
    any (an ObjectRef or the files)."""
    run_dir = storage.join(storage.absolute(storage_path), name)
    return {"trial": config.to_dict(), DATASET_FILES_KEY: dataset_files, "verbose": verbose,
            "progress_label": progress_label,
            "max_memory_bytes": resources.memory_bytes, "output_dir": run_dir,
            "failure_file": storage.join(run_dir, FAILURE_FILE),
            "cpus_per_worker": max(1, round(resources.cpus_per_worker)), "scratch_prefix": scratch_prefix(run_dir)}


def run_in_tune_actor(config: TrialConfig, *, name: str, storage_path: str | Path, resources: Resources,
                      progress_label: str = "", dataset_files: Any = None) -> dict[str, Any]:
    """Trains the trial in the calling Tune trial actor, reporting each epoch to Tune, and returns its final
    metrics. No Ray Train controller, worker group and their helper actors: 7.0 s of Ray machinery per trial
    instead of 30.5 s on 2 CPUs (benchmarks/bench_trial_overhead.py, RESULTS.md 2026-11-25). ``name`` must be
    stable across restarts, as for make_trainer.

    Raises TrialFailedError (also on each retry) when the trial failed for a reason its checkpoint would meet
    again; ``forget_failures`` lets a resume with --retry-failed run such trials again.
    """
    loop_config = make_loop_config(config, name=name, storage_path=storage_path, resources=resources,
                                   verbose=False, progress_label=progress_label, dataset_files=dataset_files)
    try:
        return train_in_tune_actor(loop_config)
    finally:  # what an earlier attempt, killed mid-way, left in the system temp directory
        remove_scratch(loop_config["output_dir"])


def run_in_ray_train(config: TrialConfig, *, name: str, storage_path: str | Path, resources: Resources,
                     progress_label: str = "", dataset_files: Any = None) -> None:
    """Trains a study's data-parallel trial (``resources.num_workers`` > 1) as a ``TorchTrainer`` driven from the
    calling Tune trial actor; rank 0's reports reach Tune through ``TuneReportCallback``. ``name`` as for
    make_trainer. A Tune retry or a resumed study continues from the run's newest checkpoint.

    Raises TrialFailedError / TrialStartError as ``fit``.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    trainer = make_trainer(config, name=name, storage_path=storage_path, resources=resources.for_ray_train(),
                           callbacks=[TuneReportCallback()], verbose=False, progress_label=progress_label,
                           dataset_files=dataset_files)
    fit(trainer)


def forget_failures(storage_path: str | Path) -> int:
    """Removes the failure records of the trials under ``storage_path`` so that they run again; returns how many."""
    runs = [run for run in storage.find(storage_path, "*") if storage.exists(storage.join(run, FAILURE_FILE))]
    for run in runs:
        storage.delete(storage.join(run, FAILURE_FILE))
    return len(runs)


def make_trainer(config: TrialConfig, *, name: str, storage_path: str | Path, resources: Resources,
                 max_failures: int = 0, callbacks: list[Any] | None = None, verbose: bool = True,
                 progress_label: str = "", dataset_files: Any = None) -> TorchTrainer:
    """Builds (does not run) the trial's ``TorchTrainer``.

    ``name`` must be stable across restarts (derive it from the Tune trial id, never a
    timestamp): Ray finds the run's checkpoints to resume from by (storage_path, name).
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    log_level = os.environ.get(RAY_TRAIN_LOG_LEVEL_ENV, RAY_TRAIN_LOG_LEVEL)
    loop_config = {**make_loop_config(config, name=name, storage_path=storage_path, resources=resources,
                                      verbose=verbose, progress_label=progress_label, dataset_files=dataset_files),
                   "ray_log_level": log_level}
    run_config = ray.train.RunConfig(
        name=name, storage_path=storage.absolute(storage_path),  # a URI: Ray Train uploads the checkpoints
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

    failure_file = trainer.train_loop_config["failure_file"]
    storage.delete(failure_file)  # from an earlier attempt of a resumed run
    try:
        result = trainer.fit()
    except ray.train.ControllerError as error:  # the worker group could not be (re)started, on every try
        raise TrialStartError(start_failure_message(trainer.run_config.name, error.controller_failure)) from error
    finally:  # what workers on this node left when killed mid-way (a restart, a stop)
        remove_scratch(trainer.train_loop_config["output_dir"])
    failure = storage.read_text(failure_file)
    if failure is not None:
        raise TrialFailedError(failure)
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


def run_single_trial(config: TrialConfig, *, name: str, storage_path: str | Path, address: str | None = None,
                     cpus_per_worker: int = 1, max_failures: int = 0, verbose: bool = True) -> dict[str, Any]:
    """Runs one trial as a TorchTrainer job and returns its final metrics; a stop signal raises
    ``cluster.interrupt.RunInterrupted`` (the run's checkpoints stay under ``storage_path/name``)."""
    import ray

    init_ray(address)
    resources = Resources(num_workers=config.train.num_workers, cpus_per_worker=cpus_per_worker,
                          gpus_per_worker=1.0 if config.train.use_gpu else 0.0)
    shipped = pack(config.data)  # the workers may run on nodes without the files: carried in Ray's object store
    trainer = make_trainer(config, name=name, storage_path=storage_path, resources=resources,
                           max_failures=max_failures, verbose=verbose,
                           dataset_files=None if shipped is None else ray.put(shipped))
    with stop_signals_end_the_run():  # raises RunInterrupted on SIGINT / SIGTERM
        return read_final_metrics(fit(trainer))
