"""Several trials of one backbone trained at once as one batched model: a fused cohort.

Each member is a whole trial (:class:`~.loop.TrialRun`): its own seed (initial weights, sample order,
negatives), loss and knobs, learning rate and schedule, AdamW state, adaptive APAO weights, validation,
kept epochs, early stop, checkpoints and reports through its own hooks, exactly as when it trains alone.
Only the training pass is shared: at every optimizer step the members' micro-batches run through
``models.fused.FusedModels`` (one kernel per operator for all members), and each member steps on its own
gradients (training/steps.train_members). A member that stops early leaves the cohort: the others go on
without it and it costs no more work. Resuming a cohort resumes every member from its own latest checkpoint;
members that had finished stay finished. A cohort interrupted between its members' checkpoints of one epoch
resumes with the members behind training that epoch alone (their dropout draws are then their solo trial's), then
all together again; one interrupted between epochs continues exactly as if it had not been.

What differs from solo trials: dropout draws (one generator for the cohort, seeded by the epoch and the
members' seeds, so a resumed cohort draws what the uninterrupted one did) and float rounding (batched
products, and on a CPU the padded history pass where a lone trial packs). tests/test_cohort.py bounds the
difference with dropout off.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from ..config import TrainConfig, TrialConfig
from ..data import Dataset
from ..models.fused import FusedModels
from .hooks import TrainingHooks
from .loop import TrialRun
from .steps import EpochMember, train_members

# what members of one cohort may set each their own; every other field of the trial config must agree
# (one architecture, one dataset, the same samples per micro-batch and step, one precision and protocol)
MEMBER_TRAIN_FIELDS = frozenset({"epochs", "lr", "weight_decay", "warmup_fraction", "patience", "metric", "seed",
                                 "group_by_length", "grad_clip", "beam_size", "eval_batch_size", "eval_max_users",
                                 "retention_users", "validate_retention", "full_sort_test", "test_every_epoch",
                                 "topk"})


def check_cohort(configs: Sequence[TrialConfig]) -> None:
    """Raises ValueError naming the first field that keeps these trials from training as one cohort."""
    if not configs:
        raise ValueError("a cohort needs at least one trial")
    first = configs[0]
    for index, config in enumerate(configs[1:], start=1):
        for section in ("data", "model", "protocol"):
            if getattr(config, section) != getattr(first, section):
                theirs, ours = getattr(config, section).to_dict(), getattr(first, section).to_dict()
                name = next(key for key in ours if ours[key] != theirs.get(key))
                raise ValueError(f"cohort member {index} has {section}.{name}={theirs.get(name)!r} where member 0 "
                                 f"has {ours[name]!r}: the members of a cohort share one {section} config")
        for item in dataclasses.fields(TrainConfig):
            if item.name not in MEMBER_TRAIN_FIELDS and getattr(config.train, item.name) != getattr(first.train,
                                                                                                   item.name):
                raise ValueError(f"cohort member {index} has train.{item.name}={getattr(config.train, item.name)!r} "
                                 f"where member 0 has {getattr(first.train, item.name)!r}; members may differ only "
                                 f"in {', '.join(sorted(MEMBER_TRAIN_FIELDS))}")
    for index, config in enumerate(configs):
        if config.loss.pretrain_ce_epochs or config.train.num_workers > 1:
            raise ValueError(f"cohort member {index} ({config.loss.name!r}, pretrain_ce_epochs="
                             f"{config.loss.pretrain_ce_epochs}, num_workers={config.train.num_workers}) cannot join a "
                             "cohort: a two-stage loss or a data-parallel trial trains alone")


def run_cohort(configs: Sequence[TrialConfig], hooks: Sequence[TrainingHooks],
               dataset: Dataset | None = None) -> list[dict[str, Any]]:
    """Trains the trials ``configs`` (each reporting through its ``hooks``) as one fused cohort; returns each
    one's final metrics, in order, as :func:`~.loop.run_trial` would."""
    check_cohort(configs)
    if len(hooks) != len(configs):
        raise ValueError(f"{len(configs)} cohort members but {len(hooks)} hooks")
    runs: list[TrialRun] = []
    for config, member_hooks in zip(configs, hooks):
        runs.append(TrialRun(config, member_hooks, dataset))
        dataset = runs[0].dataset  # loaded once
    while any(run.final is None for run in runs):
        # members resumed from checkpoints of different epochs: the ones behind catch up first
        epoch = min(run.next_epoch for run in runs if run.final is None)
        active = [run for run in runs if run.final is None and run.next_epoch == epoch]
        members = []
        for run in active:
            _, loss_fn, reference = run.begin_epoch()
            members.append(EpochMember(run.runner, run.model, loss_fn, run.optimizer, run.scheduler, reference))
        fused = FusedModels([run.model for run in active]) if len(active) > 1 else None
        tick = time.perf_counter()
        with active[0].memory_errors_named("training", epoch, members[0].loss_fn):
            if fused is None:  # a lone member trains as a trial does
                train_metrics = [active[0].runner.train_epoch(epoch, active[0].model, members[0].loss_fn,
                                                              active[0].optimizer, active[0].scheduler,
                                                              members[0].reference, active[0].progress(epoch))]
            else:
                train_metrics = train_members(epoch, members, fused, active[0].progress(epoch))
        train_seconds = time.perf_counter() - tick
        for run, metrics in zip(active, train_metrics):
            run.end_epoch({**metrics, "perf/cohort_members": len(active)}, train_seconds)
    return [run.final for run in runs]
