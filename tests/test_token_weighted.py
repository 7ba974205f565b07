"""losses/token_weighted.py: front-greater token weighting by hand on a tiny trie and against a slow float64
reference with explicit loops (no code shared with the package)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from apao_ray.config import LossConfig
from apao_ray.losses import build_loss
from apao_ray.losses.token_weighted import front_greater_weights, level_gains
from losses_helpers import T, catalog, grad, make_inputs, tiny_inputs  # noqa: F401 - catalog: a fixture


def ref_level_weights(cat):
    entropies = [0.0]
    for depth in range(1, T + 1):
        groups = Counter(tuple(c[:depth]) for c in cat.sem_codes)
        total = sum(groups.values())
        entropies.append(-sum(n / total * math.log2(n / total) for n in groups.values()))
    scores = [math.log1p(max(0.0, entropies[k] - entropies[k - 1])) for k in range(1, T + 1)]
    return [T * s / sum(scores) for s in scores]


def test_front_greater_weights_from_the_catalog_by_hand():
    cat, _ = tiny_inputs([0], [0.0, 0.0, 0.0])  # only level 2 splits the 3 IDs: all the information is there
    gains = level_gains(cat.tensors().leaf_prefix_nodes)
    torch.testing.assert_close(gains, torch.tensor([0.0, math.log2(3), 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(front_greater_weights(gains), torch.tensor([0.0, 4.0, 0.0, 0.0], dtype=torch.float64))
    assert front_greater_weights(torch.zeros(4)).tolist() == [1.0] * 4


@pytest.mark.parametrize("alpha", [1.0, 0.4])
def test_token_weighting_equals_the_reference_value_and_gradient(catalog, alpha):
    inputs = make_inputs(catalog, 5, 0, seed=12)
    loss_fn = build_loss(LossConfig(name="token_weighted").with_knobs({"front_alpha": alpha}), catalog.tensors())
    weights = [(1 - alpha) + alpha * w for w in ref_level_weights(catalog)]
    np.testing.assert_allclose(loss_fn.level_weights.numpy(), ref_level_weights(catalog), rtol=1e-6)
    logits, candidates = inputs.logits, inputs.candidates
    expected = -sum(weights[t] * (logits[b, 0, t, candidates[b, 0, t]] - torch.logsumexp(logits[b, 0, t], 0))
                    for b in range(5) for t in range(T)) / (5 * sum(weights))
    out = loss_fn(inputs)
    torch.testing.assert_close(out.loss, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad(out.loss, inputs), grad(expected, inputs), rtol=1e-6, atol=1e-7)
    assert ref_level_weights(catalog)[0] > ref_level_weights(catalog)[-1]  # front greater on this catalog
