"""losses/bear.py: BEAR by hand on a tiny trie and against a slow float64 reference with explicit loops (no code
shared with the package)."""
from __future__ import annotations

import math

import pytest
import torch

from apao_ray.config import LossConfig
from apao_ray.losses import build_loss
from losses_helpers import T, catalog, grad, make_inputs, tiny_inputs  # noqa: F401 - catalog: a fixture


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
