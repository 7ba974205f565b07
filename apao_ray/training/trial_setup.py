"""A trial's set-up: its data, model, losses, optimizer and schedule per stage, and its state, built fresh or
resumed from its latest checkpoint. ``loop.TrialRun`` trains from it."""
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
from ..names import LAST_RULE, RESUMED_HISTORY_KEY
from ..protocol import check_select_by, decoding_scoring
from .checkpoint import FINAL_METRICS_FILE, load_checkpoint
from .cost import CostMeter
from .evaluation import select_users
from .failures import memory_errors_named
from .hooks import TrainingHooks
from .precision import resolve_precision
from .progress import EpochProgress
from .selection import selection_rules
from .steps import EpochRunner
from .system_metrics import SystemSampler
from .weights import frozen_copy, unwrap

CE_STAGE_PREFIX = "ce_stage/"  # a two-stage trial's CE epochs log train/ and val/ metrics under this prefix


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, with weight decay on matrices and embeddings only (SPEC §5)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]       # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.ndim < 2]     # norms
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int,
                  warmup_fraction: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_fraction`` of ``total_steps``, then cosine decay to 0 (SPEC §5)."""
    warmup = max(1, int(round(warmup_fraction * total_steps)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class TrialSetup:
    """One trial ready for its next epoch: built from its config, or resumed from its latest checkpoint.

    ``state`` is what its checkpoints keep of the selection (the epoch, the best value and epoch, the history,
    the stage, the other rules' best epochs); ``final`` is set when a resumed trial had already finished.
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
        self.optimizer, self.scheduler = self.stage_optimizer(self.stage)
        self.valid_users = select_users(len(dataset.splits["valid"]), train_cfg.eval_max_users, train_cfg.seed)
        check_select_by(config)
        self.select_by = config.protocol.select_by
        self.scoring = decoding_scoring(config)  # how this loss's model is decoded (MSL: valid children only)
        # the other selection rules' best epochs (the last epoch needs no tracking), from the main stage's first epoch
        self.others = others = [rule for rule in dict.fromkeys(selection_rules(train_cfg.metric))
                                if rule not in (self.select_by, LAST_RULE)]
        self.state: dict[str, Any] = {
            "epoch": 0, "best_value": -math.inf, "best_epoch": 0, "history": [], "stage": self.stage,
            "rules": {rule: {"best_value": -math.inf, "best_epoch": ce_epochs} for rule in others}}
        self.best_weights = copy.deepcopy(unwrap(self.model).state_dict())
        self.rule_weights: dict[str, Any] = {rule: self.best_weights for rule in others}
        self.reference: nn.Module | None = None
        self.resumed_after = 0  # the epoch this run continued from after an interruption (0: it never was)
        self.epoch_times: list[float] = []
        self.final: dict[str, Any] | None = None
        self._restore()
        self.started = time.perf_counter()
        self.system = SystemSampler(hooks.device)  # the machine's use per epoch: the run's System metrics

    def stops(self, epoch: int) -> bool:
        """Whether the trial ends after ``epoch``: the last one, or an early stop (the CE stage runs in full)."""
        train_cfg = self.config.train
        return epoch >= train_cfg.epochs or (self.stage == "main"
                                             and epoch - self.state["best_epoch"] >= train_cfg.patience)

    def stage_optimizer(self, stage: str) -> tuple[torch.optim.Optimizer, Any]:
        """Each stage has its own AdamW state and warmup + cosine schedule over its own epochs."""
        train_cfg = self.config.train
        num_epochs = self.ce_epochs if stage == "ce" else train_cfg.epochs - self.ce_epochs
        optimizer = build_optimizer(self.model, train_cfg.lr, train_cfg.weight_decay)
        return optimizer, warmup_cosine(optimizer, num_epochs * self.runner.optimizer_steps_per_epoch,
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
        unwrap(self.model).load_state_dict(saved["model"])
        self.stage = saved.get("stage", self.stage)
        self.optimizer, self.scheduler = self.stage_optimizer(self.stage)  # the saved stage's schedule, then its state
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
            self.reference = frozen_copy(unwrap(self.model), reference_weights)
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
