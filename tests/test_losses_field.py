"""The field's losses (BEAR, front-greater token weighting) by hand on a tiny trie and against slow float64
references with explicit loops (no code shared with the package)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from apao_ray.config import LossConfig
from apao_ray.data.catalog import Catalog
from apao_ray.losses import LOSSES, LossInputs, build_loss
from apao_ray.losses.token_weighted import front_greater_weights, level_gains
from test_losses import T, catalog, grad, make_inputs  # noqa: F401  (catalog: the shared fixture)


def tiny_inputs(targets: list[int], level2: list[float]):
    """Items (0,0,0,0), (0,1,0,0), (0,2,0,0): only level 2 has a choice. Every row's logits are 0 except its
    level-2 logits over codes 0, 1, 2."""
    cat = Catalog.from_codes(["a", "b", "c"], np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0]]))
    logits = torch.zeros(len(targets), 1, T, cat.vocab_size, dtype=torch.float64)
    offset = int(cat.token_offsets[1])
    logits[:, 0, 1, offset:offset + 3] = torch.tensor(level2, dtype=torch.float64)
    sem = np.array(targets)[:, None]
    return cat, LossInputs(logits=logits.requires_grad_(), candidates=torch.as_tensor(cat.sem_tokens[sem]),
                           candidate_nodes=torch.as_tensor(cat.leaf_prefix_nodes[sem]))


def test_bear_by_hand_on_a_tiny_trie():
    cat, inputs = tiny_inputs([0, 1], [2.0, 0.0, 0.0])
    knobs = {"bear_b": 2, "bear_xi": 1.0, "bear_lambda": 1.0}
    loss = build_loss(LossConfig(name="bear").with_knobs(knobs), cat.tensors())(inputs).loss.detach()
    z = math.log(math.exp(2) + 2)  # the level-2 normaliser; the other levels have one valid token: CE 0, not counted
    ce_top, ce_second = z - 2, z          # row 0's target is the best code, row 1's ties with the 2nd best
    w_top, w_second = 1 + 1 / (1 + math.exp(-2)), 1.5   # gaps to the 2nd best log-prob: 2 and 0
    assert float(loss) == pytest.approx((w_top * ce_top + w_second * ce_second) / (w_top + w_second), rel=1e-12)
    # B larger than the 3 valid codes: the smallest valid one is the cut; lambda 0: MSL over the choosing steps
    wide = build_loss(LossConfig(name="bear").with_knobs({**knobs, "bear_b": 5, "bear_xi": 2.0}), cat.tensors())
    w_top, w_second = 1 + 1 / (1 + math.exp(-1)), 1.5
    assert float(wide(inputs).loss.detach()) == pytest.approx((w_top * ce_top + w_second * ce_second) / (w_top + w_second))
    flat = build_loss(LossConfig(name="bear").with_knobs({**knobs, "bear_lambda": 0.0}), cat.tensors())
    assert float(flat(inputs).loss.detach()) == pytest.approx((ce_top + ce_second) / 2)


def ref_bear(cat, logits, candidates, tau, top_b, xi, lam):
    """Loops: per row and level, the valid children, their softmax, the B-th best, the detached weight."""
    codes = cat.tokens_to_codes(candidates[:, 0].numpy())
    numerator, denominator = 0.0, 0.0
    for b in range(len(codes)):
        for t in range(T):
            children = sorted({int(c[t]) for c in cat.sem_codes if tuple(c[:t]) == tuple(codes[b, :t])})
            allowed = [int(cat.token_offsets[t]) + c for c in children]
            z = logits[b, 0, t, allowed] / tau
            log_p = z - torch.log(torch.exp(z).sum())
            target = log_p[allowed.index(int(candidates[b, 0, t]))]
            ordered = sorted(log_p.tolist(), reverse=True)
            cut = ordered[min(top_b, len(ordered)) - 1]
            weight = 1 + lam / (1 + math.exp(-(float(target.detach()) - cut) / xi))   # a constant: no gradient through it
            numerator = numerator - weight * target
            denominator += weight if len(children) > 1 else 0.0
    return numerator / denominator


@pytest.mark.parametrize("tau,top_b,xi,lam", [(1.0, 2, 1.0, 1.0), (2.0, 3, 0.5, 0.25), (1.0, 10, 2.75, 4.0)])
def test_bear_equals_the_reference_value_and_gradient(catalog, tau, top_b, xi, lam):
    inputs = make_inputs(catalog, 5, 0, seed=11)
    config = LossConfig(name="bear", tau=tau).with_knobs({"bear_b": top_b, "bear_xi": xi, "bear_lambda": lam})
    loss_fn = build_loss(config, catalog.tensors())
    out = loss_fn(inputs)
    expected = ref_bear(catalog, inputs.logits, inputs.candidates, tau, top_b, xi, lam)
    torch.testing.assert_close(out.loss, expected.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad(out.loss, inputs), grad(expected, inputs), rtol=1e-9, atol=1e-10)
    assert 1 <= float(out.metrics["bear_weight"]) <= 1 + lam
    assert loss_fn.step_normaliser == "valid_children" and loss_fn.decoding_temperature(config) == tau


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


def test_both_are_registered_with_their_knobs_and_paper_points():
    assert LOSSES["bear"].paper_point("tiger", "grocery") == {"bear_b": 10, "bear_xi": 1.0, "bear_lambda": 1.0}
    assert LOSSES["token_weighted"].paper_point("llama", "beauty") == {"front_alpha": 1.0}
    assert [k.name for k in LOSSES["bear"].knobs] == ["bear_b", "bear_xi", "bear_lambda"]
