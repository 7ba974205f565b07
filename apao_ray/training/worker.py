"""The training loop run inside Ray, two ways: a study's trial in Ray Tune's own trial actor (one worker:
``train_in_tune_actor``), or a Ray Train worker of a ``TorchTrainer`` (``apao train``, data parallel with
``--num-workers``: ``train_loop_per_worker``). Both set the worker up the same way (``setup_worker``)."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
from torch import nn

from .. import storage
from ..config import TrialConfig
from ..data import Dataset
from ..data.shipped import load_trial_dataset
from ..names import ALLOCATOR_KEY, SCRATCH_PREFIX, WORKER_NODE_KEY
from .checkpoint import (RESTARTS, SET_ASIDE_FILE, check_checkpoint, checkpoints_in, is_set_aside, newest_loadable,
                         with_storage_retries)
from .cohort import run_cohort
from .hooks import TrainingHooks, append_report
from .failures import TrialFailedError, failures_left, leave_failure, stops_for_good
from .loop import run_trial
from .memory import MemoryCap, allocator_in_use


def worker_facts(node_id: str) -> dict[str, Any]:
    """What every report of a trial run in Ray carries for the record: the thread pools it really ran on
    (see limit_threads), its node and its memory allocator."""
    return {"perf/torch_threads": torch.get_num_threads(), "perf/torch_interop_threads": torch.get_num_interop_threads(),
            WORKER_NODE_KEY: node_id, ALLOCATOR_KEY: allocator_in_use()}


class ScratchCheckpoints:
    """Hooks of a trial run in Ray: new checkpoints are written in a scratch directory of this node's system temp
    directory (named from ``scratch_prefix``, so the driver can remove what a killed worker left) and moved or
    uploaded from there; ``close`` removes it.

    A run directory on an object store (a URI, ``storage``) is trained in a local copy in the scratch directory:
    copied from the store when the trial starts (the checkpoints a restarted trial continues from, its reports),
    mirrored back after each report, before anyone hears of it (``_mirrored``)."""

    remote_dir: str | None = None

    def _open_scratch(self, scratch_prefix: str) -> None:
        self._scratch = Path(tempfile.mkdtemp(prefix=scratch_prefix))
        self.node_id = ray.get_runtime_context().get_node_id()  # where the trial trained, for the record

    def _local_run_dir(self, output_dir: str | Path) -> str | Path:
        """Where the trial writes its run directory ``output_dir``: in place, or a copy of a remote one."""
        if not storage.is_remote(output_dir):
            return output_dir
        self.remote_dir = str(output_dir)
        local = with_storage_retries(lambda: storage.download(output_dir, self._scratch / "run"), self.remote_dir,
                                     "the trial's checkpoints", self.warn)
        self._synced = storage.file_stats(local)  # what the store holds already: not sent back unless rewritten
        return local

    def _mirrored(self) -> None:
        """Sends the run directory's new files to the store; an outage is waited out (``with_storage_retries``)."""
        if self.remote_dir is not None:
            with_storage_retries(lambda: storage.mirror(self.output_dir, self.remote_dir, self._synced),
                                 self.remote_dir, "the epoch's checkpoint", self.warn)

    def close(self) -> None:
        """Removes the scratch directory (restored checkpoint, checkpoints before upload)."""
        shutil.rmtree(self._scratch, ignore_errors=True)

    def new_checkpoint_dir(self, epoch: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"epoch_{epoch:04d}-", dir=self._scratch))


class TuneTrialHooks(ScratchCheckpoints, TrainingHooks):
    """A trial trained in Ray Tune's trial actor: checkpoints under ``output_dir/checkpoints`` (moved there whole
    from the scratch directory), every report to Tune. A restarted trial (Tune's retry after a crash, a resumed
    study) continues from the newest checkpoint there."""

    def __init__(self, output_dir: str | Path, device: torch.device, verbose: bool = True,
                 scratch_prefix: str = SCRATCH_PREFIX) -> None:
        self._open_scratch(scratch_prefix)
        super().__init__(self._local_run_dir(output_dir), device=device, keep_checkpoints=2, resume=True,
                         verbose=verbose)

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        from ray import tune  # lazy: Tune, only in a trial's Tune actor; Ray Train's workers never load it

        super().report(metrics, checkpoint_dir)  # the checkpoint is in place before Tune's callbacks hear of it
        self._mirrored()
        tune.report({**metrics, **worker_facts(self.node_id)})


class RayTrainHooks(ScratchCheckpoints, TrainingHooks):
    """Rank, device and DDP from Ray Train; checkpoints go to the run's storage via report."""

    def __init__(self, verbose: bool = True, scratch_prefix: str = SCRATCH_PREFIX,
                 run_dir: str | Path | None = None) -> None:
        import ray.train.torch  # lazy: a trial in Tune's actor does without Ray Train

        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.verbose = verbose
        self.reports: list[dict[str, Any]] = []
        # rank 0 appends its reports there (a study's record): a local directory or a URI (``storage``), never a
        # Path, which would turn s3://bucket into s3:/bucket
        self.run_dir = str(run_dir) if run_dir else None
        self._open_scratch(scratch_prefix)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch  # lazy: as in __init__

        return ray.train.torch.prepare_model(model)  # moves to the device; DDP when world_size > 1

    def restore_checkpoint(self) -> Path | None:
        """Ray's newest checkpoint of the run (set when Ray restarts it after a failure or a resume), else, when
        that does not load, the newest before it that does: rank 0 sets the damaged ones aside, saying so; the
        other ranks skip them and reach the same one."""
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        if checkpoint.filesystem.type_name != "local":  # remote storage: Ray's newest, downloaded and verified
            restored = Path(checkpoint.to_directory(str(self._scratch / "restored")))
            check_checkpoint(restored)
            return restored
        newest = Path(checkpoint.path)
        candidates = [path for path in checkpoints_in(newest.parent) if path.name <= newest.name]
        return newest_loadable(candidates, self.warn if self.rank == 0 else None, RESTARTS)

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        self.reports.append(dict(metrics))
        if self.run_dir is not None and self.rank == 0:
            append_report(self.run_dir, metrics)
        name = f"epoch_{int(metrics['epoch']):04d}" + ("_final" if metrics.get("done") else "")
        place = storage.join(self.run_dir, name) if self.run_dir is not None else None
        if checkpoint_dir is not None and place is not None and is_set_aside(place):
            # Ray Train lists the set-aside checkpoint's place until it deletes it, and a new checkpoint of the
            # same name would go with it: an epoch's is left out (the next epoch's is written); the final one,
            # after which Ray deletes nothing, takes the place
            if metrics.get("done"):
                storage.delete(storage.join(place, SET_ASIDE_FILE))
            else:
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
                checkpoint_dir = None
        checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        # barrier: every rank calls report every epoch; only rank 0 passes a checkpoint
        ray.train.report({**metrics, **worker_facts(self.node_id)},
                         checkpoint=checkpoint,
                         checkpoint_dir_name=name if checkpoint else None,
                         delete_local_checkpoint_after_upload=checkpoint is not None)


THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def limit_threads(num_threads: int) -> None:
    """Keeps this worker's compute threads within the CPUs it reserved.

    torch defaults to one intra-op and one inter-op pool as large as the machine: two trials, or a
    trial beside other work, then run more busy threads than cores and each runs many times slower
    than its share (spinning OpenMP threads preempt each other). Both pools and the libraries that
    read the environment (OpenMP, MKL, OpenBLAS in any subprocess) get ``num_threads``.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads={num_threads} must be >= 1")
    for name in THREAD_ENV_VARS:
        os.environ[name] = str(num_threads)
    torch.set_num_threads(num_threads)
    if torch.get_num_interop_threads() != num_threads:
        try:  # torch allows it once, before any inter-op work has started in this process
            torch.set_num_interop_threads(num_threads)
        except RuntimeError:  # a reused worker process: the pool already exists and idles outside our work
            pass


def quiet_report_log(level: str) -> None:
    """Applies Ray Train's console log level to its "Reporting training result" line too: Ray 2.60 logs
    every report (with the whole metrics dict) at INFO under a logger named after its file's path, not
    ``ray.train.*``, so ``RunConfig(logging_config=...)`` misses it."""
    try:  # lazy: a private module of Ray 2.60 that another Ray may not have
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray: nothing to do
        return
    logging.getLogger(context.__file__).setLevel(level)


DATASET_FILES_KEY = "dataset_files"  # a loop config's dataset files shipped by the driver (data/shipped.py), if any


def trial_dataset(loop_config: dict[str, Any], config: TrialConfig) -> Dataset:
    """The dataset of the trial ``loop_config``: from this node's files, else from those the driver shipped (a
    ``ShippedFiles``, or an ObjectRef of one); a dataset found in neither fails naming the files and this node."""
    shipped = loop_config.get(DATASET_FILES_KEY)
    if isinstance(shipped, ray.ObjectRef):
        shipped = ray.get(shipped)
    return load_trial_dataset(config.data, shipped, node=ray.util.get_node_ip_address())


def setup_worker(loop_config: dict[str, Any]) -> MemoryCap | None:
    """Threads, warnings and memory cap of a process about to train a trial; returns the cap (None: none)."""
    limit_threads(int(loop_config.get("cpus_per_worker") or 1))
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    # after torch and Ray are loaded: the cap counts what the trial itself allocates (training/memory.py)
    return MemoryCap(int(loop_config["max_memory_bytes"])) if loop_config.get("max_memory_bytes") else None


def _start_in_tune_actor(loop_config: dict[str, Any]) -> tuple[MemoryCap | None, torch.device]:
    """Refuses a trial whose earlier attempt failed for good (its failure file), then sets the worker up;
    returns the memory cap and the device the trial trains on."""
    failure = storage.read_text(loop_config["failure_file"])
    if failure is not None:
        raise TrialFailedError(failure)
    cap = setup_worker(loop_config)
    use_gpu = TrialConfig.from_dict(loop_config["trial"]).train.use_gpu
    return cap, torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")


def _tune_hooks(cls: type[TuneTrialHooks], loop_config: dict[str, Any], device: torch.device) -> TuneTrialHooks:
    hooks = cls(loop_config["output_dir"], device, verbose=loop_config.get("verbose", True),
                scratch_prefix=loop_config.get("scratch_prefix", SCRATCH_PREFIX))
    hooks.progress_label = loop_config.get("progress_label", "")
    return hooks


def train_in_tune_actor(loop_config: dict[str, Any]) -> dict[str, Any]:
    """Trains a study's trial in the calling Ray Tune trial actor and returns its final metrics; ``loop_config``
    as for ``train_loop_per_worker`` plus ``output_dir`` (the trial's run directory).

    Raises TrialFailedError for a non-finite loss or running out of memory, and at once when an earlier attempt
    of this trial failed so (Tune retries a failed trial from its checkpoint; these would recur).
    """
    cap, device = _start_in_tune_actor(loop_config)
    hooks = _tune_hooks(TuneTrialHooks, loop_config, device)
    try:
        with failures_left([loop_config], cap):
            config = TrialConfig.from_dict(loop_config["trial"])
            return run_trial(config, hooks, trial_dataset(loop_config, config))
    finally:
        hooks.close()


class CohortMemberHooks(ScratchCheckpoints, TrainingHooks):
    """A cohort member trained by its leader's actor (training/cohort.py): checkpoints and reports into the
    member's own run directory, the worker's facts in every report, where the member's own Tune trial (a
    follower, study/run/cohorts.py) reads them and relays them to Tune."""

    def __init__(self, output_dir: str | Path, device: torch.device, scratch_prefix: str = SCRATCH_PREFIX) -> None:
        super().__init__(output_dir, device=device, keep_checkpoints=2, resume=True, verbose=False)
        self._open_scratch(scratch_prefix)

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        super().report({**metrics, **worker_facts(self.node_id)}, checkpoint_dir)


class LeaderHooks(TuneTrialHooks):
    """The leader's own member: reports to Tune as a trial does, but its final report waits for the cohort's
    end (``send_final``): Tune ends a trial, and kills its actor with the whole cohort, at a ``done`` report."""

    final: dict[str, Any] | None = None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        if not metrics.get("done"):
            return super().report(metrics, checkpoint_dir)
        TrainingHooks.report(self, metrics, checkpoint_dir)
        self.final = {**metrics, **worker_facts(self.node_id)}

    def send_final(self) -> None:
        from ray import tune

        if self.final is not None:
            tune.report(self.final)


def train_cohort_in_tune_actor(loop_configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trains a fused cohort (training/cohort.run_cohort) in the calling Tune trial actor, its leader's: each
    ``loop_configs`` entry is a member's, as for ``train_in_tune_actor``, the leader's first. Returns each
    member's final metrics.

    Raises TrialFailedError for a non-finite loss or running out of memory, leaving the reason to every member
    (the followers fail with it), and at once when an earlier attempt failed so.
    """
    cap, device = _start_in_tune_actor(loop_configs[0])
    leader = _tune_hooks(LeaderHooks, loop_configs[0], device)
    hooks = [leader, *(CohortMemberHooks(c["output_dir"], device, c.get("scratch_prefix", SCRATCH_PREFIX))
                       for c in loop_configs[1:])]
    try:
        with failures_left(loop_configs, cap):
            configs = [TrialConfig.from_dict(c["trial"]) for c in loop_configs]
            finals = run_cohort(configs, hooks, trial_dataset(loop_configs[0], configs[0]))
    finally:
        for member_hooks in hooks:
            member_hooks.close()
    leader.send_final()
    return finals


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point given to ``TorchTrainer``; ``loop_config = {"trial": TrialConfig dict, ...}``."""
    cap = setup_worker(loop_config)
    quiet_report_log(loop_config.get("ray_log_level", "INFO"))
    hooks = RayTrainHooks(verbose=loop_config.get("verbose", True),
                          scratch_prefix=loop_config.get("scratch_prefix", SCRATCH_PREFIX),
                          run_dir=loop_config.get("output_dir"))
    hooks.progress_label = loop_config.get("progress_label", "")
    try:
        config = TrialConfig.from_dict(loop_config["trial"])
        run_trial(config, hooks, trial_dataset(loop_config, config))
    except Exception as error:  # noqa: BLE001 - re-raised unless a restart would meet it again
        # ranks must stop together: a lone rank returning would stall the rest
        if not stops_for_good(error) or hooks.world_size > 1:
            raise
        # Ray Train restarts a worker after any exception (up to max_failures), and these would recur
        # from the checkpoint: end the run and leave the reason where the driver raises it once
        leave_failure(loop_config, error, cap)
    finally:  # the checkpoints were uploaded by report(): nothing in scratch is needed any more
        hooks.close()
