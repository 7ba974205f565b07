"""Validation/test of a model on one split: beam metrics, CE loss, beam retention."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..config import TrainConfig
from ..data import CatalogTensors, Dataset, iter_batches
from ..decoding import evaluate
from ..decoding.scoring import VOCABULARY_SCORING, StepScoring
from ..models.base import label_log_probs
from .precision import autocast, autocast_dtype


def select_users(num_samples: int, max_samples: int | None, seed: int) -> np.ndarray | None:
    """A fixed random subset (sorted) of ``max_samples`` sample indices, or None for all."""
    if max_samples is None or max_samples >= num_samples:
        return None
    return np.sort(np.random.default_rng([seed, 7919]).choice(num_samples, size=max_samples, replace=False))


@torch.inference_mode()
def split_ce_loss(model: nn.Module, dataset: Dataset, split_name: str, batch_size: int, device: torch.device,
                  indices: np.ndarray | None, precision: str = "fp32") -> float:
    """Mean token cross-entropy of the targets (the validation loss), normalised in float32."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in iter_batches(dataset.catalog, dataset.splits[split_name], batch_size, indices=indices):
        batch = batch.to(device)
        labels = batch.labels[:, None, :]                                                  # (B, 1, T)
        with autocast(precision, device):
            logits = model(batch.history_ids, batch.history_mask, labels)
        logp = label_log_probs(logits.float(), labels)
        total += float(-logp.sum())
        count += logp.numel()
    model.train(was_training)
    return total / max(count, 1)


def evaluate_split(model: nn.Module, dataset: Dataset, split_name: str, tensors: CatalogTensors,
                   train: TrainConfig, device: torch.device, indices: np.ndarray | None,
                   scoring: StepScoring = VOCABULARY_SCORING) -> dict[str, float]:
    """``{split}/recall_at_k``, ndcg, prefix recall and ``loss_ce`` on a user subset; beam retention
    (a full sort of every semantic ID for ``train.retention_users`` users: costly) on the test split,
    and on validation only when ``train.validate_retention``."""
    prefix = "val" if split_name == "valid" else split_name
    split = dataset.splits[split_name]
    topk = tuple(k for k in train.topk if k <= train.beam_size)
    # users sorted by history length: each batch pads to a similar length (the means do not depend on order)
    order = np.arange(len(split)) if indices is None else np.asarray(indices)
    order = order[np.argsort(split.history_lengths[order], kind="stable")]
    batches = iter_batches(dataset.catalog, split, train.eval_batch_size, indices=order)
    amp_dtype = autocast_dtype(train.precision)  # evaluation runs in the training precision
    metrics = evaluate(model, batches, tensors, topk=topk, beam_size=train.beam_size, device=device,
                       amp_dtype=amp_dtype, scoring=scoring)
    if train.retention_users and (split_name != "valid" or train.validate_retention):
        subset = select_users(len(split), train.retention_users, train.seed + 1)
        retention_batches = iter_batches(dataset.catalog, split, min(train.eval_batch_size, 64), indices=subset)
        retained = evaluate(model, retention_batches, tensors, topk=topk, beam_size=train.beam_size,
                            with_full_sort=True, device=device, amp_dtype=amp_dtype, scoring=scoring)
        metrics.update({k: v for k, v in retained.items() if k.startswith("beam_retention")})
    metrics["loss_ce"] = split_ce_loss(model, dataset, split_name, train.eval_batch_size, device, order,
                                       train.precision)
    return {f"{prefix}/{name}": float(value) for name, value in metrics.items()}
