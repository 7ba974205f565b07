"""One trial's training loop (SPEC §5), with no Ray in it: train, validate, checkpoint,
early-stop, then test the best epoch once. ``TrainingHooks`` decide where it runs.

Determinism: the sample order, the negatives and dropout's random stream of epoch e are functions of
(seed, e) (and the rank: steps.py), so a run resumed from its epoch-e checkpoint continues exactly as an
uninterrupted one (same CPU, same thread count), on every data-parallel rank.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import LossConfig, TrialConfig
from ..data import Dataset, load_dataset
from ..losses import build_loss
from ..models import build_model
from ..names import DIAGNOSIS_PREFIX, PER_USER_FILE, PER_USER_VALID_FILE, PRECISION_KEY, RESUMED_HISTORY_KEY
from ..protocol import check_select_by, decoding_scoring
from ..rank_metrics import PER_USER_METRICS
from .checkpoint import (FINAL_METRICS_FILE, load_checkpoint, rule_model_file, save_catalog, save_checkpoint,
                         seal_checkpoint)
from .cost import CostMeter
from .failures import memory_errors_named
from .evaluation import evaluate_split, evaluate_split_per_user, select_users, tests_full_sort, write_per_user
from .hooks import TrainingHooks
from .precision import resolve_precision
from .progress import EpochProgress
from .selection import (LAST, per_user_column, rule_name, selection_rules, selection_score, test_by_key,
                        validation_loss)
from .steps import EpochRunner
from .system_metrics import SystemSampler


CE_STAGE_PREFIX = "ce_stage/"  # a two-stage trial's CE epochs log train/ and val/ metrics under this prefix


def _optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]       # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.ndim < 2]     # norms
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def _schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, int(round(warmup_fraction * total_steps)))

    def factor(step: int) -> float:  # linear warmup, then cosine decay to 0 (SPEC §5)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


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


class TrialRun:
    """One trial between its epochs: set up (or resumed from its latest checkpoint), then per epoch
    :meth:`begin_epoch`, its training (by :func:`run_trial`, or with other trials as one fused cohort:
    training/cohort.py), :meth:`end_epoch` (validation, selection, checkpoint, report, early stop), and once
    the last epoch or an early stop is reached the test of the kept epochs, whose metrics are ``final``.

    ``final`` is None while epochs remain; a run restored from a finished trial has it at once.
    """

    def __init__(self, config: TrialConfig, hooks: TrainingHooks, dataset: Dataset | None = None) -> None:
        # 'auto' becomes this worker's precision: recorded in the checkpoint, the reports and MLflow
        config = config.replace(train=config.train.replace(
            precision=resolve_precision(config.train.precision, hooks.device)))
        self.config, self.hooks = config, hooks
        train_cfg, loss_cfg = config.train, config.loss
        self.meter = CostMeter(hooks.device)  # wall, CPU seconds, peak memory, energy: setup and test included
        torch.manual_seed(train_cfg.seed)
        # never a download here, in a worker: the command that started the trial found the files (config.data.data_dir)
        self.dataset = dataset = dataset or load_dataset(config.data.dataset, config.data.data_dir,
                                                         config.data.max_history, config.data.synthetic_seed,
                                                         allow_download=False)
        catalog = dataset.catalog
        self.tensors = tensors = catalog.tensors(hooks.device)
        model = build_model(config.model, catalog.vocab_size, catalog.num_levels)
        self.main_loss = build_loss(loss_cfg, tensors)
        if self.main_loss.num_negatives >= catalog.num_semantic_ids:
            raise ValueError(f"num_negatives={self.main_loss.num_negatives} must be < the catalog's "
                             f"{catalog.num_semantic_ids} semantic IDs")
        self.ce_epochs = ce_epochs = loss_cfg.pretrain_ce_epochs
        if self.main_loss.needs_reference and ce_epochs == 0:
            raise ValueError(f"loss {loss_cfg.name!r} needs a CE stage first: set pretrain_ce_epochs >= 1")
        if ce_epochs >= train_cfg.epochs:
            raise ValueError(f"pretrain_ce_epochs={ce_epochs} leaves no epoch of {loss_cfg.name!r} within "
                             f"epochs={train_cfg.epochs}; allowed: 0 <= pretrain_ce_epochs < epochs")
        self.ce_loss = build_loss(LossConfig(name="ce"), tensors)
        self.model = hooks.prepare_model(model)
        self.runner = EpochRunner(config, dataset, tensors, hooks.device, hooks.rank, hooks.world_size)
        self.stage = "ce" if ce_epochs else "main"
        self.optimizer, self.scheduler = self._stage_optimizer(self.stage)
        self.valid_users = select_users(len(dataset.splits["valid"]), train_cfg.eval_max_users, train_cfg.seed)
        check_select_by(config)
        self.select_by = config.protocol.select_by
        self.scoring = decoding_scoring(config)  # how this loss's model is decoded (MSL: valid children only)
        # the other selection rules' best epochs (the last epoch needs no tracking), from the main stage's first epoch
        self.others = others = [rule for rule in dict.fromkeys(selection_rules(train_cfg.metric))
                                if rule not in (self.select_by, LAST)]
        self.state: dict[str, Any] = {
            "epoch": 0, "best_value": -math.inf, "best_epoch": 0, "history": [], "stage": self.stage,
            "rules": {rule: {"best_value": -math.inf, "best_epoch": ce_epochs} for rule in others}}
        self.best_weights = copy.deepcopy(_unwrap(self.model).state_dict())
        self.rule_weights: dict[str, Any] = {rule: self.best_weights for rule in others}
        self.reference: nn.Module | None = None
        self.resumed_after = 0  # the epoch this run continued from after an interruption (0: it never was)
        self.epoch_times: list[float] = []
        self.final: dict[str, Any] | None = None
        self._restore()
        self.started = time.perf_counter()
        self.system = SystemSampler(hooks.device)  # the machine's use per epoch: the run's System metrics
        if self.final is None and self.resumed_after and self._stops(self.resumed_after):
            self.final = self._finish()  # interrupted between its last epoch's checkpoint and its test

    def _stops(self, epoch: int) -> bool:
        """Whether the trial ends after ``epoch``: the last one, or an early stop (the CE stage runs in full)."""
        train_cfg = self.config.train
        return epoch >= train_cfg.epochs or (self.stage == "main"
                                             and epoch - self.state["best_epoch"] >= train_cfg.patience)

    def _stage_optimizer(self, stage: str) -> tuple[torch.optim.Optimizer, Any]:
        """Each stage has its own AdamW state and warmup + cosine schedule over its own epochs."""
        train_cfg = self.config.train
        num_epochs = self.ce_epochs if stage == "ce" else train_cfg.epochs - self.ce_epochs
        optimizer = _optimizer(self.model, train_cfg.lr, train_cfg.weight_decay)
        return optimizer, _schedule(optimizer, num_epochs * self.runner.optimizer_steps_per_epoch,
                                    train_cfg.warmup_fraction)

    def _restore(self) -> None:
        restored = self.hooks.restore_checkpoint()
        if restored is None:
            return
        if (restored / FINAL_METRICS_FILE).exists():  # finished before the interruption: re-report
            final = json.loads((restored / FINAL_METRICS_FILE).read_text())
            self.hooks.report({**final, RESUMED_HISTORY_KEY: load_checkpoint(restored)[0]["history"]}, None)
            self.final = final
            return
        saved, self.best_weights, reference_weights = load_checkpoint(restored)
        _unwrap(self.model).load_state_dict(saved["model"])
        self.stage = saved.get("stage", self.stage)
        self.optimizer, self.scheduler = self._stage_optimizer(self.stage)  # the saved stage's schedule, then its state
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.main_loss.load_state_dict(saved["loss"])
        torch.set_rng_state(saved["torch_rng"])
        # a checkpoint from before the rules were recorded: they follow from the resumed epoch on
        others = self.others
        rules = saved.get("rules") or {rule: {"best_value": -math.inf, "best_epoch": saved["epoch"]} for rule in others}
        self.rule_weights = saved.get("rule_weights") or {rule: copy.deepcopy(saved["model"]) for rule in others}
        self.state = {k: saved[k] for k in ("epoch", "best_value", "best_epoch", "history")}
        self.state.update({"stage": self.stage, "rules": rules,
                           **({"ce_best_epoch": saved["ce_best_epoch"]} if "ce_best_epoch" in saved else {})})
        if reference_weights is not None:
            self.reference = _frozen_copy(_unwrap(self.model), reference_weights)
        self.resumed_after = self.state["epoch"]
        self.meter.previous = saved.get("cost") or {}  # what the earlier segments of this trial cost
        self.hooks.log(f"resumed from {restored} after epoch {self.resumed_after}")

    @property
    def next_epoch(self) -> int:
        return self.state["epoch"] + 1

    def memory_errors_named(self, doing: str, epoch: int, loss_fn: Any) -> contextlib.AbstractContextManager:
        return memory_errors_named(self.config, doing, epoch, loss_fn.num_negatives)

    def progress(self, epoch: int) -> EpochProgress:
        times = self.epoch_times
        return EpochProgress(self.hooks, epoch, self.config.train.epochs, float(np.median(times)) if times else None)

    def begin_epoch(self) -> tuple[int, Any, nn.Module | None]:
        """The next epoch, the loss it trains and the frozen reference that loss reads (or None)."""
        epoch, state = self.next_epoch, self.state
        if self.stage == "ce" and epoch > self.ce_epochs:
            # the second stage starts from the best CE epoch, with a fresh optimizer and schedule,
            # a frozen reference copied from that epoch, and its own best-epoch selection
            self.stage = state["stage"] = "main"
            _unwrap(self.model).load_state_dict(self.best_weights)
            _broadcast_from_rank0(self.model)  # only rank 0 knows the best CE epoch
            state["ce_best_epoch"] = state["best_epoch"]
            state["best_value"], state["best_epoch"] = -math.inf, self.ce_epochs  # patience counts from here
            state["rules"] = {rule: {"best_value": -math.inf, "best_epoch": self.ce_epochs} for rule in self.others}
            self.rule_weights = {rule: self.best_weights for rule in self.others}
            self.reference = (_frozen_copy(_unwrap(self.model), _unwrap(self.model).state_dict())
                              if self.main_loss.needs_reference else None)
            self.optimizer, self.scheduler = self._stage_optimizer(self.stage)
        loss_fn = self.ce_loss if self.stage == "ce" else self.main_loss
        return epoch, loss_fn, self.reference if loss_fn.needs_reference else None

    def end_epoch(self, train_metrics: dict[str, Any], train_seconds: float) -> None:
        """After the epoch's training (which took ``train_seconds``): validation, the kept epochs, the
        checkpoint and the report; then, at the last epoch or an early stop, :meth:`_finish`."""
        config, hooks, state, dataset = self.config, self.hooks, self.state, self.dataset
        train_cfg, stage, epoch = config.train, self.stage, self.next_epoch
        select_by, tensors, device = self.select_by, self.tensors, hooks.device
        select_key, rank_key = f"val/{select_by}", f"val/{train_cfg.metric}"
        loss_fn = self.ce_loss if stage == "ce" else self.main_loss
        model, reference = self.model, self.reference if loss_fn.needs_reference else None
        prefix = CE_STAGE_PREFIX if stage == "ce" else ""
        tick = time.perf_counter() - train_seconds  # as if the epoch's training had run just now
        self.runner.memory.release()  # the training phase's free blocks, before validation allocates its own
        metrics: dict[str, Any] = {"epoch": epoch, PRECISION_KEY: train_cfg.precision, **train_metrics}
        if self.resumed_after:
            metrics["train/resumed_after_epoch"] = self.resumed_after
        # lets a tracker fill what it missed
        report_history = epoch == self.resumed_after + 1 and self.resumed_after > 0
        if hooks.rank == 0:
            with memory_errors_named(config, "validating", epoch, loss_fn.num_negatives):
                metrics.update(evaluate_split(_unwrap(model), dataset, "valid", tensors, train_cfg, device,
                                              self.valid_users, self.scoring))
                # always: the validation-loss rule is recorded whatever the trial selects by
                metrics["val/loss"] = validation_loss(_unwrap(model), loss_fn, self.runner, dataset, self.valid_users,
                                                      train_cfg.eval_batch_size, reference)
                if train_cfg.test_every_epoch and stage == "main":  # diagnosis of validation vs test: nothing selects on it
                    tested = evaluate_split(_unwrap(model), dataset, "test", tensors,
                                            train_cfg.replace(retention_users=0), device, None, self.scoring)
                    metrics.update({DIAGNOSIS_PREFIX + key: value for key, value in tested.items()})
        epoch_seconds = time.perf_counter() - tick
        self.runner.memory.release()
        self.epoch_times.append(epoch_seconds)
        value = selection_score(metrics, select_by) if hooks.rank == 0 else -math.inf  # larger is better
        if hooks.rank == 0 and value > state["best_value"]:
            state["best_value"], state["best_epoch"] = value, epoch
            self.best_weights = copy.deepcopy(_unwrap(model).state_dict())
        if hooks.rank == 0 and stage == "main":
            for rule, kept_rule in state["rules"].items():
                if selection_score(metrics, rule) > kept_rule["best_value"]:
                    kept_rule["best_value"], kept_rule["best_epoch"] = selection_score(metrics, rule), epoch
                    self.rule_weights[rule] = self.best_weights if state["best_epoch"] == epoch else \
                        copy.deepcopy(_unwrap(model).state_dict())
        # only rank 0 validates: every rank must know its best epoch, or early stopping stops the others alone
        state["best_epoch"] = _from_rank0(state["best_epoch"])
        state["epoch"] = epoch
        kept = metrics if state["best_epoch"] == epoch else {k.removeprefix(prefix): v for k, v in next(
            (h for h in state["history"] if h.get("epoch") == state["best_epoch"]), {}).items()}
        metrics.update({f"best/{key}": kept.get(key, -math.inf) for key in (select_key, rank_key)})
        metrics.update({
            "best/epoch": state["best_epoch"],
            "perf/epoch_seconds": epoch_seconds, "perf/train_seconds": train_seconds,
            "perf/samples_per_second": train_metrics["train/num_samples"] * hooks.world_size / train_seconds,
            "val/num_users_evaluated": (len(self.valid_users) if self.valid_users is not None
                                        else len(dataset.splits["valid"])),
            **self.system.sample(),
        })
        if prefix:  # best/ and perf/ stay unprefixed: Tune's scheduler reads best/ from every report
            metrics = {(prefix + k if k.startswith(("train/", "val/")) else k): v for k, v in metrics.items()}
        state["history"].append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        checkpoint_dir = None
        if hooks.rank == 0:
            checkpoint_dir = save_checkpoint(
                hooks.new_checkpoint_dir(epoch),
                {**state, "model": _unwrap(model).state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "loss": self.main_loss.state_dict(),
                 "torch_rng": torch.get_rng_state(), "cost": self.meter.totals(), "rule_weights": self.rule_weights},
                self.best_weights, config.to_dict(),
                self.reference.state_dict() if self.reference is not None else None)
        should_stop = self._stops(epoch) and epoch < train_cfg.epochs
        remaining = (train_cfg.epochs - epoch) * float(np.median(self.epoch_times))
        hooks.log(f"epoch {epoch}/{train_cfg.epochs} {prefix}loss {train_metrics['train/loss']:.4f} "
                  f"{metrics['perf/samples_per_second']:.0f} samples/s | {select_key} "
                  f"{metrics.get(prefix + select_key, value):.4f} "
                  f"(best {metrics[f'best/{select_key}']:.4f} @ {state['best_epoch']}) | {epoch_seconds:.1f}s/epoch, "
                  f"ETA <= {remaining / 60:.1f} min" + (" | early stop" if should_stop else ""))
        # barrier on Ray Train: every rank reports every epoch
        hooks.report({**metrics, RESUMED_HISTORY_KEY: state["history"][:-1]} if report_history else metrics,
                     checkpoint_dir)
        if self._stops(epoch):
            self.final = self._finish()

    def _finish(self) -> dict[str, Any]:
        """Tests the kept epochs' models, writes the final checkpoint and reports the final metrics."""
        config, hooks, state, dataset = self.config, self.hooks, self.state, self.dataset
        train_cfg, model, tensors, device = config.train, self.model, self.tensors, hooks.device
        final: dict[str, Any] = dict(state["history"][-1]) if state["history"] else {}
        if "ce_best_epoch" in state:
            final[f"{CE_STAGE_PREFIX}best/epoch"] = state["ce_best_epoch"]
        final.update({"epochs_trained": state["epoch"], "best/epoch": state["best_epoch"],
                      PRECISION_KEY: train_cfg.precision, "perf/total_seconds": time.perf_counter() - self.started,
                      "done": True})
        if hooks.rank != 0:
            self.meter.stop()
            hooks.report(final, None)
            return final
        best_weights, others = self.best_weights, self.others
        last_weights = copy.deepcopy(_unwrap(model).state_dict())  # the model's own tensors change below
        kept = {self.select_by: (state["best_epoch"], best_weights), LAST: (state["epoch"], last_weights),
                **{rule: (state["rules"][rule]["best_epoch"], self.rule_weights[rule]) for rule in others}}
        tested: dict[int, tuple[dict[str, float], dict[str, Any]]] = {}  # epoch -> its test metrics, per-user table
        for rule, (rule_epoch, weights) in kept.items():  # the trial's own rule first: the model it keeps
            if rule_epoch not in tested:
                _unwrap(model).load_state_dict(weights)
                # the kept model alone is also ranked by the full sort, where that is cheap (tests_full_sort)
                tested[rule_epoch] = evaluate_split_per_user(
                    _unwrap(model), dataset, "test", tensors, train_cfg, device, None, self.scoring,
                    full_sort=not tested and tests_full_sort(train_cfg, device))
            final[test_by_key(rule, "epoch")] = rule_epoch
            final.update({test_by_key(rule, key): value for key, value in tested[rule_epoch][0].items()})
        _unwrap(model).load_state_dict(best_weights)
        test_metrics, per_user = tested[state["best_epoch"]]
        per_user = {**per_user, **{per_user_column(rule, column): tested[rule_epoch][1][column]
                                   for rule, (rule_epoch, _) in kept.items()
                                   for column in per_user if column in PER_USER_METRICS}}
        final.update(test_metrics)
        # the kept model's validation per user (the users selection saw): its means are the kept epoch's
        _, valid_per_user = evaluate_split_per_user(_unwrap(model), dataset, "valid", tensors, train_cfg, device,
                                                    self.valid_users, self.scoring)
        final.update(self.meter.stop())  # the test and validation passes included
        final_dir = hooks.new_checkpoint_dir(state["epoch"])
        save_checkpoint(final_dir, {**state, "model": best_weights}, best_weights, config.to_dict())
        for rule, (_, weights) in kept.items():  # each other rule's model, loadable by its name (rule_checkpoint)
            if rule != self.select_by:
                torch.save(weights, final_dir / rule_model_file(rule_name(rule)))
        write_per_user(final_dir / PER_USER_FILE, per_user)  # the paired significance tests read it
        write_per_user(final_dir / PER_USER_VALID_FILE, valid_per_user)
        save_catalog(final_dir, dataset.catalog.item_ids, dataset.catalog.item_codes)
        (final_dir / FINAL_METRICS_FILE).write_text(json.dumps(final, indent=2, sort_keys=True))
        seal_checkpoint(final_dir)  # the manifest again, last: the files added since save_checkpoint
        # a resumed run may have trained nothing new: its history goes with the final report too
        hooks.report({**final, RESUMED_HISTORY_KEY: state["history"]} if self.resumed_after else final, final_dir)
        return final


def _from_rank0(value: int) -> int:
    """Rank 0's ``value`` on every data-parallel rank (``value`` itself in one process); a collective."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.long)  # gloo; under NCCL the process group's device is needed
    if torch.distributed.get_backend() == "nccl":
        tensor = tensor.cuda()
    torch.distributed.broadcast(tensor, src=0)
    return int(tensor.item())


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Copies rank 0's weights to every data-parallel rank (no-op in one process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for tensor in _unwrap(model).state_dict().values():  # views of the parameters and buffers
            torch.distributed.broadcast(tensor, src=0)


def _frozen_copy(model: nn.Module, weights: dict[str, Any]) -> nn.Module:
    reference = copy.deepcopy(model)
    reference.load_state_dict(weights)
    reference.eval().requires_grad_(False)
    return reference
