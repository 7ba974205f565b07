"""Which epoch a trial keeps (``protocol.select_by``): a validation metric, or the lowest
validation loss as the released code's HF Trainer keeps (``metric_for_best_model`` = loss).

Every trial also follows the other selection rules (:func:`selection_rules`: the validation metric, the
validation loss, the last epoch) and tests each rule's epoch once at the end, so one run says whether a
comparison depends on how the epoch is chosen, everything else equal (``test_by/<rule>/<metric>``).

The validation loss here is the training objective of the epoch's loss (CE: mean token CE;
APAO: CE + beta * weighted prefix loss) averaged over the validation split, weighted by batch
size. The released code reads it from its last evaluation batch only; the mean is steadier.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..data import Dataset, iter_batches
from ..losses import sample_negatives
from ..losses.base import LossInputs
from ..models.base import label_log_probs
from ..names import LAST_RULE, LOSS_RULE, rule_name
from ..protocol import lower_is_better
from .precision import autocast


def selection_rules(metric: str) -> tuple[str, ...]:
    """The rules every trial records: its validation ``metric`` (the trial's --metric), the validation loss, the
    last epoch; each names what it keeps, as ``protocol.select_by`` does."""
    return (metric, LOSS_RULE, LAST_RULE)


def per_user_column(rule: str, metric: str) -> str:
    """``ndcg_at_10_by_val_loss``: a per-user test column at the epoch ``rule`` keeps."""
    return f"{metric}_by_{rule_name(rule)}"


def selection_score(metrics: dict[str, Any], select_by: str) -> float:
    """The number the kept epoch maximises: ``val/<select_by>``, negated for the loss.

    Raises:
        ValueError: ``val/<select_by>`` is not among the validation metrics, naming them.
    """
    key = f"val/{select_by}"
    if key not in metrics:
        known = sorted(k[len("val/"):] for k in metrics if k.startswith("val/"))
        raise ValueError(f"select_by={select_by!r}: no validation metric {key!r}; choose from {known}")
    value = float(metrics[key])
    return -value if lower_is_better(select_by) else value


@torch.inference_mode()
def validation_loss(model: nn.Module, loss_fn: Any, runner: Any, dataset: Dataset, indices: np.ndarray | None,
                    batch_size: int, reference: nn.Module | None = None) -> float:
    """Mean of ``loss_fn``'s objective over the validation split, in eval mode, no autograd, in the
    trial's precision.

    Negatives (pairwise / preference losses) come from a fixed generator, so every epoch is
    scored against the same ones. The loss's state (adaptive weights, which ``per_batch``
    recomputes per batch) is restored afterwards: validation never changes training.

    Args:
        runner: the trial's :class:`~apao_ray.training.steps.EpochRunner` (candidate labels).
        indices: the validation users (None: all).
        reference: the frozen reference model when the loss needs one.
    """
    saved_state = loss_fn.state_dict()
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(runner.config.train.seed * 1_000_003 + 99_991)
    total, count = torch.zeros((), dtype=torch.float64, device=runner.device), 0  # read once, at the end
    num_negatives = loss_fn.num_negatives
    try:
        for batch in iter_batches(dataset.catalog, dataset.splits["valid"], batch_size, indices=indices):
            # drawn from the host's targets before the batch moves: no device-to-host copy per batch
            negatives = sample_negatives(batch.target_sem, len(runner.sem_tokens), num_negatives, generator) \
                if num_negatives else None
            batch = batch.to(runner.device)
            candidates, nodes = runner.candidates_of(batch, negatives)
            with torch.inference_mode(), autocast(runner.config.train.precision, runner.device):
                logits = model(batch.history_ids, batch.history_mask, candidates)  # (B, C, T', V)
                ref_logp = None
                if reference is not None and loss_fn.needs_reference:
                    ref_logp = label_log_probs(reference(batch.history_ids, batch.history_mask, candidates),
                                               candidates)                            # (B, C, T')
                output = loss_fn(LossInputs(logits, candidates, nodes, ref_logp))
            total += output.loss.detach().to(torch.float64) * len(batch)
            count += len(batch)
    finally:
        loss_fn.load_state_dict(saved_state)
        model.train(was_training)
    return float(total) / max(count, 1)
