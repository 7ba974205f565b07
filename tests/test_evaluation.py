"""The split's validation CE, taken from the beam search's own pass over the histories, against its definition."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apao_ray.config import ModelConfig, TrainConfig
from apao_ray.models import build_model
from apao_ray.training.evaluation import evaluate_split

from apao_ray.config import TINY_MODEL


@torch.inference_mode()
def split_ce_loss(model, dataset, split_name: str, batch_size: int, device: torch.device, indices,
                  precision: str = "fp32") -> float:
    """The validation CE by its definition: the split's targets teacher-forced in a pass of their own, mean
    token CE normalised in float32 (evaluate_split takes it from the beam search's encoding instead)."""
    from apao_ray.data import iter_batches
    from apao_ray.models.base import label_log_probs
    from apao_ray.training.precision import autocast

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in iter_batches(dataset.catalog, dataset.splits[split_name], batch_size, indices=indices):
        batch = batch.to(device)
        labels = batch.labels[:, None, :]                                                  # (B, 1, T)
        with autocast(precision, device):
            logits = model(batch.history_ids, batch.history_mask, labels)
        logp = label_log_probs(logits, labels)
        total += float(-logp.sum())
        count += logp.numel()
    model.train(was_training)
    return total / max(count, 1)


@pytest.mark.parametrize("backbone", ["tiger", "llama"])
@pytest.mark.parametrize("end_token", [False, True])
def test_the_splits_ce_taken_from_the_beam_search_is_the_teacher_forced_ce(synthetic, backbone, end_token):
    """The beam search's label log-probabilities reuse each chunk's encoding of the histories (chunks of 64 rows
    sorted by length, padding trimmed): user by user the same as a teacher-forced pass of their own over
    256-row batches; evaluate_split's loss_ce is their mean."""
    from dataclasses import replace as replace_fields

    from apao_ray.data import iter_batches
    from apao_ray.data.catalog import EOS_TOKEN
    from apao_ray.decoding import evaluate_per_user
    from apao_ray.decoding.scoring import VOCABULARY_SCORING
    from apao_ray.models.base import label_log_probs

    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=backbone, **TINY_MODEL), synthetic.catalog.vocab_size,
                        synthetic.catalog.num_levels)
    model.train()  # left as it was found
    cpu = torch.device("cpu")
    tensors = synthetic.catalog.tensors(cpu)
    train = TrainConfig(beam_size=5, topk=(5,), eval_batch_size=100, retention_users=0, precision="fp32")
    scoring = replace_fields(VOCABULARY_SCORING, end_token=EOS_TOKEN) if end_token else VOCABULARY_SCORING
    split = synthetic.splits["valid"]
    users = np.arange(0, len(split), 2)  # a subset, as eval_max_users selects
    # split order: rows of mixed lengths, which the beam sorts into chunks and puts back
    per_user = evaluate_per_user(model, iter_batches(synthetic.catalog, split, 100, indices=users), tensors, topk=(5,),
                                 beam_size=5, device=cpu, scoring=scoring, with_label_log_probs=True)
    with torch.inference_mode():
        model.eval()
        expected = {}
        for batch in iter_batches(synthetic.catalog, split, 256, indices=users):
            labels = batch.labels[:, None, :]
            logp = label_log_probs(model(batch.history_ids, batch.history_mask, labels), labels)[:, 0]
            expected.update(zip(batch.sample_index.tolist(), logp))
        model.train()
    got = dict(zip(per_user.sample_index.tolist(), per_user.label_log_probs))
    assert sorted(got) == sorted(expected) == sorted(users.tolist())
    torch.testing.assert_close(torch.stack([got[u] for u in sorted(got)]), torch.stack([expected[u] for u in sorted(got)]),
                               atol=1e-5, rtol=0)
    metrics = evaluate_split(model, synthetic, "valid", tensors, train, cpu, users, scoring)
    reference = split_ce_loss(model, synthetic, "valid", 256, cpu, users)
    assert metrics["val/loss_ce"] == pytest.approx(reference, abs=1e-5) and reference > 1.0
    assert model.training
