"""A trial's epoch end, after its training: validation on rank 0, the kept epochs of every selection rule, the
checkpoint, the console line and the report (a barrier on Ray Train: every rank reports every epoch)."""
from __future__ import annotations

import copy
import math
import time
from typing import Any

import numpy as np
import torch

from ..names import DIAGNOSIS_PREFIX, PRECISION_KEY, RESUMED_HISTORY_KEY
from .checkpoint import save_checkpoint
from .evaluation import evaluate_split
from .failures import memory_errors_named
from .selection import selection_score, validation_loss
from .trial_setup import CE_STAGE_PREFIX, TrialSetup
from .weights import from_rank0, unwrap


def end_epoch(run: TrialSetup, train_metrics: dict[str, Any], train_seconds: float) -> None:
    """Validates ``run``'s model after the epoch's training (which took ``train_seconds``), keeps the epoch for
    each rule it is best by, saves the checkpoint and reports; the caller tests the kept epochs when it stops."""
    config, hooks, state, dataset = run.config, run.hooks, run.state, run.dataset
    train_cfg, stage, epoch = config.train, run.stage, run.next_epoch
    select_by, tensors, device = run.select_by, run.tensors, hooks.device
    select_key, rank_key = f"val/{select_by}", f"val/{train_cfg.metric}"
    loss_fn = run.ce_loss if stage == "ce" else run.main_loss
    model, reference = run.model, run.reference if loss_fn.needs_reference else None
    prefix = CE_STAGE_PREFIX if stage == "ce" else ""
    tick = time.perf_counter() - train_seconds  # as if the epoch's training had run just now
    run.runner.memory.release()  # the training phase's free blocks, before validation allocates its own
    metrics: dict[str, Any] = {"epoch": epoch, PRECISION_KEY: train_cfg.precision, **train_metrics}
    if run.resumed_after:
        metrics["train/resumed_after_epoch"] = run.resumed_after
    # lets a tracker fill what it missed
    report_history = epoch == run.resumed_after + 1 and run.resumed_after > 0
    if hooks.rank == 0:
        with memory_errors_named(config, "validating", epoch, loss_fn.num_negatives):
            metrics.update(evaluate_split(unwrap(model), dataset, "valid", tensors, train_cfg, device,
                                          run.valid_users, run.scoring))
            # always: the validation-loss rule is recorded whatever the trial selects by
            metrics["val/loss"] = validation_loss(unwrap(model), loss_fn, run.runner, dataset, run.valid_users,
                                                  train_cfg.eval_batch_size, reference)
            if train_cfg.test_every_epoch and stage == "main":  # diagnosis of validation vs test: nothing selects on it
                tested = evaluate_split(unwrap(model), dataset, "test", tensors,
                                        train_cfg.replace(retention_users=0), device, None, run.scoring)
                metrics.update({DIAGNOSIS_PREFIX + key: value for key, value in tested.items()})
    epoch_seconds = time.perf_counter() - tick
    run.runner.memory.release()
    run.epoch_times.append(epoch_seconds)
    value = selection_score(metrics, select_by) if hooks.rank == 0 else -math.inf  # larger is better
    _keep_best_epochs(run, metrics, value, epoch)
    state["epoch"] = epoch
    kept = metrics if state["best_epoch"] == epoch else {k.removeprefix(prefix): v for k, v in next(
        (h for h in state["history"] if h.get("epoch") == state["best_epoch"]), {}).items()}
    metrics.update({f"best/{key}": kept.get(key, -math.inf) for key in (select_key, rank_key)})
    metrics.update({
        "best/epoch": state["best_epoch"],
        "perf/epoch_seconds": epoch_seconds, "perf/train_seconds": train_seconds,
        "perf/samples_per_second": train_metrics["train/num_samples"] * hooks.world_size / train_seconds,
        "val/num_users_evaluated": (len(run.valid_users) if run.valid_users is not None
                                    else len(dataset.splits["valid"])),
        **run.system.sample(),
    })
    if prefix:  # best/ and perf/ stay unprefixed: Tune's scheduler reads best/ from every report
        metrics = {(prefix + k if k.startswith(("train/", "val/")) else k): v for k, v in metrics.items()}
    state["history"].append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    checkpoint_dir = None
    if hooks.rank == 0:
        checkpoint_dir = save_checkpoint(
            hooks.new_checkpoint_dir(epoch),
            {**state, "model": unwrap(model).state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "loss": run.main_loss.state_dict(),
             "torch_rng": torch.get_rng_state(), "cost": run.meter.totals(), "rule_weights": run.rule_weights},
            run.best_weights, config.to_dict(),
            run.reference.state_dict() if run.reference is not None else None)
    should_stop = run.stops(epoch) and epoch < train_cfg.epochs
    remaining = (train_cfg.epochs - epoch) * float(np.median(run.epoch_times))
    hooks.log(f"epoch {epoch}/{train_cfg.epochs} {prefix}loss {train_metrics['train/loss']:.4f} "
              f"{metrics['perf/samples_per_second']:.0f} samples/s | {select_key} "
              f"{metrics.get(prefix + select_key, value):.4f} "
              f"(best {metrics[f'best/{select_key}']:.4f} @ {state['best_epoch']}) | {epoch_seconds:.1f}s/epoch, "
              f"ETA <= {remaining / 60:.1f} min" + (" | early stop" if should_stop else ""))
    # barrier on Ray Train: every rank reports every epoch
    hooks.report({**metrics, RESUMED_HISTORY_KEY: state["history"][:-1]} if report_history else metrics,
                 checkpoint_dir)


def _keep_best_epochs(run: TrialSetup, metrics: dict[str, Any], value: float, epoch: int) -> None:
    """Keeps ``epoch``'s weights for the trial's rule (its selection ``value``) and each other rule it is best by
    (rank 0, which validated); then every rank learns the best epoch."""
    state, model = run.state, run.model
    if run.hooks.rank == 0 and value > state["best_value"]:
        state["best_value"], state["best_epoch"] = value, epoch
        run.best_weights = copy.deepcopy(unwrap(model).state_dict())
    if run.hooks.rank == 0 and run.stage == "main":
        for rule, kept_rule in state["rules"].items():
            if selection_score(metrics, rule) > kept_rule["best_value"]:
                kept_rule["best_value"], kept_rule["best_epoch"] = selection_score(metrics, rule), epoch
                run.rule_weights[rule] = run.best_weights if state["best_epoch"] == epoch else \
                    copy.deepcopy(unwrap(model).state_dict())
    # only rank 0 validates: every rank must know its best epoch, or early stopping stops the others alone
    state["best_epoch"] = from_rank0(state["best_epoch"])
